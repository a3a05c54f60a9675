"""The registry's readers: this process's allocations, by id, parked and draining.

The registry itself is process state (``STATE.memory``: ``registry``, ``parked``,
``draining``); :class:`~sharedarrays.memory.allocation.Allocation` fills and empties it (it
registers itself when made, and leaves it when released). These functions look an
allocation up (:func:`lookup`, :func:`revive`), list them (:func:`live_allocations`,
:func:`parked_allocations`, :func:`draining_allocations`, :func:`held_elsewhere`) and drop
or free those nothing uses (:func:`drop_parked`, :func:`reap_draining`,
:func:`wait_draining`, at exit).
"""

from __future__ import annotations

import time
from typing import cast

from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.cache import settle_draining
from sharedarrays.memory.lease import _last_used
from sharedarrays.process import STATE, running

__all__ = [
    "draining_allocations",
    "drop_parked",
    "held_elsewhere",
    "live_allocations",
    "lookup",
    "parked_allocations",
    "reap_draining",
    "revive",
    "wait_draining",
]


def lookup(alloc_id: str, draining: bool = False) -> Allocation | None:
    """Return this process's mapped allocation with id ``alloc_id``, if any (``draining``:
    also one released here but still held by other processes, see
    :func:`draining_allocations`)."""
    alloc = STATE.memory.registry.get(alloc_id)
    if alloc is None and draining:
        alloc = STATE.memory.draining.get(alloc_id)
    return cast("Allocation | None", alloc)


def revive(alloc_id: str) -> Allocation | None:
    """Put a draining allocation made here back in the registry and return it (``None`` if
    none drains under that id): a payload of it came back to its exporter, which maps it
    still (a pointer backend cannot import its own memory)."""
    with STATE.memory.lock:
        alloc: Allocation | None = STATE.memory.draining.pop(alloc_id, None)
        if alloc is not None:
            with alloc._lock:
                alloc.released = False
            STATE.memory.registry[alloc_id] = alloc
    return alloc


def live_allocations() -> list[Allocation]:
    """Every allocation currently mapped in this process (parked ones too), oldest first."""
    with STATE.memory.lock:
        allocs: list[Allocation] = list(STATE.memory.registry.values())
    return sorted(allocs, key=lambda a: a.origin.time)


def parked_allocations() -> list[Allocation]:
    """Imported allocations kept mapped with no live view, least recently used first."""
    with STATE.memory.lock:
        parked = [a for a in STATE.memory.parked.values() if a.parked]
    return sorted(parked, key=_last_used)


def drop_parked(only_orphans: bool = False) -> int:
    """Release parked allocations: all of them, or only those whose source process is gone.

    Returns how many were released.
    """
    with STATE.memory.lock:
        victims: list[Allocation] = [
            a
            for a in STATE.memory.parked.values()
            if a.parked and (not only_orphans or not running(a.origin.pid))
        ]
    return sum(a.release() for a in victims)


def draining_allocations() -> list[Allocation]:
    """Allocations of exporter-owned memory (cuda-ipc, cuda-pool) that this process released
    but cannot free yet: other processes still hold them (see :attr:`Allocation.holders`);
    and growable allocations released here with payloads in flight (see
    :meth:`Allocation.release`)."""
    with STATE.memory.lock:
        return list(STATE.memory.draining.values())


def reap_draining() -> int:
    """Free the draining allocations whose holders have all closed or exited.

    Returns how many are still waiting.
    """
    settle_draining()
    for alloc in draining_allocations():
        alloc.closed_by(None)
    with STATE.memory.lock:
        return len(STATE.memory.draining)


def held_elsewhere() -> list[Allocation]:
    """Exporter-owned allocations made here (live or draining) that other running processes
    still hold (see :attr:`Allocation.holders`)."""
    with STATE.memory.lock:
        mine: list[Allocation] = [
            a for a in STATE.memory.registry.values() if a.origin.created_here
        ]
        mine += STATE.memory.draining.values()
    return [a for a in mine if a.backend.exporter_owned and (a.holders or a.busy())]


def wait_draining(timeout: float) -> list[Allocation]:
    """Wait up to ``timeout`` seconds until no other process holds exporter-owned memory
    made here, freeing draining allocations as their holders go (used at exit).

    Returns those still held afterwards.
    """
    deadline = time.monotonic() + timeout
    while True:
        reap_draining()
        held = held_elsewhere()
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(0.05)
