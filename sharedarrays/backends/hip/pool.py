"""The HIP memory-pool backend: stream-ordered AMD GPU allocations from an IPC-capable pool
(``"hip-pool"``): :class:`~sharedarrays.backends.pool.PoolBackend` on :class:`HipPool`, the
table of HIP's pool IPC calls (the twins of cuda-pool's), made through hip-python (see
:mod:`~sharedarrays.backends.hip.runtime`):

=========== =================================================================
pool        ``hipMemPoolCreate`` (pinned memory of this device, handle type
            ``hipMemHandleTypePosixFileDescriptor``), one per process and device, made on
            first use and exported once (``hipMemPoolExportToShareableHandle``); its fd is
            what the handle server sends, once per importer of each allocation
chunk       ``hipMallocFromPoolAsync`` on the null stream, then ``hipStreamSynchronize`` (so
            the allocation is complete before any importer can see it); one per allocation
handle      ``hipMemPoolExportPointer``: its 64 bytes after the pool's 16-byte id, sent with
            the pool's fd by the exporter's handle server
importer    ``hipMemPoolImportFromShareableHandle`` once per pool (kept while any pointer of
            it is open), ``hipMemPoolImportPointer`` per allocation, ``hipFree`` when it
            releases the allocation, ``hipMemPoolDestroy`` after the last one
=========== =================================================================

Lifetime: HIP requires every importer to free a pool allocation before its exporter does, so
the exporter keeps a released allocation until every process it served has freed it or
exited (``exporter_owned``). Struct arguments (``hipMemPoolPtrExportData``) are passed as
64-byte ctypes buffers, which hip-python accepts for struct pointers. Tested on a simulated
driver only (``tests/simulated/hip.py``).
"""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

from sharedarrays.backends.hip.device import HipDevice
from sharedarrays.backends.hip.runtime import check, export_fd, why_unusable
from sharedarrays.backends.pool import (
    EXPORT_BYTES,
    GRANULARITY,
    POINTER_BYTES,
    POOL_ID_BYTES,
    PoolBackend,
)
from sharedarrays.backends.registry import Registration, register

__all__ = ["HipPoolBackend", "HipPool", "GRANULARITY", "EXPORT_BYTES", "POOL_ID_BYTES"]

_ExportData = ctypes.c_ubyte * POINTER_BYTES


class HipPool:
    """HIP's pool IPC calls (:class:`~sharedarrays.backends.pool.PoolCalls`) for one
    backend."""

    def __init__(self, backend: HipDevice) -> None:
        self._hip = hip = backend._hip
        self._device = backend.device
        self._fd_type = hip.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor

    def create_pool(self) -> Any:
        hip = self._hip
        props = hip.hipMemPoolProps()
        props.allocType = hip.hipMemAllocationType.hipMemAllocationTypePinned
        props.handleTypes = self._fd_type
        props.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        props.location.id = self._device.index
        return check(hip.hipMemPoolCreate(props), f"hipMemPoolCreate({self._device})")

    def export_pool(self, pool: Any) -> int:
        return export_fd(
            lambda out: self._hip.hipMemPoolExportToShareableHandle(out, pool, self._fd_type, 0),
            "hipMemPoolExportToShareableHandle(PosixFileDescriptor)",
        )

    def destroy_pool(self, pool: Any) -> None:
        check(self._hip.hipMemPoolDestroy(pool), "hipMemPoolDestroy")

    def stream(self) -> int:
        return 0  # the null stream

    def allocate(self, size: int, pool: Any, stream: int) -> int:
        return int(
            check(
                self._hip.hipMallocFromPoolAsync(size, pool, stream),
                f"hipMallocFromPoolAsync({size} bytes on {self._device})",
            )
        )

    def synchronize(self, stream: int) -> None:
        check(self._hip.hipStreamSynchronize(stream), "hipStreamSynchronize")

    def export_pointer(self, pointer: int) -> bytes:
        data = _ExportData()
        check(self._hip.hipMemPoolExportPointer(data, pointer), "hipMemPoolExportPointer")
        return bytes(data)

    def import_pool(self, fd: int) -> Any:
        return check(
            self._hip.hipMemPoolImportFromShareableHandle(fd, self._fd_type, 0),
            "hipMemPoolImportFromShareableHandle(PosixFileDescriptor)",
        )

    def import_pointer(self, pool: Any, data: bytes) -> int:
        return int(
            check(
                self._hip.hipMemPoolImportPointer(pool, _ExportData.from_buffer_copy(data)),
                "hipMemPoolImportPointer",
            )
        )

    def free(self, pointer: int) -> None:
        check(self._hip.hipFree(pointer), "hipFree")

    def too_large(self, size: int) -> str | None:
        return None


class HipPoolBackend(PoolBackend, HipDevice):
    """Stream-ordered memory of one AMD GPU, shared through an exported memory pool
    (``"hip-pool"``).

    Parameters
    ----------
    device : Device
        A HIP device (``Device("hip", N)``) that supports memory pools.

    Raises
    ------
    BackendUnavailable
        :func:`~sharedarrays.backends.hip.runtime.why_unusable` gave a reason.

    Notes
    -----
    See :class:`~sharedarrays.backends.pool.PoolBackend`. Allocations are made on the null
    stream.
    """

    name: ClassVar[str] = "hip-pool"
    feature: ClassVar[str] = "pool"
    peer_access: ClassVar[bool] = False

    def table(self) -> HipPool:
        """This backend's HIP pool calls."""
        return HipPool(self)


register(
    Registration(
        name=HipPoolBackend.name,
        kind="hip",
        factory=HipPoolBackend,
        preference=1,
        maps=HipPoolBackend.maps,
        exporter_owned=HipPoolBackend.exporter_owned,
        why_unusable=lambda index: why_unusable(index, HipPoolBackend.feature),
    )
)
