from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sharedarrays as sa
from sharedarrays.memory.allocation import live_allocations


def make(
    shape: tuple[int, ...] = (4, 6), dtype: str = "int64"
) -> tuple[sa.SharedDeviceArray, np.ndarray]:
    ref = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    return sa.from_array(ref, device="cpu"), ref


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_basic_indexing_matches_numpy(data: st.DataObject) -> None:
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5))
    a, ref = make(shape)
    key = data.draw(hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True))
    v = a[key]
    r = ref[key]
    r = np.asarray(r)
    assert isinstance(v, sa.SharedDeviceArray)
    assert v.allocation is a.allocation
    assert v.shape == r.shape
    np.testing.assert_array_equal(v.get(), r)
    if r.size:
        assert v.strides == r.strides or r.size == 1


def test_views_write_through_with_offsets_and_negative_strides() -> None:
    a, ref = make((5, 8))
    v = a[1:4, ::-3]
    assert v.offset > 0 and v.strides[1] < 0
    v[...] = -7
    ref[1:4, ::-3] = -7
    np.testing.assert_array_equal(a.get(), ref)
    w = v[::-1, None, 1]
    assert w.shape == (3, 1)
    np.testing.assert_array_equal(w.get(), ref[1:4, ::-3][::-1, None, 1])


def test_integer_index_gives_zero_d_view() -> None:
    a, ref = make((3, 3))
    s = a[1, 2]
    assert s.shape == () and s.get() == ref[1, 2]
    s[()] = 99
    assert a.array[1, 2] == 99


@pytest.mark.parametrize(
    "key",
    [
        [0, 1],
        np.array([1, 2]),
        np.array([True, False, True, False]),
        (slice(None), [0]),
        1.5,
        "x",
        True,
    ],
)
def test_advanced_indexing_is_refused_with_advice(key: object) -> None:
    a, _ = make()
    with pytest.raises(TypeError, match=r"a\.array\[\.\.\.\]"):
        a[key]
    with pytest.raises(TypeError):
        a[key] = 0
    assert isinstance(a.array[np.array([0, 1])], np.ndarray)  # the documented way


def test_get_is_a_copy_and_array_is_not() -> None:
    a, _ = make()
    g = a.get()
    g[0, 0] = 1234
    assert a.array[0, 0] == 0
    a.array[0, 0] = 4321
    assert a[0, 0].get() == 4321
    assert np.shares_memory(a.array, a[1:].array)


def test_numpy_protocols() -> None:
    a, ref = make()
    np.testing.assert_array_equal(np.asarray(a), ref)
    assert np.asarray(a).ctypes.data == a.address
    assert np.asarray(a, dtype=np.float32).dtype == np.float32
    assert np.array(a, copy=True).ctypes.data != a.address
    d = np.from_dlpack(a)
    assert d.ctypes.data == a.address
    assert a.__dlpack_device__() == (1, 0)
    assert not hasattr(a, "__cuda_array_interface__")
    assert len(a) == 4
    with pytest.raises(TypeError):
        len(a[0, 0])


def test_properties_and_repr() -> None:
    a, _ = make((4, 6), "float32")
    assert a.itemsize == 4 and a.device == sa.Device("cpu") and a.backend == "host"
    text = repr(a)
    assert text.startswith(repr(a.array)) and "float32" in text and "created here" in text
    assert a.allocation.id[:12] in text
    table = a.allocation.describe()
    assert "reservation" in table and "created here" in table
    assert a.allocation.origin.created_here


def test_close_then_use_raises() -> None:
    a, _ = make()
    a.close()
    assert a.closed
    assert "closed" in repr(a)
    for use in (
        lambda: a.array,
        lambda: a.get(),
        lambda: a[0],
        lambda: a.allocation,
        lambda: np.asarray(a),
    ):
        with pytest.raises(sa.ClosedArrayError):
            use()
    with pytest.raises(sa.ClosedArrayError):
        a[0] = 1
    a.close()  # twice is fine
    assert a.shape == (4, 6)  # metadata stays readable


def test_context_manager_closes() -> None:
    with sa.zeros(3, device="cpu") as a:
        a[0] = 1
    assert a.closed


def test_mapping_released_when_last_view_and_native_array_go(fd_baseline: None) -> None:
    a, _ = make((64, 1024))
    alloc_id = a.allocation.id
    b = a[2:]
    native = b.array
    a.close()
    b.close()
    assert any(x.id == alloc_id for x in live_allocations())  # the native array still uses it
    native[0, 0] = 5  # and it is still mapped
    del native
    gc.collect()
    assert all(x.id != alloc_id for x in live_allocations())


def test_native_arrays_share_one_base_and_its_lease() -> None:
    """The native arrays of an allocation's views share one native base and its one lease
    (not one per view: the per-view cost of a load): it holds the allocation while a native
    array lives, after every view closed, and the allocation is released with the last."""
    a = sa.zeros((8, 16), "int64", device="cpu", pack=False)
    alloc = a.allocation
    b = a[2:]
    assert alloc.leases == 2
    native = b.array
    assert alloc.leases == 3 and b.array is native  # the base's lease
    whole = a.array
    assert alloc.leases == 3 and whole.base is native.base
    b.close()
    a.close()
    assert alloc.leases == 1 and not alloc.released  # the natives hold the base's lease
    native[0, 0] = 5  # and it is still mapped
    assert whole[2, 0] == 5
    del native
    gc.collect()
    assert alloc.leases == 1 and not alloc.released
    del whole
    gc.collect()
    assert alloc.leases == 0 and alloc.released


def test_readonly_view_refuses_writes_before_touching_memory() -> None:
    a, _ = make((2, 2))
    ro = sa.SharedDeviceArray(a.allocation, a.dtype, a.shape, a.strides, 0, readonly=True)
    assert ro.readonly
    with pytest.raises(ValueError, match="read-only"):
        ro[0, 0] = 1
    assert not ro.array.flags.writeable
    assert a.array[0, 0] == 0


def test_wait_for_and_signal_take_any_semaphore_on_the_array_s_device() -> None:
    """The Semaphore protocol: any object with a device, wait and signal."""
    a = sa.zeros(4, device="cpu")
    calls: list[tuple[str, int | None]] = []

    class Counter:
        device = a.device

        def wait(self, value: int | None) -> None:
            calls.append(("wait", value))

        def signal(self, value: int | None) -> None:
            calls.append(("signal", value))

    a.signal(Counter(), 3)
    a.wait_for(Counter(), 3)
    assert calls == [("signal", 3), ("wait", 3)]

    class Elsewhere(Counter):
        device = sa.Device("cuda", 0)

    with pytest.raises(ValueError, match="the semaphore is on cuda:0"):
        a.wait_for(Elsewhere())
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc", "cuda-pool"])
def test_the_reduction_called_in_place_is_a_view_of_the_same_memory(backend: str) -> None:
    # the reduction called without pickling it: its ordering argument is the fence object
    # itself, not the token a pickle would carry
    import cupy

    a = sa.zeros(1 << 20, dtype="f4", device="cuda:0", backend=backend)
    a.array[:] = 3
    fn, args = a.__reduce__()
    b = fn(*args)
    assert b.allocation is a.allocation
    b.array[7] = 5
    assert float(a.array[7]) == 5 and float(cupy.sum(a.array)) == 3 * (1 << 20) + 2
    b.close()
    a.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc"])
def test_copy_and_deepcopy_of_a_cuda_array_copy_its_values(backend: str) -> None:
    import copy

    import cupy

    a = sa.zeros((4, 3), dtype="f4", device="cuda:0", backend=backend)
    a.array[:] = 3
    for c in (copy.copy(a), copy.deepcopy({"w": a})["w"]):
        assert isinstance(c, cupy.ndarray) and c.shape == (4, 3)
        c[0, 0] = 5
        assert float(a.array[0, 0]) == 3 and float(c.sum()) == 3 * 12 + 2
    a.close()
