"""SharedDeviceArray on the CUDA VMM backend, end to end (marker ``gpu``)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import workers
from conftest import NUMERIC_DTYPES

import sharedarrays as sa
from sharedarrays.memory import empty_cache

pytestmark = pytest.mark.gpu

DTYPES = NUMERIC_DTYPES


def free_memory() -> int:
    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.cuda.Device(0).synchronize()
    free, _ = cupy.cuda.runtime.memGetInfo()
    return int(free)


def test_default_device_is_cuda_and_native_is_cupy() -> None:
    import cupy

    a = sa.zeros((4, 5), "float32")
    assert str(a.device) == "cuda:0" and a.backend == "cuda-vmm"
    assert isinstance(a.array, cupy.ndarray) and a.array.data.ptr == a.address
    assert a.allocation.backend.granularity == 2 << 20
    with pytest.raises(TypeError, match="get"):
        np.asarray(a)
    cai = a.__cuda_array_interface__
    assert cai["version"] >= 3 and cai["data"][0] == a.address and "stream" in cai
    assert a.__dlpack_device__() == (2, 0)
    assert cupy.asarray(a).data.ptr == a.address
    assert np.all(a.get() == 0)


def test_an_array_made_through_the_interface_keeps_the_memory_after_close() -> None:
    """cupy.asarray(a) reads __cuda_array_interface__ and holds the view, not its native
    array: closing the view must not unmap the memory under the CuPy array."""
    import cupy

    a = sa.zeros(1 << 20, "uint8")
    alloc = a.allocation
    y = cupy.asarray(a)  # (CuPy's UnownedMemory owns ``a`` itself)
    assert y.data.ptr == a.address
    a.close()
    gc.collect()
    assert not alloc.released  # (before: released here, y pointing at unmapped addresses)
    with pytest.raises(sa.ClosedArrayError):
        _ = a.array
    y[:] = 7
    assert int(y.sum()) == 7 << 20
    del y, a
    gc.collect()
    assert alloc.released


def test_zero_copy_interop_with_torch() -> None:
    torch = pytest.importorskip("torch")
    a = sa.zeros(1000, "float32")
    t = torch.from_dlpack(a)
    assert t.is_cuda and t.data_ptr() == a.address
    t += 3
    torch.cuda.synchronize()
    assert float(a.array.sum().get()) == 3000.0
    b = sa.from_array(torch.arange(6, device="cuda", dtype=torch.int64).reshape(2, 3))
    assert b.device == sa.Device("cuda", 0) and b.get().tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips(dtype: str) -> None:
    ref = (np.arange(48).reshape(4, 12) % 5).astype(dtype)
    a = sa.from_array(ref)
    assert a.device.is_cuda and a.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(a.get(), ref)
    b = pickle.loads(pickle.dumps(a[1:, ::-3]))
    np.testing.assert_array_equal(b.get(), ref[1:, ::-3])


@pytest.mark.parametrize("shape", [0, (3, 0), ()])
def test_zero_size(shape: object) -> None:
    a = sa.zeros(shape, "float64")  # type: ignore[arg-type]
    assert a.get().shape == np.zeros(shape).shape  # type: ignore[call-overload]


def test_from_cupy_and_numpy_and_views_write_through() -> None:
    import cupy

    src = cupy.arange(60, dtype=cupy.float32).reshape(6, 10)
    a = sa.from_array(src)
    assert a.array.data.ptr != src.data.ptr
    ref = cupy.asnumpy(src)
    v = a[1:5, ::-3]
    v[...] = np.full(v.shape, -1, np.float32)  # NumPy values are copied to the device
    ref[1:5, ::-3] = -1
    np.testing.assert_array_equal(a.get(), ref)
    w = sa.from_array(np.asfortranarray(ref))
    assert w.array.flags.f_contiguous
    np.testing.assert_array_equal(w.get(), ref)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_pool_of_four_writes_slices(method: str) -> None:
    a = sa.zeros((4, 1 << 18), "float32")
    with mp.get_context(method).Pool(4) as pool:
        out = pool.map(workers.cuda_write_slice, [(a, i) for i in range(4)], chunksize=1)
    assert [o[0] for o in out] == ["cupy"] * 4 and {o[1] for o in out} == {0}
    assert [o[2] for o in out] == [float((i + 1) << 18) for i in range(4)]
    got = a.get()
    for i in range(4):
        assert np.all(got[i] == i + 1)


def test_producer_exits_before_the_consumer_reads(tmp_path: Path) -> None:
    path, ready, go = tmp_path / "a.pkl", tmp_path / "ready", tmp_path / "go"
    code = (
        "import os, pickle, time, cupy, sharedarrays as sa\n"
        "a = sa.from_array(cupy.arange(1 << 20, dtype=cupy.int64))\n"
        f"open({str(path)!r}, 'wb').write(pickle.dumps(a))\n"
        f"open({str(ready)!r}, 'w').close()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
    )
    producer = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 120
        while not ready.exists():
            assert producer.poll() is None and time.time() < deadline, "producer failed"
            time.sleep(0.01)
        a = pickle.loads(path.read_bytes())
        go.touch()
        assert producer.wait(60) == 0  # the producer released everything and exited
        got = a.get()
        np.testing.assert_array_equal(got, np.arange(1 << 20))
        a[...] = 5
        assert int(a.array.sum().get()) == 5 << 20
    finally:
        producer.kill()
        producer.wait()


def test_device_memory_returns_to_baseline() -> None:
    for _ in range(5):  # (memory an earlier test left, freed in the window: measure again)
        empty_cache()  # (what earlier tests left for reuse: freed now, not in the window)
        before = free_memory()
        a = sa.zeros(256 << 20, "uint8")
        taken = before - free_memory()
        if taken >= (256 << 20) - (2 << 20):
            break
        a.close()  # (its memory back to the cache, emptied at the top)
    assert taken >= (256 << 20) - (2 << 20), f"only {taken / 2**20:.1f} MiB taken"
    with mp.get_context("spawn").Pool(2) as pool:
        assert pool.map(workers.cuda_read_sum, [a[: 1 << 20], a[1 << 20 :]]) == [0.0, 0.0]
        a.close()
        del a
        pool.close()
        pool.join()
    deadline = time.monotonic() + 30
    # (one-sided: memory an earlier test left, freed in the window, is no leak of this one)
    while before - free_memory() > 2 << 20 and time.monotonic() < deadline:
        empty_cache()  # (kept for reuse until trimmed: trimming gives it back)
        time.sleep(0.05)
    after = free_memory()
    assert before - after <= 2 << 20, f"{(before - after) / 2**20:.1f} MiB not returned"


def test_a_running_producer_kernel_is_complete_when_the_consumer_reads() -> None:
    from cuda_helpers import Spin

    spin = Spin()
    a = sa.zeros(1 << 22, "float32")
    with mp.get_context("spawn").Pool(1) as pool:
        pool.apply(workers.cuda_min_max, (a[:1],))  # worker up, allocation imported
        spin(a.array, 42.0, 1.5)  # still running for ~1.5 s when the payload is made
        t = time.perf_counter()
        low, high = pool.apply(workers.cuda_min_max, (a,))
        waited = time.perf_counter() - t
    assert (low, high) == (42.0, 42.0)
    assert waited > 0.5  # the consumer really waited on the producer's event


def test_32_gib_array_is_handed_off_without_a_copy() -> None:
    import cupy

    n = (32 << 30) // 4
    if free_memory() < (32 << 30) + (4 << 30):
        pytest.skip("needs 36 GiB of free device memory")
    a = sa.empty(n, "float32")
    a.array.fill(1.0)
    assert len(a.allocation.chunks) == 1  # one import and one map in the worker
    step = 1 << 20
    with mp.get_context("spawn").Pool(1) as pool:
        pool.apply(workers.cuda_read_sum, (sa.zeros(1, "float32"),))  # start the worker
        t = time.perf_counter()
        sample, first, last = pool.apply(workers.cuda_sample, (a, step))
        elapsed = time.perf_counter() - t
    assert sample == len(range(0, n, step)) and first == 1.0 and last == -1.0
    assert float(a.array[-1].get()) == -1.0
    print(f"32 GiB cold handoff + strided read: {elapsed * 1e3:.1f} ms")
    del a
    cupy.get_default_memory_pool().free_all_blocks()


def test_forked_child_of_a_cuda_parent_is_told_to_use_spawn() -> None:
    a = sa.zeros(4, "float32")
    a.array.fill(1)
    blob = pickle.dumps(a)
    with mp.get_context("fork").Pool(1) as pool:
        message = pool.apply(workers.cuda_fork_child_load, (blob,))
    assert message.startswith("BackendUnavailable") and "spawn" in message, message


@pytest.mark.parametrize("device", ["cuda:7", 7, "cuda:64"])
def test_device_selection_errors_are_clear(device: object) -> None:
    with pytest.raises(sa.BackendUnavailable, match=r"out of range|device"):
        sa.empty(3, device=device)  # type: ignore[arg-type]


def test_no_sync_payload_carries_no_event() -> None:
    import cupy
    from cuda_helpers import Spin

    def token(a: sa.SharedDeviceArray) -> object:
        """The ordering token the importer receives: the reducer's fence, as pickled."""
        return pickle.loads(pickle.dumps(a.__reduce__()[1][0].fence))

    a = sa.zeros(4, "float32")
    cupy.cuda.get_current_stream().synchronize()
    assert token(a) is None  # an idle stream: nothing to order
    Spin()(cupy.zeros(16, dtype=cupy.float32), 1.0, seconds=1.0)
    assert isinstance(token(a), bytes)  # (payload, view, ordering token)
    with sa.no_sync():
        assert a.__reduce__()[1][0].fence is None
    cupy.cuda.get_current_stream().synchronize()


@pytest.mark.parametrize(
    "index",
    [
        (slice(None),),
        (slice(None, None, 2),),
        (slice(None, None, -1),),
        (slice(1, 3), slice(None)),
        (slice(None), slice(1, 3)),
        (slice(None), None, slice(None)),
        (0,),
        (slice(0, 0),),
    ],
)
@pytest.mark.parametrize("transpose", [False, True])
def test_native_array_has_the_views_layout(index: tuple[object, ...], transpose: bool) -> None:
    # (CudaDevice.native_view gives CuPy the strides only where they are not C-contiguous)
    a = sa.from_array(np.arange(24, dtype="float32").reshape(4, 6))
    want = np.arange(24, dtype="float32").reshape(4, 6)[index]
    v = a[index]
    if transpose:
        v, want = v.T, want.T
    x = v.array
    assert x.shape == want.shape and x.strides == want.strides == v.strides
    if v.size:
        assert x.data.ptr == v.address
    np.testing.assert_array_equal(x.get(), want)
    x[...] = -1  # (writes through to the allocation)
    whole = a.array.get()
    expected = np.arange(24, dtype="float32").reshape(4, 6)
    expected[index] = -1
    np.testing.assert_array_equal(whole, expected)
    a.close()


_LOAD_MISALIGNED = """
import pickle, sys
import cupy
import sharedarrays as sa
blobs = pickle.loads(sys.stdin.buffer.read())
for blob in blobs["bad"]:
    try:
        pickle.loads(blob)
    except sa.PayloadError as e:
        print("refused", "misaligned" in str(e))
    else:
        print("loaded")
good = pickle.loads(blobs["good"])
print("sum", float((good.array * 2).sum()))  # the context still runs kernels
x = cupy.arange(8, dtype=cupy.float64)
print("kernel", float(x.sum()))
"""


@pytest.mark.timeout(300)
def test_misaligned_views_of_a_cuda_array_are_refused_and_the_importer_keeps_its_context() -> None:
    # the view fields travel beside the payload's tag: a sender may write any. A misaligned
    # view of device memory would fail the importer's first kernel with
    # cudaErrorMisalignedAddress, which ends every later GPU computation of that process.
    from cuda_helpers import child_env

    from sharedarrays.api.array import _rebuild_view, message_part

    class Call:
        def __init__(self, *args: object) -> None:
            self.args = args

        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return _rebuild_view, self.args

    a = sa.zeros(4096, "uint8", pack=False)
    a[...] = 1
    bad = []
    for dtype in ("<f2", "<f4", "<f8"):
        size = np.dtype(dtype).itemsize
        for view in [
            (1, (4,), (size,), dtype, False),
            (255, (4,), (size,), dtype, False),
            (0, (4,), (2 * size + 1,), dtype, False),
            (0, (4,), (247,), dtype, False),
            (0, (2, 2), (4 * size, size + 1), dtype, False),
        ]:
            bad.append(pickle.dumps(Call(message_part(a.allocation, False), view)))
    good = pickle.dumps(a[:16])
    out = subprocess.run(
        [sys.executable, "-c", _LOAD_MISALIGNED],
        input=pickle.dumps({"bad": bad, "good": good}),
        env=child_env(),
        capture_output=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    assert lines == ["refused True"] * len(bad) + ["sum 32.0", "kernel 28.0"], lines
    a.close()
