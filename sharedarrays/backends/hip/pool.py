"""The HIP memory-pool backend (``"hip-pool"``): :class:`~sharedarrays.backends.pool.PoolBackend`
on :class:`HipPool`, HIP's table of pool IPC calls (the twins of cuda-pool's; allocations on
the null stream). Export data structs are passed as 64-byte ctypes buffers, which hip-python
takes for struct pointers. Tested on a simulated driver only (``tests/simulated/hip.py``)."""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

from sharedarrays.backends.hip.device import HipDevice
from sharedarrays.backends.hip.runtime import check, export_fd, why_unusable
from sharedarrays.backends.pool import POINTER_BYTES, PoolBackend
from sharedarrays.backends.registry import Registration, register

__all__ = ["HipPoolBackend", "HipPool"]

_ExportData = ctypes.c_ubyte * POINTER_BYTES


class HipPool:
    """HIP's pool IPC calls (:class:`~sharedarrays.backends.pool.PoolCalls`)."""

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
    """Stream-ordered memory of one AMD GPU, shared through an exported pool
    (``"hip-pool"``)."""

    name: ClassVar[str] = "hip-pool"
    feature: ClassVar[str] = "pool"
    peer_access: ClassVar[bool] = False

    def table(self) -> HipPool:
        return HipPool(self)


register(
    Registration.of(HipPoolBackend, "hip", 1, lambda i: why_unusable(i, HipPoolBackend.feature))
)
