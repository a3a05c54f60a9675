"""Handing an array's handles to this user's keeper, to name it or park it (``a.park()``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from sharedarrays.errors import HandleUnavailable, NameNotFound
from sharedarrays.memory.allocation import Allocation
from sharedarrays.protocol import keeper as keeper_protocol
from sharedarrays.transport import keeper

if TYPE_CHECKING:
    from sharedarrays.api.array import SharedDeviceArray

__all__ = ["keep", "unpark"]


def keep(a: SharedDeviceArray, name: str | None) -> None:
    """Give ``a``'s handles to the keeper (started if needed), under ``name`` or parked
    (``None``). ValueError for memory the keeper cannot hold; NameExists for a name taken."""
    alloc = a.allocation
    if alloc.backend.exporter_owned:
        raise ValueError(
            f"a {alloc.backend.name} array cannot be named or parked: its memory lives only as "
            "long as the process that made it, and the keeper holds fds, not processes. Make "
            "it with backend='cuda-vmm' (the default where the device supports it)"
        )
    if alloc.growable:
        raise ValueError(
            "a growable array (capacity=) cannot be named or parked: the keeper holds a "
            "fixed set of chunks. Keep its creator running while others load it"
        )
    chunks = alloc.chunk_sizes()
    if len(chunks) > keeper_protocol.MAX_CHUNKS:
        raise ValueError(
            f"the keeper holds arrays of at most {keeper_protocol.MAX_CHUNKS} chunks; this one has "
            f"{len(chunks)} (pass a larger chunk_bytes)"
        )
    doc = a.payload().to_doc()
    allow = None if alloc.allow_pids is None else sorted(alloc.allow_pids)
    req = keeper_protocol.Keep(alloc.id, alloc.secret, name, chunks, doc, allow)
    handles, temporary = alloc.handles_for_importers()  # read-only ones for readonly arrays
    try:
        status, body, fds = keeper.request(req, handles)
    finally:
        for fd in temporary:
            os.close(fd)
    for fd in fds:
        os.close(fd)
    what = f"cannot name the array {name!r}" if name else "cannot park the array"
    keeper.raise_for(status, body, what)
    keeper.hold(alloc.id)
    alloc.in_keeper = True
    alloc.block = None  # (its memory is never reused: the keeper may serve it to anyone)
    if name is not None:
        alloc.keeper_name = name


def unpark(alloc: Allocation) -> None:
    """Let the keeper drop a parked allocation (NameNotFound if it does not hold it)."""
    try:
        status, body, _ = keeper.request(
            keeper_protocol.Unlink(alloc_id=alloc.id, secret=alloc.secret), start=False
        )
    except HandleUnavailable:
        raise NameNotFound(f"allocation {alloc.id} is not parked: no keeper runs") from None
    keeper.raise_for(status, body, f"cannot unpark allocation {alloc.id}")
    alloc.in_keeper = False
