"""The CUDA VMM backend: device memory shared through POSIX file descriptors.

CUDA's virtual memory management API, called through ``cuda.bindings.driver`` (the
tuple-returning driver bindings, ``err, value = driver.cuX(...)``):

=========== =================================================================
reservation ``cuMemAddressReserve`` (aligned to the granularity)
chunk       ``cuMemCreate`` (pinned device memory of this device, requested handle
            type ``POSIX_FILE_DESCRIPTOR``), exported once with
            ``cuMemExportToShareableHandle``; the fd is kept for the chunk's life
mapping     ``cuMemMap``
access      ``cuMemSetAccess`` for the owning device
handle      the exported fd; an importer turns it back into a chunk with
            ``cuMemImportFromShareableHandle`` and keeps it too, so it can serve it on
=========== =================================================================

Driver loading, errors, fork safety, the primary context and cross-process ordering are
shared by the CUDA backends and live in :mod:`~sharedarrays.backends.cuda.driver`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from sharedarrays.backends.base import Access, Chunk
from sharedarrays.backends.cuda.device import CudaDevice
from sharedarrays.backends.cuda.driver import (
    CudaDriverError,
    check,
    check_export,
    peer_reason,
    why_unusable,
)
from sharedarrays.backends.device import Device
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import PayloadError, PeerAccessUnavailable

__all__ = ["CudaVmmBackend"]

# What cuMemImportFromShareableHandle answers for an fd that is no exported allocation.
_NOT_AN_ALLOCATION = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
        "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_ERROR_OPERATING_SYSTEM",
        "CUDA_ERROR_INVALID_DEVICE",
        "CUDA_ERROR_UNKNOWN",  # what driver 580 answers for a memfd or a closed fd
    }
)


class CudaVmmBackend(CudaDevice):
    """Device memory of one CUDA device, shared through exported fds (``"cuda-vmm"``).

    Parameters
    ----------
    device : Device
        A CUDA device (``Device("cuda", N)``).

    Raises
    ------
    BackendUnavailable
        :func:`why_unusable` gave a reason.

    Notes
    -----
    Chunks are pinned device memory of this device, ``requestedHandleTypes`` =
    ``POSIX_FILE_DESCRIPTOR``; sizes and mapping offsets are multiples of the recommended
    granularity (2 MiB on an H200). New chunks are not zeroed. The device's primary context
    is retained once and kept for the life of the process.
    """

    name: ClassVar[str] = "cuda-vmm"
    zeroed: ClassVar[bool] = False  # cuMemCreate does not clear memory

    maps: ClassVar[bool] = True
    exporter_owned: ClassVar[bool] = False
    peer_access: ClassVar[bool] = True

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        d = self._d

        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        prop.requestedHandleTypes = (
            d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        self._prop = prop
        self._fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        with self.context():
            self._granularity = int(
                check(
                    d.cuMemGetAllocationGranularity(
                        prop,
                        d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                    ),
                    "cuMemGetAllocationGranularity",
                )
            )

        self._access: dict[str, list[Any]] = {
            access: [self._desc(device.index, access)] for access in ("rw", "r", "none")
        }

    @property
    def granularity(self) -> int:
        """The recommended allocation granularity of this device (2 MiB on an H200)."""
        return self._granularity

    def _desc(self, index: int, access: Access) -> Any:
        """A ``CUmemAccessDesc`` giving device ``index`` ``access``."""
        d = self._d
        flags = d.CUmemAccess_flags
        flag = {
            "rw": flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            "r": flags.CU_MEM_ACCESS_FLAGS_PROT_READ,
            "none": flags.CU_MEM_ACCESS_FLAGS_PROT_NONE,
        }.get(access)
        if flag is None:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = flag
        return desc

    def _handle(self, chunk: Chunk) -> Any:
        if chunk.handle < 0:
            raise ValueError("the chunk was released")
        return self._d.CUmemGenericAllocationHandle(chunk.handle)

    # chunks -----------------------------------------------------------------------------
    def check_memory(self, nbytes: int) -> None:
        """Nothing to check beforehand: ``cuMemCreate`` takes the device memory at once, and
        fails with :class:`CudaOutOfMemory` (an :class:`~sharedarrays.OutOfMemory`)."""

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes of pinned device memory and export its fd (once)."""
        self._check_size(size, "a chunk size")
        d = self._d
        with self.context():
            handle = self._check_allocation(
                d.cuMemCreate(size, self._prop, 0),
                f"cuMemCreate({size} bytes on {self.device})",
                "a chunk of device memory",
                size,
            )
            try:
                fd = int(
                    check_export(
                        d.cuMemExportToShareableHandle(handle, self._fd_type, 0),
                        "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
                    )
                )
            except BaseException:
                d.cuMemRelease(handle)
                raise
        try:
            os.set_inheritable(fd, False)
        except BaseException:
            os.close(fd)
            with self.context():
                d.cuMemRelease(handle)
            raise
        return Chunk(size=size, handle=int(handle), fd=fd)

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Nothing to seal: a CUDA chunk's size is fixed, and its shareable fd carries no
        access mode. Read-only is set by each importer with ``cuMemSetAccess``, for its own
        mappings: a process of the same user holding the fd can set itself read-write."""
        return False

    def reopen_readonly(self, fd: int) -> int | None:
        """CUDA's shareable fds carry no access mode: read-only is set by each importer
        with ``cuMemSetAccess`` (see ``set_access``)."""
        return None

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from an fd exported by :meth:`create_chunk` (in any process).

        Takes ownership of ``fd`` (closed on failure; kept open in the chunk on success so it
        can be served on). The driver cannot tell an imported chunk's size: a payload that
        claims more than the chunk holds fails later, in :meth:`map`.

        Raises
        ------
        PayloadError
            ``size`` is not a multiple of the granularity, the fd is not an exported CUDA
            allocation, or the chunk lives on another device.
        """
        d = self._d
        try:
            if size <= 0 or size % self._granularity:
                raise PayloadError(
                    f"chunk size {size} is not a positive multiple of {self.device}'s "
                    f"granularity ({self._granularity} bytes)"
                )
            with self.context():
                try:
                    handle = check(
                        d.cuMemImportFromShareableHandle(fd, self._fd_type),
                        "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)",
                    )
                except CudaDriverError as exc:
                    if exc.error_name in _NOT_AN_ALLOCATION:
                        raise PayloadError(
                            f"the handle is not an exported CUDA allocation: {exc}"
                        ) from exc
                    raise
                try:
                    prop = check(
                        d.cuMemGetAllocationPropertiesFromHandle(handle),
                        "cuMemGetAllocationPropertiesFromHandle",
                    )
                    where = int(prop.location.id)
                    if where != self.device.index:
                        raise PayloadError(
                            f"the chunk lives on cuda:{where} (as numbered in this process), "
                            f"not on {self.device}"
                        )
                except BaseException:
                    d.cuMemRelease(handle)
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
        """Release this process's handle of the chunk and close its fd. Idempotent.

        The memory returns to the device once every process has released its handle and
        closed its fds (and nothing maps it).
        """
        handle, fd = chunk.handle, chunk.fd
        if handle < 0 and fd < 0:
            return
        chunk.handle = chunk.fd = -1
        try:
            if handle >= 0 and not self._forked():
                with self.context():
                    check(
                        self._d.cuMemRelease(self._d.CUmemGenericAllocationHandle(handle)),
                        "cuMemRelease",
                    )
        finally:
            if fd >= 0:
                os.close(fd)

    # address space ----------------------------------------------------------------------
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of device address space, aligned to the granularity."""
        self._check_size(size, "a reservation size")
        with self.context():
            ptr = self._check_allocation(
                self._d.cuMemAddressReserve(size, self._granularity, 0, 0),
                f"cuMemAddressReserve({size} bytes)",
                "a reservation of address space",
                size,
            )
        return int(ptr)

    def free_reservation(self, address: int, size: int) -> None:
        """Give back a reservation (a no-op in a forked child)."""
        if self._forked():
            return
        with self.context():
            check(self._d.cuMemAddressFree(address, size), "cuMemAddressFree")

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map the whole of ``chunk`` at ``address``.

        The range is not accessible until :meth:`set_access`. CUDA maps whole chunks only:
        ``size`` must be the chunk's size and ``chunk_offset`` 0. (``cuMemMap`` answers
        ``CUDA_ERROR_NOT_SUPPORTED`` for an offset into a device allocation or a part of
        one, on driver 580 with an H200, although its documentation allows both.)
        """
        self._check_size(size, "a mapping size")
        if chunk_offset != 0 or size != chunk.size:
            raise ValueError(
                "CUDA maps whole chunks only (cuMemMap supports no offset into, and no part "
                f"of, a device allocation): asked for {size} bytes from offset {chunk_offset} "
                f"of a chunk of {chunk.size} bytes"
            )
        with self.context():
            try:
                check(
                    self._d.cuMemMap(address, size, 0, self._handle(chunk), 0),
                    f"cuMemMap({size} bytes at {address:#x})",
                )
            except CudaDriverError as exc:
                if exc.error_name == "CUDA_ERROR_INVALID_VALUE":
                    raise PayloadError(
                        f"{exc}; the chunk may be smaller than its payload says"
                    ) from exc
                raise

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """Set this device's access to a mapped range (``"rw"``, ``"r"`` or ``"none"``), and
        that of the ``peers`` (other CUDA devices by index, each with its access), in one
        ``cuMemSetAccess``.

        Lowering access waits first (:meth:`synchronize`) for queued work that may still
        touch the range.

        Raises
        ------
        PeerAccessUnavailable
            A peer cannot access this device's memory (``cuDeviceCanAccessPeer`` is 0).
        """
        own = self._access.get(access)
        if own is None:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        descs = list(own)
        for index, mode in sorted((peers or {}).items()):
            if index == self.device.index:
                continue
            why = peer_reason(index, self.device.index)
            if why is not None:
                raise PeerAccessUnavailable(why)
            descs.append(self._desc(index, mode))
        if access != "rw" or any(m != "rw" for m in (peers or {}).values()):
            self.synchronize()
        with self.context():
            check(
                self._d.cuMemSetAccess(address, size, descs, len(descs)),
                f"cuMemSetAccess({access!r}, {size} bytes at {address:#x})",
            )

    def unmap(self, address: int, size: int) -> None:
        """Wait for queued work (``cuMemUnmap`` does not), then unmap the range.

        A no-op in a forked child.
        """
        if self._forked():
            return
        self.synchronize()
        with self.context():
            check(self._d.cuMemUnmap(address, size), f"cuMemUnmap({size} bytes at {address:#x})")


register(
    Registration(
        name=CudaVmmBackend.name,
        kind="cuda",
        factory=CudaVmmBackend,
        preference=0,
        maps=CudaVmmBackend.maps,
        exporter_owned=CudaVmmBackend.exporter_owned,
        why_unusable=lambda index: why_unusable(index, CudaVmmBackend.name),
    )
)
