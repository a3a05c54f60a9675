"""Pickled views: one payload per allocation in a message, the view's fields beside it
(issue 19's per-message memo)."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import pickle
import pickletools
import sys
import threading
import types
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import view_workers
from forking import in_forked_child

import sharedarrays as sa
from sharedarrays import importing, process
from sharedarrays.api import array as array_module
from sharedarrays.api.array import _rebuild_view, allocation_bytes, message_part
from sharedarrays.importing import import_part
from sharedarrays.process import STATE
from sharedarrays.protocol.payload import Payload


def _readonly(v: sa.SharedDeviceArray) -> sa.SharedDeviceArray:
    """A read-only view of the same memory (as an importer of read-only payloads has)."""
    return sa.SharedDeviceArray(v.allocation, v.dtype, v.shape, v.strides, v.offset, True)


def _views() -> tuple[list[sa.SharedDeviceArray], list[np.ndarray[Any, Any]]]:
    """Views of every layout (strided, negative strides, 0-d, read-only, Fortran) of two
    allocations, and the NumPy arrays they must equal."""
    base = np.arange(48, dtype=np.float64).reshape(6, 8)
    a = sa.from_array(base, device="cpu", pack=False)
    f = sa.from_array(np.asfortranarray(base[:5, :3].astype(np.int16)), device="cpu", pack=False)
    views = [a, a[1::2, ::3], a[::-1, ::-2], a[2, 5, ...], a.T, _readonly(a[1:4]), f, f.T, f[1]]
    expect = [base, base[1::2, ::3], base[::-1, ::-2], base[2, 5], base.T, base[1:4]]
    fb = np.asfortranarray(base[:5, :3].astype(np.int16))
    return views, [*expect, fb, fb.T, fb[1]]


def _check(got: list[dict[str, Any]], views: list[sa.SharedDeviceArray], expect: list[Any]) -> None:
    assert len(got) == len(views)
    for g, v, e in zip(got, views, expect):
        assert tuple(g["shape"]) == v.shape == e.shape
        assert tuple(g["strides"]) == v.strides == e.strides
        assert g["offset"] == v.offset and g["alloc"] == v.allocation.id
        assert g["readonly"] is v.readonly and g["writeable"] is not v.readonly
        np.testing.assert_array_equal(np.asarray(g["values"]), e)


def test_views_round_trip_in_this_process() -> None:
    views, expect = _views()
    loaded = pickle.loads(pickle.dumps(views))
    assert [x.allocation for x in loaded] == [v.allocation for v in views]
    got = [
        {
            "shape": x.shape,
            "strides": x.strides,
            "offset": x.offset,
            "readonly": x.readonly,
            "values": x.get(),
            "writeable": x.array.flags.writeable,
            "alloc": x.allocation.id,
        }
        for x in loaded
    ]
    _check(got, views, expect)
    assert views[3].shape == () and views[5].readonly and views[6].array.flags.f_contiguous


@pytest.mark.timeout(120)
def test_views_round_trip_to_a_pool_worker_cold_then_warm() -> None:
    views, expect = _views()
    with mp.get_context("spawn").Pool(1) as pool:
        for _ in range(2):  # mapped from the handle server, then found mapped
            got = pool.apply(view_workers.describe, (views,))
            _check(got, views, expect)
            assert all(g["access"] == "rw" for g in got)  # (the first view is read-write)
            assert got[0]["same"][:6] == [True] * 6 and got[6]["same"][6:] == [True] * 3


@pytest.mark.timeout(120)
def test_process_arguments_carry_the_fds_with_one_payload_per_allocation() -> None:
    ctx = mp.get_context("spawn")
    views, expect = _views()
    q = ctx.Queue()
    p = ctx.Process(target=view_workers.describe_to_queue, args=(views, q))
    p.start()
    _, got = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0
    _check(got, views, expect)
    assert all(g["origin"] == os.getpid() for g in got)
    assert all(v.allocation.served == () for v in views)  # no handle server was asked


@pytest.mark.timeout(120)
def test_a_thread_s_first_pickling_makes_the_spawn_check_a_plain_read() -> None:
    """Every view's reduction asks multiprocessing whether a Process is being spawned in its
    thread; where none ever was, the answer raised and caught an AttributeError inside
    (10-15 us on a cold path, at every Pool task). The thread's first pickling sets the
    answer to None, as a spawn leaves it: later ones read it plainly, and a Process spawned
    from that thread afterwards still carries the fds."""
    from multiprocessing import context

    out: dict[str, Any] = {}

    def run() -> None:
        views, expect = _views()
        before = "spawning_popen" in vars(context._tls)
        pickle.dumps(views[0])
        out["set"] = (before, vars(context._tls).get("spawning_popen", "missing"))
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=view_workers.describe_to_queue, args=(views, q))
        p.start()
        _, got = q.get(timeout=60)
        p.join(60)
        out["child"] = (p.exitcode, got, views, expect)

    t = threading.Thread(target=run)
    t.start()
    t.join(110)
    assert out["set"] == (False, None)
    exitcode, got, views, expect = out["child"]
    assert exitcode == 0
    _check(got, views, expect)
    assert all(v.allocation.served == () for v in views)  # carried, no handle server asked


@pytest.mark.timeout(120)
def test_a_read_only_view_maps_read_only_on_first_sight() -> None:
    """As with a view's whole payload: the importer maps a read-write allocation read-only
    when the first view it sees of it is read-only."""
    a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    with mp.get_context("spawn").Pool(1) as pool:
        (got,) = pool.apply(view_workers.describe, ([_readonly(a[2:])],))
    assert got["readonly"] is True and got["access"] == "r" and got["values"] == [2, 3, 4, 5, 6, 7]


def test_a_message_carries_each_allocations_payload_once() -> None:
    n = 10_000
    arrays = [sa.full(1024, float(i % 7), "float32", device="cpu", pack=True) for i in range(n)]
    allocations = {id(a.allocation): a.allocation for a in arrays}.values()
    assert 1 < len(allocations) < n // 100  # packed in slabs
    for x in allocations:  # (payloads of these slabs that earlier tests pickled and never
        x.flight.note_sent()  # loaded count again once a new one is sent, even past their bound:
        x.flight.note_loaded()  # a send and a load, which change no count, make them visible now)
    before = sum(x.in_flight()[0] for x in allocations)
    message = pickle.dumps(arrays)
    # one per allocation and message
    assert sum(x.in_flight()[0] for x in allocations) == before + len(allocations)
    blobs = {allocation_bytes(a.allocation) for a in arrays}
    assert len(blobs) == len(allocations)
    whole = sum(len(a.payload().to_bytes()) for a in arrays)
    for blob in blobs:
        assert message.count(blob) == 1  # written once, then a memo reference
    assert len(message) < 120 * n + sum(map(len, blobs))  # far less than n whole payloads
    assert len(message) < whole / 5
    loaded = pickle.loads(message)
    assert sum(x.in_flight()[0] for x in allocations) == before  # loaded here: none in flight
    assert all(x.allocation is a.allocation for x, a in zip(loaded, arrays))
    assert all(x.offset == a.offset and x.shape == a.shape for x, a in zip(loaded, arrays))
    assert float(loaded[-1].get()[0]) == float((n - 1) % 7)


def test_the_allocation_payload_is_one_bytes_object_until_the_allocation_grows() -> None:
    g = sa.zeros(1024, "uint8", device="cpu", capacity=1 << 20)
    first = g.__reduce__()[1][0].blob
    assert g[10:].__reduce__()[1][0].blob is first and g[::2].__reduce__()[1][0].blob is first
    g.resize(1 << 19)
    grown = g.__reduce__()[1][0].blob
    assert grown != first
    assert Payload.from_bytes(grown).size > Payload.from_bytes(first).size
    assert Payload.from_bytes(grown).capacity == g.allocation.capacity
    assert pickle.loads(pickle.dumps(g)).shape == (1 << 19,)


def test_the_reduction_called_in_place_passes_the_fence_and_counts_nothing_in_flight() -> None:
    a = sa.from_array(np.arange(10.0), device="cpu", pack=False)
    fn, args = a[::-3].__reduce__()
    c = fn(*args)  # (what copy.copy did before views had __copy__)
    assert c.allocation is a.allocation and c.strides == (-24,) and c.offset == 72
    assert c.get().tolist() == [9.0, 6.0, 3.0, 0.0]
    assert a.allocation.in_flight()[0] == 0


def test_copy_and_deepcopy_copy_the_values_as_numpy_does() -> None:
    # (an allocation of its own: a slab's in-flight count also counts what earlier tests
    # pickled into it and never loaded)
    a = sa.from_array(np.arange(10.0), device="cpu", pack=False)
    v = a[::-3]
    shallow, deep = copy.copy(v), copy.deepcopy({"w": v, "again": v})
    assert type(shallow) is np.ndarray and shallow.tolist() == [9.0, 6.0, 3.0, 0.0]
    assert deep["w"] is deep["again"]  # (the memo: one copy per array)
    shallow[0] = -1
    deep["w"][1] = -2
    assert a.get().tolist() == np.arange(10.0).tolist()  # the original is untouched
    assert a.allocation.in_flight()[0] == 0  # nothing pickled
    a.close()
    with pytest.raises(sa.ClosedArrayError):
        copy.copy(a)


def test_the_reduction_is_the_view_reconstructor() -> None:
    a = sa.from_array(np.arange(6, dtype=np.int32).reshape(2, 3), device="cpu", pack=False)
    fn, (part, view) = a[:, 1:].__reduce__()
    blob = part.blob
    assert fn is _rebuild_view and part.fence is None  # the host orders nothing
    assert view == (4, (2, 2), (12, 4), "<i4", False)
    p = Payload.from_bytes(blob)
    assert (p.offset, p.shape, p.dtype.str) == (0, (a.allocation.size,), "|u1")
    assert _rebuild_view(import_part(blob), view).get().tolist() == [[1, 2], [4, 5]]


def test_native_arrays_of_loaded_views_share_one_base_and_keep_read_only() -> None:
    """The views of a message share their allocation's native base: NumPy arrays over its
    buffer; a read-only view's native array refuses writes, the others do not."""
    a = sa.from_array(np.arange(64, dtype=np.float32), device="cpu", pack=False)
    views = [a[:8], _readonly(a[8:16]), a[::-4]]
    loaded = pickle.loads(pickle.dumps(views))
    natives = [v.array for v in loaded]
    assert natives[0].base is natives[1].base is natives[2].base
    assert natives[0].base.nbytes == a.allocation.size
    assert [n.flags.writeable for n in natives] == [True, False, True]
    assert natives[2].tolist() == np.arange(64, dtype=np.float32)[::-4].tolist()
    natives[0][0] = 42.0
    assert float(a.get()[0]) == 42.0


def test_a_part_whose_allocation_was_dropped_finds_it_again() -> None:
    """A parked mapping dropped between two views of one message (a release notice, the
    limit): the next view finds (or maps) the allocation anew instead of failing."""
    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    (part, view) = a[4:].__reduce__()[1]
    received = import_part(part.blob)
    assert _rebuild_view(received, view).get().tolist() == list(range(4, 16))
    gone = sa.zeros(4, device="cpu", pack=False).allocation  # (its only view is dropped)
    assert gone.released
    received.bind(gone)  # as if the part's allocation had been released meanwhile
    again = _rebuild_view(received, view)
    assert again.allocation is a.allocation and received.allocation is a.allocation
    assert again.get().tolist() == list(range(4, 16))


def test_the_views_of_one_message_share_one_lease_until_the_last_closes() -> None:
    """A message's views of one allocation hold it through one lease (one object and one
    count per message, not per view): it lasts until the last of them closes."""
    a = sa.from_array(np.arange(64.0), device="cpu", pack=False)
    alloc = a.allocation
    held = alloc.leases  # a's own
    parts = [a[i : i + 8] for i in range(0, 64, 8)]
    blob = pickle.dumps(parts)
    del parts
    assert alloc.leases == held
    views = pickle.loads(blob)
    assert alloc.leases == held + 1
    assert len({id(v._lease) for v in views}) == 1
    for v in views[:-1]:
        v.close()
    assert alloc.leases == held + 1
    assert views[-1].get().tolist() == list(range(56, 64))
    views[-1].close()
    assert alloc.leases == held
    again = pickle.loads(blob)  # a second message: a lease of its own
    assert alloc.leases == held + 1 and again[0]._lease is not views[0]._lease
    del again
    assert alloc.leases == held


def test_the_views_of_a_growable_allocation_keep_a_lease_each() -> None:
    """A growable allocation's views each keep their own lease (its end bounds shrinking)."""
    a = sa.empty(16, "float64", device="cpu", capacity=1 << 20)
    alloc = a.allocation
    held = alloc.leases
    views = pickle.loads(pickle.dumps([a[:4], a[4:8]]))
    assert alloc.leases == held + 2 and views[0]._lease is not views[1]._lease
    del views
    assert alloc.leases == held


class _OutOfBounds:
    """Pickles as a view of ``a``'s allocation (its part of the message) that lies outside it."""

    def __init__(self, a: sa.SharedDeviceArray) -> None:
        self.a = a

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        part = message_part(self.a.allocation, False)  # (the message's part, as a view finds)
        return _rebuild_view, (part, (1 << 40, (4,), (8,), "<f8", False))


def test_a_message_that_fails_to_load_holds_no_lease_in_its_traceback() -> None:
    """A message whose second view is refused: the view made before it is dropped with the
    unpickler, and the part, which the kept traceback still references, holds no lease."""
    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    alloc = a.allocation
    held = alloc.leases
    blob = pickle.dumps([a[:4], _OutOfBounds(a)])
    with pytest.raises(sa.PayloadError) as refused:
        pickle.loads(blob)
    assert refused.value.__traceback__ is not None  # (kept, with its frames)
    assert alloc.leases == held


def test_a_warm_load_takes_the_part_of_the_last_message_with_its_payload() -> None:
    """A second message with the same payload takes the part the first one found (its
    allocation and checked layout) and still counts its own load; its first view leases
    through the allocation (never the last message's lease: see the test below)."""
    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    alloc = a.allocation
    held = alloc.leases
    first, second = pickle.dumps(a[2:]), pickle.dumps(a[2:])
    assert alloc.in_flight()[0] == 2
    one = pickle.loads(first)
    assert alloc.in_flight()[0] == 1  # (loaded back here: counted)
    (part, _) = a[2:].__reduce__()[1]
    received = process.STATE.pickling.received[part.blob]
    assert received.allocation is alloc and received.token is None  # (used once)
    assert import_part(part.blob) is received
    two = pickle.loads(second)
    assert alloc.in_flight()[0] == 0  # each message's load counted
    assert two._lease is not one._lease and alloc.leases == held + 2
    assert two.get().tolist() == list(range(2, 16))
    one.close()
    two.close()
    assert alloc.leases == held


def test_a_part_shares_its_lease_only_with_views_loaded_in_the_thread_that_took_it() -> None:
    """Views of one part share the lease its first view took, in that thread. A view of the
    same part loaded in another thread (two threads loading messages with the same payload
    at once share the part) leases through the allocation instead: through the weak
    reference it could take a lease whose end is running in the first thread."""
    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    alloc = a.allocation
    held = alloc.leases
    (sent, view) = a[2:].__reduce__()[1]
    part = importing.ReceivedPart(Payload.from_bytes(sent.blob), None, None, sent.blob)
    one = _rebuild_view(part, view)
    same_thread = _rebuild_view(part, view)
    got: list[Any] = []
    other = threading.Thread(target=lambda: got.append(_rebuild_view(part, view)))
    other.start()
    other.join(30)
    assert not other.is_alive() and len(got) == 1
    (elsewhere,) = got
    assert same_thread._lease is one._lease  # (one lease for the views of one thread)
    assert elsewhere._lease is not one._lease and alloc.leases == held + 2
    assert elsewhere.get().tolist() == list(range(2, 16))
    for v in (one, same_thread, elsewhere):
        v.close()
    assert alloc.leases == held


@pytest.mark.usefixtures("no_cache")  # (a release frees: nothing kept for reuse)
def test_a_warm_load_of_another_process_s_payload_stamps_the_use_and_counts_returns() -> None:
    """The common warm load (a payload of another process, of memory it does not own) takes
    the part again in one frame: it stamps the allocation's use (parking's order), counts a
    return by the sending process (told to it at release, if it was served), waits for
    nothing without a token and refuses a malformed one; a released allocation is not
    taken."""
    import dataclasses

    from sharedarrays.api.array import allocation_payload

    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    alloc = a.allocation
    theirs = dataclasses.replace(allocation_payload(alloc), pid=os.getpid() + 1, server="/srv/x")
    blob = theirs.to_bytes()
    part = importing.ReceivedPart(Payload.from_bytes(blob), None, None, blob)
    part.bind(alloc)
    process.STATE.pickling.received[blob] = part
    try:
        alloc.last_used = 0
        assert import_part(blob) is part and alloc.last_used > 0
        assert alloc.flight.returned("/srv/x") == 1
        assert import_part(blob) is part and import_part(blob) is part
        assert alloc.flight.returned("/srv/x") == 3
        with pytest.raises(sa.PayloadError, match="ordering token"):
            import_part(blob, b"")
        view = _rebuild_view(import_part(blob), a._view_tuple())
        assert view.get().tolist() == list(range(16))
        view.close()
        own = importing.ReceivedPart(Payload.from_bytes(blob), None, None, blob)
        own.bind(sa.zeros(4, device="cpu", pack=False).allocation)  # (released: dropped)
        process.STATE.pickling.received[blob] = own
        assert import_part(blob) is not own and blob not in process.STATE.pickling.received
    finally:
        process.STATE.pickling.received.pop(blob, None)
        a.close()


def test_a_warm_part_whose_allocation_was_released_is_not_taken() -> None:
    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    (part, view) = a[4:].__reduce__()[1]
    received = import_part(part.blob)
    assert _rebuild_view(received, view).get().tolist() == list(range(4, 16))
    assert import_part(part.blob) is received
    gone = sa.zeros(4, device="cpu", pack=False).allocation  # (its only view is dropped)
    received.bind(gone)  # as if the part's allocation had been released meanwhile
    fresh = import_part(part.blob)
    assert fresh is not received and fresh.allocation is None
    assert part.blob not in process.STATE.pickling.received  # (until a view finds it again)
    assert _rebuild_view(fresh, view).allocation is a.allocation
    assert process.STATE.pickling.received[part.blob] is fresh


def test_a_warm_part_uses_the_layout_it_checked_and_checks_any_other() -> None:
    """A later message's view fields equal to the checked ones (even as other numbers) give
    the checked, canonical ones; any other fields are checked in full."""
    a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    (part, view) = a.__reduce__()[1]
    assert _rebuild_view(import_part(part.blob), view).shape == (8,)
    same = (0, (8.0,), (8,), "<f8", False)  # (equal, not ints)
    got = _rebuild_view(import_part(part.blob), same)
    assert got.shape == (8,) and type(got.shape[0]) is int
    assert got.get().tolist() == list(range(8))
    size = a.allocation.size
    for bad in (
        (0, ("8",), (8,), "<f8", False),
        (0, (size // 8 + 1,), (8,), "<f8", False),
        (0, [8], (8,), "<f8", False),
        (0, (8,), (8,), "<f8", 1),
        (size - 8, (8,), (8,), "<f8", False),
        (0, (_RaisingEq(),), (8,), "<f8", False),  # (its comparison raises: checked in full)
        (0, _Shape((8,)), (8,), "<f8", False),  # (not a tuple itself: checked in full)
    ):
        with pytest.raises(sa.PayloadError):
            _rebuild_view(import_part(part.blob), bad)


class _RaisingEq:
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing me")

    __hash__ = object.__hash__


class _Shape(tuple):  # type: ignore[type-arg]
    pass


def test_a_forked_child_takes_no_warm_part_of_its_parent() -> None:
    a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    b = pickle.loads(pickle.dumps(a))
    assert process.STATE.pickling.received

    def child() -> int:
        return len(process.STATE.pickling.received)

    assert in_forked_child(child) == 0
    assert process.STATE.pickling.received and b.get().tolist() == list(range(8))


def test_a_warm_view_reuses_the_native_array_nobody_holds() -> None:
    """`.array` of a view whose layout matches the last native array made for its allocation
    hands that array out again when nothing else holds it and it is unchanged; never one
    that is held, reshaped in place or made read-only since."""
    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    blob = pickle.dumps(a[4:12])

    def fresh() -> sa.SharedDeviceArray:
        return pickle.loads(blob)

    v = fresh()
    first = v.array
    seen = weakref.ref(first)
    del first
    v.close()
    w = fresh()
    again = w.array
    assert again is seen()  # nobody held it: handed out again
    held = again  # (a second name: held)
    w.close()
    del again
    x = fresh()
    other = x.array
    assert other is not held and other.tolist() == held.tolist()
    other[0] = -1.0  # the same memory, two arrays
    assert held[0] == -1.0 and a.get()[4] == -1.0
    del held, other
    x.close()
    y = fresh()
    changed = y.array
    changed.shape = (2, 4)  # (in place)
    del changed
    y.close()
    z = fresh()
    assert z.array.shape == (8,)
    sealed = z.array
    z.close()
    sealed.flags.writeable = False
    del sealed
    assert fresh().array.flags.writeable


def test_a_warm_message_of_many_views_reuses_each_view_s_native_array(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each layout's native array is kept (up to NATIVES_KEPT per allocation, the oldest let
    go first): the views of a warm message of many views of one allocation get the arrays
    the last message's views had, where nothing holds them; and the kept arrays go when
    the allocation is released here."""
    from sharedarrays.memory import lease as lease_module

    def natives_of_a_message(
        x: sa.SharedDeviceArray,
    ) -> tuple[bytes, list[weakref.ref[Any]]]:
        """A message of 16 views of ``x``, loaded, each view's native array made (weakly
        referred to), and every view closed."""
        blob = pickle.dumps([x[i : i + 4] for i in range(0, 64, 4)])
        views = pickle.loads(blob)
        refs = [weakref.ref(v.array) for v in views]
        for v in views:
            v.close()
        return blob, refs

    a = sa.from_array(np.arange(64.0), device="cpu", pack=False)
    blob, seen = natives_of_a_message(a)
    again = pickle.loads(blob)
    assert all(v.array is ref() for v, ref in zip(again, seen))  # every one reused
    assert [float(v.array[0]) for v in again] == [float(i) for i in range(0, 64, 4)]
    for v in again:
        v.close()
    del again
    monkeypatch.setattr(lease_module, "NATIVES_KEPT", 4)
    b = sa.from_array(np.arange(64.0), device="cpu", pack=False)
    _, refs = natives_of_a_message(b)
    assert len(b.allocation._natives) == 4  # the last four layouts
    assert [r() is None for r in refs] == [True] * 12 + [False] * 4
    alloc = a.allocation
    a.close()
    assert alloc.released and not alloc._natives and all(r() is None for r in seen)
    b.close()


@pytest.mark.timeout(120)
def test_two_threads_never_hold_the_same_kept_native_array() -> None:
    """A kept native array is taken out of its table and put back atomically: two threads
    loading views of one layout at once never both get it (each holds its array while it
    looks at the other's)."""
    a = sa.from_array(np.arange(16.0), device="cpu", pack=False)
    blob = pickle.dumps(a[4:12])
    held: dict[int, Any] = {}
    clashes: list[int] = []
    start = threading.Barrier(2)

    def run(k: int) -> None:
        start.wait()
        for _ in range(3000):
            v = pickle.loads(blob)
            x = v.array
            held[k] = x
            if held.get(1 - k) is x:
                clashes.append(k)
            del held[k]
            del x
            v.close()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (switch threads as often as the interpreter can)
    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(100)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    assert clashes == []
    a.close()


def test_releasing_an_allocation_drops_its_kept_native_array() -> None:
    a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    alloc = a.allocation
    native = a.array
    seen = weakref.ref(native)
    del native
    a.close()
    assert alloc.released and seen() is None


class _Modules(dict):  # type: ignore[type-arg]
    """sys.modules that fails a test when walked whole."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("a view's pickling walked every imported module")


def test_a_reduce_hook_runs_once_its_module_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook waiting for a module (api/dask.py's for distributed) costs a pickling a lookup
    per hook, not a walk over sys.modules, and runs once, the first pickling after the module
    is imported by any pickler but multiprocessing's (which distributed never uses)."""
    from sharedarrays.api import array as array_module

    modules = _Modules(sys.modules)
    monkeypatch.setattr(array_module, "sys", types.SimpleNamespace(modules=modules))
    ran: list[int] = []
    monkeypatch.setitem(STATE.pickling.reduce_hooks, "sa_test_awaited", lambda: ran.append(1))
    a = sa.zeros(4, device="cpu", pack=False)
    pickle.dumps(a)
    assert ran == [] and "sa_test_awaited" in STATE.pickling.reduce_hooks
    modules["sa_test_awaited"] = types.ModuleType("sa_test_awaited")
    # multiprocessing's pickler never asks (a Pool's handoff: no lookup of the hooks)
    ForkingPickler.dumps(a)
    assert ran == [] and "sa_test_awaited" in STATE.pickling.reduce_hooks
    pickle.dumps(a)
    pickle.dumps(a)
    assert ran == [1] and "sa_test_awaited" not in STATE.pickling.reduce_hooks


def test_a_part_carries_its_fences_token_once_per_message() -> None:
    """A part pickles with its fence's token itself (not the fence object: no reduction of
    it, no global for it), the same bytes object for every part of one message: written
    once."""
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    b = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    fence = types.SimpleNamespace(token=b"ordering-token-" + b"x" * 17)
    parts = [
        array_module.MessagePart(
            x.allocation, allocation_bytes(x.allocation), fence, None, (os.getpid(), 0)
        )
        for x in (a, b)
    ]
    assert parts[0].__reduce__()[1] == (parts[0].blob, fence.token)
    blob = pickle.dumps(parts)
    assert blob.count(fence.token) == 1
    assert [op.name for op, _, _ in pickletools.genops(blob) if "GLOBAL" in op.name] == [
        "STACK_GLOBAL"
    ]
    loaded = pickle.loads(blob)
    assert [p.token for p in loaded] == [fence.token, fence.token]
    # (the payloads pickled above, counted in flight and never loaded: a's twice, b's once)
    a.allocation.flight.note_loaded(2)
    b.allocation.flight.note_loaded(1)
    assert a.allocation.in_flight()[0] == 0 and b.allocation.in_flight()[0] == 0


def test_a_part_refused_as_another_nodes_keeps_its_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token is spent only by a load that found the allocation: a part refused (another
    node's payload, which distributed's unpickler defers) pickles again with it."""
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    (part, view) = a.__reduce__()[1]
    blob, alloc = part.blob, a.allocation
    alloc.flight.note_loaded()  # (the reduction above counted one in flight: none loads it)
    a.close()
    assert alloc.released  # (not mapped here: the node is asked)
    monkeypatch.setenv("SHAREDARRAYS_NODE", "other-node")
    received = import_part(blob, b"ordering-token")
    with pytest.raises(sa.WrongNode):
        _rebuild_view(received, view)
    assert received.token == b"ordering-token"
    again = pickle.loads(pickle.dumps(received))
    assert again.token == b"ordering-token" and again.blob == blob


def test_a_new_message_never_takes_a_lease_whose_end_is_running(monkeypatch: Any) -> None:
    """A parked import keeps a lease that each new message's first view takes, through the
    allocation (under its lock), never through the weak reference the part keeps to the
    last message's lease: while a lease's end runs (its ``__del__``, here in another thread's
    stead: the import's source released it), that reference still gives the lease back, and
    a view taking it would hold a lease nobody counts, on an allocation released under it."""
    from sharedarrays.backends import get_backend
    from sharedarrays.backends.device import CPU
    from sharedarrays.memory import Allocation

    source = sa.from_array(np.arange(512.0), device="cpu", pack=False)
    fd = os.dup(source.allocation.chunks[0].fd)
    alloc = Allocation.import_(
        get_backend(CPU), "d" * 32, b"q" * 32, source.allocation.chunk_sizes(), [fd], os.getppid()
    )  # (an import of the same memory, as a Pool worker's from its parent)
    blob = array_module.allocation_payload(alloc).to_bytes()
    part = importing.ReceivedPart(Payload.from_bytes(blob), None, None, blob)
    part.bind(alloc)
    process.STATE.pickling.received[blob] = part  # (as its first load leaves it)
    view = source._view_tuple()
    try:
        _rebuild_view(import_part(blob), view).close()  # parked: it keeps a lease
        _rebuild_view(import_part(blob), view).close()  # (a warm handoff: that lease)
        assert alloc.parked and alloc.kept_lease is not None
        made: list[sa.SharedDeviceArray] = []
        real = Allocation._unlease

        def unlease(self: Allocation, end: int) -> None:
            if not made:  # the kept lease is ending: a new message arrives just now
                made.append(_rebuild_view(import_part(blob), view))
            real(self, end)

        monkeypatch.setattr(Allocation, "_unlease", unlease)
        alloc.orphan()  # the source released it: the kept lease is let go, and ends
        monkeypatch.setattr(Allocation, "_unlease", real)
        assert len(made) == 1 and not alloc.released and alloc.view_leases == 1
        assert made[0].get()[5] == 5.0
        made[0].close()  # the last view of an orphaned import: released
        assert alloc.released
    finally:
        process.STATE.pickling.received.pop(blob, None)
        alloc.release()


def test_a_message_of_many_allocations_looks_at_each_part_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (the table of this thread's parts was swept for dead ones at every new part past 256:
    # every part of a message lives while it is pickled, so 10,000 allocations in one
    # message took 50 million lookups, 1.7 s)
    looked = [0]

    class Counted(weakref.ref):  # type: ignore[type-arg]
        def __call__(self) -> Any:
            looked[0] += 1
            return super().__call__()

    monkeypatch.setattr(array_module.weakref, "ref", Counted)
    monkeypatch.setattr(process.STATE.pickling.parts, "refs", {}, raising=False)
    arrays = [sa.full(2, i, dtype="int64", device="cpu", pack=False) for i in range(3000)]
    loaded = pickle.loads(pickle.dumps(arrays))
    assert [int(a[0]) for a in loaded[::1000]] == [0, 1000, 2000]
    assert looked[0] < 10 * len(arrays), looked[0]  # (quadratic: 4 million)
    for a in loaded + arrays:
        a.close()


class _Call:
    """Pickles as ``fn(*args)``: a crafted pickle naming the reconstructor."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


def _craft_values(blob: bytes, view: tuple[Any, ...]) -> Any:
    """Argument tuples for the reconstructor: junk of many shapes, a payload's ``blob``, a
    valid ``view`` tuple, and parts the reconstructor makes with carried junk."""
    from hypothesis import strategies as st

    plain = (
        st.none()
        | st.booleans()
        | st.integers(-3, 2**48)
        | st.text(max_size=4)
        | st.binary(max_size=4)
        | st.just(blob)
        | st.just(view)
        | st.just(0.5)
    )
    fields = st.recursive(
        plain, lambda inner: st.tuples(inner) | st.lists(inner, max_size=6).map(tuple), max_leaves=8
    )
    # a part made by the reconstructor itself (with carried "handles" of any kind)
    parts = st.tuples(st.just(blob), st.none() | st.binary(max_size=2), fields).map(
        lambda args: _Call(_rebuild_view, args)
    )
    return st.lists(fields | parts, max_size=5).map(tuple)


def test_a_crafted_pickle_of_the_view_reconstructor_raises_payload_error() -> None:
    # a pickle naming _rebuild_view with any arguments: a view, a part, or a PayloadError
    # (never AttributeError or TypeError from inside)
    from hypothesis import HealthCheck, given, settings

    a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    blob, view = allocation_bytes(a.allocation), a._view_tuple()

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_craft_values(blob, view))
    def check(args: tuple[Any, ...]) -> None:
        data = pickle.dumps(_Call(_rebuild_view, args))
        try:
            got = pickle.loads(data)
        except sa.PayloadError:
            return
        assert isinstance(got, (sa.SharedDeviceArray, importing.ReceivedPart))
        if isinstance(got, sa.SharedDeviceArray):
            got.close()

    check()
    fds_of_junk = _Call(_rebuild_view, (blob, None, ("x",)))
    for args in [(), (blob, None, None, None), (fds_of_junk, view), (None,)]:
        with pytest.raises(sa.PayloadError):
            pickle.loads(pickle.dumps(_Call(_rebuild_view, args)))
    a.close()


def test_a_misaligned_view_of_device_memory_is_refused_on_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # device memory of the simulated HIP runtime (hip-vmm): the view fields travel beside
    # the payload's tag, so a sender may write any; a misaligned one is a PayloadError before
    # any kernel could read it (cold: the first view of a part; warm: a later view of the
    # layout checked, at another offset)
    from sharedarrays.backends.hip import runtime

    monkeypatch.setenv(runtime.MODULE_SETTING, "simulated.hip")
    a = sa.zeros(4096, "uint8", device="hip:0", pack=False)
    part = message_part(a.allocation, False)
    for dtype in ("<f2", "<f4", "<f8"):
        size = np.dtype(dtype).itemsize
        for view in [
            (1, (4,), (size,), dtype, False),
            (255, (4,), (size,), dtype, False),
            (0, (4,), (2 * size + 1,), dtype, False),
            (0, (4,), (247,), dtype, False),
        ]:
            with pytest.raises(sa.PayloadError, match="misaligned"):
                pickle.loads(pickle.dumps(_Call(_rebuild_view, (part, view))))
        good = (8 * size, (4,), (size,), dtype, False)
        bad = (8 * size + 1, (4,), (size,), dtype, False)
        [v, w] = pickle.loads(
            pickle.dumps([_Call(_rebuild_view, (part, good)), _Call(_rebuild_view, (part, good))])
        )
        assert v.dtype == dtype and v.offset == w.offset == 8 * size
        with pytest.raises(sa.PayloadError, match="misaligned"):  # (the layout checked: warm)
            pickle.loads(
                pickle.dumps(
                    [_Call(_rebuild_view, (part, good)), _Call(_rebuild_view, (part, bad))]
                )
            )
        v.close()
        w.close()
    a.close()


def test_a_misaligned_view_of_device_memory_cannot_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sharedarrays.backends.hip import runtime

    monkeypatch.setenv(runtime.MODULE_SETTING, "simulated.hip")
    a = sa.zeros(64, "uint8", device="hip:0", pack=False)
    with pytest.raises(sa.MisalignedView, match="multiples of 8"):
        a[1:17].view(np.float64)
    with pytest.raises(sa.MisalignedView, match="multiples of 4"):
        sa.SharedDeviceArray(a.allocation, np.dtype(np.float32), (2,), (4,), 2)
    assert a[8:24].view(np.float64).shape == (2,)  # aligned: a view
    h = sa.zeros(64, "uint8", device="cpu", pack=False)
    assert h[1:17].view(np.float64).offset == h.offset + 1  # host memory: as NumPy
    h.close()
    a.close()
