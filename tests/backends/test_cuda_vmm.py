"""The CUDA VMM backend and cross-process ordering (``sharedarrays.backends.cuda.sync``).

The CPU half lives in ``test_cuda_driver.py`` (why_unusable, a fake driver, errors) and
``tests/test_sync.py`` (no_sync, tokens). Here:

- ``gpu`` tests (skipped with the reason where CUDA is unusable): the Backend protocol on a
  real device, an fd handed to a ``spawn`` child, memory returning to the baseline, unmap
  waiting for a running kernel, and an interprocess event ordering a consumer after a
  producer's kernel.

Functions that spawned children run are at module level (children import this module by
name; ``multiprocessing`` passes ``sys.path`` along).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np
import pytest
from cuda_helpers import ROOT, Spin, child_env
from hypothesis import given, settings
from hypothesis import strategies as st

from sharedarrays.backends.base import Backend, Chunk, NativeView
from sharedarrays.backends.cuda import driver as cuda_driver
from sharedarrays.backends.cuda import sync
from sharedarrays.backends.cuda.device import CudaVmmBackend, memset_word
from sharedarrays.backends.cuda.driver import (
    FORK_REASON,
    why_unusable,
)
from sharedarrays.backends.device import Device
from sharedarrays.errors import PayloadError
from sharedarrays.process import STATE

MiB = 1 << 20


# ============================================================================================
# GPU fixtures and helpers


@pytest.fixture(scope="module")
def be() -> CudaVmmBackend:
    reason = why_unusable(0)
    if reason is not None:
        pytest.skip(f"no usable CUDA device: {reason}")
    return CudaVmmBackend(Device("cuda", 0))


@contextlib.contextmanager
def mapped(be: CudaVmmBackend, chunks: list[Chunk], access: str = "rw") -> Iterator[int]:
    """Reserve a range, map ``chunks`` one after another, set access; undo on exit."""
    size = sum(c.size for c in chunks)
    address = be.reserve(size)
    done: list[tuple[int, int]] = []
    try:
        offset = 0
        for c in chunks:
            be.map(address + offset, c.size, c)
            done.append((address + offset, c.size))
            offset += c.size
        be.set_access(address, size, access)  # type: ignore[arg-type]
        yield address
    finally:
        for where, n in done:
            be.unmap(where, n)
        be.free_reservation(address, size)


class Owner:
    """Stands for the mapping that owns memory wrapped by ``as_native``."""


def f32(be: CudaVmmBackend, address: int, nbytes: int, owner: object = None) -> Any:
    n = nbytes // 4
    return be.as_native(
        NativeView(address, nbytes, 0, owner, np.dtype(np.float32), (n,), (4,), False)
    )


@pytest.fixture(scope="module")
def spin(be: CudaVmmBackend) -> Spin:
    return Spin()


class PassFd:
    """Hands an fd to a spawned child as a ``Process`` argument (multiprocessing's DupFd)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received_fd, (DupFd(self.fd),))


def _received_fd(dup: Any) -> int:
    return int(dup.detach())


def _spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, theirs))
    proc.start()
    theirs.close()
    return proc, ours


def _recv(conn: Any, proc: Any, timeout: float = 180.0) -> Any:
    if not conn.poll(timeout):
        proc.kill()
        raise AssertionError(f"no answer from the child in {timeout} s (exit code {proc.exitcode})")
    return conn.recv()


# ============================================================================================
# GPU: the protocol in one process


@pytest.mark.gpu
def test_protocol_and_granularity(be: CudaVmmBackend) -> None:
    assert isinstance(be, Backend)
    assert be.name == "cuda-vmm"
    g = be.granularity
    assert g > 0 and g & (g - 1) == 0
    print(f"granularity {g / MiB:g} MiB, free/total {be.mem_get_info()}")


@pytest.mark.gpu
def test_round_trip(be: CudaVmmBackend) -> None:
    import cupy

    g = be.granularity
    chunk = be.create_chunk(g)
    try:
        assert chunk.size == g and chunk.fd >= 0 and chunk.handle >= 0
        assert not os.get_inheritable(chunk.fd)
        with mapped(be, [chunk]) as address, mapped(be, [chunk]) as alias:
            owner = Owner()
            alive = weakref.ref(owner)
            a = f32(be, address, g, owner=owner)
            del owner
            assert alive() is not None  # the CuPy array keeps its owner
            assert a.data.ptr == address and a.device.id == 0
            a[...] = cupy.arange(a.size, dtype=cupy.float32)
            b = f32(be, alias, g)  # the same chunk mapped twice sees the same bytes
            assert float(b[12345].get()) == 12345.0
            # A 2-D view with an offset and a negative stride.
            f4 = np.dtype(np.float32)
            rev = be.as_native(NativeView(address, g, 4 * 99, None, f4, (100,), (-4,), True))
            assert rev.get().tolist() == list(range(99, -1, -1))
            two_d = be.as_native(NativeView(address, g, 4 * 8, None, f4, (8, 8), (64, 8), False))
            assert two_d.get()[1, 1] == 8 + 16 + 2
            empty = be.as_native(NativeView(address, g, 0, None, f4, (0, 3), (12, 4), False))
            assert empty.shape == (0, 3)
            view = a[10:20]
            del a, b, rev, two_d, empty
            assert alive() is not None  # ... and so does every view of it
            del view
            assert alive() is None
    finally:
        be.release_chunk(chunk)
    assert chunk.fd == -1 and chunk.handle == -1
    be.release_chunk(chunk)  # idempotent


@pytest.mark.gpu
def test_multi_chunk_mapping(be: CudaVmmBackend) -> None:
    import cupy

    g = be.granularity
    chunks = [be.create_chunk(g) for _ in range(3)]
    big = be.create_chunk(2 * g)
    try:
        with mapped(be, chunks) as address:
            whole = f32(be, address, 3 * g)
            whole[...] = cupy.arange(whole.size, dtype=cupy.float32)
            with mapped(be, [chunks[1]]) as middle:
                expect = np.arange(g // 4, 2 * g // 4, dtype=np.float32)
                assert np.array_equal(f32(be, middle, g).get(), expect)
            del whole
        # CUDA maps whole chunks only: no offset into one, no part of one.
        part = be.reserve(g)
        try:
            with pytest.raises(ValueError, match="whole chunks"):
                be.map(part, g, big, chunk_offset=g)
            with pytest.raises(ValueError, match="whole chunks"):
                be.map(part, g, big)
        finally:
            be.free_reservation(part, g)
    finally:
        for c in [*chunks, big]:
            be.release_chunk(c)


@pytest.mark.gpu
def test_access_read_only_and_none(be: CudaVmmBackend) -> None:
    g = be.granularity
    chunk = be.create_chunk(g)
    try:
        with mapped(be, [chunk]) as address:
            f32(be, address, g).fill(3.0)
            be.set_access(address, g, "r")
            assert float(f32(be, address, g)[7].get()) == 3.0
            be.set_access(address, g, "none")
            be.set_access(address, g, "rw")
            f32(be, address, g).fill(4.0)
            assert float(f32(be, address, g)[7].get()) == 4.0
            with pytest.raises(ValueError):
                be.set_access(address, g, "wx")  # type: ignore[arg-type]
    finally:
        be.release_chunk(chunk)


@pytest.mark.gpu
def test_import_rejects_foreign_fd(be: CudaVmmBackend) -> None:
    fd = os.memfd_create("not-cuda")
    os.ftruncate(fd, be.granularity)
    with pytest.raises(PayloadError):
        be.import_chunk(fd, be.granularity)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed on failure
    fd2 = os.memfd_create("not-cuda-either")
    with pytest.raises(PayloadError, match="granularity"):
        be.import_chunk(fd2, be.granularity + 1)
    with pytest.raises(OSError):
        os.fstat(fd2)


@pytest.mark.gpu
def test_import_in_same_process(be: CudaVmmBackend) -> None:
    g = be.granularity
    chunk = be.create_chunk(g)
    again = be.import_chunk(os.dup(chunk.fd), g)
    try:
        assert again.handle != chunk.handle
        with mapped(be, [chunk]) as a, mapped(be, [again]) as b:
            f32(be, a, g).fill(9.0)
            assert float(f32(be, b, g)[100].get()) == 9.0
    finally:
        be.release_chunk(chunk)
        be.release_chunk(again)


@pytest.mark.gpu
def test_works_from_a_thread_without_a_context(be: CudaVmmBackend) -> None:
    driver = cuda_driver.load_driver()
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["before"] = int(cuda_driver.check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent"))
            chunk = be.create_chunk(be.granularity)
            with mapped(be, [chunk]) as address:
                f32(be, address, be.granularity).fill(2.0)
                out["value"] = float(f32(be, address, be.granularity)[0].get())
            be.release_chunk(chunk)
            out["after"] = int(cuda_driver.check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent"))
        except BaseException:
            out["error"] = traceback.format_exc()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert out["before"] == 0 and out["value"] == 2.0 and out["after"] == be._ctx_int


@pytest.mark.gpu
def test_works_under_another_current_context(be: CudaVmmBackend) -> None:
    driver = cuda_driver.load_driver()
    out: dict[str, Any] = {}

    def work() -> None:
        other = None
        chunk = None
        address = 0
        g = be.granularity
        try:
            dev = cuda_driver.check(driver.cuDeviceGet(0), "cuDeviceGet")
            other = cuda_driver.check(driver.cuCtxCreate(None, 0, dev), "cuCtxCreate")
            # Every backend call works while a foreign context is current, and leaves it so.
            chunk = be.create_chunk(g)
            address = be.reserve(g)
            be.map(address, g, chunk)
            be.set_access(address, g, "rw")
            be.synchronize()
            current = cuda_driver.check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
            out["restored"] = int(current) == int(other)
            cuda_driver.check(driver.cuCtxDestroy(other), "cuCtxDestroy")
            other = None
            # CuPy (the primary context) sees the memory mapped meanwhile.
            f32(be, address, g).fill(6.0)
            out["value"] = float(f32(be, address, g)[0].get())
            be.unmap(address, g)
            be.free_reservation(address, g)
            be.release_chunk(chunk)
        except BaseException:
            out["error"] = traceback.format_exc()
        finally:
            if other is not None:
                driver.cuCtxDestroy(other)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert out["restored"]  # the caller's context is current again
    assert out["value"] == 6.0


@pytest.mark.gpu
def test_to_native(be: CudaVmmBackend) -> None:
    import cupy

    host = np.arange(10, dtype=np.float64)
    assert isinstance(be.to_native(host), cupy.ndarray)
    c = cupy.arange(5)
    assert be.to_native(c) is c
    assert be.to_native([1, 2, 3]).tolist() == [1, 2, 3]
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        return
    t = torch.arange(6, device="cuda:0", dtype=torch.float32)
    view = be.to_native(t)
    view[0] = 42
    torch.cuda.synchronize()
    assert float(t[0]) == 42.0  # the same memory
    assert be.to_native(torch.arange(3)).tolist() == [0, 1, 2]


# ============================================================================================
# GPU: memory returns, unmap waits


def _cycle(be: CudaVmmBackend, nchunks: int, chunk_size: int) -> int:
    """Allocate, map, fill, unmap and release; return free memory while allocated."""
    chunks = [be.create_chunk(chunk_size) for _ in range(nchunks)]
    try:
        with mapped(be, chunks) as address:
            f32(be, address, nchunks * chunk_size).fill(1.0)
            be.synchronize()
            during = be.mem_get_info()[0]
    finally:
        for c in chunks:
            be.release_chunk(c)
    return during


@pytest.mark.gpu
def test_memory_returns_to_baseline(be: CudaVmmBackend) -> None:
    import cupy

    chunk_size = 32 * be.granularity
    _cycle(be, 4, chunk_size)  # warm up: kernels loaded, driver pools grown
    cupy.get_default_memory_pool().free_all_blocks()
    be.synchronize()
    baseline = be.mem_get_info()[0]
    during = _cycle(be, 4, chunk_size)
    be.synchronize()
    after = be.mem_get_info()[0]
    print(
        f"free: baseline {baseline / MiB:.1f} MiB, during {during / MiB:.1f} MiB, "
        f"after {after / MiB:.1f} MiB"
    )
    assert baseline - during >= 4 * chunk_size - 2 * MiB
    assert abs(after - baseline) <= 2 * MiB


@pytest.mark.gpu
def test_unmap_waits_for_a_running_kernel(be: CudaVmmBackend, spin: Spin) -> None:
    g = be.granularity
    chunk = be.create_chunk(g)
    try:
        address = be.reserve(g)
        try:
            be.map(address, g, chunk)
            be.set_access(address, g, "rw")
            arr = f32(be, address, g)
            arr.fill(0.0)
            be.synchronize()
            spin(arr, 5.0, seconds=1.0)  # still running when unmap is called
            del arr
            start = time.perf_counter()
            be.unmap(address, g)
            waited = time.perf_counter() - start
        finally:
            be.free_reservation(address, g)
        print(f"unmap waited {waited:.3f} s for a 1 s kernel")
        assert waited > 0.5
        with mapped(be, [chunk]) as again:
            assert np.all(f32(be, again, g).get() == 5.0)
        be.synchronize()  # the context is healthy
    finally:
        be.release_chunk(chunk)


# ============================================================================================
# GPU: across processes


def _child_import_write(fd: int, size: int, value: float, conn: Any) -> None:
    try:
        be = CudaVmmBackend(Device("cuda", 0))
        chunk = be.import_chunk(fd, size)
        with mapped(be, [chunk]) as address:
            arr = f32(be, address, size)
            seen = float(arr[0].get())
            arr.fill(value)
            del arr
        be.release_chunk(chunk)
        conn.send({"ok": True, "seen": seen})
    except BaseException:
        conn.send({"ok": False, "error": traceback.format_exc()})


@pytest.mark.gpu
def test_fd_to_spawned_child(be: CudaVmmBackend) -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    be.synchronize()
    baseline = be.mem_get_info()[0]
    size = 4 * be.granularity
    chunk = be.create_chunk(size)
    try:
        with mapped(be, [chunk]) as address:
            f32(be, address, size).fill(1.5)
            be.synchronize()
            start = time.perf_counter()
            proc, conn = _spawn(_child_import_write, PassFd(chunk.fd), size, 7.0)
            answer = _recv(conn, proc)
            proc.join(60)
            print(f"spawned child round trip {time.perf_counter() - start:.2f} s")
            assert answer["ok"], answer.get("error")
            assert answer["seen"] == 1.5  # the child saw the parent's data
            assert np.all(f32(be, address, size).get() == 7.0)  # and the parent the child's
            assert proc.exitcode == 0
    finally:
        be.release_chunk(chunk)
    be.synchronize()
    deadline = time.monotonic() + 10  # the child's context goes away as it exits
    while True:
        after = be.mem_get_info()[0]
        if abs(after - baseline) <= 2 * MiB or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert abs(after - baseline) <= 2 * MiB, (baseline, after)


def _child_wait_read(fd: int, size: int, conn: Any) -> None:
    try:
        be = CudaVmmBackend(Device("cuda", 0))
        chunk = be.import_chunk(fd, size)
        driver = cuda_driver.load_driver()
        with mapped(be, [chunk]) as address:
            arr = f32(be, address, size)
            arr[-1:].get()  # everything loaded before the clock starts
            conn.send("ready")
            token = conn.recv()
            with be.context():
                event = sync._event_for(driver, token)
                pending = int(driver.cuEventQuery(event)[0]) == 600  # CUDA_ERROR_NOT_READY
            unsynced = float(arr[-1].get())  # a control: no wait, the kernel is still running
            start = time.perf_counter()
            be.import_sync(token)
            values = arr.get()
            waited = time.perf_counter() - start
            result = {
                "ok": bool(np.all(values == 42.0)),
                "pending": pending,
                "unsynced": unsynced,
                "waited": waited,
                "cached": STATE.backends.opened.get(bytes(token[16:80])) is not None,
            }
            del arr
        be.release_chunk(chunk)
        conn.send(result)
    except BaseException:
        conn.send({"ok": False, "error": traceback.format_exc()})


@pytest.mark.gpu
def test_ipc_event_orders_consumer_after_producer(be: CudaVmmBackend, spin: Spin) -> None:
    size = 4 * be.granularity
    chunk = be.create_chunk(size)
    try:
        with mapped(be, [chunk]) as address:
            arr = f32(be, address, size)
            arr.fill(0.0)
            be.synchronize()
            proc, conn = _spawn(_child_wait_read, PassFd(chunk.fd), size)
            assert _recv(conn, proc) == "ready"
            spin(arr, 42.0, seconds=1.5)  # the producer's kernel, still running at handoff
            token = be.export_sync()
            assert isinstance(token, bytes) and len(token) == sync.TOKEN_SIZE
            conn.send(token)
            answer = _recv(conn, proc)
            proc.join(60)
            print(f"consumer: {answer}")
            assert answer["ok"], answer
            assert answer["pending"], "the kernel had finished before the consumer looked"
            assert answer["cached"]
            del arr
    finally:
        be.release_chunk(chunk)


@pytest.mark.gpu
def test_one_multiprocessing_message_records_one_event(spin: Spin) -> None:
    """An idle stream needs no event at all. Otherwise every pool task, queue item or pipe
    message (ForkingPickler.dumps), and every plain pickle.dumps, records one event for all
    the arrays in it, pickled once (the message's fence); the next message records anew; a
    stream waits once for a token it just waited for."""
    from multiprocessing.reduction import ForkingPickler

    import cupy

    import sharedarrays as sa

    arrays = [sa.full(16, i, "float32", device="cuda:0") for i in range(50)]
    scratch = cupy.zeros(1024, dtype=cupy.float32)
    cupy.cuda.get_current_stream().synchronize()
    before = STATE.backends.records

    def token(a: Any) -> Any:
        """What an importer receives as the ordering token of a message holding ``a`` alone
        (the fence dies with its pickler when this returns)."""
        return pickle.loads(pickle.dumps(a.__reduce__()[1][0].fence))

    idle = bytes(ForkingPickler.dumps(arrays))
    assert STATE.backends.records == before and token(arrays[0]) is None  # idle: no event
    spin(scratch, 1.0, seconds=3.0)  # the stream is busy from here on
    one = bytes(ForkingPickler.dumps(arrays))
    assert STATE.backends.records == before + 1
    pickle.dumps(arrays)  # plain pickle: one record for the message too
    assert STATE.backends.records == before + 2
    tokens = [token(a) for a in arrays[:2]]  # two messages
    assert isinstance(tokens[0], bytes) and tokens[0] != tokens[1]  # two records, two numbers
    assert STATE.backends.records == before + 4
    assert len(one) < len(idle) + 2 * sync.TOKEN_SIZE  # the token went once into the message
    back = pickle.loads(one)  # in the exporter itself: its own event
    assert [float(b.array[0]) for b in back] == list(range(50))
    assert len(STATE.backends.waited) == 1  # one stream, and the token it waited for last
    assert float(scratch[0]) == 1.0


@pytest.mark.gpu
def test_export_ring_grows_only_while_pending(be: CudaVmmBackend, spin: Spin) -> None:
    import cupy

    scratch = cupy.zeros(1024, dtype=cupy.float32)
    be.synchronize()
    ring = STATE.backends.rings.get(0)
    n0 = len(ring.slots) if ring is not None else 0
    spin(scratch, 1.0, seconds=0.5)
    tokens = [be.export_sync() for _ in range(n0 + 2)]
    ring = STATE.backends.rings[0]
    assert len(ring.slots) == n0 + 2
    assert len({t for t in tokens if t is not None}) == n0 + 2  # no pending event reused
    # In this same process the token names our own event: import waits on it directly.
    assert tokens[-1] is not None
    be.import_sync(tokens[-1])
    be.synchronize()
    assert be.export_sync() is None  # an idle stream: nothing to wait for, no record
    spin(scratch, 1.0, seconds=0.5)
    more = [be.export_sync() for _ in range(3)]
    assert len(ring.slots) == n0 + 2  # completed slots are reused
    assert all(t is not None for t in more)
    with sync.no_sync():
        assert be.export_sync() is None


# ============================================================================================
# GPU: fork after CUDA was initialised


def _fork_probe(conn: Any) -> None:
    out: dict[str, Any] = {"why": why_unusable(0)}
    try:
        driver = cuda_driver.load_driver()
        out["cuInit"] = cuda_driver._error_name(driver.cuInit(0)[0])
    except BaseException as exc:
        out["cuInit"] = repr(exc)
    conn.send(out)


@pytest.mark.gpu
def test_fork_after_init_is_refused(be: CudaVmmBackend) -> None:
    import multiprocessing
    import warnings

    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        proc = ctx.Process(target=_fork_probe, args=(theirs,))
        proc.start()
    answer = _recv(ours, proc, timeout=60)
    proc.join(30)
    print(f"forked child: {answer}")
    assert answer["why"] == FORK_REASON


_CUPY_ONLY_FORK = textwrap.dedent(
    """
    import json, os, sys
    import cupy
    cupy.zeros(1)  # CuPy (the runtime) initialises CUDA; sharedarrays has not
    from sharedarrays.backends.cuda import driver as cuda_driver
    from sharedarrays.process import STATE
    assert STATE.backends.cuda_init_pid is None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, json.dumps([cuda_driver.why_unusable(0)]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        answer = json.loads(f.read())[0]
    os.waitpid(pid, 0)
    print(json.dumps({"child": answer, "parent": cuda_driver.why_unusable(0)}))
    """
)


@pytest.mark.gpu
def test_fork_after_cupy_init_is_refused(be: CudaVmmBackend) -> None:
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-c", _CUPY_ONLY_FORK],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["child"] == FORK_REASON
    assert answer["parent"] is None


# ============================================================================================
# filling new arrays by a driver memset (CPU: the word; GPU: the values)

_FILL_DTYPES = ["bool", "uint8", "int8", "int16", "float16", "int32", "uint32", "float32"]
_FILL_DTYPES += ["int64", "float64", "complex64", "complex128"]


@given(
    dtype=st.sampled_from(_FILL_DTYPES),
    value=st.one_of(
        st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.booleans(), st.complex_numbers()
    ),
)
@settings(max_examples=400, deadline=None)
def test_memset_word_repeats_to_exactly_numpys_bytes(dtype: str, value: Any) -> None:
    dt = np.dtype(dtype)
    word = memset_word(value, dt)
    if word is None:
        return  # (CuPy fills it)
    width, pattern = word
    expected = np.full(3, value, dtype=dt)  # (a value memset_word takes, NumPy casts cleanly)
    assert (pattern.to_bytes(width, sys.byteorder) * (3 * dt.itemsize // width)) == (
        expected.tobytes()
    )


def test_memset_word_leaves_what_does_not_repeat_or_cast_to_cupy() -> None:
    assert memset_word(3.0, np.dtype("float64")) is None  # (its halves differ)
    assert memset_word(300, np.dtype("uint8")) is None  # (wraps: CuPy's rule, not ours)
    assert memset_word(1.5, np.dtype("int32")) is None
    assert memset_word(1e300, np.dtype("float32")) is None  # (overflows)
    assert memset_word(1 + 2j, np.dtype("float32")) is None
    assert memset_word([1, 2], np.dtype("int32")) is None
    assert memset_word("3", np.dtype("float32")) is None  # (CuPy's error, as before)
    assert memset_word(2**70, np.dtype("float32")) is None
    assert memset_word(0.0, np.dtype("float64")) == (4, 0)
    assert memset_word(1.0, np.dtype("float32")) == (4, 0x3F800000)
    assert memset_word(-1, np.dtype("int16")) == (2, 0xFFFF)
    assert memset_word(0, np.dtype("uint8")) == (1, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", _FILL_DTYPES)
def test_full_fills_every_element_on_the_device(be: CudaVmmBackend, dtype: str) -> None:
    import sharedarrays as sa

    kind = np.dtype(dtype).kind
    for value in (0, 1, 7, True, *((-2.5,) if kind in "fc" else (-3,) if kind == "i" else ())):
        expected = np.full((37, 129), value).astype(dtype)
        for order in ("C", "F"):
            # (closed and made again: the second one reuses memory with the first's values)
            for _ in range(2):
                a = sa.full((37, 129), value, dtype, device="cuda:0", order=order, pack=False)
                got = a.array.get()
                a.close()
                np.testing.assert_array_equal(got, expected, err_msg=f"{value!r} {order}")
