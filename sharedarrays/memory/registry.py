"""The registry's readers: this process's allocations, by id, parked and draining.

The registry lives in ``STATE.memory``; allocations add and remove themselves. These
functions look allocations up, list them, and drop or free those nothing uses.
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
    """This process's allocation ``alloc_id``, if mapped (``draining``: or draining)."""
    alloc = STATE.memory.registry.get(alloc_id)
    if alloc is None and draining:
        alloc = STATE.memory.draining.get(alloc_id)
    return cast("Allocation | None", alloc)


def revive(alloc_id: str) -> Allocation | None:
    """Put a draining allocation back in the registry and return it, or ``None``.

    For a payload come back to its exporter (a pointer backend cannot import its own memory)."""
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
    """Allocations released here but not freed yet, as others may still need them."""
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
    """Exporter-owned allocations made here that other running processes still hold."""
    with STATE.memory.lock:
        mine: list[Allocation] = [
            a for a in STATE.memory.registry.values() if a.origin.created_here
        ]
        mine += STATE.memory.draining.values()
    return [a for a in mine if a.backend.exporter_owned and (a.holders or a.busy())]


def wait_draining(timeout: float) -> list[Allocation]:
    """Wait up to ``timeout`` seconds for other processes to let go of memory made here.

    Returns those still held afterwards.
    """
    deadline = time.monotonic() + timeout
    while True:
        reap_draining()
        held = held_elsewhere()
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(0.05)
