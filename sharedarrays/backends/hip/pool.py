"""The HIP memory-pool backend: stream-ordered AMD GPU allocations from an IPC-capable pool
(``"hip-pool"``), the HIP twin of cuda-pool.

Called through hip-python (see :mod:`~sharedarrays.backends.hip.runtime`):

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
import os
import threading
from typing import Any, ClassVar

from sharedarrays.backends.base import Chunk
from sharedarrays.backends.device import Device
from sharedarrays.backends.hip.device import HipDevice
from sharedarrays.backends.hip.runtime import HipError, check, why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import HandleUnavailable, PayloadError

__all__ = ["HipPoolBackend", "GRANULARITY", "EXPORT_BYTES"]

GRANULARITY = 512
"""hip-pool chunk sizes are multiples of 512 bytes (the pool sub-allocates)."""

POOL_ID_BYTES = 16
POINTER_BYTES = 64  # sizeof(hipMemPoolPtrExportData)
EXPORT_BYTES = POOL_ID_BYTES + POINTER_BYTES
"""A chunk's portable handle: the pool's random id, then ``hipMemPoolExportPointer``'s data."""

_ExportData = ctypes.c_ubyte * POINTER_BYTES


class HipPoolBackend(HipDevice):
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
    """

    name: ClassVar[str] = "hip-pool"
    feature: ClassVar[str] = "pool"
    zeroed: ClassVar[bool] = False
    maps: ClassVar[bool] = False
    exporter_owned: ClassVar[bool] = True
    peer_access: ClassVar[bool] = False

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        hip = self._hip
        self._fd_type = hip.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor
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
            hip = self._hip
            props = hip.hipMemPoolProps()
            props.allocType = hip.hipMemAllocationType.hipMemAllocationTypePinned
            props.handleTypes = self._fd_type
            props.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
            props.location.id = self.device.index
            with self._on_device():
                pool = check(hip.hipMemPoolCreate(props), f"hipMemPoolCreate({self.device})")
                out = ctypes.c_int(-1)
                try:
                    check(
                        hip.hipMemPoolExportToShareableHandle(
                            ctypes.addressof(out), pool, self._fd_type, 0
                        ),
                        "hipMemPoolExportToShareableHandle(PosixFileDescriptor)",
                    )
                except BaseException:
                    if out.value >= 0:
                        os.close(out.value)
                    hip.hipMemPoolDestroy(pool)
                    raise
            os.set_inheritable(out.value, False)
            self._pool, self._pool_fd = pool, out.value
            return pool

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes from this process's pool on the null stream, wait for the
        allocation, and export the pointer (once)."""
        self._check_size(size, "a chunk size")
        pool = self._own_pool()
        hip = self._hip
        with self._on_device():
            ptr = check(
                hip.hipMallocFromPoolAsync(size, pool, 0),
                f"hipMallocFromPoolAsync({size} bytes on {self.device})",
            )
            data = _ExportData()
            try:
                check(hip.hipStreamSynchronize(0), "hipStreamSynchronize")
                check(hip.hipMemPoolExportPointer(data, ptr), "hipMemPoolExportPointer")
            except BaseException:
                hip.hipFree(ptr)
                raise
        export = self._pool_id + bytes(data)
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
            ``export`` is not :data:`EXPORT_BYTES` long, or ``fd`` is no exported pool.
        HandleUnavailable
            The pool is not known here and no fd came with it, or the runtime refused the
            pointer (its memory was freed).
        """
        hip = self._hip
        try:
            if len(export) != EXPORT_BYTES:
                raise PayloadError(f"a hip-pool handle is {EXPORT_BYTES} bytes, not {len(export)}")
            pool_id, data = export[:POOL_ID_BYTES], export[POOL_ID_BYTES:]
            with self._lock, self._on_device():
                entry = self._imported.get(pool_id)
                if entry is None:
                    if fd < 0:
                        raise HandleUnavailable(
                            "the memory pool of this hip-pool allocation is not open here and "
                            "its handle did not come with the payload"
                        )
                    try:
                        pool = check(
                            hip.hipMemPoolImportFromShareableHandle(fd, self._fd_type, 0),
                            "hipMemPoolImportFromShareableHandle(PosixFileDescriptor)",
                        )
                    except HipError as exc:
                        raise PayloadError(
                            f"the handle is not an exported memory pool: {exc}"
                        ) from exc
                    entry = self._imported[pool_id] = [pool, 0]
                try:
                    ptr = check(
                        hip.hipMemPoolImportPointer(entry[0], _ExportData.from_buffer_copy(data)),
                        "hipMemPoolImportPointer",
                    )
                except HipError as exc:
                    if not entry[1]:
                        del self._imported[pool_id]
                        hip.hipMemPoolDestroy(entry[0])
                    raise HandleUnavailable(
                        f"{exc}: the memory of this hip-pool allocation is gone (its exporter "
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
        """Wait for queued work, then free the pointer (``hipFree``); an importer also
        destroys the imported pool after its last pointer. The pool fd stays with the
        backend. Idempotent; a no-op in a forked child."""
        ptr = chunk.handle
        if ptr < 0:
            return
        chunk.handle = -1
        chunk.fd = -1
        if self._forked():
            return
        self.synchronize()
        hip = self._hip
        with self._lock, self._on_device():
            check(hip.hipFree(ptr), "hipFree")
            if chunk.imported:
                pool_id = chunk.export[:POOL_ID_BYTES]
                entry = self._imported.get(pool_id)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self._imported[pool_id]
                        check(hip.hipMemPoolDestroy(entry[0]), "hipMemPoolDestroy(imported pool)")


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
