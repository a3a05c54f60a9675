"""A growable array's importer catching up with its exporter: the chunks added since it
mapped them, and the length (:func:`catch_up`), asked of the exporter's handle server."""

from __future__ import annotations

from sharedarrays.errors import PayloadError
from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.reservation import close_fds
from sharedarrays.protocol.payload import Payload
from sharedarrays.transport import client
from sharedarrays.transport import handles as transport


def shrunk(alloc_id: str) -> PayloadError:
    return PayloadError(
        f"allocation {alloc_id} was shrunk since this payload was made; pickle the array again"
    )


def catch_up_to(alloc: Allocation, p: Payload, received: list[int]) -> Allocation:
    """``alloc``, a growable array mapped here, with at least the chunks ``p`` names: new
    ones mapped from ``received`` (the carried fds, taken) if any, else from its exporter."""
    with alloc.growth_lock:
        local = alloc.chunk_sizes()
        n = len(p.chunks)
        if (
            not alloc.growable
            or alloc.backend.name != p.backend
            or list(p.chunks[: len(local)]) != local[:n]
        ):
            close_fds(received)
            raise PayloadError(f"payload does not match allocation {p.alloc_id} mapped here")
        if n <= len(local) or alloc.origin.created_here:
            close_fds(received)
            if n > len(local):  # (its exporter has fewer chunks than the payload names)
                raise shrunk(p.alloc_id)
            return alloc  # the same or an older generation: all mapped already
        if received:
            close_fds(received[: len(local)])
            alloc.extend(list(p.chunks[len(local) :]), received[len(local) :], p.capacity or 0)
        else:
            _fetch_growth(alloc, p.server, p.pid, local)
        return alloc


def catch_up(alloc: Allocation) -> None:
    """Map the chunks the exporter of ``alloc`` (a growable import) added since, and take its
    length (``alloc.used``); PayloadError where that cannot be done."""
    server = alloc.source_server
    if server is None:  # (inherited through fork: every growable import sets it)
        raise PayloadError(
            f"allocation {alloc.id} does not know its exporter's handle server: this process "
            f"inherited it through fork from pid {alloc.origin.pid}; load a new payload of "
            "it (pickled there) to see its current length"
        )
    with alloc.growth_lock:
        _fetch_growth(alloc, server, alloc.origin.pid, alloc.chunk_sizes())


def _fetch_growth(alloc: Allocation, server: str, pid: int, local: list[int]) -> None:
    """Map the exporter's chunks beyond ``local`` and take its length (under the growth lock)."""
    sizes, capacity, used, fds = client.fetch_growth(
        server, pid, alloc.id, alloc.secret, len(local), reply_to=transport.server_address()
    )
    if sizes[: len(local)] != local:
        close_fds(fds)
        raise PayloadError(
            f"allocation {alloc.id} was shrunk and grown again since this process mapped it "
            "(its chunks differ); close its views here and load a new payload"
        )
    if len(sizes) > len(local):
        alloc.extend(sizes[len(local) :], fds, capacity)
    else:
        close_fds(fds)
    alloc.used = used
