"""Growable arrays: resize, append and refresh without copying, seen by every process.

An array made with ``capacity=`` (see :func:`sharedarrays.empty`) has an allocation whose
reservation is larger than its chunks: growing maps new chunks at the end of the
reservation (:meth:`Allocation.grow`), so existing data and addresses never change and
nothing is copied; shrinking unmaps whole chunks past the new end
(:meth:`Allocation.shrink`). Growth beyond the capacity moves the allocation to a larger
reservation (the same chunks mapped again, still no copy).

Only the exporter resizes. A payload of a growable array names its exporter (whoever
pickles it) and carries the allocation's chunk list at that moment, its *generation*. An
importer that maps fewer chunks than a payload names fetches the missing ones from the
exporter's handle server (:func:`sharedarrays.transport.handles.fetch_growth`) before it makes the
view, so a view never reaches an unmapped hole; :func:`refresh` asks the exporter for the
current length on demand.

The exporter remembers how many chunks it served to each process; it refuses to unmap
chunks that a still-running process was served (an importer keeps its mapping, parked or
not, until it exits).
"""

from __future__ import annotations

import operator
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from sharedarrays.backends import Access, get_backend
from sharedarrays.backends.device import CPU, Device
from sharedarrays.errors import PayloadError, ResizeRefused
from sharedarrays.memory import Allocation
from sharedarrays.protocol.payload import Payload, contiguous_strides, view_extent
from sharedarrays.transport import handles as transport

if TYPE_CHECKING:
    from sharedarrays.api.array import SharedDeviceArray

__all__ = ["resize", "append", "refresh", "map_payload"]


def _row_bytes(view: SharedDeviceArray, what: str) -> tuple[Allocation, int]:
    """The allocation and the bytes per row of a view that may change its length."""
    alloc = view.allocation
    if not alloc.growable:
        raise ValueError(
            f"cannot {what} an array made without capacity=: only arrays created with "
            "sa.empty(..., capacity=...) (or zeros/full/from_array with capacity=) can grow"
        )
    if view.ndim == 0:
        raise ValueError(f"cannot {what} a 0-d array")
    if view.offset != 0 or view.strides != contiguous_strides(view.shape, view.itemsize):
        raise ValueError(
            f"cannot {what} this view: only a C-contiguous view that starts at the "
            "allocation's first byte (the array as created, or a[:k]) changes length along "
            f"axis 0; this one has offset {view.offset} and strides {view.strides}"
        )
    row = view.itemsize
    for n in view.shape[1:]:
        row *= n
    if row == 0:
        raise ValueError(f"cannot {what} an array whose rows hold no bytes")
    return alloc, row


def _set_length(view: SharedDeviceArray, length: int) -> None:
    """Give ``view`` ``length`` rows: a new lease reaching its new end, no cached native
    array or payload."""
    alloc = view.allocation
    shape = (length, *view.shape[1:])
    _, high = view_extent(view.itemsize, shape, view.strides)
    lease = alloc.lease(view.offset + high)
    view._shape = shape
    view._native = None
    view._encoded = None
    view._lease = lease


def resize(view: SharedDeviceArray, length: int) -> None:
    """Implement :meth:`SharedDeviceArray.resize`."""
    if isinstance(length, (bool, np.bool_)):
        raise TypeError("a bool is not a valid length")
    n = operator.index(length)
    if n < 0:
        raise ValueError(f"a length is not negative, got {n}")
    alloc, row = _row_bytes(view, "resize")
    if not alloc.origin.created_here:
        raise ResizeRefused(
            f"only the process that created a growable array resizes it; this one imported "
            f"it from pid {alloc.origin.pid}. Call a.refresh() to see its current length"
        )
    nbytes = n * row
    with alloc.growth_lock:
        if nbytes > alloc.size:
            alloc.grow(nbytes)
        elif n < view.shape[0]:
            view._native = None  # its lease reaches the old end
            lease = view._lease
            alloc.shrink(nbytes, exclude=lease)
        alloc.used = nbytes
        _set_length(view, n)


def append(view: SharedDeviceArray, values: Any) -> None:
    """Implement :meth:`SharedDeviceArray.append`."""
    alloc, _ = _row_bytes(view, "append to")
    if view.readonly:
        raise ValueError("this SharedDeviceArray is read-only")
    src = alloc.backend.to_native(values)
    if src.ndim == view.ndim - 1:
        src = src.reshape((1, *src.shape))
    if src.ndim != view.ndim or tuple(src.shape[1:]) != view.shape[1:]:
        raise ValueError(
            f"cannot append values of shape {tuple(src.shape)} to an array of shape "
            f"{view.shape}: give one row of shape {view.shape[1:]} or rows of shape "
            f"(k, {', '.join(map(str, view.shape[1:]))})".replace(", )", ")")
        )
    start = view.shape[0]
    resize(view, start + src.shape[0])
    try:
        view.array[start:] = src
    except BaseException:
        resize(view, start)
        raise


def refresh(view: SharedDeviceArray) -> None:
    """Implement :meth:`SharedDeviceArray.refresh`."""
    alloc, row = _row_bytes(view, "refresh")
    if not alloc.origin.created_here:
        server = alloc.source_server
        if server is None:  # pragma: no cover - every growable import sets it
            raise PayloadError(f"allocation {alloc.id} does not know its exporter")
        with alloc.growth_lock:
            local = alloc.chunk_sizes()
            sizes, capacity, used, fds = transport.fetch_growth(
                server,
                alloc.origin.pid,
                alloc.id,
                alloc.secret,
                len(local),
                reply_to=transport.server_address(),
            )
            _catch_up(alloc, local, sizes, capacity, fds)
            alloc.used = used
    _set_length(view, min(alloc.used, alloc.size) // row)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _catch_up(
    alloc: Allocation, local: list[int], sizes: list[int], capacity: int, fds: list[int]
) -> None:
    """Map the chunks an exporter reported beyond those mapped here (takes ``fds``)."""
    if sizes[: len(local)] != local:
        _close(fds)
        raise PayloadError(
            f"allocation {alloc.id} was shrunk and grown again since this process mapped it "
            "(its chunks differ); close its views here and load a new payload"
        )
    if len(sizes) > len(local):
        alloc.extend(sizes[len(local) :], fds, capacity)
    else:
        _close(fds)


def map_payload(alloc: Allocation | None, p: Payload, received: list[int]) -> Allocation:
    """The allocation of a growable array's payload, mapped here with at least the chunks
    the payload names (takes ownership of ``received``, fds that travelled with it).

    ``alloc`` is this process's mapping of it, if any: one with fewer chunks maps the new
    ones; one with more (an older payload) is used as it is.
    """
    if alloc is None:
        try:
            device = CPU if p.backend == "host" else Device("cuda", p.device)
            backend = get_backend(device, p.backend)
            if received:
                sizes, capacity, used, fds = list(p.chunks), 0, 0, received
            else:
                sizes, capacity, used, fds = transport.fetch_growth(
                    p.server, p.pid, p.alloc_id, p.secret, 0, reply_to=transport.server_address()
                )
        except BaseException:
            _close(received)
            raise
        if sizes[: len(p.chunks)] != list(p.chunks):
            _close(fds)
            raise PayloadError(
                f"allocation {p.alloc_id} was shrunk since this payload was made; pickle the "
                "array again"
            )
        access: Access = "r" if p.readonly else "rw"
        assert p.capacity is not None
        alloc = Allocation.import_(
            backend,
            p.alloc_id,
            p.secret,
            sizes,
            fds,
            p.pid,
            access,
            capacity=max(capacity, p.capacity),
        )
        if alloc.source_server is None:
            alloc.source_server = p.server
            alloc.used = used or p.size
        return alloc
    with alloc.growth_lock:
        local = alloc.chunk_sizes()
        n = len(p.chunks)
        if (
            not alloc.growable
            or alloc.backend.name != p.backend
            or list(p.chunks[: len(local)]) != local[:n]
        ):
            _close(received)
            raise PayloadError(f"payload does not match allocation {p.alloc_id} mapped here")
        if n <= len(local):  # the same or an older generation: all mapped already
            _close(received)
            return alloc
        if alloc.origin.created_here:
            _close(received)
            raise PayloadError(
                f"allocation {p.alloc_id} was shrunk since this payload was made; pickle the "
                "array again"
            )
        if received:
            _close(received[: len(local)])
            alloc.extend(list(p.chunks[len(local) :]), received[len(local) :], p.capacity or 0)
            return alloc
        sizes, capacity, used, fds = transport.fetch_growth(
            p.server, p.pid, p.alloc_id, p.secret, len(local), reply_to=transport.server_address()
        )
        _catch_up(alloc, local, sizes, capacity, fds)
        alloc.used = used
        return alloc
