"""The CUDA IPC backend (``"cuda-ipc"``): ``cuMemAlloc`` memory shared by 64-byte IPC handles,
for devices or drivers without VMM and POSIX-fd handles; the memory is the exporter's."""

from __future__ import annotations

import os
from typing import Any, ClassVar

from sharedarrays.backends.base import Chunk
from sharedarrays.backends.cuda.device import CudaDevice
from sharedarrays.backends.cuda.driver import (
    OPAQUE_BYTES,
    CudaDriverError,
    check,
    opaque_bytes,
    opaque_from_bytes,
    why_unusable,
)
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import HandleUnavailable, NotShareable, PayloadError

# What cuIpcOpenMemHandle answers for a handle whose memory is gone or never existed.
_STALE = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
        "CUDA_ERROR_MAP_FAILED",
        "CUDA_ERROR_NOT_FOUND",
    }
)

_POINTER_ATTRIBUTES = ("MEMORY_TYPE", "DEVICE_ORDINAL", "IS_MANAGED", "IS_LEGACY_CUDA_IPC_CAPABLE")


class CudaIpcBackend(CudaDevice):
    """Device memory of one CUDA device, shared by CUDA IPC handles (``"cuda-ipc"``)."""

    name: ClassVar[str] = "cuda-ipc"
    zeroed: ClassVar[bool] = False  # cuMemAlloc does not clear memory
    maps: ClassVar[bool] = False
    exporter_owned: ClassVar[bool] = True
    granularity = 2 << 20  # cuMemAlloc's pages

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes with ``cuMemAlloc`` and take its IPC handle once."""
        self._check_size(size, "a chunk size")
        d = self._d
        call = f"cuMemAlloc({size} bytes on {self.device})"
        with self.context():
            ptr = self._check_allocation(d.cuMemAlloc(size), call, "device memory", size)
            try:
                export = opaque_bytes(check(d.cuIpcGetMemHandle(ptr), "cuIpcGetMemHandle"))
            except BaseException:
                d.cuMemFree(ptr)
                raise
        return Chunk(size=size, handle=int(ptr), fd=-1, address=int(ptr), export=export)

    def borrow_chunk(self, pointer: int, owner: object) -> tuple[Chunk, int]:
        """The whole ``cuMemAlloc`` allocation holding ``pointer`` (as CuPy's and PyTorch's
        allocators make) as a chunk holding ``owner``, and the offset; else ``NotShareable``."""
        d = self._d
        suggestion = "; sa.from_array(x) copies it into new shared memory instead"

        def get(a: str) -> Any:
            attribute = getattr(d.CUpointer_attribute, f"CU_POINTER_ATTRIBUTE_{a}")
            return check(d.cuPointerGetAttribute(attribute, pointer), f"cuPointerGetAttribute({a})")

        with self.context():
            try:
                kind, ordinal, managed, capable = [get(a) for a in _POINTER_ATTRIBUTES]
            except CudaDriverError as exc:
                raise NotShareable(
                    f"address {pointer:#x} is not CUDA memory this process can see ({exc})"
                    + suggestion
                ) from exc
            if int(kind) != int(d.CUmemorytype.CU_MEMORYTYPE_DEVICE) or managed:
                raise NotShareable(
                    f"address {pointer:#x} is {'managed' if managed else 'host'} memory, "
                    "which CUDA IPC cannot export" + suggestion
                )
            if int(ordinal) != self.device.index:
                raise NotShareable(
                    f"the memory is on cuda:{int(ordinal)}, not {self.device}; share it with "
                    f"device=cuda:{int(ordinal)}"
                )
            if not capable:
                raise NotShareable(
                    "CUDA IPC cannot export this memory: it comes from a stream-ordered pool "
                    "(cudaMallocAsync, CuPy's MemoryAsyncPool) or from VMM (e.g. PyTorch's "
                    "expandable_segments), not from cuMemAlloc" + suggestion
                )
            base, length = check(d.cuMemGetAddressRange(pointer), "cuMemGetAddressRange")
            try:
                export = opaque_bytes(check(d.cuIpcGetMemHandle(base), "cuIpcGetMemHandle"))
            except CudaDriverError as exc:
                raise NotShareable(f"CUDA IPC refused this memory ({exc})" + suggestion) from exc
        chunk = Chunk(
            size=int(length), handle=int(base), fd=-1, address=int(base), export=export, owner=owner
        )
        return chunk, pointer - int(base)

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Open another process's chunk from its IPC handle (``HandleUnavailable``: freed)."""
        if fd >= 0:
            os.close(fd)
        if len(export) != OPAQUE_BYTES:
            raise PayloadError(f"a CUDA IPC handle is {OPAQUE_BYTES} bytes, not {len(export)}")
        d = self._d
        handle = opaque_from_bytes(d.CUipcMemHandle, export)
        flags = int(d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        with self.context():
            try:
                ptr = check(d.cuIpcOpenMemHandle(handle, flags), "cuIpcOpenMemHandle")
            except CudaDriverError as exc:
                if exc.error_name in _STALE:
                    raise HandleUnavailable(
                        f"{exc}: the memory behind this CUDA IPC handle is gone (its exporter "
                        "freed it or exited). cuda-ipc memory lives only as long as the "
                        "process that made it"
                    ) from exc
                raise
            try:
                base, length = check(d.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
                if int(length) - (int(ptr) - int(base)) < size:
                    raise PayloadError(
                        f"the IPC handle names {int(length)} bytes, but the payload says {size}"
                    )
            except BaseException:
                d.cuIpcCloseMemHandle(ptr)
                raise
        return Chunk(
            size=size, handle=int(ptr), fd=-1, address=int(ptr), export=export, imported=True
        )

    def release_chunk(self, chunk: Chunk) -> None:
        """Wait for queued work, then close an imported handle, free own memory, or drop a
        borrowed chunk's owner."""
        ptr = chunk.handle
        if ptr < 0:
            return
        chunk.handle = -1
        if self._forked():
            return
        self.synchronize()
        if chunk.owner is not None:
            chunk.owner = None
            return
        with self.context():
            if chunk.imported:
                check(self._d.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")
            else:
                check(self._d.cuMemFree(ptr), "cuMemFree")


register(Registration.of(CudaIpcBackend, "cuda", 1, lambda i: why_unusable(i, "cuda-ipc")))
