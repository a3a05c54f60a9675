"""How a key indexes a view: basic keys (a view of the same memory) versus advanced ones
(what the native array gives), and the layout probe NumPy works out a view's layout on."""

from __future__ import annotations

import operator
from types import EllipsisType
from typing import Any

import numpy as np

from sharedarrays.api.arraybase import ArrayBase

__all__ = ["Probe", "check_key", "native_key"]

_BASIC_INDEX = (int, slice, EllipsisType, type(None), np.integer)


def check_key(key: object) -> tuple[Any, ...] | None:
    """``key`` as a tuple of basic indices, or ``None`` for an advanced index (which a view
    cannot hold) or no index at all (which the native array refuses itself).

    The cheap type checks come first: a basic key (the hot path) pays for nothing else."""
    items = key if isinstance(key, tuple) else (key,)
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, _BASIC_INDEX):
            if _as_index(item) is item:
                return None
            return check_key(tuple(_as_index(i) for i in items))
    return items


def _as_index(item: object) -> object:
    """An integer to NumPy (a 0-d integer array, an object with ``__index__`` that is no
    array) as its int; anything else as it is."""
    if isinstance(item, (bool, np.bool_, int)):
        return item
    dtype = getattr(item, "dtype", None)
    if isinstance(dtype, np.dtype):
        zero_d = (isinstance(item, ArrayBase) or type(item) is np.ndarray) and not item.shape
        if not (zero_d and dtype.kind in "iu"):
            return item
    elif not hasattr(type(item), "__index__"):
        return item
    return operator.index(item)  # type: ignore[arg-type]


def native_key(key: object) -> object:
    """``key`` with its views replaced by their native arrays."""
    if isinstance(key, ArrayBase):
        return key.array
    if type(key) is tuple and any(isinstance(i, ArrayBase) for i in key):
        return tuple(i.array if isinstance(i, ArrayBase) else i for i in key)
    return key


class Probe:
    """A NumPy array interface over an address that is never read: NumPy works out the
    layout of a view on it without touching (possibly device) memory."""

    __slots__ = ("__array_interface__",)

    def __init__(
        self, address: int, dtype: np.dtype[Any], shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> None:
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": dtype.str,
            "strides": strides,
            "data": (address, True),
        }
