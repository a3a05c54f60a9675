"""SharedDeviceArray acts like the array it wraps (issue #17): operators, scalars, NumPy
dispatch, methods and shape views, each against the same operation on a plain NumPy array;
in-place work writes the shared memory; CuPy on cuda-vmm (marker ``gpu``)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import operator
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import workers
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sharedarrays as sa
from sharedarrays.api.views import is_view, live_views
from sharedarrays.errors import ClosedArrayError

SDA = sa.SharedDeviceArray


def make(shape: tuple[int, ...] = (3, 4), dtype: str = "int64") -> tuple[SDA, np.ndarray]:
    """A shared array and a NumPy array with the same values (1, 2, ...)."""
    ref = (np.arange(int(np.prod(shape))) + 1).astype(dtype).reshape(shape)
    return sa.from_array(ref, device="cpu"), ref


def readonly_view(a: SDA) -> SDA:
    """A read-only view of ``a``'s memory (what an importer of a readonly export gets)."""
    return SDA(a.allocation, a.dtype, a.shape, a.strides, a.offset, readonly=True)


def same(got: Any, want: Any) -> None:
    """Same values, dtype, shape and type (a NumPy array or a NumPy scalar, not shared)."""
    assert not isinstance(got, SDA), "a new result is a native array"
    assert type(got) is type(want), (type(got), type(want))
    got_a, want_a = np.asarray(got), np.asarray(want)
    assert got_a.dtype == want_a.dtype and got_a.shape == want_a.shape
    np.testing.assert_array_equal(got_a, want_a)


def raised(f: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as info:
        f()
    return info.value


def same_error(got: Callable[[], Any], want: Callable[[], Any]) -> None:
    """Both raise, the same type with the same message."""
    g, w = raised(got), raised(want)
    assert type(g) is type(w) and str(g) == str(w), (g, w)


# operators ------------------------------------------------------------------------------
BINARY = [
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    divmod,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
]
BITWISE = [operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift]


@pytest.mark.parametrize("op", BINARY + BITWISE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", ["int64", "uint8", "float32", "bool"])
def test_binary_operators_match_numpy(op: Callable[[Any, Any], Any], dtype: str) -> None:
    a, ref = make((3, 4), dtype)
    b, ref_b = make((4,), dtype)  # broadcasts against the rows
    others: list[tuple[Any, Any]] = [(2, 2), (ref_b, ref_b), (b, ref_b), (a, ref)]
    if dtype != "bool":
        others.append((np.float64(1.5), np.float64(1.5)))
    for other, want_other in others:
        check_binary(lambda: op(a, other), lambda: op(ref, want_other))  # noqa: B023
        check_binary(lambda: op(other, a), lambda: op(want_other, ref))  # noqa: B023


def check_binary(got: Callable[[], Any], want: Callable[[], Any]) -> None:
    """The same result as NumPy's (a divmod pair too), or the same error."""
    try:
        expected = want()
    except Exception:
        same_error(got, want)
        return
    with np.errstate(all="ignore"):
        result = got()
    if isinstance(expected, tuple):  # divmod
        assert len(result) == len(expected)
        for r, e in zip(result, expected, strict=True):
            same(r, e)
    else:
        same(result, expected)


def test_matmul_and_unary_match_numpy() -> None:
    a, ref = make((3, 4), "float64")
    b, ref_b = make((4, 2), "float64")
    same(a @ b, ref @ ref_b)
    same(ref.T @ a, ref.T @ ref)
    same(a @ ref_b, ref @ ref_b)
    same(-a, -ref)
    same(+a, +ref)
    same(abs(-a), abs(-ref))
    i, ref_i = make((5,), "int32")
    same(~i, ~ref_i)
    same_error(lambda: ~a, lambda: ~ref)
    same_error(lambda: a @ a, lambda: ref @ ref)


def test_comparison_is_elementwise_and_view_unhashable() -> None:
    a, ref = make((2, 3))
    a[0, 0] = 0
    ref[0, 0] = 0
    same(a == 0, ref == 0)
    same(a != a, ref != ref)
    assert (a == 0).sum() == 1
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)
    with pytest.raises(TypeError, match="unhashable"):
        {a}  # noqa: B018
    # the live-view registry does not hash views
    assert is_view(a) and any(v is a for v in live_views())
    v = a[1:]
    assert is_view(v)
    v_id = id(v)
    del v
    gc.collect()
    assert all(id(x) != v_id or x is a for x in live_views())
    assert 0 in a and 99 not in a
    assert (0 in a) == (0 in ref)


INPLACE = [
    (operator.iadd, 3),
    (operator.isub, 1),
    (operator.imul, 2),
    (operator.itruediv, 2),
    (operator.ifloordiv, 2),
    (operator.imod, 3),
    (operator.ipow, 2),
]
INPLACE_BITS = [
    (operator.iand, 6),
    (operator.ior, 8),
    (operator.ixor, 5),
    (operator.ilshift, 1),
    (operator.irshift, 1),
]


@pytest.mark.parametrize(("op", "value"), INPLACE + INPLACE_BITS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_inplace_operators_write_shared_memory(
    op: Callable[[Any, Any], Any], value: int, dtype: str
) -> None:
    a, ref = make((3, 4), dtype)
    other = a[...]  # another view of the same memory
    try:
        op(ref, value)
    except Exception:  # e.g. int //= float casting, float &= int: NumPy's error, nothing written
        before = a.get()
        same_error(lambda: op(a, value), lambda: op(ref.copy(), value))
        np.testing.assert_array_equal(a.get(), before)
        return
    result = op(a, value)
    assert result is a  # the same SharedDeviceArray, not a new array
    np.testing.assert_array_equal(other.get(), ref)
    # broadcasting operand, through a strided view
    view = a[::2, 1:]
    view_ref = ref[::2, 1:]
    op(view_ref, np.arange(1, 4, dtype=dtype))
    assert op(view, np.arange(1, 4, dtype=dtype)) is view
    np.testing.assert_array_equal(other.get(), ref)


def test_inplace_with_shared_operand_and_matmul() -> None:
    a, ref = make((3, 3), "float64")
    b, ref_b = make((3, 3), "float64")
    a += b
    ref += ref_b
    np.testing.assert_array_equal(a.get(), ref)
    a @= b
    ref @= ref_b
    np.testing.assert_array_equal(a.get(), ref)


@pytest.mark.parametrize(
    "write",
    [
        lambda a: operator.iadd(a, 1),
        lambda a: operator.imul(a, 2),
        lambda a: operator.ilshift(a, 1),
        lambda a: a.fill(0),
        lambda a: a.sort(),
        lambda a: np.add(a, 1, out=a),
        lambda a: a.clip(0, 1, out=a),
        lambda a: np.copyto(a, 5),
        lambda a: np.put(a, [0], [7]),
        lambda a: a.reshape(-1).fill(3),
        lambda a: operator.iadd(a.T, 1),
        lambda a: operator.setitem(a, (0, 0), 1),
        lambda a: operator.setitem(a, ..., 0),
    ],
)
def test_writes_refused_on_readonly_and_closed_views(write: Callable[[SDA], Any]) -> None:
    a, ref = make((2, 3))
    ro = readonly_view(a)
    with pytest.raises(ValueError, match="assignment destination is read-only"):
        write(ro)
    np.testing.assert_array_equal(a.get(), ref)  # nothing written
    a.close()
    with pytest.raises(ClosedArrayError):
        write(a)


def test_reads_refused_on_a_closed_view() -> None:
    a, _ = make()
    a.close()
    for read in (
        lambda: a + 1,
        lambda: a == 0,
        lambda: a.sum(),
        lambda: np.sum(a),
        lambda: np.sqrt(a),
        lambda: float(a),
        lambda: a.T,
        lambda: a.reshape(-1),
    ):
        with pytest.raises(ClosedArrayError):
            read()


# scalars --------------------------------------------------------------------------------
@pytest.mark.parametrize("convert", [bool, float, int, complex, operator.index])
@pytest.mark.parametrize("shape", [(), (1,), (1, 1), (2,), (0,), (2, 3)])
def test_scalar_conversions_like_numpy(
    convert: Callable[[Any], Any], shape: tuple[int, ...]
) -> None:
    a, ref = make(shape, "int64")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            want = convert(ref)
        except Exception:
            same_error(lambda: convert(a), lambda: convert(ref))
            return
        got = convert(a)
    assert type(got) is type(want) and got == want


def test_scalar_of_an_element_and_float_index_refused() -> None:
    a, ref = make((3, 4), "float32")
    assert float(a[1, 2]) == float(ref[1, 2])
    assert int(a[0, 0]) == 1 and bool(a[0, 0]) is True
    same_error(lambda: operator.index(a[0, 0]), lambda: operator.index(ref[0, 0]))
    same_error(
        lambda: operator.index(a[0, 0, ...]), lambda: operator.index(ref[0, 0:1].reshape(()))
    )
    i, _ = make((5,))
    assert [10, 20, 30, 40, 50, 60][i[2]] == 40  # __index__


# NumPy dispatch -------------------------------------------------------------------------
def test_ufuncs_match_numpy_and_out_writes_shared_memory() -> None:
    a, ref = make((3, 4), "float64")
    same(np.add(a, 1), np.add(ref, 1))
    same(np.sqrt(a), np.sqrt(ref))
    same(np.maximum(a, a[0]), np.maximum(ref, ref[0]))
    same(np.add.reduce(a, axis=1), np.add.reduce(ref, axis=1))
    same(np.multiply.outer(a[0], a[1]), np.multiply.outer(ref[0], ref[1]))
    other = a[...]
    assert np.sqrt(a, out=a) is a
    np.sqrt(ref, out=ref)
    np.testing.assert_array_equal(other.get(), ref)
    row = a[0]
    assert np.add(a[1], a[2], out=row) is row
    np.add(ref[1], ref[2], out=ref[0])
    np.testing.assert_array_equal(other.get(), ref)
    q, r = a[0], a[1]
    got = np.divmod(a[2], 2.0, out=(q, r))
    np.divmod(ref[2], 2.0, out=(ref[0], ref[1]))
    assert got[0] is q and got[1] is r
    np.testing.assert_array_equal(other.get(), ref)
    assert np.add.at(a, (0, [1, 1]), 1.0) is None
    np.add.at(ref, (0, [1, 1]), 1.0)
    np.testing.assert_array_equal(other.get(), ref)
    out = np.empty(4)
    assert np.add(a[0], 1, out=out) is out  # a native out stays native
    mask = a > 5
    np.copyto(ref, 0.0, where=ref > 5)
    np.copyto(a, 0.0, where=mask)
    np.testing.assert_array_equal(other.get(), ref)


def test_array_functions_match_numpy() -> None:
    a, ref = make((3, 4), "float64")
    b, ref_b = make((2, 4), "float64")
    same(np.sum(a), np.sum(ref))
    same(np.mean(a, axis=0), np.mean(ref, axis=0))
    same(np.std(a), np.std(ref))
    same(np.concatenate([a, b]), np.concatenate([ref, ref_b]))
    same(np.concatenate((a, ref_b), axis=0), np.concatenate((ref, ref_b), axis=0))
    same(np.stack([a[0], b[1]]), np.stack([ref[0], ref_b[1]]))
    same(np.where(a > 3, a, -1.0), np.where(ref > 3, ref, -1.0))
    same(np.einsum("ij->j", a), np.einsum("ij->j", ref))
    same(np.median(a), np.median(ref))
    same(np.unique(a), np.unique(ref))
    same(np.allclose(a, ref), np.allclose(ref, ref))
    assert np.array_equal(a, ref) and np.shape(a) == ref.shape and np.ndim(a) == 2
    same_error(lambda: np.concatenate([a, a[0]]), lambda: np.concatenate([ref, ref[0]]))
    total = a[0, 0, ...]  # (a 0-d view: a[0, 0] is NumPy's scalar)
    assert np.sum(a[1], out=total) is total
    assert a.get()[0, 0] == ref[1].sum()


def test_copyto_writes_shared_memory() -> None:
    a, ref = make((2, 3), "float32")
    other = pickle.loads(pickle.dumps(a))
    assert np.copyto(a, 5) is None
    np.testing.assert_array_equal(other.get(), np.full((2, 3), 5, "float32"))
    np.copyto(a[:, 1], np.arange(2, dtype="float32"))
    assert other.get()[:, 1].tolist() == [0.0, 1.0]
    same_error(lambda: np.copyto(a, 1.5j), lambda: np.copyto(ref, 1.5j))


# methods --------------------------------------------------------------------------------
READS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("sum", (), {}),
    ("sum", (0,), {}),
    ("sum", (), {"axis": 1, "dtype": "float32", "keepdims": True}),
    ("mean", (), {}),
    ("mean", (1,), {}),
    ("min", (), {}),
    ("max", (), {"axis": 0}),
    ("std", (), {"ddof": 1}),
    ("var", (), {}),
    ("prod", (), {"axis": 1}),
    ("any", (), {}),
    ("all", (), {"axis": 0}),
    ("argmax", (), {}),
    ("argmin", (), {"axis": 1}),
    ("cumsum", (), {}),
    ("cumprod", (1,), {}),
    ("astype", ("float32",), {}),
    ("astype", ("int8",), {"casting": "unsafe"}),
    ("copy", (), {}),
    ("copy", ("F",), {}),
    ("tolist", (), {}),
    ("item", (5,), {}),
    ("item", (1, 2), {}),
    ("clip", (2, 7), {}),
    ("round", (), {"decimals": -1}),
    ("nonzero", (), {}),
    ("argsort", (), {"axis": 0}),
    ("dot", (np.ones(4),), {}),
    ("conj", (), {}),
    ("conjugate", (), {}),
    ("trace", (), {}),
    ("take", ([0, 5],), {}),
    ("repeat", (2,), {"axis": 0}),
    ("flatten", (), {}),
    ("flatten", ("F",), {}),
    ("tobytes", (), {}),
]


@pytest.mark.parametrize(("name", "args", "kwargs"), READS, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", ["int64", "float64"])
def test_read_methods_match_numpy(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: str
) -> None:
    a, ref = make((3, 4), dtype)
    a[1, 1] = 0
    ref[1, 1] = 0
    got = getattr(a, name)(*args, **kwargs)
    want = getattr(ref, name)(*args, **kwargs)
    if want is ref:  # NumPy returns the array itself (conj of real values)
        assert got is a
        return
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            same(g, w)
    elif isinstance(want, (list, bytes, int, float)):
        assert type(got) is type(want) and got == want
    else:
        same(got, want)
    if isinstance(got, np.ndarray):
        assert not np.shares_memory(got, a.array), "a new result does not share the memory"


def test_astype_without_copy_and_method_errors_like_numpy() -> None:
    a, ref = make((3, 4))
    assert a.astype("int64", copy=False) is a
    copy = a.astype("int64")
    assert isinstance(copy, np.ndarray) and not np.shares_memory(copy, a.array)
    same_error(lambda: a.sum(axis=2), lambda: ref.sum(axis=2))
    same_error(lambda: a.item(), lambda: ref.item())
    same_error(lambda: a.astype("int8", casting="safe"), lambda: ref.astype("int8", casting="safe"))
    total = a[0, 0, ...]
    assert a[1].sum(out=total) is total  # out= a shared view writes the memory
    assert a.get()[0, 0] == ref[1].sum()


def test_fill_and_sort_write_shared_memory() -> None:
    a, ref = make((3, 4), "float64")
    other = a[...]
    a[::2].fill(-1.5)
    ref[::2].fill(-1.5)
    np.testing.assert_array_equal(other.get(), ref)
    rng = np.random.default_rng(0)
    ref[...] = rng.standard_normal((3, 4))
    a[...] = ref
    assert a.sort(axis=0) is None
    ref.sort(axis=0)
    np.testing.assert_array_equal(other.get(), ref)
    a.T.sort()
    ref.T.sort()
    np.testing.assert_array_equal(other.get(), ref)


# shape views ----------------------------------------------------------------------------
def assert_shared_view(v: Any, r: np.ndarray, a: SDA) -> None:
    """``v`` is a SharedDeviceArray of ``a``'s allocation laid out as NumPy's view ``r``."""
    assert isinstance(v, SDA), type(v)
    assert v.allocation is a.allocation
    assert v.shape == r.shape and v.dtype == r.dtype
    if r.size > 1:
        assert v.strides == r.strides
    np.testing.assert_array_equal(v.get(), r)


def test_transpose_swapaxes_squeeze_view_are_shared() -> None:
    a, ref = make((2, 1, 3, 4), "int32")
    assert_shared_view(a.T, ref.T, a)
    assert_shared_view(a.transpose(), ref.transpose(), a)
    assert_shared_view(a.transpose(2, 0, 3, 1), ref.transpose(2, 0, 3, 1), a)
    assert_shared_view(a.transpose((3, 2, 1, 0)), ref.transpose((3, 2, 1, 0)), a)
    assert_shared_view(a.swapaxes(0, 3), ref.swapaxes(0, 3), a)
    assert_shared_view(a.squeeze(), ref.squeeze(), a)
    assert_shared_view(a.squeeze(1), ref.squeeze(1), a)
    assert_shared_view(a.view(), ref.view(), a)
    assert_shared_view(a.view("uint8"), ref.view("uint8"), a)
    assert_shared_view(a.view("int64"), ref.view("int64"), a)
    assert_shared_view(a[:, :, 1:].view("float32"), ref[:, :, 1:].view("float32"), a)
    same_error(lambda: a.transpose(0, 1), lambda: ref.transpose(0, 1))
    same_error(lambda: a.squeeze(0), lambda: ref.squeeze(0))
    same_error(lambda: a.swapaxes(0, 4), lambda: ref.swapaxes(0, 4))
    same_error(lambda: a[..., ::2].view("int64"), lambda: ref[..., ::2].view("int64"))
    same_error(lambda: a[..., :3].view("int64"), lambda: ref[..., :3].view("int64"))
    # writes through a transposed view land in the shared memory
    t = a.T
    t[0, 0, 0, 1] = 99
    assert a.get()[1, 0, 0, 0] == 99


def test_squeeze_with_nothing_to_remove_is_the_view_itself_as_numpys() -> None:
    a, ref = make((3, 4))
    zero_d, ref_0d = sa.from_array(np.array(2.5), device="cpu"), np.array(2.5)
    for v, r, args in ((a, ref, ()), (zero_d, ref_0d, ()), (zero_d, ref_0d, (0,))):
        assert r.squeeze(*args) is r and np.squeeze(r) is r
        assert v.squeeze(*args) is v and np.squeeze(v) is v
    one = a[:1]
    assert one.squeeze() is not one and one.squeeze().shape == (4,)


def test_flags_like_numpy() -> None:
    a, ref = make((3, 4))
    for v, r in ((a, ref), (a.T, ref.T), (a[:, ::2], ref[:, ::2]), (a[0:1], ref[0:1])):
        for key in ("c_contiguous", "f_contiguous"):
            assert getattr(v.flags, key) == getattr(r.flags, key)
        assert v.flags["C_CONTIGUOUS"] == r.flags["C_CONTIGUOUS"]
        assert v.flags["F"] == r.flags["F"] and v.flags.writeable and not v.flags.owndata
    assert not readonly_view(a).flags.writeable and not readonly_view(a).flags["W"]
    with pytest.raises(KeyError):
        a.flags["NOPE"]


FLAG_NAMES = [
    "c_contiguous",
    "f_contiguous",
    "contiguous",
    "fortran",
    "owndata",
    "writeable",
    "aligned",
    "writebackifcopy",
    "behaved",
    "carray",
    "farray",
    "fnc",
    "forc",
    "num",
]
FLAG_KEYS = [
    "C",
    "C_CONTIGUOUS",
    "CONTIGUOUS",
    "F",
    "F_CONTIGUOUS",
    "FORTRAN",
    "W",
    "WRITEABLE",
    "O",
    "OWNDATA",
    "A",
    "ALIGNED",
    "X",
    "WRITEBACKIFCOPY",
    "B",
    "BEHAVED",
    "CA",
    "CARRAY",
    "FA",
    "FARRAY",
    "FNC",
    "FORC",
]


def test_every_flag_reads_as_numpys() -> None:
    a, ref = make((3, 4), "float64")
    ref = ref[...]  # (a view, which owns no data, like every SharedDeviceArray)
    odd = sa.from_array(np.zeros(17, "uint8"), device="cpu")[1:].view("int64")
    odd_ref = np.zeros(17, "uint8")[1:].view("int64")
    pairs = [(a, ref), (a.T, ref.T), (a[:, ::2], ref[:, ::2]), (a[::-1], ref[::-1])]
    for v, r in [*pairs, (a[0:1], ref[0:1]), (odd, odd_ref), (a[1, 1, ...], ref[1, 1, ...])]:
        for name in FLAG_NAMES:
            assert getattr(v.flags, name) == getattr(r.flags, name), name
        for key in FLAG_KEYS:
            assert v.flags[key] == r.flags[key], key
        assert repr(v.flags) == repr(r.flags)
    for key in ("c", "w", "NUM", "UPDATEIFCOPY", 0):
        same_error(lambda k=key: a.flags[k], lambda k=key: ref.flags[k])
    with pytest.raises(TypeError, match="unhashable"):
        hash(a.flags)
    assert a.flags == a[...].flags and a.flags != a.T.flags


def test_flags_writeable_false_makes_the_view_read_only_as_numpys() -> None:
    a, _ = make((3, 4))
    before = a.array  # (a native array taken before stays writable, as a NumPy view does)
    a.flags.writeable = False
    assert a.readonly and not a.flags.writeable and not a.flags["W"] and not a.flags.behaved
    writes: list[Callable[[], Any]] = [
        lambda: a.__setitem__(0, 1),
        lambda: a.__iadd__(1),
        lambda: a.fill(0),
        lambda: np.add(a, 1, out=a),
        lambda: a.array.__setitem__(0, 1),  # (the native array made after is read-only)
        lambda: a[1:].__setitem__(..., 0),  # (and a view derived after)
        lambda: pickle.loads(pickle.dumps(a)).__setitem__(0, 1),  # (and its pickle)
    ]
    for write in writes:
        with pytest.raises(ValueError, match="read-only"):
            write()
    before[0, 0] = 7
    assert a[0, 0] == 7  # (the same memory)
    # NumPy refuses write=True on a view of a read-only array, and so does a view here
    derived, ref = a[1:], np.arange(3)
    ref.flags.writeable = False
    same_error(lambda: derived.setflags(write=True), lambda: ref[1:].setflags(write=True))
    a.flags["WRITEABLE"] = True  # (NumPy's item form too)
    a[0, 0] = 9
    a.array[0, 1] = 8
    assert a.flags.writeable and a.tolist()[0][:2] == [9, 8]
    a.setflags(write=False)
    a.setflags(True)
    assert not a.readonly


def test_flags_refused_as_numpys() -> None:
    a, ref = make((3, 4))
    # read-only as made (an importer's view of a read-only export): never writable here
    ro, owner = readonly_view(a), np.arange(3)
    owner.flags.writeable = False
    ref_ro = owner[...]
    same_error(lambda: ro.setflags(write=True), lambda: ref_ro.setflags(write=True))
    same_error(lambda: ro.flags.__setattr__("writeable", 1), lambda: ref_ro.setflags(write=1))
    same_error(lambda: a.setflags(uic=True), lambda: ref.setflags(uic=True))
    with pytest.raises(TypeError):
        a.setflags(1, 1, 0, 1)  # type: ignore[call-arg]
    odd = sa.from_array(np.zeros(17, "uint8"), device="cpu")[1:].view("int64")
    odd_ref = np.zeros(17, "uint8")[1:].view("int64")
    same_error(lambda: odd.setflags(align=True), lambda: odd_ref.setflags(align=True))
    a.setflags(align=True, uic=False)  # (aligned: nothing to do)
    with pytest.raises(ValueError, match="ALIGNED"):
        a.flags.aligned = False
    for key in ("C", "OWNDATA", "nope"):
        same_error(
            lambda k=key: a.flags.__setitem__(k, True),
            lambda k=key: ref.flags.__setitem__(k, True),
        )
    with pytest.raises(AttributeError):
        a.flags.c_contiguous = False  # type: ignore[misc]
    a.close()
    with pytest.raises(ClosedArrayError):
        a.setflags(write=False)


@st.composite
def strided(draw: st.DrawFn) -> tuple[SDA, np.ndarray]:
    """A basic-indexing view of a shared array (or of its transpose), and NumPy's."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    a, ref = make(shape)
    if draw(st.booleans()):
        a, ref = a.T, ref.T
    key = draw(hnp.basic_indices(ref.shape, allow_newaxis=True, allow_ellipsis=True))
    key = key if isinstance(key, tuple) else (key,)
    if Ellipsis not in key:
        key = (*key, ...)  # (a view, never NumPy's scalar of one element)
    return a[key], np.asarray(ref[key])


def _shares(x: Any, y: np.ndarray) -> bool:
    return bool(np.shares_memory(x, y)) if isinstance(x, np.ndarray) else False


@settings(max_examples=150, deadline=None)
@given(pair=strided(), data=st.data())
def test_reshape_is_a_shared_view_exactly_when_numpy_does_not_copy(
    pair: tuple[SDA, np.ndarray], data: st.DataObject
) -> None:
    v, r = pair
    size = r.size
    divisors = [d for d in range(1, size + 1) if size % d == 0] or [1]
    first = data.draw(st.sampled_from(divisors))
    new = data.draw(
        st.sampled_from([(size,), (first, -1), (-1, first, 1), (1, first, size // first)])
    )
    order = data.draw(st.sampled_from(["C", "F", "A"]))
    want = r.reshape(new, order=order)
    got = v.reshape(new, order=order)
    if np.shares_memory(want, r) or want.size == 0:
        if want.size:
            assert_shared_view(got, want, v)
        assert isinstance(got, SDA)
    else:
        assert type(got) is np.ndarray and not _shares(got, v.array)
        same(got, want)
        with pytest.raises(ValueError):
            v.reshape(new, order=order, copy=False)
    c = v.reshape(new, order=order, copy=True)
    assert type(c) is np.ndarray and not np.shares_memory(c, v.array)
    np.testing.assert_array_equal(c, want)


@settings(max_examples=150, deadline=None)
@given(pair=strided(), order=st.sampled_from(["C", "F", "A", "K"]))
def test_ravel_is_a_shared_view_exactly_when_numpy_returns_one(
    pair: tuple[SDA, np.ndarray], order: str
) -> None:
    v, r = pair
    want = r.ravel(order)
    got = v.ravel(order)
    np.testing.assert_array_equal(np.asarray(got.get() if isinstance(got, SDA) else got), want)
    if r.size > 1:
        assert isinstance(got, SDA) == bool(np.shares_memory(want, r)), (r.strides, order)
    flat = v.flatten(order if order != "K" else "C")
    assert type(flat) is np.ndarray and not np.shares_memory(flat, v.array)


def test_reshape_arguments_and_errors_like_numpy() -> None:
    a, ref = make((3, 4))
    assert_shared_view(a.reshape(12), ref.reshape(12), a)
    assert_shared_view(a.reshape(2, 6), ref.reshape(2, 6), a)
    assert_shared_view(a.reshape([4, -1]), ref.reshape([4, -1]), a)
    assert_shared_view(a.T.reshape((2, 2, 3), order="F"), ref.T.reshape((2, 2, 3), order="F"), a)
    same_error(lambda: a.reshape(5), lambda: ref.reshape(5))
    same_error(lambda: a.reshape(-1, -1), lambda: ref.reshape(-1, -1))
    copied = a.T.reshape(12)
    assert type(copied) is np.ndarray and not np.shares_memory(copied, a.array)
    same(copied, ref.T.reshape(12))
    with pytest.raises(ValueError):
        a.T.reshape(12, copy=False)


def test_shape_views_pickle_as_shared_views() -> None:
    a, _ = make((3, 4), "float64")
    for v in (a.T, a.reshape(2, 6), a.ravel(), a[:, 1:].swapaxes(0, 1), a.view("uint8")):
        back = pickle.loads(pickle.dumps(v))
        assert isinstance(back, SDA) and back.allocation is a.allocation
        assert (back.shape, back.strides, back.offset) == (v.shape, v.strides, v.offset)
    t = pickle.loads(pickle.dumps(a.T))
    t += 1
    assert a.get()[2, 3] == 13


def test_inplace_writes_seen_by_another_process() -> None:
    ref = np.arange(1.0, 13.0).reshape(3, 4)
    # an allocation of its own: a packed slab served to a process would show in later tests'
    # arrays packed beside it ("served to 1 process")
    a = sa.from_array(ref, device="cpu", pack=False)
    with mp.get_context("spawn").Pool(1) as pool:
        total, first, rows = pool.apply_async(workers.inplace_ops, (a,)).get(timeout=120)
    ref += 1
    ref *= 2
    ref[:, 0] -= 1
    ref.reshape(-1)[-1] = 42.0
    np.testing.assert_array_equal(a.get(), ref)
    assert (total, first, rows) == (ref.sum(), ref[0, 0], 3)


# CUDA (cuda-vmm): CuPy results ----------------------------------------------------------
def make_cuda(shape: tuple[int, ...] = (3, 4), dtype: str = "float32") -> tuple[SDA, np.ndarray]:
    ref = (np.arange(int(np.prod(shape))) + 1).astype(dtype).reshape(shape)
    a = sa.from_array(ref, device="cuda:0")
    assert a.backend == "cuda-vmm"
    return a, ref


@pytest.mark.gpu
def test_cuda_operators_return_cupy_and_write_in_place() -> None:
    import cupy

    a, ref = make_cuda()
    for got, want in (
        (a + 1, ref + 1),
        (2 * a, 2 * ref),
        (a == 3, ref == 3),
        (-a, -ref),
        (a @ a.T, ref @ ref.T),
        (a > a[0], ref > ref[0]),
    ):
        assert isinstance(got, cupy.ndarray)
        np.testing.assert_array_equal(got.get(), want)
    other = a[...]
    a += 1
    a *= a
    ref += 1
    ref *= ref
    cupy.cuda.Device(0).synchronize()
    np.testing.assert_array_equal(other.get(), ref)
    native = cupy.ones((3, 4), "float32")
    got = native + a  # CuPy defers to the shared array (__array_priority__)
    assert isinstance(got, cupy.ndarray)
    np.testing.assert_array_equal(got.get(), 1 + ref)
    assert float(a[0, 0]) == float(ref[0, 0]) and bool(a[0, 0])
    i, _ = make_cuda((4,), "int32")
    assert [0, 1, 2, 3, 4, 5][i[1]] == 2
    with pytest.raises(ValueError, match="read-only"):
        readonly_view(a).__iadd__(1)
    with pytest.raises(TypeError):
        float(a)


@pytest.mark.gpu
def test_cuda_masks_and_index_arrays_assign_in_place_iteration_and_round() -> None:
    import cupy

    a, ref = make_cuda((3, 4), "float32")
    a[a > 6] = 0  # a CuPy mask
    ref[ref > 6] = 0
    a[[0, 2]] = -1  # a list
    ref[[0, 2]] = -1
    a[cupy.asarray([1]), 1:3] = 9  # a CuPy index array with a slice
    ref[np.asarray([1]), 1:3] = 9
    cupy.cuda.Device(0).synchronize()
    np.testing.assert_array_equal(a.get(), ref)
    rows = list(a)
    assert len(rows) == 3 and all(type(r) is sa.SharedDeviceArray for r in rows)
    np.testing.assert_array_equal(rows[1].get(), ref[1])
    with pytest.raises(TypeError, match="0-d"):
        iter(a[0, 0])
    assert round(a[1, 1]) == round(float(ref[1, 1]))
    assert float(a.flat[5]) == ref.flat[5]


@pytest.mark.gpu
def test_cuda_methods_dispatch_and_views() -> None:
    import cupy

    a, ref = make_cuda((3, 4), "float32")
    assert isinstance(a.sum(), cupy.ndarray)
    assert float(a.sum()) == ref.sum()
    np.testing.assert_allclose(a.mean(axis=0).get(), ref.mean(axis=0))
    assert a.tolist() == ref.tolist() and a[1, 1].item() == ref.item(5)
    assert isinstance(a.astype("float64"), cupy.ndarray)
    np.testing.assert_array_equal(np.sqrt(a).get(), np.sqrt(ref))  # NumPy ufunc -> CuPy
    np.testing.assert_array_equal(np.sum(a, axis=1).get(), ref.sum(axis=1))
    cat = np.concatenate([a, a])
    assert isinstance(cat, cupy.ndarray) and cat.shape == (6, 4)
    assert np.add(a, 1, out=a) is a
    np.copyto(a[0], cupy.zeros(4, "float32"))
    ref += 1
    ref[0] = 0
    np.testing.assert_array_equal(a.get(), ref)
    a.fill(2)
    a.T.reshape(-1)  # a CuPy copy: the transpose is not contiguous
    t = a.T
    assert isinstance(t, SDA) and t.allocation is a.allocation
    r = a.reshape(2, 6)
    assert isinstance(r, SDA) and r.allocation is a.allocation
    assert isinstance(a.T.reshape(-1), cupy.ndarray)
    r[0, 0] = 7
    assert float(a[0, 0]) == 7
    v = a.view("int32")
    assert isinstance(v, SDA) and v.shape == (3, 4)


@pytest.mark.parametrize(
    ("func", "args", "kwargs"),
    [
        (np.transpose, (), {}),
        (np.transpose, ((2, 0, 1),), {}),
        (np.transpose, (), {"axes": (1, 2, 0)}),
        (np.swapaxes, (0, 2), {}),
        (np.squeeze, (), {}),
        (np.reshape, ((6, 4),), {}),
        (np.reshape, (), {"shape": (4, 6), "order": "C"}),
        (np.ravel, (), {}),
    ],
)
def test_numpy_shape_functions_give_shared_views(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    base = np.arange(24.0).reshape(2, 3, 4)
    a = sa.from_array(base)
    got = func(a, *args, **kwargs)
    want = func(base, *args, **kwargs)
    assert isinstance(got, sa.SharedDeviceArray)
    assert got.allocation is a.allocation
    np.testing.assert_array_equal(np.asarray(got), want)
    got[(0,) * got.ndim] = -1.0  # writes the shared memory
    assert a.array[0, 0, 0] == -1.0
    again = pickle.loads(pickle.dumps(got))  # pickles as a shared view, not a copy
    assert again.allocation is a.allocation


def test_numpy_reshape_that_must_copy_gives_a_native_copy() -> None:
    a = sa.from_array(np.arange(24.0).reshape(4, 6))
    # a transpose is not C-contiguous: flattening it in C order needs a copy, as in NumPy
    got = np.reshape(a.T, (-1,))
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, np.reshape(np.arange(24.0).reshape(4, 6).T, (-1,)))
    with pytest.raises(TypeError):
        np.transpose(a, (1, 0), "extra")  # NumPy's own error for a wrong call


@pytest.mark.parametrize(
    ("func", "args"),
    [
        (np.moveaxis, (0, -1)),
        (np.moveaxis, ([0, 1], [2, 0])),
        (np.rollaxis, (2,)),
        (np.expand_dims, (1,)),
        (np.expand_dims, ((0, 4),)),
        (np.atleast_3d, ()),
        (np.flip, ()),
        (np.flip, (1,)),
        (np.fliplr, ()),
        (np.flipud, ()),
        (np.rot90, ()),
        (np.rot90, (3, (1, 2))),
    ],
)
def test_numpy_layout_functions_give_shared_views(
    func: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    base = np.arange(24.0).reshape(2, 3, 4)
    a = sa.from_array(base)
    got = func(a, *args)
    want = func(base, *args)
    assert isinstance(got, sa.SharedDeviceArray) and got.allocation is a.allocation
    assert got.shape == want.shape and got.strides == want.strides
    np.testing.assert_array_equal(np.asarray(got), want)
    got.array[...] = -got.array  # every element, through the view: shared memory
    np.testing.assert_array_equal(a.array, -base)


@pytest.mark.parametrize(
    ("func", "args"),
    [
        (np.split, (2,)),
        (np.array_split, (3, 1)),
        (np.hsplit, ([1],)),
        (np.vsplit, (2,)),
        (np.dsplit, (np.array([1, 3]),)),
    ],
)
def test_numpy_splits_give_lists_of_shared_views(
    func: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    base = np.arange(24.0).reshape(2, 3, 4)
    a = sa.from_array(base)
    got = func(a, *args)
    want = func(base, *args)
    assert isinstance(got, list) and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, sa.SharedDeviceArray) and g.allocation is a.allocation
        np.testing.assert_array_equal(np.asarray(g), w)
        g.array[...] = 7.0
    assert (a.array == 7.0).all()


def test_atleast_with_other_arrays_is_numpys_and_alone_is_the_view_itself() -> None:
    a = sa.from_array(np.arange(3.0))
    assert np.atleast_1d(a) is a
    both = np.atleast_2d(a, np.zeros(2))
    assert all(isinstance(x, np.ndarray) for x in both) and both[0].shape == (1, 3)


def test_array_namespace_is_the_native_arrays() -> None:
    a = sa.from_array(np.arange(6.0).reshape(2, 3))
    xp = a.__array_namespace__()
    assert xp is np
    assert float(xp.sum(a)) == 15.0 and isinstance(xp.sum(a, axis=0), np.ndarray)


@pytest.mark.gpu
def test_cuda_layout_views_and_namespace() -> None:
    import cupy

    a, ref = make_cuda((2, 3), "float32")
    m = np.moveaxis(a, 0, 1)
    assert isinstance(m, SDA) and m.allocation is a.allocation
    np.testing.assert_array_equal(m.get(), np.moveaxis(ref, 0, 1))
    xp = a.__array_namespace__()
    assert xp is cupy
    total = xp.sum(a)
    assert isinstance(total, cupy.ndarray) and float(total) == ref.sum()


def test_base_names_the_view_a_view_was_derived_from() -> None:
    a = sa.from_array(np.arange(12.0).reshape(3, 4))
    assert a.base is None  # made by a constructor
    v = a[1:]
    assert v.base is a and v.T.base is a and v.reshape(8).base is a
    assert np.moveaxis(a, 0, 1).base is a and np.split(a, 3)[0].base is a
    assert pickle.loads(pickle.dumps(v)).base is None  # loaded from a payload


def test_a_0d_integer_view_indexes_as_its_value() -> None:
    a, ref = make((6,))
    i = sa.from_array(np.array([4, 2], dtype="int64"), device="cpu")
    assert a[i[1]] == ref[2]  # (i[1] is NumPy's scalar; i[1, ...] a 0-d view)
    assert a[i[1, ...]] == ref[2]
    np.testing.assert_array_equal(a[i[0, ...] :].get(), ref[4:])  # (slices take __index__)
    a[i[1, ...]] = 99
    ref[2] = 99
    np.testing.assert_array_equal(a.get(), ref)
    got = a[i]  # a 1-d index array is advanced indexing: NumPy's copy
    assert type(got) is np.ndarray
    np.testing.assert_array_equal(got, ref[[4, 2]])
    f = sa.from_array(np.array(1.0), device="cpu")
    same_error(lambda: a[f], lambda: ref[np.array(1.0)])  # (NumPy's IndexError)
    a.close()
    i.close()
    f.close()


ADVANCED_READS = [
    [0, 1],
    range(2),
    np.array([0, 2]),
    np.array([True, False, True]),
    (np.array([0, 1]), np.array([1, 2])),
    ([0, 1], slice(None)),
    (slice(None), range(1, 3)),
    (0, [0, 1]),
    [],
    True,
    np.array(True),
]
BAD_READS = [
    [0.5],  # no index at all
    [slice(None)],
    "a",
    {0},
    np.array([True] * 5),  # a mask of the wrong length
    (0, 0, [0]),  # too many indices
    [0, 9],  # out of range
    (np.array([0, 1]), np.array([1, 2, 3])),  # arrays that do not broadcast
]


@pytest.mark.parametrize("key", ADVANCED_READS, ids=repr)
def test_an_advanced_index_read_is_numpys_copy(key: object) -> None:
    a, ref = make((3, 4))
    got = a[key]
    assert type(got) is np.ndarray and not np.shares_memory(got, a.array)
    same(got, ref[key])
    got[...] = 0  # (a copy: the shared memory keeps its values)
    same(a.get(), make((3, 4))[1])


@pytest.mark.parametrize("key", BAD_READS, ids=repr)
def test_an_index_numpy_refuses_raises_numpys_indexerror(key: object) -> None:
    a, ref = make((3, 4))
    same_error(lambda: a[key], lambda: ref[key])


def test_getfield_is_a_shared_view_and_setfield_writes_as_numpys() -> None:
    a, ref = make((2, 3), "float64")
    for dtype, offset in (("int32", 4), ("uint8", 7), ("float64", 0), ("int16", 2)):
        got = a.getfield(dtype, offset)
        assert isinstance(got, SDA) and got.allocation is a.allocation
        same(got.get(), ref.getfield(dtype, offset))
    zero_d = a[1, 2, ...].getfield("int32", 4)  # (a 0-d view, as NumPy's is a 0-d array)
    assert isinstance(zero_d, SDA) and zero_d.shape == ()
    a.setfield(3, "int32", 4)
    ref.setfield(3, "int32", 4)
    np.testing.assert_array_equal(a.array, ref)
    a.T.getfield("int32", 0)[0, 0] = 5  # (the view writes the shared memory)
    ref.T.getfield("int32", 0)[0, 0] = 5
    np.testing.assert_array_equal(a.array, ref)
    for bad in (("int64", 4), ("int32", -4), ("int32", 6)):
        same_error(lambda b=bad: a.getfield(*b), lambda b=bad: ref.getfield(*b))
    with pytest.raises(TypeError, match="not supported"):
        a.getfield("U1")
    with pytest.raises(ValueError, match="read-only"):
        readonly_view(a).setfield(0, "int32", 4)


def test_data_ctypes_and_to_device_are_the_native_arrays() -> None:
    a, ref = make((3, 4), "float64")
    view = a[:, 1::2]
    data = view.data
    assert isinstance(data, memoryview) and not data.readonly
    assert data.tolist() == ref[:, 1::2].data.tolist()
    assert readonly_view(a).data.readonly
    assert view.ctypes.data == view.address and view.ctypes.strides[:] == [32, 16]
    assert a.to_device("cpu") is a
    same_error(lambda: a.to_device("cuda"), lambda: ref.to_device("cuda"))
    del view
    gc.collect()
    data[0, 0] = 7.5  # (the memoryview keeps the memory mapped, the view gone)
    assert a[0, 1] == 7.5
    a.close()
    with pytest.raises(ClosedArrayError):
        _ = a.data


def test_an_attribute_the_native_array_lacks_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = make()
    monkeypatch.setattr(SDA, "array", property(lambda self: object()))  # (as CuPy's: no ctypes)
    with pytest.raises(AttributeError, match=r"no attribute 'ctypes'.*builtins\.object"):
        _ = a.ctypes
    with pytest.raises(AttributeError, match=r"no attribute 'to_device'.*builtins\.object"):
        a.to_device("cpu")
    assert not hasattr(a, "ctypes")


def test_real_and_imag_are_views_like_numpy() -> None:
    ref = np.array([[1 + 2j, 3 - 4j], [5 + 0j, -1j]], dtype="complex64")
    a = sa.from_array(ref, device="cpu")
    re, im = a.real, a.imag
    assert isinstance(re, sa.SharedDeviceArray) and isinstance(im, sa.SharedDeviceArray)
    assert re.dtype == im.dtype == np.float32 and re.strides == ref.real.strides
    np.testing.assert_array_equal(re.get(), ref.real)
    np.testing.assert_array_equal(im.get(), ref.imag)
    im[0, 0] = 7  # a view: writes the shared memory
    assert a.get()[0, 0] == 1 + 7j
    r = sa.from_array(np.arange(3.0), device="cpu")
    assert isinstance(r.real, sa.SharedDeviceArray) and r.real.get().tolist() == [0, 1, 2]
    zeros = r.imag  # (NumPy: a new read-only array of zeros for real values)
    assert zeros.tolist() == [0, 0, 0] and not zeros.flags.writeable
    a.close()
    r.close()


@pytest.mark.gpu
def test_cuda_real_imag_format_and_0d_index() -> None:
    cupy = pytest.importorskip("cupy")
    ref = np.array([1 + 2j, 3 - 4j, 5j], dtype="complex128")
    a = sa.from_array(cupy.asarray(ref))
    a.imag[1] = 8
    assert isinstance(a.real, SDA) and a.real.get().tolist() == [1, 3, 0]
    assert a.get().tolist() == [1 + 2j, 3 + 8j, 5j]
    i = sa.from_array(cupy.asarray(np.array([2])))
    assert complex(a[i[0]]) == 5j and f"{a.real[1]:.1f}" == "3.0" and str(a) == str(a.array)
    a.close()
    i.close()


def test_flip_of_a_0d_view_and_index_objects_act_as_numpys() -> None:
    # (np.flip of a 0-d view read its value off the layout probe, whose address may be
    # device memory, and raised "view reaches outside its allocation"; an object with
    # __index__ was refused as an index, as NumPy takes it)
    a, ref = make((6,))
    got, want = np.flip(a[2, ...]), np.flip(ref[2, ...])
    assert type(got) is type(want) and got == want

    class Idx:
        def __init__(self, n: int) -> None:
            self.n = n

        def __index__(self) -> int:
            return self.n

    assert a[Idx(1)] == ref[Idx(1)]
    np.testing.assert_array_equal(a[Idx(1) :].get(), ref[1:])
    m, ref_m = make((3, 4))
    assert m[0, Idx(2)] == ref_m[0, Idx(2)]
    assert isinstance(m[Idx(1)], SDA) and m[Idx(1)].shape == (4,)


def test_a_view_as_a_dtype_that_cannot_be_shared_is_refused_at_once() -> None:
    # (a.view('M8[s]') made a view that failed only when pickled: PayloadError, no advice)
    a, _ = make((2, 4), "float64")
    for dtype in ("M8[s]", "S8", [("x", "f4"), ("y", "f4")], "O"):
        with pytest.raises(TypeError, match=r"cannot be shared.*a\.array\.view"):
            a.view(dtype)
    assert a.view("int64").dtype == np.dtype("int64")


def test_numpys_mean_var_std_of_a_numpy_array_into_a_shared_out() -> None:
    # (x.mean(axis=0, out=a) left the column sums in a: NumPy's _mean divides in place
    # only where the sum came back as an ndarray)
    x = np.arange(24.0).reshape(4, 6)
    for name in ("mean", "var", "std"):
        out, ref_out = make((6,), "float64")
        got = getattr(x, name)(axis=0, out=out)
        want = getattr(x, name)(axis=0, out=ref_out)
        np.testing.assert_allclose(out.get(), want)
        np.testing.assert_allclose(np.asarray(got), want)
        assert np.shares_memory(np.asarray(got), out.array)
    total, _ = make((), "float64")
    x.mean(out=total)
    assert total.get() == x.mean()
    o, _ = make((6,), "float64")
    assert x.sum(axis=0, out=o) is o  # (a sum's out= is still the view itself)
    np.testing.assert_array_equal(o.get(), x.sum(axis=0))


def test_more_ndarray_methods_act_as_numpys(tmp_path: Any) -> None:
    # (put, partition, argpartition, compress, choose, diagonal, mT, byteswap, tofile, dump,
    # dumps were missing: AttributeError)
    a, ref = make((3, 4), "float64")
    a.put([0, 5], [-1.0, -2.0])
    ref.put([0, 5], [-1.0, -2.0])
    np.testing.assert_array_equal(a.get(), ref)
    a.partition(2, axis=1)
    ref.partition(2, axis=1)
    np.testing.assert_array_equal(a.get(), ref)
    same(a.argpartition(1), ref.argpartition(1))
    same(a.compress([True, False, True], axis=0), ref.compress([True, False, True], axis=0))
    same(a.diagonal(), ref.diagonal())
    choices, ref_choices = make((4,), "int64")
    a_small, _ = make((4,), "int64")
    same(
        (a_small % 2).choose([ref_choices, -ref_choices]),
        (a_small.get() % 2).choose([ref_choices, -ref_choices]),
    )
    assert isinstance(a.mT, SDA) and a.mT.shape == (4, 3)
    np.testing.assert_array_equal(a.mT.get(), ref.mT)
    with pytest.raises(ValueError, match="ndim < 2"):
        _ = a[0].mT
    same(a.byteswap(), ref.byteswap())
    assert a.byteswap(inplace=True) is a
    ref.byteswap(inplace=True)
    np.testing.assert_array_equal(a.get(), ref)
    path = tmp_path / "a.bin"
    a.tofile(str(path))
    np.testing.assert_array_equal(np.fromfile(path, ref.dtype).reshape(ref.shape), ref)
    assert pickle.loads(a.dumps()).tolist() == ref.tolist()
    ro = sa.SharedDeviceArray(a.allocation, a.dtype, a.shape, a.strides, a.offset, readonly=True)
    for write in (lambda: ro.put([0], [1.0]), lambda: ro.partition(1), lambda: ro.byteswap(True)):
        with pytest.raises(ValueError, match="read-only"):
            write()
    del choices


def test_setting_real_and_imag_writes_in_place_as_numpys() -> None:
    z = sa.from_array(np.array([1 + 2j, 3 + 4j]), device="cpu")
    ref = np.array([1 + 2j, 3 + 4j])
    z.real = 0
    ref.real = 0
    z.imag = [5, 6]
    ref.imag = [5, 6]
    np.testing.assert_array_equal(z.get(), ref)
    r, ref_r = make((3,), "float64")
    r.real = 7.0
    ref_r.real = 7.0
    np.testing.assert_array_equal(r.get(), ref_r)
    same_error(lambda: setattr(r, "imag", 1.0), lambda: setattr(ref_r, "imag", 1.0))


def test_view_as_an_ndarray_type_del_ravel_none_and_reshape_without_shape() -> None:
    # (a.view(np.ndarray) and view(type=) were refused; del a[0] raised AttributeError;
    # ravel(None) and reshape() raised other errors than NumPy's)
    a, ref = make((2, 3), "float64")
    for got in (a.view(np.ndarray), a.view(type=np.ndarray), a.view(np.int64, np.ndarray)):
        assert type(got) is np.ndarray and np.shares_memory(got, a.array)
    assert a.view(np.int64, np.ndarray).dtype == np.int64
    same_error(lambda: a.__delitem__(0), lambda: ref.__delitem__(0))
    assert isinstance(a.ravel(None), SDA) and a.ravel(None).shape == (6,)
    same_error(lambda: a.ravel(order=1), lambda: ref.ravel(order=1))
    same_error(lambda: a.reshape(), lambda: ref.reshape())
