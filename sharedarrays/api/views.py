"""The live views of this process, as the memory map reads them.

The view class registers itself (:func:`register`), so the widgets need not import it.
Views are tracked only once asked for: the first :func:`live_views` finds the live ones
with ``gc.get_objects``, and from then on each view made is tracked weakly by id (in
``STATE.views``).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Protocol, TypeGuard

import numpy as np

from sharedarrays.memory.allocation import Allocation
from sharedarrays.process import STATE

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
    """A weak reference to a live view that knows its key in ``STATE.views.live``."""

    __slots__ = ("key",)
    key: int


def register(cls: type) -> None:
    """Make ``cls`` (the view class) known here: its instances are views."""
    if cls not in STATE.views.types:
        STATE.views.types = (*STATE.views.types, cls)


def _forget(ref: _ViewRef) -> None:
    """Drop a dead view's entry (unless its id was already reused by a newer view)."""
    if STATE.views.live.get(ref.key) is ref:
        STATE.views.live.pop(ref.key, None)


def track(view: object) -> None:
    """Count ``view`` among the live views (the view's constructor calls it once
    ``STATE.views.tracking``: a call less per view until then)."""
    ref = _ViewRef(view, _forget)
    ref.key = id(view)
    STATE.views.live[ref.key] = ref


def is_view(obj: object) -> TypeGuard[ArrayView]:
    """Whether ``obj`` is a view (an instance of a :func:`register`-ed class)."""
    return isinstance(obj, STATE.views.types)


def live_views() -> list[ArrayView]:
    """A snapshot of the views alive in this process (open or closed)."""
    state = STATE.views
    if not state.tracking:
        with state.lock:
            if not state.tracking:
                state.tracking = True  # (first: a view made during the search is tracked)
                for obj in gc.get_objects():
                    # (one still being made has no lease slot yet: its track() comes)
                    if is_view(obj) and hasattr(obj, "_lease") and id(obj) not in state.live:
                        track(obj)
    # Another thread may add a view while we copy the dict; copy again if so.
    for _ in range(10):
        try:
            refs = list(state.live.values())
        except RuntimeError:
            continue
        return [v for v in (ref() for ref in refs) if v is not None]
    return []
