"""The HIP VMM backend: AMD GPU memory shared through POSIX file descriptors (``"hip-vmm"``).

HIP's virtual memory management API (the twin of CUDA's), called through hip-python
(see :mod:`~sharedarrays.backends.hip.runtime`):

=========== =================================================================
reservation ``hipMemAddressReserve`` (aligned to the granularity)
chunk       ``hipMemCreate`` (pinned memory of this device, requested handle type
            ``hipMemHandleTypePosixFileDescriptor``), exported once with
            ``hipMemExportToShareableHandle``; the fd is kept for the chunk's life
mapping     ``hipMemMap`` (whole chunks)
access      ``hipMemSetAccess`` for the owning device
handle      the exported fd; an importer turns it back into a chunk with
            ``hipMemImportFromShareableHandle`` and keeps it too, so it can serve it on
release     ``hipMemUnmap``, ``hipMemRelease``, ``hipMemAddressFree``
=========== =================================================================

The memory lives while any process holds a handle, an fd or a mapping of it (as on
cuda-vmm). Tested on a simulated driver only (``tests/simulated/hip.py``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from typing import Any, ClassVar

from sharedarrays.backends.base import Access, Chunk
from sharedarrays.backends.device import Device
from sharedarrays.backends.hip.device import HipDevice
from sharedarrays.backends.hip.runtime import HipError, check, why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import PayloadError

__all__ = ["HipVmmBackend", "KDL_ROCM"]

KDL_ROCM = 10
"""DLPack's device type of ROCm memory (``kDLROCM``)."""

# What hipMemImportFromShareableHandle answers for an fd that is no exported allocation.
_NOT_AN_ALLOCATION = frozenset(
    {"hipErrorInvalidValue", "hipErrorInvalidHandle", "hipErrorNotSupported"}
)


class HipVmmBackend(HipDevice):
    """Memory of one AMD GPU, shared through exported fds (``"hip-vmm"``).

    Parameters
    ----------
    device : Device
        A HIP device (``Device("hip", N)``).

    Raises
    ------
    BackendUnavailable
        :func:`~sharedarrays.backends.hip.runtime.why_unusable` gave a reason.

    Notes
    -----
    Native arrays and ordering as :class:`~sharedarrays.backends.hip.device.HipDevice`.
    """

    name: ClassVar[str] = "hip-vmm"
    feature: ClassVar[str] = "vmm"
    zeroed: ClassVar[bool] = False  # hipMemCreate does not clear memory
    maps: ClassVar[bool] = True
    exporter_owned: ClassVar[bool] = False
    peer_access: ClassVar[bool] = False

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        hip = self._hip
        self._fd_type = hip.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor
        prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        prop.location.id = device.index
        # ROCm 7 renamed requestedHandleType to requestedHandleTypes
        field = "requestedHandleType"
        if hasattr(prop, "requestedHandleTypes"):
            field = "requestedHandleTypes"
        setattr(prop, field, self._fd_type)
        self._prop = prop
        with self._on_device():
            self._granularity = int(
                check(
                    hip.hipMemGetAllocationGranularity(
                        prop,
                        hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended,
                    ),
                    "hipMemGetAllocationGranularity",
                )
            )
        self._access = {a: self._desc(a) for a in ("rw", "r", "none")}

    @property
    def granularity(self) -> int:
        """The recommended allocation granularity of this device."""
        return self._granularity

    def _desc(self, access: Access) -> Any:
        hip = self._hip
        flags = hip.hipMemAccessFlags
        desc = hip.hipMemAccessDesc()
        desc.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        desc.location.id = self.device.index
        desc.flags = {
            "rw": flags.hipMemAccessFlagsProtReadWrite,
            "r": flags.hipMemAccessFlagsProtRead,
            "none": flags.hipMemAccessFlagsProtNone,
        }[access]
        return desc

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes of device memory and export its fd (once)."""
        self._check_size(size, "a chunk size")
        hip = self._hip
        with self._on_device():
            handle = check(
                hip.hipMemCreate(size, self._prop, 0),
                f"hipMemCreate({size} bytes on {self.device})",
            )
            out = ctypes.c_int(-1)
            try:
                check(
                    hip.hipMemExportToShareableHandle(
                        ctypes.addressof(out), handle, self._fd_type, 0
                    ),
                    "hipMemExportToShareableHandle(PosixFileDescriptor)",
                )
                fd = out.value
                os.set_inheritable(fd, False)
            except BaseException:
                if out.value >= 0:
                    os.close(out.value)
                hip.hipMemRelease(handle)
                raise
        return Chunk(size=size, handle=int(handle), fd=fd)

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Nothing to seal: a HIP chunk's size is fixed and its fd carries no access mode;
        read-only is each importer's own ``hipMemSetAccess``."""
        return False

    def reopen_readonly(self, fd: int) -> int | None:
        """HIP's shareable fds carry no access mode."""
        return None

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from an fd exported by :meth:`create_chunk` (in any process).

        Takes ownership of ``fd``. A payload that claims more than the chunk holds fails in
        :meth:`map`.

        Raises
        ------
        PayloadError
            ``size`` is not a multiple of the granularity, or the fd is not an exported HIP
            allocation.
        """
        hip = self._hip
        try:
            if size <= 0 or size % self._granularity:
                raise PayloadError(
                    f"chunk size {size} is not a positive multiple of {self.device}'s "
                    f"granularity ({self._granularity} bytes)"
                )
            with self._on_device():
                try:
                    handle = check(
                        hip.hipMemImportFromShareableHandle(fd, self._fd_type),
                        "hipMemImportFromShareableHandle(PosixFileDescriptor)",
                    )
                except HipError as exc:
                    if exc.error_name in _NOT_AN_ALLOCATION:
                        raise PayloadError(
                            f"the handle is not an exported HIP allocation: {exc}"
                        ) from exc
                    raise
        except BaseException:
            os.close(fd)
            raise
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass
        return Chunk(size=size, handle=int(handle), fd=fd, imported=True)

    def release_chunk(self, chunk: Chunk) -> None:
        """Release this process's handle of the chunk and close its fd. Idempotent."""
        handle, fd = chunk.handle, chunk.fd
        if handle < 0 and fd < 0:
            return
        chunk.handle = chunk.fd = -1
        try:
            if handle >= 0 and not self._forked():
                check(self._hip.hipMemRelease(handle), "hipMemRelease")
        finally:
            if fd >= 0:
                os.close(fd)

    # address space ----------------------------------------------------------------------

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of device address space, aligned to the granularity."""
        self._check_size(size, "a reservation size")
        with self._on_device():
            ptr = check(
                self._hip.hipMemAddressReserve(size, self._granularity, 0, 0),
                f"hipMemAddressReserve({size} bytes)",
            )
        return int(ptr)

    def free_reservation(self, address: int, size: int) -> None:
        """Give back a reservation (a no-op in a forked child)."""
        if not self._forked():
            check(self._hip.hipMemAddressFree(address, size), "hipMemAddressFree")

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map the whole of ``chunk`` at ``address`` (whole chunks only, as on CUDA)."""
        self._check_size(size, "a mapping size")
        if chunk_offset != 0 or size != chunk.size:
            raise ValueError(
                f"HIP maps whole chunks only: asked for {size} bytes from offset "
                f"{chunk_offset} of a chunk of {chunk.size} bytes"
            )
        if chunk.handle < 0:
            raise ValueError("the chunk was released")
        with self._on_device():
            try:
                check(
                    self._hip.hipMemMap(address, size, 0, chunk.handle, 0),
                    f"hipMemMap({size} bytes at {address:#x})",
                )
            except HipError as exc:
                if exc.error_name == "hipErrorInvalidValue":
                    raise PayloadError(
                        f"{exc}; the chunk may be smaller than its payload says"
                    ) from exc
                raise

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """Set this device's access to a mapped range with ``hipMemSetAccess``; lowering it
        waits first for queued work. Peer devices are not supported (yet)."""
        desc = self._access.get(access)
        if desc is None:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        if any(index != self.device.index for index in peers or {}):
            raise ValueError(f"{self.name} grants no peer devices: access= takes {self.device}")
        if access != "rw":
            self.synchronize()
        with self._on_device():
            check(
                self._hip.hipMemSetAccess(address, size, [desc], 1),
                f"hipMemSetAccess({access!r}, {size} bytes at {address:#x})",
            )

    def unmap(self, address: int, size: int) -> None:
        """Wait for queued work, then unmap the range (a no-op in a forked child)."""
        if self._forked():
            return
        self.synchronize()
        check(self._hip.hipMemUnmap(address, size), f"hipMemUnmap({size} bytes at {address:#x})")


register(
    Registration(
        name=HipVmmBackend.name,
        kind="hip",
        factory=HipVmmBackend,
        preference=0,
        maps=HipVmmBackend.maps,
        exporter_owned=HipVmmBackend.exporter_owned,
        why_unusable=why_unusable,
    )
)
