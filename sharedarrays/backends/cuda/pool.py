"""The CUDA memory-pool backend: stream-ordered allocations from an IPC-capable pool.

Called through ``cuda.bindings.driver``:

=========== =================================================================
pool        ``cuMemPoolCreate`` (pinned memory of this device, handle type
            ``POSIX_FILE_DESCRIPTOR``), one per process and device, made on first use and
            exported once (``cuMemPoolExportToShareableHandle``); its fd is what the handle
            server sends, once per importer of each allocation
chunk       ``cuMemAllocFromPoolAsync`` on the current stream (then synchronised, so the
            allocation is complete before any importer can see it); one per allocation
handle      ``cuMemPoolExportPointer``: 64 bytes after the pool's 16-byte id, sent with
            the pool's fd by the exporter's handle server
importer    ``cuMemPoolImportFromShareableHandle`` once per pool (kept while any pointer of
            it is open), ``cuMemPoolImportPointer`` per allocation, ``cuMemFree`` when it
            releases the allocation
=========== =================================================================

Lifetime: CUDA requires every importer to free a pool allocation before its exporter does.
The exporter enforces that order: an allocation it releases keeps its memory until every
process it served has freed it or exited (see :meth:`sharedarrays.Allocation.release`). This
is the CUDA twin of HIP's ``hipMemPoolExportToShareableHandle``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, ClassVar

from sharedarrays.backends.base import Chunk
from sharedarrays.backends.cuda.device import CudaDevice
from sharedarrays.backends.cuda.driver import (
    OPAQUE_BYTES,
    CudaDriverError,
    check,
    check_export,
    opaque_bytes,
    opaque_from_bytes,
    why_unusable,
)
from sharedarrays.backends.device import Device
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import HandleUnavailable, PayloadError
from sharedarrays.settings import env_number

__all__ = ["CudaPoolBackend", "GRANULARITY", "EXPORT_BYTES", "MAX_BYTES", "max_bytes"]

GRANULARITY = 512
"""cuda-pool chunk sizes are multiples of 512 bytes (the pool sub-allocates)."""

MAX_BYTES = 4 << 30
"""Largest cuda-pool allocation (``SHAREDARRAYS_POOL_MAX_BYTES`` overrides it). Measured on
an H200 with driver 580.159 (``benchmarks/probe_pool_import.py``): another process that
imports a pool allocation of 5.25 GiB or more crashes with a segmentation fault inside
``cuMemPoolImportPointer`` (cuda.core's IPC buffers crash the same way at 8 GiB), while 1 to
5 GiB work. Both sides refuse larger sizes, so that no importer can crash."""

POOL_ID_BYTES = 16
EXPORT_BYTES = POOL_ID_BYTES + OPAQUE_BYTES
"""A chunk's portable handle: the pool's random id, then ``cuMemPoolExportPointer``'s data."""


def max_bytes() -> int:
    """The largest cuda-pool allocation allowed here: :data:`MAX_BYTES` unless the
    ``SHAREDARRAYS_POOL_MAX_BYTES`` environment variable says otherwise."""
    return env_number("SHAREDARRAYS_POOL_MAX_BYTES", MAX_BYTES, 1)


def _too_large(size: int) -> str | None:
    limit = max_bytes()
    if size <= limit:
        return None
    return (
        f"a cuda-pool allocation of {size} bytes is larger than {limit} "
        "(SHAREDARRAYS_POOL_MAX_BYTES): importing pool allocations above about 5 GiB crashes "
        "the importing process inside cuMemPoolImportPointer (driver 580, H200). Use "
        "backend='cuda-vmm' or 'cuda-ipc' for large arrays"
    )


class CudaPoolBackend(CudaDevice):
    """Stream-ordered device memory of one CUDA device, shared through an exported memory
    pool (``"cuda-pool"``).

    Parameters
    ----------
    device : Device
        A CUDA device (``Device("cuda", N)``).

    Raises
    ------
    BackendUnavailable
        :func:`~sharedarrays.backends.cuda.driver.why_unusable` gave a reason.
    """

    name: ClassVar[str] = "cuda-pool"
    zeroed: ClassVar[bool] = False
    maps: ClassVar[bool] = False
    exporter_owned: ClassVar[bool] = True
    values_refused: ClassVar[str | None] = (
        "the driver refuses stream memory operations on pool memory imported by another "
        "process (cuStreamWaitValue64 answers CUDA_ERROR_INVALID_VALUE, seen on an H200 with "
        "driver 580). Put the counter in a cuda-vmm or cuda-ipc array: sa.zeros(1, 'uint64', "
        "backend='cuda-vmm')"
    )

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        d = self._d
        self._fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self._lock = threading.Lock()
        self._pool: Any = None  # this process's own pool, made on first create_chunk
        self._pool_fd = -1
        self._pool_id = os.urandom(POOL_ID_BYTES)
        self._imported: dict[bytes, list[Any]] = {}  # pool id -> [pool, open pointers]

    @property
    def granularity(self) -> int:
        """Chunk sizes are multiples of 512 bytes (:data:`GRANULARITY`)."""
        return GRANULARITY

    @property
    def pool_fd(self) -> int:
        """The exported fd of this process's pool (``-1`` before the first allocation)."""
        return self._pool_fd

    def _own_pool(self) -> Any:
        with self._lock:
            if self._pool is not None:
                return self._pool
            d = self._d
            props = d.CUmemPoolProps()
            props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            props.handleTypes = self._fd_type
            props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            props.location.id = self.device.index
            with self.context():
                pool = check(d.cuMemPoolCreate(props), f"cuMemPoolCreate(POSIX fd, {self.device})")
                try:
                    fd = int(
                        check_export(
                            d.cuMemPoolExportToShareableHandle(pool, self._fd_type, 0),
                            "cuMemPoolExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
                        )
                    )
                except BaseException:
                    d.cuMemPoolDestroy(pool)
                    raise
            os.set_inheritable(fd, False)
            self._pool, self._pool_fd = pool, fd
            return pool

    def check_memory(self, nbytes: int) -> None:
        """Nothing to check beforehand: ``cuMemAllocFromPoolAsync`` takes the device memory
        at once, and fails with :class:`CudaOutOfMemory` (an :class:`~sharedarrays.OutOfMemory`)."""

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes from this process's pool on the current stream, wait for
        the allocation, and export the pointer (once)."""
        self._check_size(size, "a chunk size")
        why = _too_large(size)
        if why is not None:
            raise ValueError(why)
        pool = self._own_pool()
        d = self._d
        stream = self.current_stream()
        with self.context():
            ptr = self._check_allocation(
                d.cuMemAllocFromPoolAsync(size, pool, stream),
                f"cuMemAllocFromPoolAsync({size} bytes on {self.device})",
                "pool memory",
                size,
            )
            try:
                check(d.cuStreamSynchronize(stream), "cuStreamSynchronize")
                data = check(d.cuMemPoolExportPointer(ptr), "cuMemPoolExportPointer")
            except BaseException:
                d.cuMemFree(ptr)
                raise
        export = self._pool_id + opaque_bytes(data)
        return Chunk(size=size, handle=int(ptr), fd=self._pool_fd, address=int(ptr), export=export)

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Nothing to seal: pool handles carry no access mode (read-only is a promise)."""
        return False

    def reopen_readonly(self, fd: int) -> int | None:
        """Pool handles carry no access mode: a read-only export is the importer's promise."""
        return None

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Open another process's pool allocation: ``export`` is its pool id and pointer
        data, ``fd`` the pool's exported fd (imported once per pool, then closed; ``-1`` once
        this process has the pool).

        Raises
        ------
        PayloadError
            ``export`` is not :data:`EXPORT_BYTES` long, ``fd`` is no exported pool, or
            ``size`` is above :func:`max_bytes` (the driver would crash this process).
        HandleUnavailable
            The pool is not known here and no fd came with it, or the driver refused the
            pointer (its memory was freed).
        """
        try:
            if len(export) != EXPORT_BYTES:
                raise PayloadError(f"a cuda-pool handle is {EXPORT_BYTES} bytes, not {len(export)}")
            why = _too_large(size)
            if why is not None:
                raise PayloadError(f"refusing to import: {why}")
            pool_id, data = export[:POOL_ID_BYTES], export[POOL_ID_BYTES:]
            d = self._d
            with self._lock, self.context():
                entry = self._imported.get(pool_id)
                if entry is None:
                    if fd < 0:
                        raise HandleUnavailable(
                            "the memory pool of this cuda-pool allocation is not open here and "
                            "its handle did not come with the payload"
                        )
                    try:
                        pool = check(
                            d.cuMemPoolImportFromShareableHandle(fd, self._fd_type, 0),
                            "cuMemPoolImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)",
                        )
                    except CudaDriverError as exc:
                        raise PayloadError(
                            f"the handle is not an exported memory pool: {exc}"
                        ) from exc
                    entry = self._imported[pool_id] = [pool, 0]
                try:
                    share = opaque_from_bytes(d.CUmemPoolPtrExportData, data)
                    ptr = check(d.cuMemPoolImportPointer(entry[0], share), "cuMemPoolImportPointer")
                except CudaDriverError as exc:
                    if not entry[1]:
                        del self._imported[pool_id]
                        d.cuMemPoolDestroy(entry[0])
                    raise HandleUnavailable(
                        f"{exc}: the memory of this cuda-pool allocation is gone (its exporter "
                        "freed it or exited)"
                    ) from exc
                entry[1] += 1
        finally:
            if fd >= 0:
                os.close(fd)
        return Chunk(
            size=size, handle=int(ptr), fd=-1, address=int(ptr), export=export, imported=True
        )

    def release_chunk(self, chunk: Chunk) -> None:
        """Wait for queued work, then free the pointer (``cuMemFree``); an importer also
        closes the imported pool after its last pointer, also where the wait or the free
        failed (the pointer is given up then: ``cuMemPoolDestroy`` of an imported pool
        defers to its last outstanding pointer). The pool fd stays with the backend.
        Idempotent; a no-op in a forked child."""
        ptr = chunk.handle
        if ptr < 0:
            return
        chunk.handle = -1
        chunk.fd = -1
        if self._forked():
            return
        d = self._d
        try:
            self.synchronize()
            with self._lock, self.context():
                check(d.cuMemFree(ptr), "cuMemFree")
        finally:
            if chunk.imported:
                self._close_imported(chunk.export[:POOL_ID_BYTES])

    def _close_imported(self, pool_id: bytes) -> None:
        """One pointer of imported pool ``pool_id`` less; the pool closed after its last."""
        d = self._d
        with self._lock:
            entry = self._imported.get(pool_id)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._imported[pool_id]
            with self.context():
                check(d.cuMemPoolDestroy(entry[0]), "cuMemPoolDestroy(imported pool)")


register(
    Registration(
        name=CudaPoolBackend.name,
        kind="cuda",
        factory=CudaPoolBackend,
        preference=2,
        maps=CudaPoolBackend.maps,
        exporter_owned=CudaPoolBackend.exporter_owned,
        why_unusable=lambda index: why_unusable(index, CudaPoolBackend.name),
    )
)
