"""Fake ``cuda.bindings.driver`` modules for the CUDA tests that run without a GPU.

:class:`FakeDriver` answers what :func:`~sharedarrays.backends.cuda.driver.why_unusable`
asks (``test_cuda_driver.py``). :class:`FakeCuda` adds what the three CUDA backends call
(context, VMM, legacy IPC, memory pools, IPC events), keeps books of every resource it hands
out (generic allocation handles, reservations, mappings, exported fds, pointers, pools, pool
imports, events, pushed contexts) and fails any call on demand (:meth:`FakeCuda.fail`), so
that a test can make a call in the middle of a path fail and then ask what is still held
(:meth:`FakeCuda.held`).

:func:`use_fake` points :mod:`sharedarrays.backends.cuda.driver` at a fake, with fresh caches,
the way the tests substitute the driver bindings (``monkeypatch``, undone afterwards). The
driver's types and enums (``CUmemAllocationProp``, ``CUipcMemHandle``, ...) are the real
ones of cuda-bindings, which import without a GPU.
"""

from __future__ import annotations

import enum
import itertools
import os
import types
from collections import Counter
from typing import Any

import pytest

from sharedarrays.backends.cuda import driver as cuda_driver
from sharedarrays.process import STATE


class FakeResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_VALUE = 1


class FakeAttribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115
    CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES = 119


class FakeDriver:
    """Just enough of ``cuda.bindings.driver`` for :func:`why_unusable`."""

    CUresult = FakeResult
    CUdevice_attribute = FakeAttribute

    def __init__(
        self,
        init: Any = FakeResult.CUDA_SUCCESS,
        count: int = 1,
        vmm: int = 1,
        posix_fd: int = 1,
        initialised: bool = False,
    ) -> None:
        self.init, self.count, self.vmm, self.posix_fd = init, count, vmm, posix_fd
        self.initialised = initialised
        self.init_calls = 0
        self.peer_access = 1
        self.attrs: dict[Any, int] = {  # the other backends' features, all present
            FakeAttribute.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: 1,
            FakeAttribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: 1,
            FakeAttribute.CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES: 0b1001,
        }

    def cuInit(self, flags: int) -> tuple[Any]:
        self.init_calls += 1
        if isinstance(self.init, BaseException):
            raise self.init
        return (self.init,)

    def cuDeviceGetCount(self) -> tuple[Any, int]:
        return FakeResult.CUDA_SUCCESS, self.count

    def cuDeviceGet(self, index: int) -> tuple[Any, int]:
        return FakeResult.CUDA_SUCCESS, index

    def cuDeviceGetAttribute(self, attribute: Any, dev: int) -> tuple[Any, int]:
        if attribute is FakeAttribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED:
            return FakeResult.CUDA_SUCCESS, self.vmm
        if attribute in self.attrs:
            return FakeResult.CUDA_SUCCESS, self.attrs[attribute]
        return FakeResult.CUDA_SUCCESS, self.posix_fd

    def cuDeviceCanAccessPeer(self, dev: int, peer: int) -> tuple[Any, int]:
        return FakeResult.CUDA_SUCCESS, self.peer_access

    def cuDeviceGetName(self, length: int, dev: int) -> tuple[Any, bytes]:
        return FakeResult.CUDA_SUCCESS, b"Fake GPU\0\0\0"

    def cuGetErrorString(self, err: Any) -> tuple[Any, bytes]:
        return FakeResult.CUDA_SUCCESS, b"described"

    def cuCtxGetCurrent(self) -> tuple[Any, int]:
        if self.initialised:
            return FakeResult.CUDA_SUCCESS, 0
        return FakeResult.CUDA_ERROR_NOT_INITIALIZED, 0


def use_fake(monkeypatch: pytest.MonkeyPatch, driver: Any) -> None:
    """Point :mod:`sharedarrays.backends.cuda.driver` at ``driver`` with fresh caches, and
    make CuPy look installed (restored when the test ends)."""
    state = STATE.backends
    monkeypatch.setattr(state, "cuda_driver", driver)
    monkeypatch.setattr(state, "reasons", {})
    monkeypatch.setattr(state, "cuda_init_pid", None)
    monkeypatch.setattr(state, "cuda_count", 0)
    monkeypatch.setattr(state, "cuda_forked", False)
    monkeypatch.setattr(state, "cuda_parent_had", False)
    real = cuda_driver.installed
    monkeypatch.setattr(cuda_driver, "installed", lambda name: name == "cupy" or real(name))


# ============================================================================================
# the backends' calls, with books


GRANULARITY = 2 << 20
"""What the fake answers for ``cuMemGetAllocationGranularity``."""

_HANDLE_TYPE_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class FakeCuda(FakeDriver):
    """The calls the CUDA backends make, on no device: every resource handed out is
    recorded until it is given back, and any call can be made to fail.

    Parameters
    ----------
    free, total : int
        What ``cuMemGetInfo`` answers.

    Attributes
    ----------
    handles : dict of int to int
        Live generic allocation handles (``cuMemCreate``, ``cuMemImportFromShareableHandle``)
        and the bytes each names.
    reserved : dict of int to int
        Reserved address ranges (start to size).
    mapped : dict of int to tuple of (int, int)
        Mappings (start to size and handle).
    exports : dict of int to int
        Inode of each exported fd (a memfd) to the handle it was exported from.
    pointers : dict of int to str
        Device pointers held (``cuMemAlloc``, ``cuMemAllocFromPoolAsync``, imported pool
        pointers, opened IPC memory) and what made them.
    pools : dict of int to str
        Live pools, own (``"own"``) or imported.
    events : dict of int to str
        Live events, created or opened.
    semaphores : dict of int to str
        Imported external semaphores.
    pushed : int
        Contexts pushed and not popped.
    synchronized : int
        ``cuCtxSynchronize`` calls.
    log : list of str
        Every faked call, in order.
    """

    def __init__(self, free: int = 1 << 30, total: int = 80 << 30) -> None:
        super().__init__(initialised=True)
        import cuda.bindings.driver as real

        self._real = real
        self.CUresult = real.CUresult  # type: ignore[misc, assignment]
        self.free, self.total = free, total
        self.current: int | None = None  # the calling thread's current context (one thread)
        self.primary = 0xC0
        self.pushed = 0
        self.synchronized = 0
        self.handles: dict[int, int] = {}
        self.reserved: dict[int, int] = {}
        self.mapped: dict[int, tuple[int, int]] = {}
        self.exports: dict[int, int] = {}
        self.pointers: dict[int, str] = {}
        self.pools: dict[int, str] = {}
        self.events: dict[int, str] = {}
        self.semaphores: dict[int, str] = {}
        self.log: list[str] = []
        self._failures: dict[str, list[tuple[int, Any]]] = {}
        self._counts: Counter[str] = Counter()
        self._ids = itertools.count(0x1000)
        self._next_va = 0x7F0000000000

    # the driver's types and enums are the real ones
    def __getattr__(self, name: str) -> Any:
        if name.startswith("CU"):
            return getattr(self._real, name)
        raise AttributeError(f"the fake driver has no {name}")

    # failing on demand -------------------------------------------------------------------
    def fail(self, call: str, error: str = "CUDA_ERROR_UNKNOWN", nth: int = 1) -> None:
        """Make the ``nth`` call of ``call`` from now on answer ``error`` (once)."""
        self._failures.setdefault(call, []).append(
            (self._counts[call] + nth, getattr(self._real.CUresult, error))
        )

    def _err(self, call: str) -> Any:
        self.log.append(call)
        self._counts[call] += 1
        for entry in self._failures.get(call, []):
            if entry[0] == self._counts[call]:
                self._failures[call].remove(entry)
                return entry[1]
        return self._real.CUresult.CUDA_SUCCESS

    def _new_id(self) -> int:
        return next(self._ids)

    def held(self) -> dict[str, Any]:
        """What is still held, by kind (empty: nothing leaked)."""
        books = {
            "handles": self.handles,
            "reserved": self.reserved,
            "mapped": self.mapped,
            "pointers": self.pointers,
            "pools": {p: w for p, w in self.pools.items() if w != "own"},
            "events": self.events,
            "semaphores": self.semaphores,
            "pushed": self.pushed,
        }
        return {k: v for k, v in books.items() if v}

    # context -----------------------------------------------------------------------------
    def cuCtxGetCurrent(self) -> tuple[Any, Any]:
        return self._err("cuCtxGetCurrent"), self.current

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple[Any, int]:
        return self._err("cuDevicePrimaryCtxRetain"), self.primary

    def cuCtxSetCurrent(self, ctx: int) -> tuple[Any]:
        err = self._err("cuCtxSetCurrent")
        if not err:
            self.current = int(ctx)
        return (err,)

    def cuCtxPushCurrent(self, ctx: int) -> tuple[Any]:
        err = self._err("cuCtxPushCurrent")
        if not err:
            self.pushed += 1
        return (err,)

    def cuCtxPopCurrent(self) -> tuple[Any, int]:
        err = self._err("cuCtxPopCurrent")
        if not err:
            self.pushed -= 1
        return err, self.primary

    def cuCtxSynchronize(self) -> tuple[Any]:
        err = self._err("cuCtxSynchronize")
        if not err:
            self.synchronized += 1
        return (err,)

    def cuMemGetInfo(self) -> tuple[Any, int, int]:
        return self._err("cuMemGetInfo"), self.free, self.total

    def cuStreamSynchronize(self, stream: Any) -> tuple[Any]:
        return (self._err("cuStreamSynchronize"),)

    def cuStreamQuery(self, stream: Any) -> tuple[Any]:
        return (self._err("cuStreamQuery"),)

    def cuStreamWaitEvent(self, stream: Any, event: Any, flags: int) -> tuple[Any]:
        return (self._err("cuStreamWaitEvent"),)

    # VMM ---------------------------------------------------------------------------------
    def cuMemGetAllocationGranularity(self, prop: Any, flags: Any) -> tuple[Any, int]:
        return self._err("cuMemGetAllocationGranularity"), GRANULARITY

    def CUmemGenericAllocationHandle(self, handle: int) -> int:
        return int(handle)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[Any, int | None]:
        err = self._err("cuMemCreate")
        if err:
            return err, None
        handle = self._new_id()
        self.handles[handle] = size
        return err, handle

    def cuMemRelease(self, handle: int) -> tuple[Any]:
        err = self._err("cuMemRelease")
        if not err:
            if int(handle) not in self.handles:
                return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE,)
            del self.handles[int(handle)]
        return (err,)

    def cuMemExportToShareableHandle(
        self, handle: int, kind: Any, flags: int
    ) -> tuple[Any, int | None]:
        err = self._err("cuMemExportToShareableHandle")
        if err:
            return err, None
        fd = os.memfd_create("fake-cuda-export")
        self.exports[os.fstat(fd).st_ino] = int(handle)
        return err, fd

    def cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> tuple[Any, int | None]:
        err = self._err("cuMemImportFromShareableHandle")
        if err:
            return err, None
        try:
            source = self.exports[os.fstat(fd).st_ino]
        except (OSError, KeyError):
            return self._real.CUresult.CUDA_ERROR_INVALID_VALUE, None
        handle = self._new_id()
        self.handles[handle] = self.handles.get(source, GRANULARITY)
        return err, handle

    def cuMemGetAllocationPropertiesFromHandle(self, handle: int) -> tuple[Any, Any]:
        err = self._err("cuMemGetAllocationPropertiesFromHandle")
        prop = self._real.CUmemAllocationProp()
        prop.location.id = 0
        return err, prop

    def cuMemAddressReserve(
        self, size: int, alignment: int, addr: int, flags: int
    ) -> tuple[Any, int | None]:
        err = self._err("cuMemAddressReserve")
        if err:
            return err, None
        address = self._next_va
        self._next_va += size + GRANULARITY
        self.reserved[address] = size
        return err, address

    def cuMemAddressFree(self, address: int, size: int) -> tuple[Any]:
        err = self._err("cuMemAddressFree")
        if err:
            return (err,)
        inside = [a for a in self.mapped if address <= a < address + size]
        if self.reserved.get(address) != size or inside:
            return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.reserved[address]
        return (err,)

    def cuMemMap(self, address: int, size: int, offset: int, handle: int, flags: int) -> tuple[Any]:
        err = self._err("cuMemMap")
        if not err:
            self.mapped[int(address)] = (size, int(handle))
        return (err,)

    def cuMemUnmap(self, address: int, size: int) -> tuple[Any]:
        err = self._err("cuMemUnmap")
        if not err:
            if self.mapped.get(int(address), (None,))[0] != size:
                return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE,)
            del self.mapped[int(address)]
        return (err,)

    def cuMemSetAccess(self, address: int, size: int, descs: Any, count: int) -> tuple[Any]:
        return (self._err("cuMemSetAccess"),)

    # legacy IPC --------------------------------------------------------------------------
    def cuMemAlloc(self, size: int) -> tuple[Any, int | None]:
        err = self._err("cuMemAlloc")
        if err:
            return err, None
        ptr = self._new_id() << 20
        self.pointers[ptr] = "cuMemAlloc"
        return err, ptr

    def cuMemFree(self, ptr: int) -> tuple[Any]:
        err = self._err("cuMemFree")
        if not err:
            if int(ptr) not in self.pointers:
                return (self._real.CUresult.CUDA_ERROR_INVALID_VALUE,)
            del self.pointers[int(ptr)]
        return (err,)

    def cuIpcGetMemHandle(self, ptr: int) -> tuple[Any, Any]:
        return self._err("cuIpcGetMemHandle"), self._real.CUipcMemHandle()

    def cuIpcOpenMemHandle(self, handle: Any, flags: int) -> tuple[Any, int | None]:
        err = self._err("cuIpcOpenMemHandle")
        if err:
            return err, None
        ptr = self._new_id() << 20
        self.pointers[ptr] = "cuIpcOpenMemHandle"
        return err, ptr

    def cuIpcCloseMemHandle(self, ptr: int) -> tuple[Any]:
        err = self._err("cuIpcCloseMemHandle")
        if not err:
            del self.pointers[int(ptr)]
        return (err,)

    def cuMemGetAddressRange(self, ptr: int) -> tuple[Any, int, int]:
        return self._err("cuMemGetAddressRange"), int(ptr), 1 << 40

    # pools -------------------------------------------------------------------------------
    def cuMemPoolCreate(self, props: Any) -> tuple[Any, int | None]:
        err = self._err("cuMemPoolCreate")
        if err:
            return err, None
        pool = self._new_id()
        self.pools[pool] = "own"
        return err, pool

    def cuMemPoolDestroy(self, pool: int) -> tuple[Any]:
        err = self._err("cuMemPoolDestroy")
        if not err:
            del self.pools[int(pool)]
        return (err,)

    def cuMemPoolExportToShareableHandle(
        self, pool: int, kind: Any, flags: int
    ) -> tuple[Any, int | None]:
        err = self._err("cuMemPoolExportToShareableHandle")
        return err, None if err else os.memfd_create("fake-cuda-pool")

    def cuMemPoolImportFromShareableHandle(
        self, fd: int, kind: Any, flags: int
    ) -> tuple[Any, int | None]:
        err = self._err("cuMemPoolImportFromShareableHandle")
        if err:
            return err, None
        pool = self._new_id()
        self.pools[pool] = "imported"
        return err, pool

    def cuMemAllocFromPoolAsync(self, size: int, pool: int, stream: Any) -> tuple[Any, Any]:
        err = self._err("cuMemAllocFromPoolAsync")
        if err:
            return err, None
        ptr = self._new_id() << 20
        self.pointers[ptr] = "cuMemAllocFromPoolAsync"
        return err, ptr

    def cuMemPoolExportPointer(self, ptr: int) -> tuple[Any, Any]:
        return self._err("cuMemPoolExportPointer"), self._real.CUmemPoolPtrExportData()

    def cuMemPoolImportPointer(self, pool: int, data: Any) -> tuple[Any, int | None]:
        err = self._err("cuMemPoolImportPointer")
        if err:
            return err, None
        ptr = self._new_id() << 20
        self.pointers[ptr] = "cuMemPoolImportPointer"
        return err, ptr

    # events ------------------------------------------------------------------------------
    def cuEventCreate(self, flags: int) -> tuple[Any, int | None]:
        err = self._err("cuEventCreate")
        if err:
            return err, None
        event = self._new_id()
        self.events[event] = "created"
        return err, event

    def cuEventDestroy(self, event: int) -> tuple[Any]:
        err = self._err("cuEventDestroy")
        if not err:
            del self.events[int(event)]
        return (err,)

    def cuIpcOpenEventHandle(self, handle: Any) -> tuple[Any, int | None]:
        err = self._err("cuIpcOpenEventHandle")
        if err:
            return err, None
        event = self._new_id()
        self.events[event] = "opened"
        return err, event

    # external semaphores -----------------------------------------------------------------
    def cuImportExternalSemaphore(self, desc: Any) -> tuple[Any, int | None]:
        err = self._err("cuImportExternalSemaphore")
        if err:
            return err, None
        os.close(desc.handle.fd)  # (CUDA owns the fd once it took it)
        sem = self._new_id()
        self.semaphores[sem] = "imported"
        return err, sem

    def cuDestroyExternalSemaphore(self, sem: int) -> tuple[Any]:
        err = self._err("cuDestroyExternalSemaphore")
        if not err:
            del self.semaphores[int(sem)]
        return (err,)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """A :class:`FakeCuda` in place of the driver bindings (cuda-bindings' types needed)."""
    pytest.importorskip("cuda.bindings.driver")
    driver = FakeCuda()
    use_fake(monkeypatch, driver)
    monkeypatch.setattr(STATE.backends, "objects", {})  # (backends made now use the fake)
    monkeypatch.setattr(STATE.backends, "cupy_stream", lambda index: types.SimpleNamespace(ptr=0))
    return driver
