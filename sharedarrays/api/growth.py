"""Growth along axis 0 (``resize``, ``append``, ``refresh``) of arrays made with ``capacity=``."""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from sharedarrays.api.arraybase import _READONLY, ArrayBase
from sharedarrays.errors import ResizeRefused
from sharedarrays.memory import Allocation
from sharedarrays.protocol.payload import contiguous_strides, view_extent
from sharedarrays.transport import growth

__all__ = ["Growth"]


class Growth(ArrayBase):
    """The growth methods of :class:`~sharedarrays.SharedDeviceArray`."""

    __slots__ = ()

    def resize(self, length: int) -> None:
        """Set the length along axis 0 of a growable array in place, without copying; in its
        creator only, through a C-contiguous view from the first byte (as created, ``a[:k]``).

        Growing maps chunks at the end (rows uninitialised, zeros on the host); past the
        capacity they move to a reservation twice as large (:attr:`address` changes).
        Shrinking unmaps whole chunks past the end. Importers see it on their next load or
        :meth:`refresh`. ResizeRefused in an importer, or for a shrink that would unmap
        chunks in use.
        """
        if isinstance(length, (bool, np.bool_)):
            raise TypeError("a bool is not a valid length")
        n = operator.index(length)
        if n < 0:
            raise ValueError(f"a length is not negative, got {n}")
        alloc, row = self._row_bytes("resize")
        if not alloc.origin.created_here:
            how = (
                "inherited it through fork"
                if alloc.source_server is None
                else "imported it; call a.refresh() to see its current length"
            )
            raise ResizeRefused(
                f"only the process that created a growable array resizes it (pid "
                f"{alloc.origin.pid}); this one {how}"
            )
        nbytes = n * row
        with alloc.growth_lock:
            if nbytes > alloc.size:
                alloc.grow(nbytes)
            elif n < self._shape[0]:
                if self._native is not None and self._lease is not None:
                    # the native array shares the view's lease, which reaches the old end:
                    # the view takes a lease of its own, the old one ends with the native
                    end = self._lease.end
                    self._native = None
                    self._lease = alloc.lease(end)
                alloc.shrink(nbytes, exclude=self._lease)
            alloc.used = nbytes
            self._set_length(n)

    def append(self, values: Any) -> None:
        """Append a row or rows (``(k, *a.shape[1:])``) to a growable array (:meth:`resize`)."""
        alloc, _ = self._row_bytes("append to")
        if self._readonly:
            raise ValueError(_READONLY)
        src = alloc.backend.to_native(values)
        if src.ndim == len(self._shape) - 1:
            src = src.reshape((1, *src.shape))
        if src.ndim != len(self._shape) or tuple(src.shape[1:]) != self._shape[1:]:
            raise ValueError(
                f"cannot append values of shape {tuple(src.shape)} to an array of shape "
                f"{self._shape}: give one row of shape {self._shape[1:]} or rows of shape "
                f"(k, {', '.join(map(str, self._shape[1:]))})".replace(", )", ")")
            )
        start = self._shape[0]
        self.resize(start + src.shape[0])
        try:
            self.array[start:] = src
        except BaseException:
            self.resize(start)
            raise

    def refresh(self) -> None:
        """Take the exporter's current length along axis 0 (views as for :meth:`resize`)."""
        alloc, row = self._row_bytes("refresh")
        if not alloc.origin.created_here:
            growth.catch_up(alloc)
        self._set_length(min(alloc.used, alloc.size) // row)

    def _row_bytes(self, what: str) -> tuple[Allocation, int]:
        """The allocation and bytes per row of a view that may change its length."""
        alloc = self.allocation
        if not alloc.growable:
            raise ValueError(
                f"cannot {what} an array made without capacity=: only arrays created with "
                "sa.empty(..., capacity=...) (or zeros/full/from_array with capacity=) can grow"
            )
        if not self._shape:
            raise ValueError(f"cannot {what} a 0-d array")
        itemsize = self.dtype.itemsize
        if self._offset != 0 or self._strides != contiguous_strides(self._shape, itemsize):
            raise ValueError(
                f"cannot {what} this view: only a C-contiguous view that starts at the "
                "allocation's first byte (the array as created, or a[:k]) changes length along "
                f"axis 0; this one has offset {self._offset} and strides {self._strides}"
            )
        row = itemsize * math.prod(self._shape[1:])
        if row == 0:
            raise ValueError(f"cannot {what} an array whose rows hold no bytes")
        return alloc, row

    def _set_length(self, length: int) -> None:
        """Give this view ``length`` rows, with a lease reaching its new end."""
        alloc = self.allocation
        shape = (length, *self._shape[1:])
        _, high = view_extent(self.dtype.itemsize, shape, self._strides)
        lease = alloc.lease(self._offset + high)
        self._shape = shape
        self._native = None
        self._packed = None
        self._lease = lease
