"""What makes a :class:`~sharedarrays.SharedDeviceArray` act like its native array.

Everything is computed on the native array: **new memory** (``a + 1``, ``a.sum()``,
``np.sqrt(a)``) is a native array, not shared; **in-place** operations (``a += 1``,
``np.add(a, 1, out=a)``) write the shared memory; **shape views** (``a.T``, the
:mod:`~sharedarrays.api.shapeviews`) are shared. This module adds NumPy dispatch, the array
API namespace, reductions and in-place methods to the operators and shape views.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import FrameType, MappingProxyType
from typing import Any

import numpy as np

from sharedarrays._cpython import caller_frame, frame_function, frame_local
from sharedarrays.api.arraybase import (
    _READONLY,
    _check_writable,
    _native,
    _native_nested,
    _outs,
    _with_outs,
)
from sharedarrays.api.arrayoperators import ArrayOperators
from sharedarrays.api.shapeviews import ShapeViews

__all__ = ["NativeArrayMethods"]

# NumPy functions that write their first argument (checked here: CuPy has no read-only flag)
_WRITES_FIRST: frozenset[Callable[..., Any]] = frozenset(
    {np.copyto, np.place, np.put, np.putmask, np.fill_diagonal, np.put_along_axis}
)


def _np_reshape(
    a: Any, shape: Any = None, order: str = "C", *, newshape: Any = None, copy: bool | None = None
) -> Any:
    if shape is None:
        if newshape is None:
            raise TypeError("reshape() missing 1 required positional argument: 'shape'")
        shape = newshape
    return a.reshape(shape, order=order, copy=copy)


# NumPy functions answered by the view's method, so that ``np.transpose(a)`` is a shared view
_SHAPE_VIEWS: Mapping[Callable[..., Any], Callable[..., Any]] = MappingProxyType(
    {
        np.transpose: lambda a, axes=None: a.transpose() if axes is None else a.transpose(axes),
        np.swapaxes: lambda a, axis1, axis2: a.swapaxes(axis1, axis2),
        np.squeeze: lambda a, axis=None: a.squeeze(axis),
        np.reshape: _np_reshape,
        np.ravel: lambda a, order="C": a.ravel(order),
    }
)

# NumPy functions that only rearrange their first argument's layout, answered on its layout
# probe: shared views (a list of them for the splits)
_LAYOUT_VIEWS: frozenset[Callable[..., Any]] = frozenset(
    (
        *(np.moveaxis, np.rollaxis, np.expand_dims, np.atleast_1d, np.atleast_2d, np.atleast_3d),
        *(np.flip, np.fliplr, np.flipud, np.rot90),
        *(np.split, np.array_split, np.hsplit, np.vsplit, np.dsplit),
    )
)


def _numpy_averages(frame: FrameType | None) -> bool:
    """Whether ``frame`` is NumPy's own ``mean``, ``var`` or ``std``."""
    module, function = frame_function(frame)
    averages = ("_mean", "_var", "_std")
    return function in averages and module in ("numpy._core._methods", "numpy.core._methods")


def _asking_compat(frame: FrameType | None) -> Any:
    """The array-api-compat package (or vendored copy) whose ``array_namespace`` runs
    ``frame``, else ``None``."""
    name = frame_function(frame)[0]
    if not name.endswith("array_api_compat.common._helpers"):
        return None
    return sys.modules.get(name[: -len(".common._helpers")])


def _calls(name: str) -> Callable[..., Any]:
    """The method ``name`` of the native array, as a method of the view."""

    def method(self: NativeArrayMethods, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Like :meth:`numpy.ndarray.{name}`; a native result."
    return method


def _writes(name: str) -> Callable[..., None]:
    """The in-place method ``name`` of the native array, writing the shared memory."""

    def method(self: NativeArrayMethods, *args: Any, **kwargs: Any) -> None:
        getattr(self._writable_native(), name)(*[_native(x) for x in args], **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Like :meth:`numpy.ndarray.{name}`, in shared memory."
    return method


class NativeArrayMethods(ArrayOperators, ShapeViews):
    """Operators, NumPy dispatch and ndarray methods over :attr:`array` (see the module)."""

    __slots__ = ()
    # above CuPy's (100): cupy_array + a defers to a.__radd__, which unwraps a
    __array_priority__ = 200.0

    # NumPy dispatch ---------------------------------------------------------------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """Ufuncs on the native arrays; shared ``out=`` arrays are written and returned."""
        outs = _outs(kwargs)
        args = tuple(_native(x) for x in inputs)
        kwargs = {k: _native(v) for k, v in kwargs.items()}
        result = getattr(ufunc, method)(*args, **kwargs)
        if outs is not None and method == "reduce" and _numpy_averages(caller_frame()):
            # NumPy's x.mean(out=a) divides the sum in place only where it is an ndarray:
            # the native array (the same memory) is divided there
            return result
        return _with_outs(result, outs)

    def __array_function__(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """NumPy functions on the native arrays (also inside lists, tuples, dicts); ``out=``
        and ``np.copyto``'s destination write shared memory; the shape and layout functions
        (``np.transpose``, ``np.moveaxis``, ``np.split``, ...) give shared views."""
        if func in _SHAPE_VIEWS and args and args[0] is self:
            return _SHAPE_VIEWS[func](*args, **kwargs)
        if (
            func in _LAYOUT_VIEWS
            and args
            and args[0] is self
            and (len(args) == 1 or func not in (np.atleast_1d, np.atleast_2d, np.atleast_3d))
            and (self.shape or func is not np.flip)  # (flip of a 0-d array reads its value)
        ):
            return self._on_layout(lambda layout: func(layout, *args[1:], **kwargs))
        if func in _WRITES_FIRST and args:
            _check_writable(args[0])
        kwargs = dict(kwargs)
        outs = _outs(kwargs)
        result = func(*_native_nested(args), **_native_nested(kwargs))
        return _with_outs(result, outs)

    def __array_namespace__(self, *, api_version: str | None = None) -> Any:
        """The native array's namespace (``numpy``, ``cupy``). Asked by array-api-compat's
        ``array_namespace`` (or a vendored copy), the namespace that copy gives the native
        array, so that shared and native arrays mixed resolve to one namespace."""
        native = self.array
        frame = caller_frame()
        compat = _asking_compat(frame)
        if compat is not None:
            use_compat = frame_local(frame, "use_compat")  # (its argument: None, True, False)
            return compat.array_namespace(native, api_version=api_version, use_compat=use_compat)
        namespace = getattr(native, "__array_namespace__", None)
        if namespace is not None:
            return namespace(api_version=api_version)
        return sys.modules[type(native).__module__.partition(".")[0]]

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The native array's method ``name``; ``out=`` as for ufuncs; where it returns the
        native array itself, this view."""
        outs = _outs(kwargs)
        args = tuple(_native(x) for x in args)
        kwargs = {k: _native(v) for k, v in kwargs.items()}
        native = self.array
        result = getattr(native, name)(*args, **kwargs)
        return self if result is native else _with_outs(result, outs)

    # reductions and other reads: native results (``out=a`` writes in place)
    sum = _calls("sum")
    mean = _calls("mean")
    min = _calls("min")
    max = _calls("max")
    std = _calls("std")
    var = _calls("var")
    prod = _calls("prod")
    any = _calls("any")
    all = _calls("all")
    argmax = _calls("argmax")
    argmin = _calls("argmin")
    cumsum = _calls("cumsum")
    cumprod = _calls("cumprod")
    clip = _calls("clip")
    round = _calls("round")
    argsort = _calls("argsort")
    dot = _calls("dot")
    trace = _calls("trace")
    take = _calls("take")
    repeat = _calls("repeat")
    argpartition = _calls("argpartition")
    compress = _calls("compress")
    choose = _calls("choose")
    diagonal = _calls("diagonal")
    searchsorted = _calls("searchsorted")
    nonzero = _calls("nonzero")
    copy = _calls("copy")
    flatten = _calls("flatten")
    tolist = _calls("tolist")
    item = _calls("item")
    tofile = _calls("tofile")
    dumps = _calls("dumps")  # (a copy's pickle: pickle.dumps(a) shares the memory)
    dump = _calls("dump")
    astype = _calls("astype")  # (copy=False to the same dtype: this view)
    conj = _calls("conj")  # (of real values this view: NumPy returns the array itself)
    conjugate = _calls("conjugate")

    def __copy__(self) -> Any:
        """A native copy of the values (another view of the same memory is ``a[...]``)."""
        return self.array.copy(order="K")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A native copy of the values: a deep copy never writes the original's memory."""
        return self.__copy__()

    @property
    def flat(self) -> Any:
        """The native array's flat iterator: assignments write the shared memory."""
        return self.array.flat

    @flat.setter
    def flat(self, value: Any) -> None:
        if self.readonly:
            raise ValueError(_READONLY)
        self.array.flat = _native(value)

    def tobytes(self, order: str = "C") -> bytes:
        """The raw bytes of the values, like :meth:`numpy.ndarray.tobytes`."""
        native = self.array
        if not isinstance(native, np.ndarray):
            native = native.get()
        return bytes(native.tobytes(order))

    # in place: writes the shared memory
    fill = _writes("fill")
    sort = _writes("sort")
    partition = _writes("partition")
    put = _writes("put")

    def __delitem__(self, key: Any) -> None:
        raise ValueError("cannot delete array elements")  # (NumPy's words)

    def byteswap(self, inplace: bool = False) -> Any:
        """Like :meth:`numpy.ndarray.byteswap`; ``inplace=True`` swaps shared memory."""
        if inplace:
            self._writable_native().byteswap(True)
            return self
        return self.array.byteswap(False)
