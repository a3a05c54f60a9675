from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sharedarrays as sa
from sharedarrays.memory.registry import live_allocations


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
    if not isinstance(r, np.ndarray):  # one element: NumPy's scalar, as NumPy gives
        assert type(v) is type(r) and v == r
        return
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


def test_derived_views_keep_the_dtype_with_what_a_type_string_cannot_say() -> None:
    dt = np.dtype("float32", metadata={"unit": "m"})
    with sa.zeros((4, 3), dt, device="cpu") as a:
        for derived in (a[1:], a.T, a.reshape(12), a.ravel(), a.view(), a.real):
            assert derived.dtype.metadata == {"unit": "m"}
        assert a.view("int32").dtype == np.dtype("int32")  # (a new dtype: NumPy's)
        assert sa.zeros(4, ">f4", device="cpu")[1:].dtype == np.dtype(">f4")


def test_an_element_index_gives_numpys_scalar_and_with_ellipsis_a_0d_view() -> None:
    # (a 0-d view followed later writes: a[0], a[1] = a[1], a[0] left [2, 2, ...], and
    # random.shuffle(a) duplicated values, where NumPy's scalars are copies)
    a, ref = make((3, 3))
    s = a[1, 2]
    assert type(s) is type(ref[1, 2]) and s == ref[1, 2]
    a[1, 2] = 99
    assert s == ref[1, 2]  # a copy of the value
    v = a[1, 2, ...]
    assert isinstance(v, sa.SharedDeviceArray) and v.shape == () and v.get() == 99
    v[()] = 7
    assert a.array[1, 2] == 7
    b = sa.from_array(np.arange(5.0), device="cpu")
    b[0], b[1] = b[1], b[0]
    np.testing.assert_array_equal(b.get(), [1.0, 0.0, 2.0, 3.0, 4.0])
    total = b[0]
    for x in b[1:]:
        total += x
    assert total == 10.0 and b[0] == 1.0  # (the accumulator wrote b[0])
    import random

    random.Random(3).shuffle(b)
    assert sorted(b.get()) == [0.0, 1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "key",
    [
        [0, 1],
        np.array([1, 2]),
        np.array([True, False, True, False]),
        (slice(None), [0]),
        True,
        (np.array([0, 2]), slice(1, 3)),
    ],
)
def test_advanced_indexing_reads_copy_as_numpy_and_writes_go_in_place(
    key: object,
) -> None:
    # (a view cannot hold an advanced index: a read is NumPy's copy; an assignment copies
    # nothing, in NumPy either)
    a, ref = make()
    got = a[key]
    assert type(got) is np.ndarray and not np.shares_memory(got, a.array)
    np.testing.assert_array_equal(got, ref[key])
    a[key] = -5
    ref[key] = -5
    np.testing.assert_array_equal(a.get(), ref)
    a[key] = np.arange(ref[key].size).reshape(ref[key].shape) + 100  # values of its shape
    ref[key] = np.arange(ref[key].size).reshape(ref[key].shape) + 100
    np.testing.assert_array_equal(a.get(), ref)


def test_a_mask_made_from_the_array_assigns_in_place_and_read_only_refuses() -> None:
    a, ref = make()
    a[a > 10] = 0
    ref[ref > 10] = 0
    np.testing.assert_array_equal(a.get(), ref)
    shared_mask = sa.from_array(ref == 0, device="cpu")  # a mask that is itself shared
    a[shared_mask] = 7
    ref[ref == 0] = 7
    np.testing.assert_array_equal(a.get(), ref)
    ro = sa.SharedDeviceArray(a.allocation, a.dtype, a.shape, a.strides, 0, readonly=True)
    with pytest.raises(ValueError, match="read-only"):
        ro[ro > 0] = 1
    np.testing.assert_array_equal(a.get(), ref)


@pytest.mark.parametrize(
    "key", [1.5, "x", object(), (0, 1.0), np.float64(1), np.array(1.0), np.array([0.0, 1.0])]
)
def test_what_is_no_index_raises_index_error_as_numpy(key: object) -> None:
    a, ref = make()
    with pytest.raises(IndexError) as want:
        ref[key]
    with pytest.raises(IndexError) as got:  # (NumPy's own, message and all)
        a[key]
    assert str(got.value) == str(want.value)
    with pytest.raises(IndexError):
        a[key] = 0


def test_zero_d_integer_arrays_index_as_their_value() -> None:
    a, ref = make()
    for index in (np.array(1), np.array(2, dtype=np.uint8), a[0, 1].astype(np.int64)):
        np.testing.assert_array_equal(a[index].get(), ref[index])
    with pytest.raises(IndexError):  # (as NumPy's)
        a[a[0, 1].astype(np.float64)]
    got = a[np.array(True)]  # (a boolean index adds an axis: a copy, as NumPy's)
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, ref[np.array(True)])


def test_iteration_gives_views_and_refuses_a_zero_d_array() -> None:
    a, ref = make()
    rows = list(a)
    assert len(rows) == ref.shape[0] and all(isinstance(r, sa.SharedDeviceArray) for r in rows)
    rows[1][...] = -1
    assert (a.get()[1] == -1).all()
    with pytest.raises(TypeError, match="iteration over a 0-d array"):
        iter(a[0, 0, ...])
    with pytest.raises(TypeError, match="iteration over a 0-d array"):
        sum(a[0, 0, ...])  # (it was 0: Python's old iteration stopped at a[0]'s IndexError)


def test_round_and_flat_act_as_numpys() -> None:
    a, ref = make(dtype="float64")
    a[...] = ref / 3
    ref = ref / 3
    for ndigits in (None, 2):
        got, want = round(a[1, 1], ndigits), round(ref[1, 1], ndigits)
        assert got == want and type(got) is type(want)
    with pytest.raises(TypeError, match="__round__"):  # (as NumPy's n-d arrays)
        round(a)
    assert list(a.flat)[:5] == list(ref.flat)[:5]
    a.flat[3] = 42.0
    assert a.get().flat[3] == 42.0
    a.flat = 7.0  # (fills, as NumPy's)
    assert (a.get() == 7.0).all()


def test_get_is_a_copy_and_array_is_not() -> None:
    a, _ = make()
    g = a.get()
    g[0, 0] = 1234
    assert a.array[0, 0] == 0
    a.array[0, 0] = 4321
    assert a[0, 0] == 4321
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
    assert text.startswith(repr(a.array)) and "float32" in text and "exporter: this process" in text
    assert a.allocation.id[:12] in text
    table = a.allocation.describe()
    assert "reservation" in table and "exporter: this process" in table
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
