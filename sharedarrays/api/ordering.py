"""A view's device work: waiting for it, peer access, and ordering it with semaphores."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from sharedarrays.api.arraybase import ArrayBase
from sharedarrays.backends import Access, get_backend
from sharedarrays.backends.device import Device, DeviceLike, parse_device
from sharedarrays.memory import live_allocations

__all__ = ["Ordering", "Semaphore", "synchronize"]


@runtime_checkable
class Semaphore(Protocol):
    """What :meth:`SharedDeviceArray.wait_for` and :meth:`~SharedDeviceArray.signal` take:
    an :class:`~sharedarrays.ExternalSemaphore`, a :class:`~sharedarrays.Timeline`, or any
    object with a ``device`` and these methods ordering that device's current stream."""

    @property
    def device(self) -> Device: ...

    def wait(self, value: int | None) -> None: ...

    def signal(self, value: int | None) -> None: ...


class Ordering(ArrayBase):
    """The device methods of :class:`~sharedarrays.SharedDeviceArray`."""

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
        whole allocation in this process, without copying (``cuMemSetAccess``).

        Raises
        ------
        ValueError
            Not a cuda-vmm array, the memory's own device, or a bad mode.
        PeerAccessUnavailable
            That device cannot reach this memory (``cuDeviceCanAccessPeer`` is 0).
        BackendUnavailable
            No such device.
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
        if sem.device != self.device:
            raise ValueError(f"the semaphore is on {sem.device}, this array on {self.device}")
        return sem


def synchronize(device: DeviceLike = None) -> None:
    """Wait until the work queued so far on a device is done (BackendUnavailable if the
    device asked for cannot be used here).

    Parameters
    ----------
    device : str, int, torch.device, cupy.cuda.Device or None
        The device; ``None``: every device with shared memory mapped here.
    """
    if device is not None:
        get_backend(parse_device(device)).synchronize()
        return
    for backend in {id(a.backend): a.backend for a in live_allocations()}.values():
        backend.synchronize()
