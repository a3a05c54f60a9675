"""The hip-vmm backend on the simulated HIP runtime (``tests/simulated/hip.py``)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.backends import get_backend
from sharedarrays.backends.device import Device
from sharedarrays.backends.hip import runtime


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The simulated runtime, unless the setting names one (scripts/hip_check.sh: the real)."""
    if not os.environ.get(runtime.MODULE_SETTING):
        monkeypatch.setenv(runtime.MODULE_SETTING, "simulated.hip")
    yield


def test_without_the_runtime_backends_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(runtime.MODULE_SETTING, "no_such_hip_module")
    why = sa.list_backends()["hip-vmm"]
    assert why is not None and "no_such_hip_module" in why
    with pytest.raises(sa.BackendUnavailable, match="cannot be imported"):
        sa.zeros(4, device="hip:0")


def test_the_default_module_names_libamdhip64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(runtime.MODULE_SETTING, raising=False)
    if runtime._loadable("libamdhip64.so"):
        pytest.skip("this machine has libamdhip64")
    why = sa.list_backends()["hip-vmm"]
    assert why is not None and why.startswith("no AMD GPU: libamdhip64 not found")


def test_auto_picks_hip_vmm_and_round_trips(simulated: None) -> None:
    a = sa.from_array(np.arange(1000, dtype=np.int32), device="hip:0", pack=False)
    assert a.backend == "hip-vmm" and str(a.device) == "hip:0"
    a[3] = 7
    assert a.get()[3] == 7 and a.get().sum() == np.arange(1000).sum() - 3 + 7


def test_an_fd_that_is_no_allocation_is_refused(simulated: None) -> None:
    backend = get_backend(Device("hip", 0), "hip-vmm")
    fd = os.memfd_create("not-hip")
    os.ftruncate(fd, backend.granularity)
    with pytest.raises(sa.PayloadError, match="not an exported HIP allocation"):
        backend.import_chunk(fd, backend.granularity)
    with pytest.raises(OSError):
        os.fstat(fd)  # the backend took the fd and closed it


def test_a_payload_larger_than_its_chunk_is_refused(simulated: None) -> None:
    backend = get_backend(Device("hip", 0), "hip-vmm")
    g = backend.granularity
    chunk = backend.create_chunk(g)
    other = backend.import_chunk(os.dup(chunk.fd), g)
    address = backend.reserve(2 * g)
    try:
        other.size = 2 * g  # what a lying payload would claim
        with pytest.raises(sa.PayloadError, match="smaller than its payload"):
            backend.map(address, 2 * g, other)
    finally:
        backend.free_reservation(address, 2 * g)
        backend.release_chunk(other)
        backend.release_chunk(chunk)
    assert chunk.fd == -1 and other.fd == -1


def test_errors_carry_hip_names() -> None:
    with pytest.raises(runtime.HipOutOfMemory) as info:
        runtime.check((_Err(2, "hipErrorOutOfMemory"),), "hipMemCreate(huge)")
    assert isinstance(info.value, sa.OutOfMemory)
    assert "hipErrorOutOfMemory (2)" in str(info.value)
    assert runtime.check((_Err(0, "hipSuccess"), 5), "x") == 5


class _Err(int):
    def __new__(cls, code: int, name: str) -> _Err:
        self = super().__new__(cls, code)
        self.name = name  # type: ignore[attr-defined]
        return self


def test_hip_pool_round_trips(simulated: None) -> None:
    a = sa.from_array(np.arange(100, dtype=np.int64), device="hip:0", backend="hip-pool")
    assert a.backend == "hip-pool" and len(a.allocation.exports()[0]) == 16 + 64
    a[3] = -3
    assert a.get()[3] == -3 and a.get()[4] == 4
    assert sa.zeros(4, device="hip:0").backend == "hip-vmm"  # auto still prefers VMM


def test_a_hip_pool_pointer_freed_by_its_exporter_is_unavailable(simulated: None) -> None:
    backend = get_backend(Device("hip", 0), "hip-pool")
    chunk = backend.create_chunk(4096)
    pool_fd = chunk.fd
    ctypes.c_int64.from_address(chunk.address).value = 99
    other = backend.import_chunk(os.dup(chunk.fd), 4096, chunk.export)
    try:
        assert other.address != chunk.address
        assert ctypes.c_int64.from_address(other.address).value == 99  # the same memory
    finally:
        backend.release_chunk(other)
    backend.release_chunk(chunk)
    with pytest.raises(sa.HandleUnavailable, match="gone"):
        backend.import_chunk(os.dup(pool_fd), 4096, chunk.export)


def test_an_fd_that_is_no_pool_is_refused(simulated: None) -> None:
    backend = get_backend(Device("hip", 0), "hip-pool")
    fd = os.memfd_create("not-a-pool")
    with pytest.raises(sa.PayloadError, match="not an exported memory pool"):
        backend.import_chunk(fd, 4096, bytes(80))
    with pytest.raises(OSError):
        os.fstat(fd)  # the backend took the fd and closed it
    with pytest.raises(sa.PayloadError, match="80 bytes"):
        backend.import_chunk(-1, 4096, bytes(8))


class _RocmArray:
    """What a ROCm array (CuPy's ROCm build, a torch tensor on an AMD GPU) shows of itself."""

    def __init__(self, data: np.ndarray) -> None:  # type: ignore[type-arg]
        self.data = data

    def __dlpack_device__(self) -> tuple[int, int]:
        return (10, 0)  # kDLROCM

    def get(self) -> np.ndarray:  # type: ignore[type-arg]
        return self.data.copy()


def test_from_array_of_rocm_memory_takes_the_hip_device(simulated: None) -> None:
    a = sa.from_array(_RocmArray(np.arange(6.0)))
    assert str(a.device) == "hip:0" and a.backend == "hip-vmm"
    np.testing.assert_array_equal(a.get(), np.arange(6.0))
