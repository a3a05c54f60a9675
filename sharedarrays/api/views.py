"""The live views of this process, as the memory map reads them.

The view class registers itself (:func:`register`), so the widgets need not import it.
Views are tracked only once asked for: the first :func:`live_views` finds the live ones
with ``gc.get_objects``, and from then on each view made is tracked weakly by id.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Protocol, TypeGuard

import numpy as np

from sharedarrays.memory.allocation import Allocation

__all__ = ["ArrayView", "register", "track", "is_view", "live_views"]


class ArrayView(Protocol):
    """What the memory map reads of a view (a :class:`~sharedarrays.SharedDeviceArray`)."""

    @property
    def allocation(self) -> Allocation: ...

    @property
    def closed(self) -> bool: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def strides(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...

    @property
    def itemsize(self) -> int: ...

    @property
    def offset(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def readonly(self) -> bool: ...


class _ViewRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a live view that knows its key in :data:`_live` (no closure)."""

    __slots__ = ("key",)
    key: int


# id -> weak reference; a dict, not a WeakSet: a view is unhashable (its == is elementwise)
_live: dict[int, _ViewRef] = {}
_view_types: tuple[type, ...] = ()
tracking = False
"""Whether views are tracked (set by the first :func:`live_views`); read by the view's
constructor, a call less per view until then."""
_start_lock = threading.Lock()


def register(cls: type) -> None:
    """Make ``cls`` (the view class) known here: its instances are views."""
    global _view_types
    if cls not in _view_types:
        _view_types = (*_view_types, cls)


def _forget(ref: _ViewRef) -> None:
    """Drop a dead view's entry (unless its id was already reused by a newer view)."""
    if _live.get(ref.key) is ref:
        _live.pop(ref.key, None)


def track(view: ArrayView) -> None:
    """Count ``view`` among the live views, once tracking started."""
    if not tracking:
        return
    _add(view)


def _add(view: object) -> None:
    ref = _ViewRef(view, _forget)
    ref.key = id(view)
    _live[ref.key] = ref


def is_view(obj: object) -> TypeGuard[ArrayView]:
    """Whether ``obj`` is a view (an instance of a :func:`register`-ed class)."""
    return isinstance(obj, _view_types)


def _start() -> None:
    """Track views from now on, starting with those the garbage collector finds alive."""
    global tracking
    with _start_lock:
        if tracking:
            return
        tracking = True  # (first: a view made during the search is tracked by track())
        for obj in gc.get_objects():
            # (one still being made has no lease slot yet: its track() comes)
            if isinstance(obj, _view_types) and hasattr(obj, "_lease") and id(obj) not in _live:
                _add(obj)


def live_views() -> list[ArrayView]:
    """A snapshot of the views alive in this process (open or closed)."""
    if not tracking:
        _start()
    # Another thread may add a view while we copy the dict; copy again if so.
    for _ in range(10):
        try:
            refs = list(_live.values())
        except RuntimeError:
            continue
        return [v for v in (ref() for ref in refs) if v is not None]
    return []
