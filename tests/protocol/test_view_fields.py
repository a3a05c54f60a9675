"""A pickled view's own fields (protocol/payload.py ViewFields) and the reduction that carries
them beside one payload per allocation (api/array.py _rebuild_view, importing.py)."""

from __future__ import annotations

import pickle
import pickletools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedarrays as sa
from sharedarrays.api.array import _rebuild_view
from sharedarrays.importing import import_part
from sharedarrays.protocol.payload import MAX_NDIM, MAX_SIZE, Payload, ViewFields, view_extent

_A = sa.from_array(np.arange(48, dtype=np.float32).reshape(6, 8), device="cpu", pack=False)
_SIZE = _A.allocation.size


def _parts(a: sa.SharedDeviceArray) -> tuple[bytes, tuple[object, ...]]:
    """The allocation's payload and the view's tuple that a pickle of ``a`` carries."""
    fn, (part, view) = a.__reduce__()
    assert fn is _rebuild_view
    return part.blob, view


def _rebuild(blob: object, view: object) -> object:
    """What unpickling a message of one view calls: the allocation's part, then the view."""
    return _rebuild_view(import_part(blob), view)  # type: ignore[arg-type]


_BLOB, _VIEW = _parts(_A[1:, ::2])


def test_the_view_tuple_round_trips() -> None:
    v = ViewFields.from_tuple(_VIEW, _SIZE)
    assert v.to_tuple() == _VIEW
    assert v == ViewFields(32, (5, 4), (32, 8), np.dtype(np.float32), False)
    assert Payload.from_bytes(_BLOB).view_fields() == ViewFields(
        0, (_SIZE,), (1,), np.dtype(np.uint8), False
    )


def test_the_allocation_part_is_the_whole_allocation() -> None:
    p = Payload.from_bytes(_BLOB)
    assert p.alloc_id == _A.allocation.id and p.size == _SIZE
    assert (p.dtype, p.shape, p.strides, p.offset) == (np.dtype(np.uint8), (_SIZE,), (1,), 0)
    # the public whole-view payload is that payload with the view's fields
    whole = _A[1:, ::2].payload()
    assert (whole.shape, whole.strides, whole.offset) == ((5, 4), (32, 8), 32)
    assert whole.alloc_id == p.alloc_id and whole.chunks == p.chunks and whole.secret == p.secret


def test_pickle_names_only_the_reconstructor_once() -> None:
    """The view and its allocation's part call the same function: one global per message."""
    ops = list(pickletools.genops(pickle.dumps([_A, _A[1:]])))
    assert [op.name for op, _, _ in ops if "GLOBAL" in op.name] == ["STACK_GLOBAL"]
    strings = [arg for op, arg, _ in ops if op.name in ("SHORT_BINUNICODE", "BINUNICODE")]
    assert strings == ["sharedarrays.api.array", "_rebuild_view", "<f4"]


@pytest.mark.parametrize(
    "view",
    [
        None,
        [],
        (32, (5, 4), (32, 8), "<f4"),  # a field missing
        (32, (5, 4), (32, 8), "<f4", False, 1),  # one too many
        [32, (5, 4), (32, 8), "<f4", False],  # a list, not a tuple
        (True, (5, 4), (32, 8), "<f4", False),  # a bool is not an int
        (np.int64(32), (5, 4), (32, 8), "<f4", False),
        (-1, (5, 4), (32, 8), "<f4", False),
        (_SIZE + 1, (), (), "<f4", False),
        (2**63, (5, 4), (32, 8), "<f4", False),
        (32, [5, 4], (32, 8), "<f4", False),  # lists, not tuples
        (32, (5, 4), [32, 8], "<f4", False),
        (32, (5, True), (32, 8), "<f4", False),
        (32, (5, -4), (32, 8), "<f4", False),
        (32, (5, 4.0), (32, 8), "<f4", False),
        (32, (5, 4), (32, 8.0), "<f4", False),
        (32, (5, 4), (32,), "<f4", False),  # dims differ
        (0, (1,) * (MAX_NDIM + 1), (0,) * (MAX_NDIM + 1), "<f4", False),
        (0, (MAX_SIZE + 1,), (0,), "<f4", False),
        (0, (2**40, 2**40), (0, 0), "<f4", False),  # more elements than any array
        (0, (2,), (2**48,), "<f4", False),
        (32, (5, 4000), (32, 8), "<f4", False),  # outside the allocation
        (32, (5, 4), (32, -80), "<f4", False),  # before its start
        (_SIZE, (1,), (4,), "<f4", False),  # one element past the end
        (32, (5, 4), (32, 8), "O", False),
        (32, (5, 4), (32, 8), "<U4", False),
        (32, (5, 4), (32, 8), "V8", False),
        (32, (5, 4), (32, 8), np.dtype(np.float32), False),  # a dtype object, not its str
        (32, (5, 4), (32, 8), "<f4", 0),
        (32, (5, 4), (32, 8), "<f4", None),
        (0, (1 << 40,), (0,), "<f8", False),  # one element read 2**40 times
        (0, (_SIZE, _SIZE), (1, 1), "|u1", False),  # overlapping rows: _SIZE**2 elements
    ],
)
def test_bad_view_tuples_are_payload_errors(view: object) -> None:
    with pytest.raises(sa.PayloadError):
        ViewFields.from_tuple(view, _SIZE)
    with pytest.raises(sa.PayloadError):
        _rebuild(_BLOB, view)


def test_a_view_is_checked_against_its_own_allocation() -> None:
    """The same view tuple is fine for a larger allocation and refused for a smaller one."""
    big = sa.zeros(1 << 16, "uint8", device="cpu", pack=False)
    view = (60000, (100,), (1,), "|u1", False)
    assert ViewFields.from_tuple(view, big.allocation.size).offset == 60000
    with pytest.raises(sa.PayloadError, match=rf"'offset' must be an int in \[0, {_SIZE}\]"):
        _rebuild(_BLOB, view)
    with pytest.raises(sa.PayloadError, match="outside its allocation"):
        _rebuild(_BLOB, (4000, (100,), (1,), "|u1", False))
    blob, _ = _parts(big)
    assert _rebuild(blob, view).get().shape == (100,)


def test_the_payload_part_must_be_a_payload() -> None:
    for bad in (None, "SA1", _VIEW, b"", b"SA2" + _BLOB[3:]):
        with pytest.raises(sa.PayloadError):
            _rebuild(bad, _VIEW)  # type: ignore[arg-type]


_INTS = st.integers(min_value=-(2**70), max_value=2**70)
_SMALL = st.integers(min_value=-100, max_value=300)
_JUNK = st.none() | st.booleans() | st.floats(allow_nan=False) | st.text(max_size=4) | _INTS


def _ints(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(inner, max_size=4).map(tuple) | st.lists(inner, max_size=4) | _JUNK


_VIEWS = st.tuples(
    _SMALL | _INTS | _JUNK,
    _ints(st.integers(min_value=-2, max_value=12) | _INTS | _JUNK),
    _ints(_SMALL | _INTS | _JUNK),
    st.sampled_from(["<f4", "|u1", "<i8", ">f8", "<c16", "|b1", "O", "<U2", "f", "", "<f3"])
    | _JUNK,
    st.booleans() | _JUNK,
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view=_VIEWS | st.lists(_JUNK, max_size=6).map(tuple) | _JUNK)
def test_forged_view_tuples_fail_or_stay_inside_the_allocation(view: object) -> None:
    """A forged view tuple (the allocation's payload unaltered) is a PayloadError or a view
    inside the allocation, with exactly the fields it named."""
    try:
        v = _rebuild(_BLOB, view)
    except sa.PayloadError:
        return
    assert type(view) is tuple
    assert v.allocation is _A.allocation
    assert (v.offset, v.shape, v.strides, v.dtype.str, v.readonly) == view
    low, high = view_extent(v.itemsize, v.shape, v.strides)
    assert v.offset + low >= 0 and v.offset + high <= _SIZE
    assert v.array.shape == v.shape  # (the native array over it can be made)
    v.close()


_PART = import_part(_BLOB)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(offset=_SMALL | _INTS | _JUNK, readonly=st.booleans() | _JUNK)
def test_a_message_part_checks_every_view_of_a_layout_it_saw(
    offset: object, readonly: object
) -> None:
    """The views after the first of one layout in a message (the same shape, strides and
    dtype objects: the sender interns them) skip the layout's check, not the bounds: a
    forged offset or read-only flag is refused or lands inside the allocation."""
    offset0, shape, strides, dtype_str, _ = _VIEW
    seen = _rebuild_view(_PART, (offset0, shape, strides, dtype_str, False))
    assert seen.shape == shape
    view = (offset, shape, strides, dtype_str, readonly)
    try:
        v = _rebuild_view(_PART, view)
    except sa.PayloadError:
        assert (
            type(offset) is not int
            or type(readonly) is not bool
            or offset < 0
            or (offset + view_extent(4, shape, strides)[1] > _SIZE)
        )
        return
    assert (v.offset, v.shape, v.strides, v.dtype.str, v.readonly) == view
    low, high = view_extent(v.itemsize, v.shape, v.strides)
    assert v.offset + low >= 0 and v.offset + high <= _SIZE


def test_a_message_finds_its_allocation_once() -> None:
    """Every view of one allocation in a message shares one part: the payload is decoded and
    the allocation found once (one load counted), each view checked on its own."""
    views = [_A[i : i + 1] for i in range(6)] + [_A[::2, ::-1]]
    message = pickle.dumps(views)
    calls: list[object] = []
    from sharedarrays import importing

    real, again = importing.load_payload, importing.load_again

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(args[0])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    def counting_again(*args: object, **kwargs: object) -> object:
        calls.append(args[0])
        return again(*args, **kwargs)  # type: ignore[arg-type]

    # (found: load_payload; or, where an earlier message with the payload found it, taken
    # again: load_again)
    importing.load_payload = counting  # type: ignore[assignment]
    importing.load_again = counting_again  # type: ignore[assignment]
    try:
        loaded = pickle.loads(message)
    finally:
        importing.load_payload, importing.load_again = real, again
    assert len(calls) == 1
    assert [v.get().tolist() for v in loaded] == [v.get().tolist() for v in views]


_MISALIGNED = [  # (dtype, offset, shape, strides): each misaligned for its dtype
    ("<f2", 1, (4,), (2,)),
    ("<f2", 0, (4,), (3,)),
    ("<f4", 2, (4,), (4,)),
    ("<f4", 0, (2, 2), (10, 4)),
    ("<f8", 255, (4,), (8,)),
    ("<f8", 0, (4,), (247,)),
    ("<f8", 8, (3,), (-4,)),
]


@pytest.mark.parametrize(("dtype", "offset", "shape", "strides"), _MISALIGNED)
def test_a_misaligned_view_of_device_memory_is_refused(
    dtype: str, offset: int, shape: tuple[int, ...], strides: tuple[int, ...]
) -> None:
    view = (offset, shape, strides, dtype, False)
    with pytest.raises(sa.PayloadError, match=f"multiples of {np.dtype(dtype).alignment}"):
        ViewFields.from_tuple(view, 4096, device=True)
    assert ViewFields.from_tuple(view, 4096).offset == offset  # host memory: as NumPy
    # a payload of CUDA memory with that view is refused before anything is opened (its
    # backend is registered here, a GPU or not); of host memory it loads, as NumPy's would
    doc = _A.payload().to_doc()
    doc.update(dtype=dtype, offset=offset, shape=list(shape), strides=list(strides))
    loaded = sa.load(Payload.from_doc(doc))
    assert loaded.offset == offset and loaded.strides == strides
    loaded.close()
    doc["backend"] = "cuda-vmm"
    with pytest.raises(sa.PayloadError, match="misaligned"):
        sa.load(Payload.from_doc(doc))


def test_an_aligned_view_of_device_memory_loads_and_unused_strides_do_not_count() -> None:
    for view in [
        (8, (4,), (8,), "<f8", False),
        (16, (2, 1), (16, 3), "<f8", False),  # (a length-1 axis's stride is never used)
        (3, (0,), (5,), "<f8", False),  # (an empty view touches nothing)
        (2, (3,), (2,), "<f2", False),
        (1, (3,), (1,), "|u1", False),
    ]:
        assert ViewFields.from_tuple(view, 4096, device=True).offset == view[0]
