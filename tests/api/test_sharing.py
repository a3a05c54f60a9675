"""sa.share: CuPy arrays and torch CUDA tensors shared in place over cuda-ipc (marker ``gpu``);
its refusals and errors on every machine."""

from __future__ import annotations

import gc
import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.backends import get_backend, kind_unusable
from sharedarrays.backends.device import CPU
from sharedarrays.memory import Allocation
from tests import workers


# -- everywhere ------------------------------------------------------------------------------
def test_host_memory_is_not_shareable_in_place() -> None:
    for obj in (np.zeros(3), [1.0, 2.0], 3.0):
        with pytest.raises(sa.NotShareable, match=r"sa\.from_array\(x\) copies"):
            sa.share(obj)
    assert issubclass(sa.NotShareable, sa.SharedArrayError)
    assert issubclass(sa.NotShareable, ValueError)


def test_a_shared_array_is_returned_as_it_is() -> None:
    a = sa.zeros(4, device="cpu")
    assert sa.share(a) is a


def test_from_array_copy_false_points_to_share() -> None:
    with pytest.raises(ValueError, match=r"sa\.share\(x\)"):
        sa.from_array(np.zeros(3), copy=False)


class FakeDeviceArray:
    """Claims to be CUDA memory at an address no CUDA allocation has."""

    class device:
        id = 0

    __cuda_array_interface__ = {
        "shape": (4,),
        "typestr": "<f4",
        "data": (0x1000, False),
        "version": 3,
        "strides": None,
    }


def test_an_address_that_is_not_cuda_memory_is_refused() -> None:
    if kind_unusable("cuda", 0) is None:
        # CuPy wraps the interface as it is; the driver does not know the address
        with pytest.raises(sa.NotShareable, match=r"not CUDA memory|does not describe CUDA memory"):
            sa.share(FakeDeviceArray())
    else:
        with pytest.raises(sa.BackendUnavailable, match="cuda"):
            sa.share(FakeDeviceArray())


def test_only_an_exporter_owned_pointer_backend_borrows() -> None:
    chunk = get_backend(CPU).create_chunk(get_backend(CPU).granularity)
    try:
        with pytest.raises(ValueError, match="cannot be borrowed"):
            Allocation.borrow(get_backend(CPU), chunk)
    finally:
        get_backend(CPU).release_chunk(chunk)


# -- CUDA ------------------------------------------------------------------------------------
def spawn_pool(n: int = 2) -> Any:
    return mp.get_context("spawn").Pool(n)


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_share_a_cupy_array_workers_write_it_in_place() -> None:
    import cupy

    x = cupy.zeros((4, 1 << 16), dtype=cupy.float32)
    a = sa.share(x)
    assert isinstance(a, sa.SharedDeviceArray) and a.backend == "cuda-ipc"
    assert a.array.data.ptr == x.data.ptr  # the same memory, not a copy
    assert a.shape == x.shape and a.dtype == x.dtype and a.device == "cuda:0"
    cupy.cuda.Device(0).synchronize()
    with spawn_pool() as pool:
        got = pool.map(workers.cuda_write_slice, [(a, i) for i in range(4)])
        back = pool.apply(workers.echo, (a[1:3],))  # an array returned from a worker
    assert [g[0] for g in got] == ["cupy"] * 4
    want = np.repeat(np.arange(1, 5, dtype=np.float32)[:, None], 1 << 16, axis=1)
    np.testing.assert_array_equal(x.get(), want)
    assert back.allocation is a.allocation and back.array.data.ptr == x[1:3].data.ptr


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_share_a_strided_view_at_an_offset() -> None:
    import cupy

    x = cupy.zeros((8, 16), dtype=cupy.float64)
    v = x[2:6, ::2]
    a = sa.share(v)
    assert a.array.data.ptr == v.data.ptr and a.strides == v.strides
    cupy.cuda.Device(0).synchronize()
    with spawn_pool(1) as pool:
        pool.apply(workers.fill_value, (a, 5.0))
    want = np.zeros((8, 16))
    want[2:6, ::2] = 5.0
    np.testing.assert_array_equal(x.get(), want)


@pytest.mark.gpu
def test_the_memory_stays_while_the_shared_array_lives() -> None:
    import cupy

    x = cupy.full(1 << 20, 3.0, dtype=cupy.float32)
    ptr = x.data.ptr
    a = sa.share(x)
    del x
    gc.collect()
    others = [cupy.zeros(1 << 20, dtype=cupy.float32) for _ in range(4)]  # the pool's reuse
    assert all(o.data.ptr != ptr for o in others)
    cupy.cuda.Device(0).synchronize()
    assert float(a.array.sum()) == 3.0 * (1 << 20)
    alloc = a.allocation
    a.close()
    del a
    gc.collect()
    assert alloc.released
    again = cupy.zeros(1 << 20, dtype=cupy.float32)  # the block went back to CuPy's pool
    del again


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_share_a_torch_tensor() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros((4, 1 << 12), device="cuda:0")
    a = sa.share(t)
    assert a.array.data.ptr == t.data_ptr() and a.backend == "cuda-ipc"
    w = torch.nn.Parameter(torch.ones(8, device="cuda:0"))  # requires grad: shared as data
    b = sa.share(w)
    assert b.array.data.ptr == w.data_ptr()
    torch.cuda.synchronize()
    with spawn_pool() as pool:
        pool.map(workers.cuda_write_slice, [(a, i) for i in range(4)])
        pool.apply(workers.fill_value, (b, 2.0))
    torch.cuda.synchronize()
    assert t.sum(dim=1).tolist() == [float(i + 1) * (1 << 12) for i in range(4)]
    assert w.detach().cpu().tolist() == [2.0] * 8


@pytest.mark.gpu
def test_memory_cuda_ipc_cannot_export_is_refused() -> None:
    import cupy

    pool = cupy.cuda.MemoryAsyncPool()
    with cupy.cuda.using_allocator(pool.malloc):
        x = cupy.zeros(1024, dtype=cupy.float32)
    with pytest.raises(sa.NotShareable, match=r"stream-ordered pool.*sa\.from_array"):
        sa.share(x)
    mem = cupy.cuda.malloc_managed(4096)
    m = cupy.ndarray((1024,), dtype=cupy.float32, memptr=mem)
    with pytest.raises(sa.NotShareable, match="managed"):
        sa.share(m)
    copy = sa.from_array(x)  # the way out the message names
    assert copy.backend != "cuda-ipc" or copy.array.data.ptr != x.data.ptr
