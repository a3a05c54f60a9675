"""Packing small arrays into shared slabs (the current ones are kept in ``STATE.memory``)."""

from __future__ import annotations

from sharedarrays.backends import Backend, round_up
from sharedarrays.memory.allocation import Allocation
from sharedarrays.process import STATE

__all__ = ["PACK_ALIGN", "PACK_BYTES", "SLAB_BYTES", "pack_into_slab"]

PACK_BYTES = 64 << 10
"""Arrays of at most this many bytes are packed into slabs by default (see ``pack=``)."""

SLAB_BYTES = 2 << 20
"""Size of one slab allocation (rounded up to the backend's granularity)."""

PACK_ALIGN = 256
"""Packed arrays start at multiples of this many bytes (CuPy's and cuBLAS's alignment)."""


def pack_into_slab(backend: Backend, nbytes: int) -> tuple[Allocation, int]:
    """Carve ``nbytes`` out of this process's current slab for ``backend``'s device.

    A bump allocator over allocations of :data:`SLAB_BYTES` (space is never reused, so a
    region another process maps never changes owner).

    Returns
    -------
    allocation, offset
        The slab and the byte offset of the new array in it.
    """
    need = round_up(max(nbytes, 1), PACK_ALIGN)
    size = round_up(SLAB_BYTES, backend.granularity)
    if need > size:
        raise ValueError(f"an array of {nbytes} bytes does not fit a {size}-byte slab; pack=False")
    key = (backend.name, backend.device)
    with STATE.memory.slabs_lock:
        current = STATE.memory.slabs.get(key)
        if current is None or current[1] + need > current[0].allocation.size:
            lease = Allocation.create(backend, size).lease()
            lease.allocation.slab = True
            offset = 0
        else:
            lease, offset = current
        STATE.memory.slabs[key] = (
            lease,
            offset + need,
        )  # the previous slab's lease goes here, if replaced
        return lease.allocation, offset
