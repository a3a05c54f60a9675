"""The CUDA backends' error paths, on the CPU, with a fake driver (``tests/fake_cuda.py``):
whatever driver call fails in the middle of making, importing, mapping or releasing memory,
every handle, reservation, mapping, fd, pointer, pool import and pushed context is given
back, and the caller sees a :class:`~sharedarrays.SharedArrayError` that says what to do.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import sys
from collections.abc import Iterator

import pytest
from fake_cuda import GRANULARITY, FakeCuda, fake_cuda

import sharedarrays as sa
from sharedarrays.backends import pool
from sharedarrays.backends.base import Chunk
from sharedarrays.backends.cuda import sync
from sharedarrays.backends.cuda.device import CudaVmmBackend
from sharedarrays.backends.cuda.driver import CudaDriverError
from sharedarrays.backends.cuda.pool import CudaPoolBackend
from sharedarrays.backends.device import Device
from sharedarrays.errors import SharedArrayError
from sharedarrays.memory.allocation import Allocation
from sharedarrays.process import STATE
from sharedarrays.protocol import token as wire

__all__ = ["fake_cuda"]  # a fixture, used by name

pytestmark = pytest.mark.usefixtures("no_cache")  # (a release frees: nothing kept for reuse)

CUDA0 = Device("cuda", 0)


def _fds() -> set[int]:
    return set(map(int, os.listdir("/proc/self/fd")))


def test_the_fake_gives_everything_back_on_the_good_path(fake_cuda: FakeCuda) -> None:
    be = CudaVmmBackend(CUDA0)
    before = _fds()
    alloc = Allocation.create(be, 3 * GRANULARITY, chunk_bytes=GRANULARITY)
    assert len(fake_cuda.handles) == 3 and len(fake_cuda.mapped) == 3
    assert alloc.release()
    assert fake_cuda.held() == {}
    assert _fds() <= before


# ============================================================================================
# cuda-vmm: making an allocation


@pytest.mark.parametrize(
    ("call", "nth"),
    [
        ("cuMemCreate", 2),  # the second chunk: the first is made and mapped
        ("cuMemExportToShareableHandle", 3),
        ("cuMemMap", 2),  # after cuMemCreate and cuMemAddressReserve succeeded
        ("cuMemSetAccess", 1),  # after every map
        ("cuMemAddressReserve", 1),
    ],
)
def test_a_failing_call_while_making_releases_everything(
    fake_cuda: FakeCuda, call: str, nth: int
) -> None:
    be = CudaVmmBackend(CUDA0)
    before, registered = _fds(), len(STATE.memory.registry)
    fake_cuda.fail(call, "CUDA_ERROR_INVALID_VALUE", nth=nth)
    with pytest.raises(SharedArrayError, match=call):
        Allocation.create(be, 3 * GRANULARITY, chunk_bytes=GRANULARITY)
    assert fake_cuda.held() == {}
    assert _fds() <= before
    assert len(STATE.memory.registry) == registered


# ============================================================================================
# cuda-vmm: importing an allocation


def _held(fake: FakeCuda) -> dict[str, object]:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in fake.held().items()}


@pytest.mark.parametrize(
    ("call", "nth"),
    [
        ("cuMemImportFromShareableHandle", 2),  # half-way through three chunks
        ("cuMemGetAllocationPropertiesFromHandle", 3),
        ("cuMemMap", 3),
        ("cuMemSetAccess", 1),
        ("cuMemAddressReserve", 1),
        ("cuCtxGetCurrent", 4),
    ],
)
def test_a_failing_call_while_importing_releases_everything(
    fake_cuda: FakeCuda, call: str, nth: int
) -> None:
    be = CudaVmmBackend(CUDA0)
    source = Allocation.create(be, 3 * GRANULARITY, chunk_bytes=GRANULARITY)
    held, before, registered = _held(fake_cuda), _fds(), len(STATE.memory.registry)
    fds = [os.dup(fd) for fd in source.chunk_fds()]
    fake_cuda.fail(call, "CUDA_ERROR_OUT_OF_MEMORY", nth=nth)
    with pytest.raises(SharedArrayError, match=call):
        Allocation.import_(be, "ab" * 16, source.secret, source.chunk_sizes(), fds, 1)
    assert _held(fake_cuda) == held  # the source's, nothing more
    assert _fds() == before  # the fds given are closed, also those not reached
    assert len(STATE.memory.registry) == registered
    assert source.release() and fake_cuda.held() == {}


# ============================================================================================
# out of device memory


@pytest.mark.parametrize(
    ("backend", "call"),
    [
        ("cuda-vmm", "cuMemCreate"),
        ("cuda-vmm", "cuMemAddressReserve"),
        ("cuda-ipc", "cuMemAlloc"),
        ("cuda-pool", "cuMemAllocFromPoolAsync"),
    ],
)
def test_out_of_memory_names_the_size_and_what_is_free(
    fake_cuda: FakeCuda, backend: str, call: str
) -> None:
    fake_cuda.free, fake_cuda.total = 3 << 30, 80 << 30
    fake_cuda.fail(call, "CUDA_ERROR_OUT_OF_MEMORY")
    with pytest.raises(sa.OutOfMemory) as info:
        sa.empty(5 << 28, "uint8", device="cuda:0", backend=backend)
    text = str(info.value)
    assert call in text and "CUDA_ERROR_OUT_OF_MEMORY" in text
    assert str(5 << 28) in text  # the size asked
    assert "3.00 GiB" in text and "80.00 GiB" in text  # what is free, of what
    assert "smaller" in text  # what to do
    assert fake_cuda.held() == {}
    assert pickle.loads(pickle.dumps(info.value)).args == info.value.args


def test_out_of_memory_where_the_free_memory_is_not_known(fake_cuda: FakeCuda) -> None:
    fake_cuda.fail("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")
    fake_cuda.fail("cuMemGetInfo", "CUDA_ERROR_INVALID_CONTEXT")
    with pytest.raises(sa.OutOfMemory, match="not known") as info:
        sa.empty(1 << 20, "uint8", device="cuda:0", backend="cuda-vmm")
    assert str(GRANULARITY) in str(info.value)


# ============================================================================================
# cuda-pool: the imported pool


def _import_pool_chunk(be: CudaPoolBackend) -> Chunk:
    """A chunk of another process's pool (its id unknown here), imported with its pool's fd."""
    export = os.urandom(pool.POOL_ID_BYTES) + bytes(64)
    return be.import_chunk(os.memfd_create("a-pool-fd"), pool.PoolBackend.granularity, export)


@pytest.mark.parametrize("call", ["cuMemFree", "cuCtxSynchronize"])
def test_a_failing_release_still_closes_the_imported_pool(fake_cuda: FakeCuda, call: str) -> None:
    be = CudaPoolBackend(CUDA0)
    before = _fds()
    chunk = _import_pool_chunk(be)
    assert list(fake_cuda.pools.values()) == ["imported"] and _fds() == before
    fake_cuda.fail(call)
    with pytest.raises(SharedArrayError, match=call):
        be.release_chunk(chunk)
    assert fake_cuda.pools == {}  # the pool import ends with its last pointer, freed or not
    assert be._imported == {}
    be.release_chunk(chunk)  # idempotent


def test_the_imported_pool_stays_while_another_pointer_is_open(fake_cuda: FakeCuda) -> None:
    be = CudaPoolBackend(CUDA0)
    export = os.urandom(pool.POOL_ID_BYTES) + bytes(64)
    first = be.import_chunk(os.memfd_create("a-pool-fd"), pool.PoolBackend.granularity, export)
    second = be.import_chunk(-1, pool.PoolBackend.granularity, export)  # (the pool is open here)
    fake_cuda.fail("cuMemFree")
    with pytest.raises(SharedArrayError, match="cuMemFree"):
        be.release_chunk(first)
    assert list(fake_cuda.pools.values()) == ["imported"]
    be.release_chunk(second)
    assert fake_cuda.pools == {} and be._imported == {}


# ============================================================================================
# ordering: the events opened for other processes' tokens


class _On:
    device = CUDA0

    def context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def test_events_of_exporters_that_exited_are_destroyed(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("opened", "waited", "own", "rings"):
        monkeypatch.setattr(STATE.backends, name, {})
    alive = {100001: 7, 100002: 9}  # pid -> start time, of two "exporters"
    monkeypatch.setattr(sync, "start_time", alive.get)
    monkeypatch.setattr(sync, "running", lambda pid: pid in alive)

    def token(pid: int, seq: int) -> bytes:
        return wire.encode(wire.OrderingToken(pid, alive[pid], bytes([seq]) * 64, seq))

    first, second = token(100001, 1), token(100001, 2)
    sync.import_sync(_On(), first)
    sync.import_sync(_On(), second)
    assert list(fake_cuda.events.values()) == ["opened", "opened"]
    del alive[100001]  # it exited, and sends no token again: its events are no use here
    sync.import_sync(_On(), token(100002, 3))
    assert list(fake_cuda.events.values()) == ["opened"]  # (three were kept)
    assert len(STATE.backends.opened) == 1


# ============================================================================================
# contexts and the fd limit


def test_a_failing_call_under_another_context_pops_what_it_pushed(fake_cuda: FakeCuda) -> None:
    be = CudaVmmBackend(CUDA0)
    fake_cuda.current = 0xBEEF  # another library's context is current: ours is pushed
    fake_cuda.fail("cuMemMap")
    with pytest.raises(SharedArrayError, match="cuMemMap"):
        Allocation.create(be, 2 * GRANULARITY, chunk_bytes=GRANULARITY)
    assert fake_cuda.held() == {}  # (pushed: 0)
    assert fake_cuda.current == 0xBEEF and "cuCtxPushCurrent" in fake_cuda.log


@contextlib.contextmanager
def _no_fd_left() -> Iterator[None]:
    """This process may open no more fds for the block (``RLIMIT_NOFILE`` at the lowest
    free fd number, which the kernel gives a new fd)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest = os.open(os.devnull, os.O_RDONLY)
    os.close(lowest)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_export_refused_at_the_fd_limit_says_so(fake_cuda: FakeCuda) -> None:
    be = CudaVmmBackend(CUDA0)
    # (what the driver answers for an export in a process with no fd left is not known here)
    fake_cuda.fail("cuMemExportToShareableHandle", "CUDA_ERROR_OPERATING_SYSTEM")
    with _no_fd_left(), pytest.raises(sa.HandleUnavailable, match=r"ulimit -n") as info:
        be.create_chunk(GRANULARITY)
    assert "cuMemExportToShareableHandle" in str(info.value)
    assert fake_cuda.held() == {}
    fake_cuda.fail("cuMemExportToShareableHandle", "CUDA_ERROR_OPERATING_SYSTEM")
    with pytest.raises(CudaDriverError, match="cuMemExportToShareableHandle"):
        be.create_chunk(GRANULARITY)  # with fds left: the driver's own error
    assert fake_cuda.held() == {}


def test_a_stream_asked_while_another_thread_imports_cupy_is_the_default(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Pool's result thread loads a CUDA array while the main thread is still importing
    CuPy (a module without its ``cuda`` yet): the legacy stream, not an AttributeError."""
    import types

    from sharedarrays.backends.cuda import driver

    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setattr(STATE.backends, "cupy_stream", None)
    assert driver.current_stream(0) == 0
    assert STATE.backends.cupy_stream is None  # (asked again once CuPy is imported)
