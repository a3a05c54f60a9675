"""This process's allocations (``STATE.memory``): look them up, list them, drop or free those
nothing uses, and pack small arrays into slabs."""

from __future__ import annotations

import time
from typing import cast

from sharedarrays.backends import Backend, round_up
from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.cache import settle_draining
from sharedarrays.process import STATE, running

PACK_BYTES = 64 << 10
"""Arrays of at most this many bytes are packed into slabs by default (see ``pack=``)."""
SLAB_BYTES = 2 << 20
"""Size of one slab allocation (rounded up to the backend's granularity)."""
PACK_ALIGN = 256
"""Packed arrays start at multiples of this many bytes (CuPy's and cuBLAS's alignment)."""


def lookup(alloc_id: str, draining: bool = False) -> Allocation | None:
    """This process's allocation ``alloc_id``, if mapped (``draining``: or draining)."""
    alloc = STATE.memory.registry.get(alloc_id)
    if alloc is None and draining:
        alloc = STATE.memory.draining.get(alloc_id)
    return cast("Allocation | None", alloc)


def revive(alloc_id: str) -> Allocation | None:
    """Put a draining allocation back in the registry (a payload came back to its exporter,
    which cannot import its own memory); it, or ``None``."""
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
    return sorted(parked, key=lambda a: a.last_used)


def drop_parked(only_orphans: bool = False) -> int:
    """Release parked allocations (``only_orphans``: of gone sources); how many it released."""
    victims = [a for a in parked_allocations() if not only_orphans or not running(a.origin.pid)]
    return sum(a.release() for a in victims)


def draining_allocations() -> list[Allocation]:
    """Allocations released here but not freed yet, as others may still need them."""
    with STATE.memory.lock:
        return list(STATE.memory.draining.values())


def reap_draining() -> int:
    """Free the draining allocations whose holders all closed or exited; how many are left."""
    settle_draining()
    for alloc in draining_allocations():
        alloc.closed_by(None)
    with STATE.memory.lock:
        return len(STATE.memory.draining)


def held_elsewhere() -> list[Allocation]:
    """Exporter-owned allocations made here that other running processes still hold."""
    with STATE.memory.lock:
        mine = [a for a in STATE.memory.registry.values() if a.origin.created_here]
        mine += STATE.memory.draining.values()
    return [a for a in mine if a.backend.exporter_owned and (a.holders or a.busy())]


def wait_draining(timeout: float) -> list[Allocation]:
    """Wait up to ``timeout`` seconds for others to let go of memory made here; those held."""
    deadline = time.monotonic() + timeout
    while True:
        reap_draining()
        held = held_elsewhere()
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(0.05)


def pack_into_slab(backend: Backend, nbytes: int) -> tuple[Allocation, int]:
    """The current slab for ``backend``'s device and the offset of ``nbytes`` carved out of it
    (a bump allocator: a region never changes owner)."""
    need = round_up(max(nbytes, 1), PACK_ALIGN)
    size = round_up(SLAB_BYTES, backend.granularity)
    if need > size:
        raise ValueError(f"an array of {nbytes} bytes does not fit a {size}-byte slab; pack=False")
    key = (backend.name, backend.device)
    with STATE.memory.slabs_lock:
        current = STATE.memory.slabs.get(key)
        if current is None or current[1] + need > current[0].allocation.size:
            lease = Allocation.create(backend, size).lease()
            lease.allocation.drop_block()  # (its room is never reused either)
            STATE.memory.packed.add(lease.allocation)
            offset = 0
        else:
            lease, offset = current
        # (the previous slab's lease goes here, if replaced)
        STATE.memory.slabs[key] = (lease, offset + need)
        return lease.allocation, offset
