"""The exporter's cache of released memory for its next arrays of the same sizes, reused once
every importer said ``DONE`` (importers find their parked mappings by the *block* token);
bounded by ``SHAREDARRAYS_CACHE_BYTES``, emptied when memory or fds run out and at exit."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from sharedarrays.process import STATE, at_exit, at_fork
from sharedarrays.settings import env_number

Allocation = Any  # (memory.allocation imports this module)

CACHE_BYTES = 4 << 30
"""Default bound on the bytes one process keeps cached (``SHAREDARRAYS_CACHE_BYTES``)."""
CACHE_BLOCKS = 64
"""Bound on the allocations one process keeps cached (each holds its chunks' fds open)."""


def cache_bytes() -> int:
    """The bytes this process may keep cached: ``SHAREDARRAYS_CACHE_BYTES`` (default 4 GiB)."""
    return env_number("SHAREDARRAYS_CACHE_BYTES", CACHE_BYTES, 0)


def empty_cache() -> int:
    """Free the memory this process keeps for reuse; returns the bytes freed."""
    return int(STATE.memory.cache.trim())


def block_id(block: bytes) -> str:
    """The id a notice names a block by (its secret is the token itself)."""
    return block[:16].hex()


class ChunkCache:
    """Released allocations made here, kept for reuse, least recently released first."""

    def __init__(self) -> None:
        self.hits = 0  # (arrays made on kept memory)
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, Allocation] = OrderedDict()
        self.nbytes = 0

    def put(self, alloc: Allocation) -> bool:
        """Keep ``alloc``, freeing the oldest over the bound; whether it was kept."""
        limit = cache_bytes()
        if alloc.capacity > limit or alloc.block is None:
            return False
        with self._lock:
            self._kept[alloc.block] = alloc
            self.nbytes += alloc.capacity
            over = self._over(limit)
        for old in over:
            old.free_cached()
        return True

    def take(self, backend_name: str, device: object, sizes: list[int]) -> Allocation | None:
        """Take out the latest kept allocation matching backend, device and sizes, or ``None``."""
        key, wanted = (backend_name, device), tuple(sizes)
        with self._lock:
            for block, alloc in reversed(self._kept.items()):
                if (alloc.backend.name, alloc.device) == key and alloc.has_chunk_sizes(wanted):
                    del self._kept[block]
                    self.nbytes -= alloc.capacity
                    self.hits += 1
                    return alloc
        return None

    def trim(self) -> int:
        """Free all that is kept; returns the bytes freed."""
        with self._lock:
            freed, over = self.nbytes, self._over(0)
        for alloc in over:
            alloc.free_cached()
        return freed

    def drop(self, alloc_id: str) -> bool:
        """Free the kept allocation whose last id was ``alloc_id``; whether one was kept."""
        with self._lock:
            gone = [self._kept.pop(b) for b, a in list(self._kept.items()) if a.id == alloc_id]
            self.nbytes -= sum(a.capacity for a in gone)
        for alloc in gone:
            alloc.free_cached()
        return bool(gone)

    def kept(self) -> list[Allocation]:
        """The kept allocations, oldest first (for ``describe`` and the widgets)."""
        with self._lock:
            return list(self._kept.values())

    def _over(self, limit: int) -> list[Allocation]:
        over = []
        while self._kept and (self.nbytes > limit or len(self._kept) > CACHE_BLOCKS):
            _, alloc = self._kept.popitem(last=False)
            self.nbytes -= alloc.capacity
            over.append(alloc)
        return over


STATE.memory.cache = ChunkCache()


DONE_WAIT = 1.0
"""Seconds a released, fully loaded block waits for ``DONE`` before it is freed instead."""


def settle_draining(at_exit: bool = False) -> None:
    """Cache draining blocks whose importers are all done; free those that waited too long
    (``at_exit``: all)."""
    with STATE.memory.lock:
        waiting = [
            a for a in STATE.memory.draining.values() if a.block is not None and a.cacheable()
        ]
    now = time.monotonic()
    for alloc in waiting:
        undone, _ = alloc.flight.undone()
        held = alloc.busy() or now < alloc.released_at + DONE_WAIT
        if undone and held and not at_exit:
            continue
        with alloc.growth_lock:
            with STATE.memory.lock:
                if STATE.memory.draining.pop(alloc.id, None) is not alloc:
                    continue
            if at_exit or not alloc.flight.all_done() or not STATE.memory.cache.put(alloc):
                alloc.free_cached()


def _release_at_exit() -> None:
    settle_draining(at_exit=True)
    STATE.memory.cache.trim()


def _keep_inherited_memory_from_reuse() -> None:
    # (before fork) a forked child inherits the host memory of this process's views, and
    # nobody can ask it for DONE: that memory is never reused (CUDA's is unusable there)
    with STATE.memory.lock:
        allocs = [a for a in STATE.memory.registry.values() if not a.device.needs_context]
    for alloc in allocs:
        if alloc.view_leases:
            alloc.drop_block()


at_exit(_release_at_exit, "memory")
at_fork("memory", before=_keep_inherited_memory_from_reuse)
