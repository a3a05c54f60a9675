"""The ascend backend on the simulated CANN runtime (``tests/simulated/ascend.py``): the pid
trust list across processes, lifetime, and errors."""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.backends import get_backend
from sharedarrays.backends.ascend import runtime
from sharedarrays.backends.ascend.vmm import AscendBackend
from sharedarrays.backends.base import Chunk
from sharedarrays.backends.device import Device

TESTS = Path(__file__).parent.parent

IMPORTER = """
import ctypes, sys
import sharedarrays as sa
from sharedarrays.backends import get_backend
from sharedarrays.backends.device import Device
backend = get_backend(Device("npu", 0), "ascend")
print(__import__("os").getpid(), flush=True)
sys.stdin.readline()  # the exporter decides (admits, or frees) meanwhile
export, size = bytes.fromhex(sys.argv[1]), int(sys.argv[2])
try:
    chunk = backend.import_chunk(-1, size, export)
except sa.SharedArrayError as exc:
    print(type(exc).__name__, exc, flush=True)
else:
    value = ctypes.c_int64.from_address(chunk.address)
    print("imported", value.value, flush=True)
    value.value = -1
    backend.release_chunk(chunk)
"""


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The simulated runtime, unless the setting is there (scripts/ascend_check.sh sets it
    empty: the library itself)."""
    if runtime.MODULE_SETTING not in os.environ:
        monkeypatch.setenv(runtime.MODULE_SETTING, "simulated.ascend")
    yield


@pytest.fixture
def backend(simulated: None) -> AscendBackend:
    b = get_backend(Device("npu", 0), "ascend")
    assert isinstance(b, AscendBackend)
    return b


def _importer(chunk: Chunk, size: int | None = None) -> subprocess.Popen[str]:
    """A fresh interpreter that imports ``chunk`` by its raw handle once told to (bypassing
    the handle server, so nobody admits it but the test); its first line is its pid."""
    return subprocess.Popen(
        [sys.executable, "-c", IMPORTER, chunk.export.hex(), str(size or chunk.size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=TESTS,
    )


def _go(child: subprocess.Popen[str]) -> str:
    out, err = child.communicate("go\n", timeout=120)
    assert child.returncode == 0, err
    return out.splitlines()[-1]


def test_without_the_runtime_backends_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runtime.MODULE_SETTING, "no_such_acl_module")
    why = sa.list_backends()["ascend"]
    assert why is not None and "no_such_acl_module" in why
    with pytest.raises(sa.BackendUnavailable, match="cannot be imported"):
        sa.zeros(4, device="npu:0")


def test_the_default_names_libascendcl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.MODULE_SETTING, raising=False)
    if runtime._loadable(runtime.LIBRARY):
        pytest.skip("this machine has libascendcl")
    why = sa.list_backends()["ascend"]
    assert why is not None and why.startswith("no Ascend NPU: libascendcl not found")


def test_auto_picks_ascend_and_round_trips(simulated: None) -> None:
    a = sa.from_array(np.arange(1000, dtype=np.int32), device="npu:0", pack=False)
    assert a.backend == "ascend" and str(a.device) == "npu:0"
    assert len(a.allocation.exports()[0]) == 8  # the uint64 shareable handle
    a[3] = 7
    assert a.get()[3] == 7 and a.get().sum() == np.arange(1000).sum() - 3 + 7


@pytest.mark.timeout(180)
def test_an_importer_not_on_the_trust_list_is_refused(backend: AscendBackend) -> None:
    chunk = backend.create_chunk(backend.granularity)
    try:
        child = _importer(chunk)
        assert child.stdout is not None
        int(child.stdout.readline())
        last = _go(child)  # not admitted
    finally:
        backend.release_chunk(chunk)
    assert last.startswith("PermissionDenied")
    assert "ACL_ERROR_RT_NO_PERMISSION (207006)" in last and "trust list" in last


@pytest.mark.timeout(180)
def test_an_admitted_importer_maps_the_same_memory(backend: AscendBackend) -> None:
    chunk = backend.create_chunk(backend.granularity)
    try:
        ctypes.c_int64.from_address(chunk.address).value = 1234
        child = _importer(chunk)
        assert child.stdout is not None
        backend.admit(chunk, int(child.stdout.readline()))
        assert _go(child) == "imported 1234"
        assert ctypes.c_int64.from_address(chunk.address).value == -1  # its write, seen here
    finally:
        backend.release_chunk(chunk)


@pytest.mark.timeout(180)
def test_a_handle_freed_by_its_exporter_is_unavailable(backend: AscendBackend) -> None:
    chunk = backend.create_chunk(backend.granularity)
    child = _importer(chunk)
    assert child.stdout is not None
    backend.admit(chunk, int(child.stdout.readline()))
    backend.release_chunk(chunk)  # destroys the shareable handle
    assert chunk.handle == -1 and chunk.address == 0
    last = _go(child)
    assert last.startswith("HandleUnavailable") and "gone" in last


@pytest.mark.timeout(180)
def test_a_payload_larger_than_its_chunk_is_refused(backend: AscendBackend) -> None:
    chunk = backend.create_chunk(backend.granularity)
    try:
        child = _importer(chunk, 2 * backend.granularity)
        assert child.stdout is not None
        backend.admit(chunk, int(child.stdout.readline()))
        last = _go(child)
    finally:
        backend.release_chunk(chunk)
    assert last.startswith("PayloadError") and "smaller than its payload" in last


@pytest.mark.timeout(180)
def test_the_handle_server_admits_the_processes_it_serves(simulated: None) -> None:
    """Through sharedarrays (pickling to a fresh interpreter) the exporter admits the
    importer before handing it the handle: the import works, and only that pid was added."""
    a = sa.from_array(np.zeros(100, dtype=np.int64), device="npu:0", pack=False)
    backend = a.allocation.backend
    assert isinstance(backend, AscendBackend)
    code = (
        "import os, pickle, sys\n"
        "v = pickle.loads(sys.stdin.buffer.read())\n"
        "v[5] = os.getpid()\n"
        "print(os.getpid())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(a),
        capture_output=True,
        timeout=120,
        cwd=TESTS,
    )
    assert out.returncode == 0, out.stderr.decode()
    pid = int(out.stdout.split()[-1])
    assert a.get()[5] == pid
    shareable = int.from_bytes(a.allocation.exports()[0], "little")
    assert backend._admitted[shareable] == {pid}


def test_errors_carry_acl_names() -> None:
    with pytest.raises(runtime.AclOutOfMemory) as info:
        runtime.check(207001, "aclrtMallocPhysical(huge)")
    assert isinstance(info.value, sa.OutOfMemory)
    assert "ACL_ERROR_RT_MEMORY_ALLOCATION (207001)" in str(info.value)
    with pytest.raises(runtime.AclError, match="aclError 123456"):
        runtime.check(123456, "x")
    runtime.check(0, "x")


class _NpuTensor:
    """What a torch_npu tensor shows of itself: DLPack's kDLExtDev (PyTorch's PrivateUse1)
    and ``device.type == "npu"``, or DLPack's own ``kDLAscend``."""

    def __init__(self, data: np.ndarray, kind: int, device_type: str = "npu") -> None:  # type: ignore[type-arg]
        self.data, self.kind = data, kind
        self.device = type("device", (), {"type": device_type, "index": 0})()

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.kind, 0)

    def cpu(self) -> _NpuTensor:
        return self

    def detach(self) -> _NpuTensor:
        return self

    def numpy(self) -> np.ndarray:  # type: ignore[type-arg]
        return self.data.copy()

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:  # type: ignore[type-arg]
        return self.data.copy()


@pytest.mark.parametrize("kind", [12, 21])
def test_from_array_of_npu_memory_takes_the_npu_device(simulated: None, kind: int) -> None:
    a = sa.from_array(_NpuTensor(np.arange(5, dtype=np.float32), kind))
    assert str(a.device) == "npu:0" and a.backend == "ascend"
    np.testing.assert_array_equal(a.get(), np.arange(5, dtype=np.float32))


def test_another_ext_dev_is_not_taken_for_an_npu() -> None:
    from sharedarrays.api.creation import _source_device

    assert _source_device(_NpuTensor(np.arange(3.0), 12, device_type="other")) is None
    assert _source_device(_NpuTensor(np.arange(3.0), 12)) == Device("npu", 0)
