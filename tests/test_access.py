"""Access for several devices: ``access=``, ``a.grant``, importers on another GPU.

CPU: argument checks, the host's single device, the peer check against a fake driver (in
``backends/test_cuda_driver.py``). ``gpu``: what one GPU can check (the own device in
``access=``, devices that do not exist, grants refused). ``multigpu`` cases need two CUDA
devices and skip, with the reason, where there are fewer: workers pinned to different GPUs
writing their slices of one array on GPU 0, and the copy bandwidth of GPU 1 reading GPU 0.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api.widgets.model import build_map
from sharedarrays.backends.base import NativeView


def cuda_devices() -> int:
    if sa.list_backends()["cuda-vmm"] is not None:
        return 0
    from sharedarrays.backends.cuda.driver import load_driver

    return int(load_driver().cuDeviceGetCount()[1])


def need_gpus(n: int) -> None:
    have = cuda_devices()
    if have < n:
        pytest.skip(f"needs {n} CUDA devices with cuda-vmm; this machine has {have}")


# --------------------------------------------------------------------------------------------
# CPU


def test_host_memory_has_one_device() -> None:
    a = sa.zeros(8, device="cpu", access=["cpu"])
    assert a.access == {"cpu": "rw"}
    assert build_map(a.allocation).access == {"cpu": "rw"}
    with pytest.raises(ValueError, match="grant\\(\\) takes a CUDA device"):
        a.grant("cpu")
    with pytest.raises(ValueError, match="own device and keeps read-write"):
        sa.zeros(8, device="cpu", access=[("cpu", "r")])


@pytest.mark.parametrize(
    ("access", "error", "match"),
    [
        ("cpu", TypeError, "a list of devices"),
        ([("cpu", "w")], ValueError, "'rw' or 'r'"),
        ([("cpu", "rw", 3)], ValueError, "devices or \\(device, mode\\) pairs"),
    ],
)
def test_access_arguments(access: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        sa.zeros(8, device="cpu", access=access)


# --------------------------------------------------------------------------------------------
# one GPU


@pytest.mark.gpu
def test_own_device_in_the_access_list() -> None:
    a = sa.zeros(1 << 20, "float32", device="cuda:0", access=["cuda:0"])
    assert a.access == {"cuda:0": "rw"}
    a.array[...] = 2
    assert float(a.array.sum()) == 2 * (1 << 20)
    with pytest.raises(ValueError, match="own device"):
        a.grant("cuda:0")
    with pytest.raises(ValueError, match="'rw', 'r' or 'none'"):
        a.allocation.grant(1, "x")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_devices_that_do_not_exist_are_named() -> None:
    n = cuda_devices()
    with pytest.raises(sa.BackendUnavailable, match="out of range"):
        sa.zeros(16, device="cuda:0", access=["cuda:0", f"cuda:{n}"])
    a = sa.zeros(16, device="cuda:0")
    with pytest.raises(sa.BackendUnavailable, match="out of range"):
        a.grant(f"cuda:{n}")
    assert a.access == {"cuda:0": "rw"}  # nothing changed


@pytest.mark.gpu
def test_pointer_backends_refuse_peers() -> None:
    need_gpus(2)
    with pytest.raises(ValueError, match="needs backend='cuda-vmm'"):
        sa.zeros(16, device="cuda:0", backend="cuda-ipc", access=["cuda:1"])


# --------------------------------------------------------------------------------------------
# several GPUs


def _pin(devices: Any) -> None:
    """Pool initializer: this worker works on the next GPU (CuPy's current device)."""
    import cupy

    cupy.cuda.Device(devices.get()).use()


def write_own_row(a: Any) -> tuple[int, int]:
    """Write row ``d`` of ``a`` with a kernel on this worker's GPU ``d``."""
    import cupy

    d = cupy.cuda.runtime.getDevice()
    assert a.array.device.id == d  # imported as a peer: the CuPy array is on this GPU
    a.array[d] = d + 1
    cupy.cuda.get_current_stream().synchronize()
    time.sleep(0.05)  # let every worker take a task
    return d, int(a.allocation.native_device or a.device.index)


@pytest.mark.gpu
def test_pool_workers_on_every_gpu_write_their_slice_of_one_array() -> None:
    need_gpus(2)
    n = cuda_devices()
    a = sa.zeros((n, 1 << 20), "float32", device="cuda:0", access=[f"cuda:{i}" for i in range(n)])
    assert set(a.access) == {f"cuda:{i}" for i in range(n)}
    ctx = mp.get_context("spawn")
    devices = ctx.Queue()
    for i in range(n):
        devices.put(i)
    with ctx.Pool(n, initializer=_pin, initargs=(devices,)) as pool:
        seen = pool.map(write_own_row, [a] * (8 * n), chunksize=1)
    assert {d for d, _ in seen} == set(range(n)), seen  # every GPU wrote
    assert all(d == native for d, native in seen)
    got = a.get()
    for i in range(n):
        assert (got[i] == i + 1).all(), i


@pytest.mark.gpu
def test_peer_copy_bandwidth_against_a_local_copy() -> None:
    """A copy kernel on GPU 1 reading memory on GPU 0 (granted), against the same copy
    between two arrays of GPU 1. Records both rates (GB/s, read + written)."""
    need_gpus(2)
    import cupy

    nbytes = 1 << 30
    src = sa.zeros(nbytes // 4, "float32", device="cuda:0", access=["cuda:1"])
    with cupy.cuda.Device(1):
        src1 = src.allocation.backend.as_native(
            NativeView(
                src.address, src.allocation.size, 0, src, np.dtype("float32"), src.shape,
                src.strides, False, 1,
            )
        )  # fmt: skip
        dst = cupy.empty_like(src1)
        local = cupy.empty_like(src1)

        def rate(a: Any, b: Any) -> float:
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            cupy.copyto(b, a)
            start.record()
            for _ in range(10):
                cupy.copyto(b, a)
            stop.record()
            stop.synchronize()
            return 10 * 2 * nbytes / (cupy.cuda.get_elapsed_time(start, stop) / 1e3) / 1e9

        peer, own = rate(src1, dst), rate(local, dst)
    print(f"copy on cuda:1: reading cuda:0 {peer:.0f} GB/s, local {own:.0f} GB/s")
    assert peer > 0 and own > 0
