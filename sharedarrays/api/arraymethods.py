"""What makes a :class:`~sharedarrays.SharedDeviceArray` act like its native array: NumPy
dispatch, the array API namespace, reductions and in-place methods (the operators are
:mod:`~sharedarrays.api.arraybase`'s, the shape views :mod:`~sharedarrays.api.shapeviews`').

New memory (``a + 1``, ``a.sum()``, ``np.sqrt(a)``) is a native array, not shared; in-place
operations (``a += 1``, ``np.add(a, 1, out=a)``) write the shared memory; shape views (``a.T``)
are shared.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import FrameType, MappingProxyType
from typing import Any

import numpy as np

from sharedarrays._cpython import caller_frame, frame_function, frame_local
from sharedarrays.api.arraybase import _apply, _check_writable, _native
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


def _methods(writes: bool, *names: str) -> tuple[Callable[..., Any], ...]:
    """The native array's methods ``names`` as the view's: native results, or (``writes``)
    in place, writing the shared memory."""

    def make(name: str) -> Callable[..., Any]:
        def method(self: NativeArrayMethods, *args: Any, **kwargs: Any) -> Any:
            if not writes:
                return self._call(name, *args, **kwargs)
            getattr(self._writable_native(), name)(*[_native(x) for x in args], **kwargs)
            return None

        method.__name__ = method.__qualname__ = name
        how = ", in shared memory" if writes else "; a native result"
        method.__doc__ = f"Like :meth:`numpy.ndarray.{name}`{how}."
        return method

    return tuple(map(make, names))


class NativeArrayMethods(ShapeViews):
    """Operators, NumPy dispatch and ndarray methods over :attr:`array` (see the module)."""

    __slots__ = ()
    # above CuPy's (100): cupy_array + a defers to a.__radd__, which unwraps a
    __array_priority__ = 200.0

    # NumPy dispatch ---------------------------------------------------------------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """Ufuncs on the native arrays; shared ``out=`` arrays are written and returned."""
        # NumPy's x.mean(out=a) divides the sum in place only where it is an ndarray: the
        # native array (the same memory) is returned to be divided there
        native_out = "out" in kwargs and method == "reduce" and _numpy_averages(caller_frame())
        return _apply(getattr(ufunc, method), inputs, kwargs, native_out)

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
        return _apply(func, args, kwargs)

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
        native = self.array
        result = _apply(getattr(native, name), args, kwargs)
        return self if result is native else result

    # reductions and other reads: native results (``out=a`` writes in place); ``dumps`` is a
    # copy's pickle (pickle.dumps(a) shares the memory); astype(copy=False) to the same dtype
    # and conj of real values give this view, as NumPy gives the array itself
    sum, mean, min, max, std, var, prod, any, all = _methods(
        False, "sum", "mean", "min", "max", "std", "var", "prod", "any", "all"
    )
    argmax, argmin, cumsum, cumprod, clip, round, argsort, dot, trace = _methods(
        False, "argmax", "argmin", "cumsum", "cumprod", "clip", "round", "argsort", "dot", "trace"
    )
    take, repeat, argpartition, compress, choose, diagonal, searchsorted = _methods(
        False, "take", "repeat", "argpartition", "compress", "choose", "diagonal", "searchsorted"
    )
    nonzero, copy, flatten, tolist, item, tofile, dumps, dump = _methods(
        False, "nonzero", "copy", "flatten", "tolist", "item", "tofile", "dumps", "dump"
    )
    astype, conj, conjugate = _methods(False, "astype", "conj", "conjugate")

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
        self._writable_native().flat = _native(value)

    def tobytes(self, order: str = "C") -> bytes:
        """The raw bytes of the values, like :meth:`numpy.ndarray.tobytes`."""
        native = self.array
        if not isinstance(native, np.ndarray):
            native = native.get()
        return bytes(native.tobytes(order))

    fill, sort, partition, put = _methods(True, "fill", "sort", "partition", "put")

    def __delitem__(self, key: Any) -> None:
        raise ValueError("cannot delete array elements")  # (NumPy's words)

    def byteswap(self, inplace: bool = False) -> Any:
        """Like :meth:`numpy.ndarray.byteswap`; ``inplace=True`` swaps shared memory."""
        if inplace:
            self._writable_native().byteswap(True)
            return self
        return self.array.byteswap(False)
