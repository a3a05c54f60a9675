"""The HIP memory-pool backend (``"hip-pool"``): :class:`~sharedarrays.backends.pool.PoolBackend`
on :class:`HipPool`, HIP's pool IPC calls (the twins of cuda-pool's; allocations on the null
stream). Export data structs are passed as 64-byte ctypes buffers, which hip-python takes for
struct pointers. Tested on a simulated driver only (``tests/simulated/hip.py``)."""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

from sharedarrays.backends.hip.device import HipCalls, HipDevice
from sharedarrays.backends.hip.runtime import why_unusable
from sharedarrays.backends.pool import POINTER_BYTES, PoolBackend, PoolCalls
from sharedarrays.backends.registry import Registration, register

_ExportData = ctypes.c_ubyte * POINTER_BYTES


class HipPool(HipCalls, PoolCalls):
    """HIP's pool IPC calls (:class:`~sharedarrays.backends.pool.PoolCalls`)."""

    allocate_call = "MallocFromPoolAsync"
    free_call = "Free"

    def stream(self) -> int:
        return 0  # the null stream

    def export_pointer(self, pointer: int) -> bytes:
        data = _ExportData()
        self.call("MemPoolExportPointer", data, pointer)
        return bytes(data)

    def import_pointer(self, pool: Any, data: bytes) -> int:
        return int(self.call("MemPoolImportPointer", pool, _ExportData.from_buffer_copy(data)))


class HipPoolBackend(PoolBackend, HipDevice):
    """Stream-ordered memory of one AMD GPU, shared through an exported pool
    (``"hip-pool"``)."""

    name: ClassVar[str] = "hip-pool"
    feature: ClassVar[str] = "pool"
    peer_access: ClassVar[bool] = False
    calls = HipPool


register(
    Registration.of(HipPoolBackend, "hip", 1, lambda i: why_unusable(i, HipPoolBackend.feature))
)
