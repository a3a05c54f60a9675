"""The memory layer: allocations, leases, growth, payloads in flight, slabs, reuse.

Per-process state is ``STATE.memory`` (:mod:`sharedarrays.process`). Modules: ``allocation``
(the :class:`Allocation`), ``lease``, ``growth``, ``info`` (what it shows), ``reservation``,
``inflight``, ``cache`` (reuse), ``registry`` (lookup, parked, draining, slabs). Upper layers
import the names re-exported here and subscribe through ``STATE.memory``'s hooks.
"""

from __future__ import annotations

from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.cache import empty_cache
from sharedarrays.memory.growth import DEFAULT_CHUNK_BYTES, MAX_CHUNKS, chunk_sizes, growth_sizes
from sharedarrays.memory.inflight import IN_FLIGHT_SECONDS, Served, in_flight_seconds
from sharedarrays.memory.info import ChunkInfo, MappingInfo, Origin
from sharedarrays.memory.lease import Lease, keep_imports, use_clock
from sharedarrays.memory.registry import (
    PACK_BYTES,
    SLAB_BYTES,
    draining_allocations,
    drop_parked,
    held_elsewhere,
    live_allocations,
    lookup,
    pack_into_slab,
    parked_allocations,
    reap_draining,
    revive,
    wait_draining,
)

__all__ = [
    "Allocation",
    "Lease",
    "draining_allocations",
    "drop_parked",
    "empty_cache",
    "held_elsewhere",
    "keep_imports",
    "live_allocations",
    "lookup",
    "parked_allocations",
    "use_clock",
    "reap_draining",
    "revive",
    "wait_draining",
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNKS",
    "chunk_sizes",
    "growth_sizes",
    "IN_FLIGHT_SECONDS",
    "in_flight_seconds",
    "ChunkInfo",
    "MappingInfo",
    "Origin",
    "Served",
    "PACK_BYTES",
    "SLAB_BYTES",
    "pack_into_slab",
]
