"""The live views of this process, as the memory map reads them.

Every :class:`~sharedarrays.SharedDeviceArray` made in this process is tracked here by id (weakly:
tracking never keeps a view alive), so that :mod:`sharedarrays.api.widgets` can draw the
views of an allocation without importing the array module. :class:`ArrayView` is what the
widgets read of a view.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol, TypeGuard

import numpy as np

from sharedarrays.memory.allocation import Allocation

__all__ = ["ArrayView", "track", "is_view", "live_views"]


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


class _ViewRef(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to a live view that knows its key in :data:`_live` (one object per
    view, no closure: a view is made for every load, and each object the collector tracks
    makes its passes longer)."""

    __slots__ = ("key",)
    key: int


# id -> weak reference; a dict, not a WeakSet: a view is unhashable (its == is elementwise)
_live: dict[int, _ViewRef] = {}


def _forget(ref: _ViewRef) -> None:
    """Drop a dead view's entry (unless its id was already reused by a newer view)."""
    if _live.get(ref.key) is ref:
        _live.pop(ref.key, None)


def track(view: ArrayView) -> None:
    """Count ``view`` among the live views (the array's constructor calls this)."""
    ref = _ViewRef(view, _forget)
    ref.key = id(view)
    _live[ref.key] = ref


def is_view(obj: object) -> TypeGuard[ArrayView]:
    """Whether ``obj`` is a tracked view (every SharedDeviceArray made here is)."""
    ref = _live.get(id(obj))
    return ref is not None and ref() is obj


def live_views() -> list[ArrayView]:
    """A snapshot of the views alive in this process (open or closed)."""
    # Another thread may add a view while we copy the dict; copy again if so.
    for _ in range(10):
        try:
            refs = list(_live.values())
        except RuntimeError:
            continue
        return [v for v in (ref() for ref in refs) if v is not None]
    return []
