"""The live views of this process, as the memory map reads them.

Every :class:`~sharedarrays.SharedDeviceArray` made in this process is tracked here (weakly:
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


_live: weakref.WeakSet[Any] = weakref.WeakSet()


def track(view: ArrayView) -> None:
    """Count ``view`` among the live views (the array's constructor calls this)."""
    _live.add(view)


def is_view(obj: object) -> TypeGuard[ArrayView]:
    """Whether ``obj`` is a tracked view (every SharedDeviceArray made here is)."""
    try:
        return obj in _live
    except TypeError:  # weakly referable but unhashable (a NumPy array): not a view
        return False


def live_views() -> list[ArrayView]:
    """A snapshot of the views alive in this process (open or closed)."""
    # Another thread may add a view while we copy the weak set; copy again if so.
    for _ in range(10):
        try:
            return list(_live)
        except RuntimeError:
            continue
    return []
