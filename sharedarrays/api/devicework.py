"""DeviceWork: an array's work on its device (synchronize, grant, access, wait_for, signal)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sharedarrays.api.arraybase import ArrayBase
from sharedarrays.backends import Access
from sharedarrays.backends.device import Device, DeviceLike, parse_device


@runtime_checkable
class Semaphore(Protocol):
    """What :meth:`SharedDeviceArray.wait_for` and :meth:`~SharedDeviceArray.signal` take:
    an :class:`~sharedarrays.ExternalSemaphore`, a :class:`~sharedarrays.Timeline`, or any
    object with a ``device`` and these methods ordering that device's current stream."""

    @property
    def device(self) -> Device: ...

    def wait(self, value: int | None) -> None: ...

    def signal(self, value: int | None) -> None: ...


class DeviceWork(ArrayBase):
    """The device work of :class:`~sharedarrays.SharedDeviceArray`."""

    __slots__ = ()

    def synchronize(self) -> None:
        """Wait until the work queued so far on this array's device is done (every stream
        of its context on CUDA): before another process reads what this one wrote."""
        self.allocation.backend.synchronize()

    @property
    def access(self) -> dict[str, str]:
        """Which devices may touch this array's memory here: ``"rw"`` or ``"r"`` by name."""
        return {str(d): a for d, a in self.allocation.access_by_device.items()}

    def grant(self, device: DeviceLike, mode: Access = "rw") -> None:
        """Let another CUDA device read (``"r"``) or read and write (``"rw"``) this array's
        whole allocation in this process, without copying (``cuMemSetAccess``). ValueError
        for a non-cuda-vmm array, the memory's own device or a bad mode;
        PeerAccessUnavailable where that device cannot reach it; BackendUnavailable: no such
        device.
        """
        dev = parse_device(device)
        if not dev.needs_context:
            raise ValueError(f"grant() takes a CUDA device, not {dev}")
        self.allocation.grant(dev.index, mode)

    def wait_for(self, sem: Semaphore, value: int | None = None) -> None:
        """Make later work on this array's device (its current stream) wait for ``sem``, a
        :class:`Semaphore` on that device; ``value``: required for timelines, omitted for
        binary semaphores."""
        self._same_device(sem).wait(value)

    def signal(self, sem: Semaphore, value: int | None = None) -> None:
        """Signal ``sem`` once the work queued so far on this array's device (its current
        stream) is done: a timeline is set to ``value``; a binary semaphore takes none."""
        self._same_device(sem).signal(value)

    def _same_device(self, sem: Semaphore) -> Semaphore:
        if not isinstance(sem, Semaphore):
            raise TypeError(
                f"expected an ExternalSemaphore or a Timeline (an object with a device, wait "
                f"and signal), not {type(sem).__name__}"
            )
        if sem.device != self.allocation.device:
            raise ValueError(
                f"the semaphore is on {sem.device}, this array on {self.allocation.device}"
            )
        return sem
