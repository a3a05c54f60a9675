"""The CUDA VMM backend and cross-process ordering (``sharedarrays.sync``).

Two halves:

- CPU tests (run everywhere, CI included): :func:`why_unusable` gives a reason and never
  raises, against the real environment and against a fake driver module; fork detection;
  the lazy imports; :func:`no_sync`; token parsing; helpers.
- ``gpu`` tests (skipped with the reason where CUDA is unusable): the Backend protocol on a
  real device, an fd handed to a ``spawn`` child, memory returning to the baseline, unmap
  waiting for a running kernel, and an interprocess event ordering a consumer after a
  producer's kernel.

Functions that spawned children run are at module level (children import this module by
name; ``multiprocessing`` passes ``sys.path`` along).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
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
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cuda_helpers import Spin

from sharedarrays import sync
from sharedarrays.backends import cuda_driver
from sharedarrays.backends.base import Backend, Chunk
from sharedarrays.backends.cuda_driver import (
    FORK_REASON,
    INSTALL_HINT,
    CudaDriverError,
    CudaOutOfMemory,
    why_unusable,
)
from sharedarrays.backends.cuda_vmm import CudaVmmBackend
from sharedarrays.device import Device
from sharedarrays.errors import BackendUnavailable, PayloadError
from sharedarrays.process import start_time

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def child_env() -> dict[str, str]:
    """The environment for a fresh interpreter that must import sharedarrays from here."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


# ============================================================================================
# CPU: why_unusable against the real environment


def test_why_unusable_answers_without_raising() -> None:
    reason = why_unusable()
    assert reason is None or (isinstance(reason, str) and reason)
    assert why_unusable() == reason  # cached, stable
    assert why_unusable(0) == reason
    far = why_unusable(4096)
    assert isinstance(far, str) and far


def test_why_unusable_here_without_a_driver() -> None:
    reason = why_unusable()
    if reason is None:
        pytest.skip("CUDA is usable on this machine")
    # Whatever is missing here (cuda-bindings, CuPy, or the driver), the answer says so.
    assert any(
        word in reason for word in ("cuda-bindings", "CuPy", "NVIDIA driver", "device", "cuInit")
    ), reason


def test_backend_refuses_with_the_reason() -> None:
    reason = why_unusable(0)
    if reason is None:
        pytest.skip("CUDA is usable on this machine")
    with pytest.raises(BackendUnavailable, match="cannot use cuda:0"):
        CudaVmmBackend(Device("cuda", 0))


def test_importing_loads_no_cuda_module() -> None:
    code = (
        "import sys\n"
        "import sharedarrays.backends.cuda_vmm, sharedarrays.sync\n"
        "bad = [m for m in sys.modules if m == 'cupy' or m.startswith(('cupy.', 'cuda.'))"
        " or m in ('cuda', 'torch')]\n"
        "assert not bad, bad\n"
    )
    env = child_env()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# ============================================================================================
# CPU: why_unusable against a fake driver


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

    def cuDeviceGetName(self, length: int, dev: int) -> tuple[Any, bytes]:
        return FakeResult.CUDA_SUCCESS, b"Fake GPU\0\0\0"

    def cuGetErrorString(self, err: Any) -> tuple[Any, bytes]:
        return FakeResult.CUDA_SUCCESS, b"described"

    def cuCtxGetCurrent(self) -> tuple[Any, int]:
        if self.initialised:
            return FakeResult.CUDA_SUCCESS, 0
        return FakeResult.CUDA_ERROR_NOT_INITIALIZED, 0


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    """Point cuda_driver at a fake driver with fresh caches (restored afterwards)."""
    driver = FakeDriver()
    monkeypatch.setattr(cuda_driver, "_driver", driver)
    monkeypatch.setattr(cuda_driver, "_reasons", {})
    monkeypatch.setattr(cuda_driver, "_reasons_pid", os.getpid())
    monkeypatch.setattr(cuda_driver, "_init_pid", None)
    monkeypatch.setattr(cuda_driver, "_device_count", 0)
    monkeypatch.setattr(cuda_driver, "_forked_from_cuda", False)
    monkeypatch.setattr(cuda_driver, "_parent_had_cuda", False)
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        if name == "cupy":
            return object()
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    yield driver


def test_fake_usable_and_cached(fake: FakeDriver) -> None:
    assert why_unusable() is None
    assert why_unusable(0) is None
    assert fake.init_calls == 1
    assert cuda_driver._init_pid == os.getpid()


def test_fake_no_bindings(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "_driver", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    reason = why_unusable()
    assert reason is not None and "cuda-bindings" in reason and INSTALL_HINT in reason


def test_fake_no_cupy(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    reason = why_unusable()
    assert reason is not None and "CuPy" in reason and INSTALL_HINT in reason


def test_fake_libcuda_missing(fake: FakeDriver) -> None:
    fake.init = RuntimeError("Failed to dlopen libcuda.so.1")
    reason = why_unusable()
    assert reason is not None and "no NVIDIA driver" in reason and "libcuda" in reason


def test_fake_no_device(fake: FakeDriver) -> None:
    fake.init = FakeResult.CUDA_ERROR_NO_DEVICE
    reason = why_unusable()
    assert reason is not None and "no CUDA device" in reason


def test_fake_zero_devices(fake: FakeDriver) -> None:
    fake.count = 0
    reason = why_unusable()
    assert reason is not None and "no CUDA device" in reason


def test_fake_init_error_named(fake: FakeDriver) -> None:
    fake.init = FakeResult.CUDA_ERROR_INVALID_VALUE
    reason = why_unusable()
    assert reason is not None and "CUDA_ERROR_INVALID_VALUE" in reason


def test_fake_not_initialized_hints_at_fork(fake: FakeDriver) -> None:
    fake.init = FakeResult.CUDA_ERROR_NOT_INITIALIZED
    reason = why_unusable()
    assert reason is not None and "CUDA_ERROR_NOT_INITIALIZED" in reason and "spawn" in reason


def test_fake_index_out_of_range(fake: FakeDriver) -> None:
    assert why_unusable(0) is None
    reason = why_unusable(3)
    assert reason is not None and "out of range" in reason and "1 CUDA device" in reason
    reason = why_unusable(-1)
    assert reason is not None and ">= 0" in reason


def test_fake_no_vmm(fake: FakeDriver) -> None:
    fake.vmm = 0
    reason = why_unusable()
    assert reason is not None and "virtual memory management" in reason and "Fake GPU" in reason


def test_fake_no_posix_fd(fake: FakeDriver) -> None:
    fake.posix_fd = 0
    reason = why_unusable()
    assert reason is not None and "POSIX file descriptors" in reason


@pytest.mark.parametrize(
    ("backend", "attribute", "value", "says"),
    [
        ("cuda-ipc", "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING", 0, "unified addressing"),
        ("cuda-pool", "CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED", 0, "memory pools"),
        ("cuda-pool", "CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES", 0b1000, "POSIX"),
    ],
)
def test_fake_each_backend_names_the_feature_it_lacks(
    fake: FakeDriver, backend: str, attribute: str, value: int, says: str
) -> None:
    assert why_unusable(0, backend) is None
    cuda_driver._reasons.clear()
    fake.attrs[FakeAttribute[attribute]] = value
    reason = why_unusable(0, backend)
    assert reason is not None and says in reason and backend in reason and "Fake GPU" in reason
    assert why_unusable(0, "cuda-vmm") is None  # the others do not need it


def test_fake_vmm_missing_leaves_the_other_backends(fake: FakeDriver) -> None:
    from sharedarrays.backends import choose_backend, cuda_usable

    fake.vmm = 0
    assert why_unusable(0, "cuda-vmm") is not None
    assert cuda_usable(0) is None  # "any": cuda-ipc can
    assert choose_backend(Device("cuda", 0)) == "cuda-ipc"
    fake.attrs[FakeAttribute.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING] = 0
    cuda_driver._reasons.clear()
    assert choose_backend(Device("cuda", 0)) == "cuda-pool"
    fake.attrs[FakeAttribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED] = 0
    cuda_driver._reasons.clear()
    with pytest.raises(BackendUnavailable, match="no CUDA backend can use cuda:0") as info:
        choose_backend(Device("cuda", 0))
    for name in ("cuda-vmm:", "cuda-ipc:", "cuda-pool:"):
        assert name in str(info.value)
    assert why_unusable(0, "cuda-hip") is not None and "unknown" in why_unusable(0, "cuda-hip")


def test_fake_unexpected_error_does_not_raise(fake: FakeDriver) -> None:
    fake.init = ValueError("boom")
    reason = why_unusable()
    assert reason is not None and "unexpectedly" in reason and "boom" in reason


def _why_unusable_in_a_forked_child() -> str:
    """What ``why_unusable()`` answers in a child forked from this process."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            os.write(write, (why_unusable() or "usable").encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer


def test_fork_after_our_init_is_named(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "_init_pid", os.getpid() + 100000)  # "initialised in a parent"
    reason = why_unusable()
    assert reason == FORK_REASON
    assert "'spawn'" in reason and "'forkserver'" in reason


def test_fork_child_is_marked_by_the_hook(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Someone else (CuPy, say) initialised CUDA here: the driver answers cuCtxGetCurrent.
    fake.initialised = True
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", fake)
    assert why_unusable() is None  # the parent itself is fine (and this cached "usable")
    answer = _why_unusable_in_a_forked_child()
    assert answer == FORK_REASON
    assert why_unusable() is None  # the parent is not marked


def test_fork_without_cuda_is_fine(fake: FakeDriver) -> None:
    answer = _why_unusable_in_a_forked_child()
    assert answer == "usable"


# ============================================================================================
# CPU: errors, helpers, sync switches


def test_check_and_errors() -> None:
    assert cuda_driver.check((FakeResult.CUDA_SUCCESS,), "x") is None
    assert cuda_driver.check((FakeResult.CUDA_SUCCESS, 5), "x") == 5
    assert cuda_driver.check((FakeResult.CUDA_SUCCESS, 5, 6), "x") == (5, 6)
    with pytest.raises(CudaDriverError, match="cuFoo failed: CUDA_ERROR_INVALID_VALUE") as info:
        cuda_driver.check((FakeResult.CUDA_ERROR_INVALID_VALUE,), "cuFoo")
    assert info.value.code == 1 and isinstance(info.value, OSError)
    err = CudaOutOfMemory("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
    assert isinstance(err, MemoryError) and isinstance(err, CudaDriverError)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is CudaOutOfMemory and str(again) == str(err)


def test_no_sync_switch() -> None:
    assert sync.sync_enabled()
    with sync.no_sync():
        assert not sync.sync_enabled()
        assert sync.export_sync(object()) is None  # type: ignore[arg-type]
        seen: list[bool] = []
        t = threading.Thread(target=lambda: seen.append(sync.sync_enabled()))
        t.start()
        t.join()
        assert seen == [True]  # the switch is local to this thread
        with sync.no_sync():
            pass
        assert not sync.sync_enabled()
    assert sync.sync_enabled()


def test_sync_token_checks() -> None:
    with pytest.raises(PayloadError, match="sync token"):
        sync._event_for(None, b"short")
    # A token whose exporter has exited needs no wait (and touches no driver).
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(proc.stdout)
    token = sync._HEAD.pack(dead, 12345) + bytes(64) + bytes(8)
    assert sync._event_for(None, token) is None
    # A token naming this process but no event of it is malformed.
    mine = sync._HEAD.pack(os.getpid(), 0) + b"\x01" * 64 + bytes(8)
    with pytest.raises(PayloadError, match="never exported"):
        sync._event_for(None, mine)


def test_process_start_time() -> None:
    assert start_time(os.getpid()) == sync._my_start_time() > 0
    assert start_time(2**31 + 7) is None


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
    return be.as_native(address, nbytes, 0, owner, np.dtype(np.float32), (n,), (4,), False)


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
            rev = be.as_native(address, g, 4 * 99, None, f4, (100,), (-4,), True)
            assert rev.get().tolist() == list(range(99, -1, -1))
            two_d = be.as_native(address, g, 4 * 8, None, f4, (8, 8), (64, 8), False)
            assert two_d.get()[1, 1] == 8 + 16 + 2
            empty = be.as_native(address, g, 0, None, f4, (0, 3), (12, 4), False)
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
                "cached": sync._opened.get(bytes(token[16:80])) is not None,
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
    message (ForkingPickler.dumps) records one event for all the arrays in it, pickled once;
    plain pickle records one per array; a stream waits once for a token it just waited for."""
    from multiprocessing.reduction import ForkingPickler

    import cupy

    import sharedarrays as sa

    arrays = [sa.full(16, i, "float32", device="cuda:0") for i in range(50)]
    scratch = cupy.zeros(1024, dtype=cupy.float32)
    cupy.cuda.get_current_stream().synchronize()
    before = sync._records
    idle = bytes(ForkingPickler.dumps(arrays))
    assert sync._records == before and arrays[0].__reduce__()[1][1] is None  # idle: no event
    spin(scratch, 1.0, seconds=3.0)  # the stream is busy from here on
    one = bytes(ForkingPickler.dumps(arrays))
    assert sync._records == before + 1
    pickle.dumps(arrays)
    assert sync._records == before + 51
    tokens = [a.__reduce__()[1][1] for a in arrays[:2]]
    assert tokens[0] is not None and tokens[0] != tokens[1]  # two records, two sequence numbers
    assert len(one) < len(idle) + 2 * sync.TOKEN_SIZE  # the token went once into the message
    back = pickle.loads(one)  # in the exporter itself: its own event
    assert [float(b.array[0]) for b in back] == list(range(50))
    assert len(sync._waited) == 1  # one stream, and the token it waited for last
    assert float(scratch[0]) == 1.0


@pytest.mark.gpu
def test_export_ring_grows_only_while_pending(be: CudaVmmBackend, spin: Spin) -> None:
    import cupy

    scratch = cupy.zeros(1024, dtype=cupy.float32)
    be.synchronize()
    ring = sync._rings.get(0)
    n0 = len(ring.slots) if ring is not None else 0
    spin(scratch, 1.0, seconds=0.5)
    tokens = [be.export_sync() for _ in range(n0 + 2)]
    ring = sync._rings[0]
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
    from sharedarrays.backends import cuda_driver
    assert cuda_driver._init_pid is None
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
