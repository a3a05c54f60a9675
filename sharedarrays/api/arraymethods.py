"""What makes a :class:`~sharedarrays.SharedDeviceArray` act like the array it wraps.

:class:`NativeArrayMethods` is the array's base class: operators, NumPy dispatch
(``__array_ufunc__``, ``__array_function__``), methods and shape views, all computed on the
zero-copy native array (:attr:`~sharedarrays.SharedDeviceArray.array`: NumPy on the host,
CuPy on CUDA). Three kinds of results:

- **new memory** (``a + 1``, ``a.sum()``, ``a.copy()``, ``np.sqrt(a)``) is a plain native
  array or scalar, not shared;
- **in-place** operations (``a += 1``, ``a.fill(0)``, ``a.sort()``, ``np.add(a, 1, out=a)``,
  ``np.copyto(a, x)``) write the shared memory and return the SharedDeviceArray itself;
- **shape views** (``a.T``, ``a.reshape(...)`` when NumPy would not copy, ``a.view(dtype)``,
  ...) are SharedDeviceArrays over the same allocation, which pickle as shared views.

The layout of a shape view is worked out by NumPy on a *layout probe* (an array interface over
the view's address that is never read, see :meth:`NativeArrayMethods._layout`), so device
memory is never touched to find it. This module does not import the array module: the array
supplies :meth:`~NativeArrayMethods._layout` and :meth:`~NativeArrayMethods._derive`.

The methods come in families, a module each: what the array supplies and the unwrapping
helpers (:mod:`~sharedarrays.api.arraybase`), the operators
(:mod:`~sharedarrays.api.arrayoperators`), the shape views and flags
(:mod:`~sharedarrays.api.shapeviews`); this module adds NumPy dispatch, the array API
namespace, reductions and other reads, and the in-place methods.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
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

# NumPy functions that write their first argument (checked for read-only views, which CuPy
# arrays cannot refuse on their own)
_WRITES_FIRST: frozenset[Callable[..., Any]] = frozenset(
    {np.copyto, np.place, np.put, np.putmask, np.fill_diagonal, np.put_along_axis}
)


def _np_transpose(a: Any, axes: Any = None) -> Any:
    return a.transpose() if axes is None else a.transpose(axes)


def _np_swapaxes(a: Any, axis1: int, axis2: int) -> Any:
    return a.swapaxes(axis1, axis2)


def _np_squeeze(a: Any, axis: Any = None) -> Any:
    return a.squeeze(axis)


def _np_reshape(
    a: Any, shape: Any = None, order: str = "C", *, newshape: Any = None, copy: bool | None = None
) -> Any:
    if shape is None:
        if newshape is None:
            raise TypeError("reshape() missing 1 required positional argument: 'shape'")
        shape = newshape
    return a.reshape(shape, order=order, copy=copy)


def _np_ravel(a: Any, order: str = "C") -> Any:
    return a.ravel(order)


# NumPy functions that return a view of their first argument, answered by the method of the
# same name so that ``np.transpose(a)`` is a shared view like ``a.T`` (not a native view,
# which would pickle as a copy)
_SHAPE_VIEWS: dict[Callable[..., Any], Callable[..., Any]] = {
    np.transpose: _np_transpose,
    np.swapaxes: _np_swapaxes,
    np.squeeze: _np_squeeze,
    np.reshape: _np_reshape,
    np.ravel: _np_ravel,
}


# NumPy functions that only rearrange the layout of their first argument and read no value:
# answered on the view's layout (see ArrayBase._layout), so what they return are
# shared views too (a list of them for the splits)
_LAYOUT_VIEWS: frozenset[Callable[..., Any]] = frozenset(
    {
        np.moveaxis,
        np.rollaxis,
        np.expand_dims,
        np.atleast_1d,
        np.atleast_2d,
        np.atleast_3d,
        np.flip,
        np.fliplr,
        np.flipud,
        np.rot90,
        np.split,
        np.array_split,
        np.hsplit,
        np.vsplit,
        np.dsplit,
    }
)


_AVERAGES = frozenset({"_mean", "_var", "_std"})


def _numpy_averages(frame: FrameType | None) -> bool:
    """Whether ``frame`` is NumPy's own ``mean``, ``var`` or ``std`` (``numpy._core._methods``),
    which finish a reduction into ``out=`` in place only where it returned an ndarray."""
    module, function = frame_function(frame)
    return function in _AVERAGES and module in ("numpy._core._methods", "numpy.core._methods")


def _more_arrays(func: Callable[..., Any], args: tuple[Any, ...]) -> bool:
    """Whether ``np.atleast_*d`` was given other arrays beside the first (NumPy returns a
    list with views of each; only the first is ours)."""
    return func in (np.atleast_1d, np.atleast_2d, np.atleast_3d) and len(args) > 1


def _asking_compat(frame: FrameType | None) -> Any:
    """The array-api-compat package whose ``array_namespace`` runs ``frame`` (the package or
    a vendored copy: ``scipy._lib.array_api_compat``, ...), else ``None``."""
    name = frame_function(frame)[0]
    if not name.endswith("array_api_compat.common._helpers"):
        return None
    return sys.modules.get(name[: -len(".common._helpers")])


class NativeArrayMethods(ArrayOperators, ShapeViews):
    """Operators, NumPy dispatch and ndarray methods over :attr:`array` (see the module).

    Comparisons are elementwise, so, like :class:`numpy.ndarray`, the array is unhashable.
    """

    __slots__ = ()
    # above CuPy's (100): cupy_array + a defers to a.__radd__, which unwraps a
    __array_priority__ = 200.0

    # NumPy dispatch ---------------------------------------------------------------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """``np.add(a, 1)``, ``np.sqrt(a, out=a)``: computed on the native arrays; outputs
        that were SharedDeviceArrays are written in shared memory and returned as given."""
        outs = _outs(kwargs)
        args = tuple(_native(x) for x in inputs)
        kwargs = {k: _native(v) for k, v in kwargs.items()}
        result = getattr(ufunc, method)(*args, **kwargs)
        if outs is not None and method == "reduce" and _numpy_averages(caller_frame()):
            # NumPy's mean, var and std of a NumPy array with this view as out= (x.mean(out=a)
            # runs NumPy's own code, not ours) divide the sum in place only where it is an
            # ndarray, else into a new one, leaving the sum in a: given the native array
            # (the same memory), they divide it there, as with an ndarray out=
            return result
        return _with_outs(result, outs)

    def __array_function__(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``np.sum(a)``, ``np.concatenate([a, b])``, ``np.copyto(a, x)``: SharedDeviceArrays
        in the arguments (also inside lists, tuples, dicts) are replaced by their native
        arrays; ``out=`` and the destination of ``np.copyto`` and the like write shared
        memory (refused on read-only views). ``np.transpose``, ``np.swapaxes``,
        ``np.squeeze``, ``np.reshape`` and ``np.ravel`` of a view are its methods: shared
        views where the method gives one. ``np.moveaxis``, ``np.rollaxis``,
        ``np.expand_dims``, ``np.atleast_1d`` / ``2d`` / ``3d``, ``np.flip``, ``np.fliplr``,
        ``np.flipud``, ``np.rot90`` and the splits (``np.split``, ``np.array_split``,
        ``np.hsplit``, ``np.vsplit``, ``np.dsplit``) return shared views (a list of them for
        the splits), as NumPy returns views."""
        if func in _SHAPE_VIEWS and args and args[0] is self:
            return _SHAPE_VIEWS[func](*args, **kwargs)
        if (
            func in _LAYOUT_VIEWS
            and args
            and args[0] is self
            and not _more_arrays(func, args)
            and (self.ndim or func is not np.flip)  # (flip of a 0-d array reads its value:
        ):  # never on the layout probe, whose address may be device memory)
            layout = self._layout()
            return self._derive_all(layout, func(layout, *args[1:], **kwargs))
        if func in _WRITES_FIRST and args:
            _check_writable(args[0])
        kwargs = dict(kwargs)
        outs = _outs(kwargs)
        result = func(*_native_nested(args), **_native_nested(kwargs))
        return _with_outs(result, outs)

    def _derive_all(self, layout: np.ndarray[Any, Any], result: Any) -> Any:
        """Shared views for what a layout function returned: an array (``layout`` itself
        means this view), or a list or tuple of arrays."""
        if isinstance(result, (list, tuple)):
            return type(result)(self._derive_all(layout, r) for r in result)
        if result is layout:
            return self
        return self._derive(layout, result, self.dtype)

    def __array_namespace__(self, *, api_version: str | None = None) -> Any:
        """The array API namespace of the native array: ``numpy`` on the host, ``cupy`` on a
        GPU. Its functions take this array (NumPy through ``__array_function__``, CuPy
        through ``__cuda_array_interface__``) and return native arrays.

        Asked by array-api-compat's ``array_namespace`` (the package, or a copy vendored in
        SciPy or scikit-learn), the namespace that copy gives the native array (its wrapper,
        ``array_api_compat.numpy`` for an ndarray): a shared array mixed with native arrays
        then resolves to one namespace, not to "Multiple namespaces". The copy is the
        caller's (its ``common._helpers`` module), so each copy compares its own wrappers."""
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
        """The native array's method ``name``; ``out=`` as for ufuncs; where NumPy returns
        the array itself (``conj`` of real values), this view."""
        outs = _outs(kwargs)
        args = tuple(_native(x) for x in args)
        kwargs = {k: _native(v) for k, v in kwargs.items()}
        native = self.array
        result = getattr(native, name)(*args, **kwargs)
        return self if result is native else _with_outs(result, outs)

    # reductions and other reads: native results -------------------------------------------
    def sum(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.sum`; a native result."""
        return self._call("sum", *args, **kwargs)

    def mean(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.mean`; a native result."""
        return self._call("mean", *args, **kwargs)

    def min(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.min`; a native result."""
        return self._call("min", *args, **kwargs)

    def max(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.max`; a native result."""
        return self._call("max", *args, **kwargs)

    def std(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.std`; a native result."""
        return self._call("std", *args, **kwargs)

    def var(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.var`; a native result."""
        return self._call("var", *args, **kwargs)

    def prod(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.prod`; a native result."""
        return self._call("prod", *args, **kwargs)

    def any(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.any`; a native result."""
        return self._call("any", *args, **kwargs)

    def all(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.all`; a native result."""
        return self._call("all", *args, **kwargs)

    def argmax(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.argmax`; a native result."""
        return self._call("argmax", *args, **kwargs)

    def argmin(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.argmin`; a native result."""
        return self._call("argmin", *args, **kwargs)

    def cumsum(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.cumsum`; a native result."""
        return self._call("cumsum", *args, **kwargs)

    def cumprod(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.cumprod`; a native result."""
        return self._call("cumprod", *args, **kwargs)

    def clip(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.clip`; a native result (``out=a`` writes in place)."""
        return self._call("clip", *args, **kwargs)

    def round(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.round`; a native result (``out=a`` writes in place)."""
        return self._call("round", *args, **kwargs)

    def nonzero(self) -> Any:
        """Like :meth:`numpy.ndarray.nonzero`; a tuple of native index arrays."""
        return self.array.nonzero()

    def argsort(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.argsort`; a native result."""
        return self._call("argsort", *args, **kwargs)

    def dot(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.dot`; a native result."""
        return self._call("dot", *args, **kwargs)

    def conj(self) -> Any:
        """Like :meth:`numpy.ndarray.conj`: a native result, or this view for real values
        (NumPy returns the array itself)."""
        return self._call("conj")

    def conjugate(self) -> Any:
        """Same as :meth:`conj`."""
        return self._call("conjugate")

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.trace`; a native result."""
        return self._call("trace", *args, **kwargs)

    def take(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.take`; a native result."""
        return self._call("take", *args, **kwargs)

    def repeat(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.repeat`; a native result."""
        return self._call("repeat", *args, **kwargs)

    def argpartition(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.argpartition`; a native result."""
        return self._call("argpartition", *args, **kwargs)

    def compress(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.compress`; a native result."""
        return self._call("compress", *args, **kwargs)

    def choose(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.choose`; a native result."""
        return self._call("choose", *args, **kwargs)

    def diagonal(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.diagonal`: a native (read-only) view."""
        return self._call("diagonal", *args, **kwargs)

    def searchsorted(self, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.searchsorted`; a native result."""
        return self._call("searchsorted", *args, **kwargs)

    def astype(self, dtype: Any, *args: Any, **kwargs: Any) -> Any:
        """Like :meth:`numpy.ndarray.astype`: a native copy, or this view itself when
        ``copy=False`` and the dtype is already this one."""
        return self._call("astype", dtype, *args, **kwargs)

    def copy(self, order: str = "C") -> Any:
        """A native copy (not shared)."""
        return self.array.copy(order=order)

    def __copy__(self) -> Any:
        """``copy.copy``: a native copy of the values (not shared), as :meth:`copy`; NumPy's
        and CuPy's ``copy.copy`` copy the values too. (Another view of the same memory is
        ``a[...]``.)"""
        return self.array.copy(order="K")

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """``copy.deepcopy``: a native copy of the values (not shared), so that a deep copy
        of an object holding the array never writes the original's memory."""
        return self.__copy__()

    @property
    def flat(self) -> Any:
        """The native array's flat iterator (:attr:`numpy.ndarray.flat`): reads copy,
        assignments (``a.flat[i] = x``) write the shared memory."""
        return self.array.flat

    @flat.setter
    def flat(self, value: Any) -> None:
        if self.readonly:
            raise ValueError(_READONLY)
        self.array.flat = _native(value)

    def flatten(self, order: str = "C") -> Any:
        """A one-dimensional native copy (not shared), like :meth:`numpy.ndarray.flatten`."""
        return self.array.flatten(order)

    def tolist(self) -> Any:
        """The values as nested Python lists."""
        return self.array.tolist()

    def item(self, *args: Any) -> Any:
        """One element as a Python scalar, like :meth:`numpy.ndarray.item`."""
        return self.array.item(*args)

    def tobytes(self, order: str = "C") -> bytes:
        """The raw bytes of the values, like :meth:`numpy.ndarray.tobytes`."""
        native = self.array
        if not isinstance(native, np.ndarray):
            native = native.get()
        return bytes(native.tobytes(order))

    # in place: writes the shared memory -------------------------------------------------
    def __delitem__(self, key: Any) -> None:
        raise ValueError("cannot delete array elements")  # (NumPy's words)

    def fill(self, value: Any) -> None:
        """Set every element to ``value``, in shared memory."""
        self._writable_native().fill(_native(value))

    def sort(self, *args: Any, **kwargs: Any) -> None:
        """Sort in place, in shared memory, like :meth:`numpy.ndarray.sort`."""
        self._writable_native().sort(*args, **kwargs)

    def partition(self, *args: Any, **kwargs: Any) -> None:
        """Partition in place, in shared memory, like :meth:`numpy.ndarray.partition`."""
        self._writable_native().partition(*args, **kwargs)

    def put(self, indices: Any, values: Any, mode: str = "raise") -> None:
        """Write ``values`` at the flat ``indices``, in shared memory, like
        :meth:`numpy.ndarray.put`."""
        self._writable_native().put(_native(indices), _native(values), mode)

    def byteswap(self, inplace: bool = False) -> Any:
        """Like :meth:`numpy.ndarray.byteswap`: a native copy with its bytes swapped, or
        with ``inplace=True`` the bytes swapped in shared memory and this view."""
        if inplace:
            self._writable_native().byteswap(True)
            return self
        return self.array.byteswap(False)

    def tofile(self, *args: Any, **kwargs: Any) -> None:
        """Write the values to a file, like :meth:`numpy.ndarray.tofile` (host memory)."""
        self.array.tofile(*args, **kwargs)

    def dumps(self) -> bytes:
        """A pickle of a native copy of the values (:meth:`numpy.ndarray.dumps`); pickle the
        view itself (``pickle.dumps(a)``) to share the memory."""
        return self.array.dumps()  # type: ignore[no-any-return]

    def dump(self, file: Any) -> None:
        """Pickle a native copy of the values to ``file`` (:meth:`numpy.ndarray.dump`)."""
        self.array.dump(file)
