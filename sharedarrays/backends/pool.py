"""The memory-pool backend of every GPU vendor (``cuda-pool``, ``hip-pool``) on its
:class:`~.base.VendorCalls`: one exported pool per process and device, a chunk one allocation
from it. An importer opens each pool once and must free before its exporter does."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, ClassVar

from sharedarrays.backends.base import Chunk, DeviceBase
from sharedarrays.backends.device import Device
from sharedarrays.errors import DriverError, HandleUnavailable, PayloadError

POOL_ID_BYTES = 16
POINTER_BYTES = 64  # sizeof(CUmemPoolPtrExportData), sizeof(hipMemPoolPtrExportData)
EXPORT_BYTES = POOL_ID_BYTES + POINTER_BYTES  # an export: the pool's random id, pointer's data


class PoolBackend(DeviceBase):
    """Stream-ordered memory of one GPU shared through an exported pool, put before the
    vendor's device base class (:attr:`calls`: its table)."""

    zeroed: ClassVar[bool] = False
    maps: ClassVar[bool] = False
    exporter_owned: ClassVar[bool] = True
    granularity = 512  # the pool sub-allocates

    def __init__(self, device: Device) -> None:
        super().__init__(device)  # type: ignore[call-arg]  # (the device base class)
        self._calls = self.calls(self)
        self._lock = threading.Lock()
        self._pool: Any = None  # this process's own pool, made on first create_chunk
        self._pool_fd = -1
        self._pool_id = os.urandom(POOL_ID_BYTES)
        self._imported: dict[bytes, list[Any]] = {}  # pool id -> [pool, open pointers]

    def _too_large(self, size: int) -> str | None:  # why ``size`` is refused, or None
        return None

    def _own_pool(self) -> Any:
        with self._lock:
            if self._pool is not None:
                return self._pool
            calls = self._calls
            with self.context():
                props = calls.located("PoolProps", self.device.index)
                props.allocType = calls.enum["pinned"]
                props.handleTypes = calls.fd_type
                pool = calls.call("MemPoolCreate", props, what=f"({calls.fd_name}, {self.device})")
                try:
                    fd = calls.export_fd("MemPoolExportToShareableHandle", pool)
                except BaseException:
                    with contextlib.suppress(DriverError):
                        calls.call("MemPoolDestroy", pool)
                    raise
            os.set_inheritable(fd, False)
            self._pool, self._pool_fd = pool, fd
            return pool

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes from this process's pool, wait for it, export the pointer."""
        self._check_size(size, "a chunk size")
        calls = self._calls
        why = self._too_large(size)
        if why is not None:
            raise ValueError(why)
        pool = self._own_pool()
        stream = calls.stream()
        what = f"({size} bytes on {self.device})"
        with self.context():
            args = (size, pool, stream)
            ptr = int(calls.allocating("pool memory", size, calls.allocate_call, *args, what=what))
            try:
                calls.call("StreamSynchronize", stream)
                data = calls.export_pointer(ptr)
            except BaseException:
                with contextlib.suppress(DriverError):
                    calls.call(calls.free_call, ptr)
                raise
        export = self._pool_id + data
        return Chunk(size=size, handle=ptr, fd=self._pool_fd, address=ptr, export=export)

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Open another process's allocation from ``export`` and the pool's ``fd`` (or ``-1``);
        ``HandleUnavailable`` where the pool is not open here and no fd came, or it was freed."""
        calls = self._calls
        try:
            if len(export) != EXPORT_BYTES:
                raise PayloadError(
                    f"a {self.name} handle is {EXPORT_BYTES} bytes, not {len(export)}"
                )
            why = self._too_large(size)
            if why is not None:
                raise PayloadError(f"refusing to import: {why}")
            pool_id, data = export[:POOL_ID_BYTES], export[POOL_ID_BYTES:]
            with self._lock, self.context():
                entry = self._imported.get(pool_id)
                if entry is None:
                    if fd < 0:
                        raise HandleUnavailable(
                            f"the memory pool of this {self.name} allocation is not open here "
                            "and its handle did not come with the payload"
                        )
                    args, what = (fd, calls.fd_type, 0), f"({calls.fd_name})"
                    try:
                        pool = calls.call("MemPoolImportFromShareableHandle", *args, what=what)
                    except DriverError as exc:
                        raise PayloadError(
                            f"the handle is not an exported memory pool: {exc}"
                        ) from exc
                    entry = self._imported[pool_id] = [pool, 0]
                try:
                    ptr = calls.import_pointer(entry[0], data)
                except DriverError as exc:
                    if not entry[1]:
                        del self._imported[pool_id]
                        with contextlib.suppress(DriverError):
                            calls.call("MemPoolDestroy", entry[0])
                    raise HandleUnavailable(
                        f"{exc}: the memory of this {self.name} allocation is gone (its "
                        "exporter freed it or exited)"
                    ) from exc
                entry[1] += 1
        finally:
            if fd >= 0:
                os.close(fd)
        return Chunk(size=size, handle=ptr, fd=-1, address=ptr, export=export, imported=True)

    def release_chunk(self, chunk: Chunk) -> None:
        """Wait for queued work, free the pointer, and close an imported pool after its last
        pointer (even where freeing failed)."""
        ptr = chunk.handle
        if ptr < 0:
            return
        chunk.handle = chunk.fd = -1
        if self._forked():
            return
        try:
            self.synchronize()
            with self._lock, self.context():
                self._calls.call(self._calls.free_call, ptr)
        finally:
            if chunk.imported:
                self._close_imported(chunk.export[:POOL_ID_BYTES])

    def _close_imported(self, pool_id: bytes) -> None:
        with self._lock:
            entry = self._imported.get(pool_id)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] > 0:
                return
            del self._imported[pool_id]
            with self.context():
                self._calls.call("MemPoolDestroy", entry[0])
