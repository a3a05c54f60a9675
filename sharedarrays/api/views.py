"""The live views of this process, as the memory map reads them: found by the first
:func:`live_views` with ``gc.get_objects``, then each new one tracked weakly (``STATE.views``).
"""

from __future__ import annotations

import gc
from typing import Any, Protocol, TypeGuard

import numpy as np

from sharedarrays.api.arraybase import ArrayBase
from sharedarrays.memory.allocation import Allocation
from sharedarrays.process import STATE

__all__ = ["ArrayView", "is_view", "live_views"]


class ArrayView(Protocol):
    """What the memory map reads of a view."""

    allocation: Allocation
    closed: bool
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype[Any]
    itemsize: int
    offset: int
    nbytes: int
    readonly: bool


def is_view(obj: object) -> TypeGuard[ArrayView]:
    """Whether ``obj`` is a view, by its type (``isinstance`` reads ``obj.__class__``, which a
    dead weakref.proxy raises for and deprecated aliases warn on)."""
    return issubclass(type(obj), ArrayBase)


def live_views() -> list[ArrayView]:
    """A snapshot of the views alive in this process (open or closed)."""
    state = STATE.views
    if not state.tracking:
        with state.lock:
            if not state.tracking:
                state.tracking = True  # (first: a view made during the search is tracked)
                for obj in gc.get_objects():
                    # (one still being made has no lease slot yet: its _init tracks it)
                    if is_view(obj) and hasattr(obj, "_lease") and id(obj) not in state.live:
                        state.live[id(obj)] = obj
    # (valuerefs copies the refs at once, where iterating meets another thread's views)
    return [v for v in (ref() for ref in state.live.valuerefs()) if v is not None]
