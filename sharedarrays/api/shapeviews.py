"""Shape views (``a.T``, ``a.reshape(...)``, ``a.view(dtype)``: laid out by NumPy on the layout
probe, sharing the memory), flags, and growth along axis 0 (``capacity=``) of a shared array."""

from __future__ import annotations

import builtins
import contextlib
import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar, cast

import numpy as np

from sharedarrays.api.arraybase import _READONLY, ArrayBase, operator_index, shareable_dtype
from sharedarrays.backends.device import Device
from sharedarrays.errors import ResizeRefused
from sharedarrays.memory import Allocation
from sharedarrays.protocol.payload import contiguous_strides, view_extent
from sharedarrays.transport import growth

__all__ = ["ArrayFlags", "ShapeViews"]

_S = TypeVar("_S", bound="ShapeViews")

# the settable flags: setflags' keyword by attribute, the attribute by item
_SETTABLE = MappingProxyType({"writeable": "write", "aligned": "align", "writebackifcopy": "uic"})
_SETTABLE_ITEMS = MappingProxyType(
    {"W": "writeable", "WRITEABLE": "writeable", "A": "aligned", "ALIGNED": "aligned"}
    | {"X": "writebackifcopy", "WRITEBACKIFCOPY": "writebackifcopy"}
)


class ArrayFlags:
    """A view's flags, read as :attr:`numpy.ndarray.flags`; ``writeable``, ``aligned`` and
    ``writebackifcopy`` set as :meth:`ShapeViews.setflags`."""

    __slots__ = ("_view", "_numpy")
    __hash__: ClassVar[None]  # type: ignore[assignment]
    _view: ShapeViews
    _numpy: tuple[Any, Any]  # NumPy's flags of the layout probe, writable and read-only

    def __init__(self, view: ShapeViews) -> None:
        self._view = view
        self._numpy = (view._layout(writeable=True).flags, view._layout().flags)

    def _flags(self) -> Any:
        return self._numpy[self._view._readonly]

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            with contextlib.suppress(AttributeError):
                return getattr(self._flags(), name)
        raise AttributeError(f"'ArrayFlags' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        if name.startswith("_"):  # its own fields (also as copy.copy sets them)
            object.__setattr__(self, name, value)
        elif name in _SETTABLE:
            self._view.setflags(**{_SETTABLE[name]: value})
        else:
            raise AttributeError(f"attribute {name!r} of 'ArrayFlags' objects is not writable")

    def __getitem__(self, key: str) -> bool:
        return self._flags()[key]  # type: ignore[no-any-return]

    def __setitem__(self, key: str, value: object) -> None:
        if not isinstance(key, str) or key not in _SETTABLE_ITEMS:
            raise KeyError("Unknown flag")  # (NumPy's words)
        setattr(self, _SETTABLE_ITEMS[key], value)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArrayFlags):
            return NotImplemented
        return bool(self._flags() == other._flags())

    def __repr__(self) -> str:
        return repr(self._flags())


def _reshape_view(layout: np.ndarray[Any, Any], shape: Any, order: Any) -> np.ndarray[Any, Any]:
    """``layout`` reshaped without a copy, else ValueError."""
    try:
        reshaped: np.ndarray[Any, Any] = layout.reshape(shape, order=order, copy=False)
        return reshaped
    except TypeError:  # NumPy < 2.1 has no copy=: assigning a shape never copies either
        pass
    fortran = order in ("F", "f") or (order in ("A", "a") and layout.flags.f_contiguous)
    view = layout.T.view() if fortran else layout.view()
    new = np.broadcast_to(np.False_, layout.shape).reshape(shape, order=order).shape
    try:
        view.shape = new[::-1] if fortran else new
    except AttributeError as e:
        raise ValueError(f"cannot reshape without a copy: {e}") from None
    result: np.ndarray[Any, Any] = view.T if fortran else view
    return result


class ShapeViews(ArrayBase):
    """Shape views and flags over the layout probe; growth along axis 0."""

    __slots__ = ()

    def _on_layout(self: _S, how: Callable[[Any], Any]) -> _S:
        """The shared view(s) of ``how(layout probe)``."""
        layout = self._layout()
        return cast(_S, self._derive_all(layout, how(layout)))

    def _derive_all(self, layout: np.ndarray[Any, Any], result: Any) -> Any:
        if isinstance(result, (list, tuple)):
            return type(result)(self._derive_all(layout, r) for r in result)
        return self if result is layout else self._derive(layout, result)

    @property
    def flags(self) -> ArrayFlags:
        """Memory layout, like :attr:`numpy.ndarray.flags` (``owndata`` is False)."""
        return ArrayFlags(self)

    def setflags(self, write: object = None, align: object = None, uic: object = None) -> None:
        """Like :meth:`numpy.ndarray.setflags`: ``write=False`` makes this view (and views made
        from it) read-only, ``write=True`` undoes only that. ValueError as NumPy's, and for
        ``align=False``."""
        if write is not None:
            if self._lease is None:
                raise self._closed()
            if bool(write) == self._readonly:
                if not self._locked and write:  # read-only as made: NumPy's words
                    raise ValueError("cannot set WRITEABLE flag to True of this array")
                self._readonly = self._locked = not write
                self._native = self._packed = None
        if align is not None:
            if not align:
                raise ValueError(
                    "cannot clear the ALIGNED flag of a SharedDeviceArray: it follows the "
                    "view's address (a.array.setflags(align=False) marks a native array)"
                )
            if not self.flags.aligned:
                raise ValueError("cannot set aligned flag of mis-aligned array to True")
        if uic:
            raise ValueError("cannot set WRITEBACKIFCOPY flag to True")  # (NumPy's words)

    def _part(self: _S, name: str) -> _S:
        layout = self._layout()  # (real of real values: the probe, still a new view)
        return self._derive(layout, getattr(layout, name))

    @property
    def real(self: _S) -> _S:
        """The real part, a shared view like :attr:`numpy.ndarray.real`."""
        return self._part("real")

    @real.setter
    def real(self, value: Any) -> None:
        cast(Any, self.real)[...] = value  # (as NumPy's a.real = x: writes them in place)

    @property
    def imag(self) -> Any:
        """The imaginary part: a shared view of complex values; of real ones NumPy's zeros."""
        return self._part("imag") if self._dtype.kind == "c" else self.array.imag

    @imag.setter
    def imag(self, value: Any) -> None:
        if self._dtype.kind != "c":
            raise TypeError("array does not have imaginary part to set")  # (NumPy's words)
        self.imag[...] = value

    @property
    def T(self: _S) -> _S:  # NumPy's name
        """The transposed view (shared)."""
        return self.transpose()

    @property
    def mT(self: _S) -> _S:  # NumPy's name
        """The view (shared) with the last two axes swapped."""
        if len(self._shape) < 2:
            raise ValueError("matrix transpose with ndim < 2 is undefined")
        return self.swapaxes(-1, -2)

    def transpose(self: _S, *axes: Any) -> _S:
        """A transposed view (shared)."""
        return self._on_layout(lambda layout: layout.transpose(*axes))

    def swapaxes(self: _S, axis1: int, axis2: int) -> _S:
        """A view (shared) with two axes swapped."""
        return self._on_layout(lambda layout: layout.swapaxes(axis1, axis2))

    def squeeze(self: _S, axis: int | tuple[int, ...] | None = None) -> _S:
        """A view (shared) without the axes of length one (or only ``axis``)."""
        return self._on_layout(lambda layout: layout.squeeze(axis))

    def getfield(self: _S, dtype: Any, offset: int = 0) -> _S:
        """A shared view like :meth:`numpy.ndarray.getfield`."""
        new = shareable_dtype(dtype, f"a.array.getfield({dtype!r}, ...) is a native view of it")
        return self._on_layout(lambda layout: layout.getfield(new, offset))

    def setfield(self, val: Any, dtype: Any, offset: int = 0) -> None:
        """Like :meth:`numpy.ndarray.setfield`, in shared memory."""
        self._writable_native()
        cast(Any, self.getfield(dtype, offset))[...] = val

    @property
    def data(self) -> Any:
        """The native array's ``data`` (a :class:`memoryview`, CuPy's ``MemoryPointer``)."""
        return self._native_attribute("data")

    @property
    def ctypes(self) -> Any:
        """The native array's ``ctypes`` (host memory only)."""
        return self._native_attribute("ctypes")

    def to_device(self, device: Any, /, *, stream: Any = None) -> Any:
        """The native array's ``to_device``; this view where that gives the native array."""
        to_device = self._native_attribute("to_device")
        if isinstance(device, Device):
            device = str(device)
        result = to_device(device) if stream is None else to_device(device, stream=stream)
        return self if result is self.array else result

    def _native_attribute(self, name: str) -> Any:
        """The native array's attribute ``name``, or an AttributeError naming both types."""
        native = self.array
        try:
            return getattr(native, name)
        except AttributeError:
            kind = f"{type(native).__module__.partition('.')[0]}.{type(native).__name__}"
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute {name!r} here: its native "
                f"array, a {kind}, has none"
            ) from None

    def view(self: _S, dtype: Any = None, type: Any = None) -> Any:
        """A shared view of the same bytes as another dtype (NumPy's rules); with ``type`` (or
        an ndarray class first), a native view of that type. MisalignedView where device
        memory would be misaligned."""
        if isinstance(dtype, builtins.type) and issubclass(dtype, np.ndarray):
            dtype, type = None, dtype  # (NumPy's a.view(np.ndarray): a type, not a dtype)
        if type is not None:  # an ndarray (subclass) view over the same memory: native
            native = self.array
            return native.view(type=type) if dtype is None else native.view(dtype, type)
        layout = self._layout()
        if dtype is None:
            return self._derive(layout, layout)
        new = shareable_dtype(dtype, f"a.array.view({dtype!r}) is a native view of it")
        return self._derive(layout, layout.view(new))

    def reshape(self, *shape: Any, order: str = "C", copy: bool | None = None) -> Any:
        """A shared view where NumPy's reshape would not copy, else a native copy."""
        # checks the shape with NumPy's errors, reading nothing (every stride is 0)
        np.broadcast_to(np.False_, self._shape).reshape(*shape, order=order)  # type: ignore[call-overload]
        new: Any = shape[0] if len(shape) == 1 else shape
        if copy:
            return self.array.reshape(new, order=order).copy(order="K")
        layout = self._layout()
        try:
            view = _reshape_view(layout, new, order)
        except ValueError:
            if copy is False:
                raise
            return self.array.reshape(new, order=order)
        return self._derive(layout, view)

    def ravel(self, order: str | None = "C") -> Any:
        """A 1-d view (shared) where NumPy's ravel gives a view, else a native copy."""
        np.empty(0).ravel(cast(Any, order))  # NumPy's checks and errors for ``order``
        layout = self._layout()
        flags = layout.flags
        kind = "C" if order is None else order.upper()  # (NumPy's ravel(None) is ravel("C"))
        if kind == "A":
            kind = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
        if (kind == "C" and flags.c_contiguous) or (kind == "F" and flags.f_contiguous):
            return self._derive(layout, layout.reshape(-1, order=cast(Any, kind)))
        if kind == "K":  # contiguous in the order of its strides (e.g. a transpose): a view
            perm = sorted(range(layout.ndim), key=lambda i: -layout.strides[i])
            permuted = layout.transpose(perm)
            forward = all(
                s >= 0 for s, n in zip(layout.strides, layout.shape, strict=True) if n > 1
            )
            if permuted.flags.c_contiguous and forward:
                return self._derive(layout, permuted.reshape(-1))
        return self.array.ravel(order)

    def resize(self, length: int) -> None:
        """Set the length along axis 0 of a growable array in place, without copying; in its
        creator only, through a C-contiguous view from the first byte (as created, ``a[:k]``).

        Growing maps chunks at the end (rows uninitialised); past the capacity they move to a
        reservation twice as large (:attr:`address` changes). Shrinking unmaps whole chunks
        past the end. Importers see it on their next load or :meth:`refresh`. ResizeRefused
        in an importer, or for a shrink that would unmap chunks in use.
        """
        n = operator_index(length, "length")
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
        itemsize = self._dtype.itemsize
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
        shape = (length, *self._shape[1:])
        _, high = view_extent(self._dtype.itemsize, shape, self._strides)
        lease = self.allocation.lease(self._offset + high)
        self._shape, self._native, self._packed, self._lease = shape, None, None, lease
