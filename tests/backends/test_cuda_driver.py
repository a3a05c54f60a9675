"""The CUDA driver layer (``sharedarrays.backends.cuda.driver``), on the CPU.

:func:`why_unusable` gives a reason and never raises, against the real environment and
against a fake driver module (per backend: cuda-vmm, cuda-ipc, cuda-pool); ``check`` and the
error types; the lazy imports. The GPU side (the backends on a real device, fork after CUDA
was initialised) is in ``test_cuda_vmm.py``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from cuda_helpers import ROOT, child_env
from fake_cuda import FakeAttribute, FakeDriver, FakeResult, use_fake

from sharedarrays.backends.cuda import driver as cuda_driver
from sharedarrays.backends.cuda.device import CudaVmmBackend
from sharedarrays.backends.cuda.driver import (
    FORK_REASON,
    INSTALL_HINT,
    CudaDriverError,
    CudaOutOfMemory,
    why_unusable,
)
from sharedarrays.backends.device import Device
from sharedarrays.errors import BackendUnavailable
from sharedarrays.process import STATE

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
        "import sharedarrays.backends.cuda.device, sharedarrays.backends.cuda.sync\n"
        "bad = [m for m in sys.modules if m == 'cupy' or m.startswith(('cupy.', 'cuda.'))"
        " or m in ('cuda', 'torch')]\n"
        "assert not bad, bad\n"
    )
    env = child_env()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)


# ============================================================================================
# CPU: why_unusable against a fake driver


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeDriver]:
    """Point cuda_driver at a fake driver with fresh caches (restored afterwards)."""
    driver = FakeDriver()
    use_fake(monkeypatch, driver)
    yield driver


def test_fake_usable_and_cached(fake: FakeDriver) -> None:
    assert why_unusable() is None
    assert why_unusable(0) is None
    assert fake.init_calls == 1
    assert STATE.backends.cuda_init_pid == os.getpid()


def test_fake_no_bindings(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(STATE.backends, "cuda_driver", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    reason = why_unusable()
    assert reason is not None and "cuda-bindings" in reason and INSTALL_HINT in reason


def test_fake_no_cupy(fake: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "installed", lambda name: False)
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
    STATE.backends.reasons.clear()
    fake.attrs[FakeAttribute[attribute]] = value
    reason = why_unusable(0, backend)
    assert reason is not None and says in reason and backend in reason and "Fake GPU" in reason
    assert why_unusable(0, "cuda-vmm") is None  # the others do not need it


def test_fake_vmm_missing_leaves_the_other_backends(fake: FakeDriver) -> None:
    from sharedarrays.backends import choose_backend, kind_unusable

    fake.vmm = 0
    assert why_unusable(0, "cuda-vmm") is not None
    assert kind_unusable("cuda", 0) is None  # any of them: cuda-ipc can
    assert choose_backend(Device("cuda", 0)) == "cuda-ipc"
    fake.attrs[FakeAttribute.CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING] = 0
    STATE.backends.reasons.clear()
    assert choose_backend(Device("cuda", 0)) == "cuda-pool"
    fake.attrs[FakeAttribute.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED] = 0
    STATE.backends.reasons.clear()
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
    # "initialised in a parent"
    monkeypatch.setattr(STATE.backends, "cuda_init_pid", os.getpid() + 100000)
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
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        pytest.skip(
            "torch initialised CUDA in this process (a GPU test ran before): its fork child is "
            "rightly refused (test_a_fork_child_of_torch_with_cuda_is_refused)"
        )
    answer = _why_unusable_in_a_forked_child()
    assert answer == "usable"


def test_a_fork_child_of_torch_with_cuda_is_refused(
    fake: FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's own flag for a fork child of a process where it had initialised CUDA
    bad_fork = types.SimpleNamespace(cuda=types.SimpleNamespace(_is_in_bad_fork=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", bad_fork)
    assert why_unusable() == FORK_REASON


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


def test_fake_peer_access(fake: FakeDriver) -> None:
    fake.count = 2
    assert cuda_driver.peer_reason(1, 0) is None
    assert cuda_driver.peer_reason(0, 0) is None  # a device reaches its own memory
    fake.peer_access = 0
    STATE.backends.reasons.clear()
    why = cuda_driver.peer_reason(1, 0)
    assert why is not None and "cuda:1" in why and "cuDeviceCanAccessPeer is 0" in why
    assert "out of range" in (cuda_driver.peer_reason(2, 0) or "")


# ============================================================================================
# CPU: when CudaDevice.native_view leaves the strides to CuPy


@pytest.mark.parametrize(
    ("shape", "view"),
    [
        ((7,), (slice(None),)),
        ((7,), (slice(None, None, 2),)),
        ((7,), (slice(None, None, -1),)),
        ((3, 4), (slice(None), slice(None))),
        ((3, 4), (slice(None), slice(1, 3))),
        ((3, 1, 4), (slice(None), slice(None), slice(None))),
        ((3, 4), (slice(None), None, slice(None))),
        ((1,), (slice(None),)),
        ((0,), (slice(None),)),
        ((3, 0), (slice(None), slice(None))),
        ((), ()),
    ],
)
@pytest.mark.parametrize("dtype", ["uint8", "float32", "complex128"])
def test_c_contiguous_strides_are_told_apart(
    shape: tuple[int, ...], view: tuple[Any, ...], dtype: str
) -> None:
    from sharedarrays.backends.cuda.device import _c_contiguous

    base = np.zeros(shape, dtype)
    for v in (base[view], base[view].T):
        c_strides = np.empty(v.shape, v.dtype).strides  # (NumPy's own, for a new C array)
        expected = v.size > 0 and v.flags.c_contiguous and v.strides == c_strides
        assert _c_contiguous(v.shape, v.strides, v.itemsize) is bool(expected), (v.shape, v.strides)


def test_current_stream_is_cupys_looked_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fence asks for the current stream at every message: CuPy's
    ``get_current_stream`` is looked up once, when CuPy is first seen, and kept; a CuPy
    without the ``device_id`` argument is asked inside the device's context."""
    monkeypatch.setattr(STATE.backends, "cupy_stream", None)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert cuda_driver.current_stream(0) == 0  # no CuPy: the legacy default stream
    asked: list[Any] = []

    def get_current_stream(device_id: int) -> Any:
        asked.append(device_id)
        return types.SimpleNamespace(ptr=1000 + device_id)

    new = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=get_current_stream))
    monkeypatch.setitem(sys.modules, "cupy", new)
    assert cuda_driver.current_stream(1) == 1001
    monkeypatch.delitem(sys.modules, "cupy")  # kept: not looked up again
    assert cuda_driver.current_stream(2) == 1002
    assert asked[-1] == 2

    monkeypatch.setattr(STATE.backends, "cupy_stream", None)
    entered: list[int] = []

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            entered.append(self.index)

        def __exit__(self, *exc: object) -> None:
            pass

    def old_get_current_stream() -> Any:
        return types.SimpleNamespace(ptr=2000 + entered[-1])

    old = types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_current_stream=old_get_current_stream, Device=Device)
    )
    monkeypatch.setitem(sys.modules, "cupy", old)
    assert cuda_driver.current_stream(3) == 2003
    assert cuda_driver.current_stream(4) == 2004 and entered == [3, 4]
