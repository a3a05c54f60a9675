"""The memory layer's section of the one process-state object (``STATE.memory``)."""

from __future__ import annotations

import ast
import gc
import os
from pathlib import Path
from typing import Any

import numpy as np
from forking import in_forked_child

import sharedarrays as sa
from sharedarrays.backends import get_backend
from sharedarrays.backends.device import CPU
from sharedarrays.memory import Allocation, drop_parked, lookup, parked_allocations
from sharedarrays.process import STATE

MEMORY = Path(__file__).resolve().parents[2] / "sharedarrays" / "memory"


def _import_of(source: sa.SharedDeviceArray, alloc_id: str, origin: int) -> Allocation:
    """An import in this process of ``source``'s memory, as if from process ``origin``."""
    fd = os.dup(source.allocation.chunks[0].fd)
    return Allocation.import_(
        get_backend(CPU), alloc_id, b"q" * 32, source.allocation.chunk_sizes(), [fd], origin
    )


def test_a_forked_child_starts_with_a_reset_state() -> None:
    drop_parked()  # (what earlier tests in this process left parked: this test counts its own)
    parent = os.getpid()
    exported = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    growable = sa.zeros(8, device="cpu", capacity=1 << 20)
    packed = sa.zeros(4, device="cpu")  # in a slab
    source = sa.from_array(np.arange(512.0), device="cpu", pack=False)
    parked_id = "4" * 32
    imported = _import_of(source, parked_id, parent)
    sa.SharedDeviceArray(imported, source.dtype, source.shape, source.strides, 0).close()
    del imported
    gc.collect()
    assert [a.id for a in parked_allocations()] == [parked_id]
    draining_id = "5" * 32
    STATE.memory.draining[draining_id] = (
        object()
    )  # (a stand-in: only the child's copy is looked at)
    e = exported.allocation
    locks = (id(STATE.memory.lock), id(STATE.memory.slabs_lock), id(e._lock), id(e.flight))
    hooks = (len(STATE.memory.release_hooks), len(STATE.memory.hand_over_hooks))
    assert STATE.memory.slabs

    def child() -> dict[str, Any]:
        e, g = exported.allocation, growable.allocation
        return {
            "locks_new": [
                id(x) != old
                for x, old in zip(
                    (STATE.memory.lock, STATE.memory.slabs_lock, e._lock, e.flight), locks
                )
            ],
            "slabs": len(STATE.memory.slabs),
            "inherited_slab": any(
                isinstance(i, tuple) and i[0].allocation is packed.allocation
                for i in STATE.memory.inherited
            ),
            "inherited_parked": any(
                getattr(i, "id", None) == parked_id for i in STATE.memory.inherited
            ),
            "parked": [a.id for a in parked_allocations()],
            "parked_registered": lookup(parked_id) is not None,
            "draining": list(STATE.memory.draining),
            "exported": [e.origin.created_here, e.origin.pid, e.pid, lookup(e.id) is e],
            "growable": [g.origin.created_here, g.pid],
            "data": exported.get().tolist(),
            "hooks": [len(STATE.memory.release_hooks), len(STATE.memory.hand_over_hooks)],
            "new_slab": sa.zeros(4, device="cpu").allocation is not packed.allocation,
        }

    try:
        out = in_forked_child(child)
    finally:
        del STATE.memory.draining[draining_id]
    assert out["locks_new"] == [True, True, True, True]  # and a new record of payloads
    assert out["slabs"] == 0 and out["inherited_slab"]
    assert out["parked"] == [] and not out["parked_registered"] and out["inherited_parked"]
    assert out["draining"] == []
    # a host allocation made here: the child's own import from its parent
    assert out["exported"][:2] == [False, parent] and out["exported"][2] != parent
    assert out["exported"][3]
    # growable: still the parent's (its pid), which alone may resize it (not created here)
    assert out["growable"] == [False, parent]
    assert out["data"] == list(np.arange(8.0))
    assert out["hooks"] == list(hooks)  # subscriptions are the modules', which the child has
    assert out["new_slab"]  # a small array in the child never shares the parent's slab
    # the parent is untouched
    assert STATE.memory.slabs and lookup(parked_id) is not None
    assert exported.allocation.origin.created_here and exported.allocation.pid == parent
    assert id(STATE.memory.lock) == locks[0]
    assert drop_parked() == 1


def test_no_module_globals_of_state_in_memory() -> None:
    """No module of memory/ assigns a container or a lock to a module global: its state is
    ``STATE.memory`` (sharedarrays/process.py)."""
    makers = {"dict", "list", "set", "OrderedDict", "deque", "Lock", "RLock", "defaultdict"}
    found = []
    for path in sorted(MEMORY.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                continue
            value = node.value
            if isinstance(value, ast.Call):
                func = value.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name in makers:
                    found.append(f"{path.name}:{node.lineno}")
            elif isinstance(value, (ast.Dict, ast.List, ast.Set)):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_a_parked_import_leased_again_is_not_parked_until_idle(monkeypatch: Any) -> None:
    """Parked imports are listed in least-recently-idle order; one leased again stays listed
    (a lease does not touch the list) but is not parked: not reported, not dropped, and an
    eviction takes it off the list without releasing it."""

    monkeypatch.setattr(STATE.memory, "keep_imports", (float("inf"), 1))  # limit 1
    source = sa.from_array(np.arange(512.0), device="cpu", pack=False)
    first = _import_of(source, "6" * 32, os.getppid())  # (as a worker's, from its parent)
    second = _import_of(source, "7" * 32, os.getppid())
    try:
        view = sa.SharedDeviceArray(first, source.dtype, source.shape, source.strides, 0)
        view.close()
        assert first.parked and [a.id for a in parked_allocations()] == [first.id]
        view = sa.SharedDeviceArray(first, source.dtype, source.shape, source.strides, 0)
        assert first.id in STATE.memory.parked  # (still listed)
        assert not first.parked and parked_allocations() == []
        assert drop_parked() == 0 and not first.released
        assert in_forked_child(lambda: lookup("6" * 32) is not None)  # in use: the child's too
        other = sa.SharedDeviceArray(second, source.dtype, source.shape, source.strides, 0)
        other.close()  # parked: the limit's eviction passes the first, leased: taken off
        assert [a.id for a in parked_allocations()] == [second.id]
        assert first.id not in STATE.memory.parked and not first.released
        assert view.get()[5] == 5.0
        view.close()  # idle again: parked, and the second evicted (released)
        assert [a.id for a in parked_allocations()] == [first.id]
        assert second.released and not first.released
    finally:
        drop_parked()
    assert first.released and second.released


def test_a_parked_import_keeps_a_lease_for_its_next_view_and_the_limit_evicts_by_last_use(
    monkeypatch: Any,
) -> None:
    """Parked, an import keeps a lease that its next view takes: a warm handoff makes and
    ends no lease and leaves the list alone, and the import is parked again when the view
    goes. The parked list is in order of last use, and a park over the limit (lowered since)
    evicts the least recently used. An import whose source is this process's parent parks
    (``getppid`` says it runs); one whose source has exited is released at once."""

    monkeypatch.setattr(STATE.memory, "keep_imports", (float("inf"), 2))
    source = sa.from_array(np.arange(512.0), device="cpu", pack=False)
    first = _import_of(source, "8" * 32, os.getppid())
    second = _import_of(source, "9" * 32, os.getppid())
    third = _import_of(source, "4" * 32, os.getppid())
    gone = _import_of(source, "5" * 32, in_forked_child(os.getpid))  # (exited by now)

    def handoff(alloc: Allocation) -> None:
        sa.SharedDeviceArray(alloc, source.dtype, source.shape, source.strides, 0).close()

    try:
        handoff(first)
        handoff(second)
        assert [a.id for a in parked_allocations()] == [first.id, second.id]
        # (a reference held here, pytest's asserts' too, would be a holder: only ids and
        # counts are kept)
        kept, leases, view_leases = id(first.kept_lease), first.leases, first.view_leases
        assert kept != id(None) and (leases, view_leases) == (0, 0)
        view = sa.SharedDeviceArray(first, source.dtype, source.shape, source.strides, 0)
        assert id(view._lease) == kept and first.leases == 1 and not first.parked
        assert [a.id for a in parked_allocations()] == [second.id]  # (in use: not parked)
        view.close()  # parked again, no lease ended; now the most recently used
        again, leases = id(first.kept_lease), first.leases
        assert again == kept and leases == 0 and first.parked
        assert [a.id for a in parked_allocations()] == [second.id, first.id]
        monkeypatch.setattr(STATE.memory, "keep_imports", (float("inf"), 1))
        handoff(first)  # (a warm handoff does not evict: the next park does)
        assert not second.released
        handoff(third)  # over the lowered limit: the least recently used two go
        assert [a.id for a in parked_allocations()] == [third.id]
        assert second.released and first.released and not third.released
        handoff(gone)
        assert gone.released and gone.id not in STATE.memory.parked
    finally:
        drop_parked()
    assert third.released


def test_an_import_orphaned_or_released_while_parked_lets_its_kept_lease_go() -> None:
    """The source's release notice (``orphan``) releases a parked import at once, and one
    whose kept lease a view holds when that view goes; a release of a parked import lets
    the kept lease go with it."""
    source = sa.from_array(np.arange(512.0), device="cpu", pack=False)
    parked = _import_of(source, "a" * 32, os.getppid())
    held = _import_of(source, "b" * 32, os.getppid())
    dropped = _import_of(source, "c" * 32, os.getppid())

    def view(alloc: Allocation) -> sa.SharedDeviceArray:
        return sa.SharedDeviceArray(alloc, source.dtype, source.shape, source.strides, 0)

    try:
        for alloc in (parked, held, dropped):
            view(alloc).close()
            kept = alloc.kept_lease is not None
            assert alloc.parked and kept
        parked.orphan()
        assert parked.released and parked.kept_lease is None
        in_use = view(held)  # (the kept lease)
        held.orphan()
        assert not held.released and held.kept_lease is None
        assert in_use.get()[3] == 3.0
        in_use.close()
        assert held.released
        assert dropped.release() and dropped.released and dropped.kept_lease is None
    finally:
        drop_parked()


def test_a_lease_to_keep_is_made_outside_the_lock_and_not_kept_if_orphaned_meanwhile(
    monkeypatch: Any,
) -> None:
    """Parking counts the lease it keeps under the allocation's lock and makes it outside
    (making an object may start a collection, whose end of another lease would take the
    lock): the lock is free while the lease is made. Where the source's release notice
    comes in between, the lease is not kept: it ends at once and the import is released."""
    from sharedarrays.memory import lease as lease_module

    source = sa.from_array(np.arange(512.0), device="cpu", pack=False)
    alloc = _import_of(source, "e" * 32, os.getppid())
    made: list[bool] = []
    real = lease_module.Lease

    class Watched(real):  # type: ignore[misc, valid-type]
        __slots__ = ()

        def __init__(self, allocation: Allocation, end: int, reservation: Any = None) -> None:
            if allocation is alloc and end == alloc.size and reservation is None and made:
                # the lease to keep, after the view's: the lock is free; the notice comes now
                free = allocation._lock.acquire(blocking=False)
                if free:
                    allocation._lock.release()
                made.append(free)
                if free:  # (held, this thread would wait on it for ever)
                    alloc.orphan()
            else:
                made.append(True)
            super().__init__(allocation, end, reservation)

    monkeypatch.setattr(lease_module, "Lease", Watched)
    try:
        sa.SharedDeviceArray(alloc, source.dtype, source.shape, source.strides, 0).close()
        assert made == [True, True]  # the view's lease, then the one to keep (lock free)
        assert alloc.released and alloc.kept_lease is None and alloc.leases == 0
        assert alloc.id not in STATE.memory.parked
    finally:
        monkeypatch.setattr(lease_module, "Lease", real)
        alloc.release()
