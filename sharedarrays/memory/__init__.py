"""The memory layer: allocations, leases, growth, payloads in flight, slabs, reuse. Its state
is ``STATE.memory``, whose hooks upper layers subscribe to."""

from __future__ import annotations

from sharedarrays.memory.allocation import Allocation as Allocation
from sharedarrays.memory.cache import empty_cache as empty_cache
from sharedarrays.memory.growth import DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES
from sharedarrays.memory.growth import chunk_sizes as chunk_sizes
from sharedarrays.memory.growth import growth_sizes as growth_sizes
from sharedarrays.memory.inflight import Served as Served
from sharedarrays.memory.info import ChunkInfo as ChunkInfo
from sharedarrays.memory.info import MappingInfo as MappingInfo
from sharedarrays.memory.info import Origin as Origin
from sharedarrays.memory.lease import Lease as Lease
from sharedarrays.memory.registry import PACK_BYTES as PACK_BYTES
from sharedarrays.memory.registry import SLAB_BYTES as SLAB_BYTES
from sharedarrays.memory.registry import drop_parked as drop_parked
from sharedarrays.memory.registry import live_allocations as live_allocations
from sharedarrays.memory.registry import lookup as lookup
from sharedarrays.memory.registry import pack_into_slab as pack_into_slab
from sharedarrays.memory.registry import parked_allocations as parked_allocations
from sharedarrays.memory.registry import reap_draining as reap_draining
