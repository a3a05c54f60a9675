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
"""

from __future__ import annotations

import builtins
import operator
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any, ClassVar, TypeVar, cast

import numpy as np

from sharedarrays._cpython import caller_frame, frame_function, frame_local
from sharedarrays.backends.device import Device

__all__ = ["ArrayFlags", "NativeArrayMethods"]

_A = TypeVar("_A", bound="NativeArrayMethods")

_READONLY = "assignment destination is read-only"  # NumPy's message for the same misuse

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
# answered on the view's layout (see NativeArrayMethods._layout), so what they return are
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


class ArrayFlags:
    """The flags of a view, like :attr:`numpy.ndarray.flags`: its memory layout and whether
    it may be written.

    Attributes and items read as NumPy's (``flags.c_contiguous``, ``flags["C"]``,
    ``flags["ALIGNED"]``, ``flags.behaved``, ``flags.num``, ...). ``owndata`` is always
    False (a view never owns the shared memory) and ``writebackifcopy`` always False. As
    with NumPy, ``flags.writeable = False`` (or ``flags["W"] = False``) makes the view
    read-only (:meth:`~sharedarrays.SharedDeviceArray.setflags`); the layout flags are not
    writable. ``writeable`` follows the view; the layout flags are the view's when the
    flags were read.
    """

    __slots__ = ("_view", "_c", "_f", "_aligned")
    __hash__: ClassVar[None]  # type: ignore[assignment]

    # NumPy's item names (case-sensitive, as NumPy's) and the attribute each reads
    _KEYS: ClassVar[dict[str, str]] = {
        "C": "c_contiguous",
        "C_CONTIGUOUS": "c_contiguous",
        "CONTIGUOUS": "c_contiguous",
        "F": "f_contiguous",
        "F_CONTIGUOUS": "f_contiguous",
        "FORTRAN": "f_contiguous",
        "W": "writeable",
        "WRITEABLE": "writeable",
        "O": "owndata",
        "OWNDATA": "owndata",
        "A": "aligned",
        "ALIGNED": "aligned",
        "X": "writebackifcopy",
        "WRITEBACKIFCOPY": "writebackifcopy",
        "B": "behaved",
        "BEHAVED": "behaved",
        "CA": "carray",
        "CARRAY": "carray",
        "FA": "farray",
        "FARRAY": "farray",
        "FNC": "fnc",
        "FORC": "forc",
    }
    # the items NumPy lets one set, and setflags' keyword for each
    _SETTABLE: ClassVar[dict[str, str]] = {
        "W": "write",
        "WRITEABLE": "write",
        "A": "align",
        "ALIGNED": "align",
        "X": "uic",
        "WRITEBACKIFCOPY": "uic",
    }

    def __init__(
        self, view: NativeArrayMethods, c_contiguous: bool, f_contiguous: bool, aligned: bool
    ) -> None:
        self._view = view
        self._c = c_contiguous
        self._f = f_contiguous
        self._aligned = aligned

    @property
    def c_contiguous(self) -> bool:
        """Whether the elements are contiguous in C order."""
        return self._c

    @property
    def f_contiguous(self) -> bool:
        """Whether the elements are contiguous in Fortran order."""
        return self._f

    @property
    def contiguous(self) -> bool:
        """Same as ``c_contiguous``."""
        return self._c

    @property
    def fortran(self) -> bool:
        """Same as ``f_contiguous``."""
        return self._f

    @property
    def owndata(self) -> bool:
        """Always False: a view never owns the shared memory."""
        return False

    @property
    def writeable(self) -> bool:
        """Whether the view may be written (set it False to make the view read-only)."""
        return not self._view.readonly

    @writeable.setter
    def writeable(self, value: object) -> None:
        self._view.setflags(write=value)

    @property
    def aligned(self) -> bool:
        """Whether every element's address is a multiple of its type's alignment."""
        return self._aligned

    @aligned.setter
    def aligned(self, value: object) -> None:
        self._view.setflags(align=value)

    @property
    def writebackifcopy(self) -> bool:
        """Always False: a view is never a temporary copy."""
        return False

    @writebackifcopy.setter
    def writebackifcopy(self, value: object) -> None:
        self._view.setflags(uic=value)

    @property
    def behaved(self) -> bool:
        """Aligned and writeable."""
        return self._aligned and self.writeable

    @property
    def carray(self) -> bool:
        """Behaved and C-contiguous."""
        return self.behaved and self._c

    @property
    def farray(self) -> bool:
        """Behaved and not C-contiguous (NumPy's test, which reads no Fortran flag)."""
        return self.behaved and not self._c

    @property
    def fnc(self) -> bool:
        """Fortran-contiguous and not C-contiguous."""
        return self._f and not self._c

    @property
    def forc(self) -> bool:
        """Fortran- or C-contiguous."""
        return self._f or self._c

    @property
    def num(self) -> int:
        """The flags as NumPy's bits (``NPY_ARRAY_C_CONTIGUOUS``, ...)."""
        bits = (
            (self._c, 0x1),
            (self._f, 0x2),
            (self._aligned, 0x100),
            (self.writeable, 0x400),
        )
        return sum(bit for on, bit in bits if on)

    def __getitem__(self, key: str) -> bool:
        name = self._KEYS.get(key) if isinstance(key, str) else None
        if name is None:
            raise KeyError("Unknown flag")  # (NumPy's words)
        return bool(getattr(self, name))

    def __setitem__(self, key: str, value: object) -> None:
        keyword = self._SETTABLE.get(key) if isinstance(key, str) else None
        if keyword is None:
            raise KeyError("Unknown flag")
        self._view.setflags(**{keyword: value})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ArrayFlags):
            return NotImplemented
        return self.num == other.num

    def __repr__(self) -> str:
        names = ("C_CONTIGUOUS", "F_CONTIGUOUS", "OWNDATA", "WRITEABLE", "ALIGNED")
        lines = [f"  {name} : {self[name]}" for name in (*names, "WRITEBACKIFCOPY")]
        return "\n".join(lines) + "\n"


def shareable_dtype(dtype: Any, instead: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype, where a shared array can hold it (bool, integer, float or
    complex numbers: what a payload names).

    Raises
    ------
    TypeError
        Any other dtype (``instead``: what to do, said in the message)."""
    dt: np.dtype[Any] = np.dtype(dtype)
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(
            f"dtype {dt} is not supported: shared arrays hold bool, integer, float or complex "
            f"numbers (object, string, datetime and structured dtypes cannot be shared); {instead}"
        )
    return dt


_AVERAGES = frozenset({"_mean", "_var", "_std"})


def _numpy_averages(frame: FrameType | None) -> bool:
    """Whether ``frame`` is NumPy's own ``mean``, ``var`` or ``std`` (``numpy._core._methods``),
    which finish a reduction into ``out=`` in place only where it returned an ndarray."""
    module, function = frame_function(frame)
    return function in _AVERAGES and module in ("numpy._core._methods", "numpy.core._methods")


def _native(obj: Any) -> Any:
    """The native array of a SharedDeviceArray; anything else as it is."""
    return obj.array if isinstance(obj, NativeArrayMethods) else obj


def _native_nested(obj: Any) -> Any:
    """:func:`_native` through lists, tuples and dicts (``np.concatenate([a, b])``)."""
    if isinstance(obj, NativeArrayMethods):
        return obj.array
    if type(obj) is list:
        return [_native_nested(x) for x in obj]
    if type(obj) is tuple:
        return tuple(_native_nested(x) for x in obj)
    if type(obj) is dict:
        return {k: _native_nested(v) for k, v in obj.items()}
    return obj


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


def _check_writable(target: Any) -> None:
    """Refuse to write a read-only (or closed) SharedDeviceArray, as NumPy refuses."""
    if isinstance(target, NativeArrayMethods):
        target._writable_native()


def _outs(kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """Replace ``out=`` in ``kwargs`` by native arrays; return the outputs as given."""
    out = kwargs.get("out")
    if out is None:
        return None
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        _check_writable(o)
    natives = tuple(_native(o) for o in outs)
    kwargs["out"] = natives if isinstance(out, tuple) else natives[0]
    return outs


def _with_outs(result: Any, outs: tuple[Any, ...] | None) -> Any:
    """``result`` with the native arrays of SharedDeviceArray outputs replaced by those."""
    if outs is None:
        return result
    shared = {id(o.array): o for o in outs if isinstance(o, NativeArrayMethods)}
    if isinstance(result, tuple):
        return tuple(shared.get(id(r), r) for r in result)
    return shared.get(id(result), result)


def _reshape_view(layout: np.ndarray[Any, Any], shape: Any, order: Any) -> np.ndarray[Any, Any]:
    """``layout`` reshaped without a copy (never reading it), or ValueError if NumPy would
    have to copy. ``shape`` is valid for ``layout``'s size."""
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


class NativeArrayMethods:
    """Operators, NumPy dispatch and ndarray methods over :attr:`array` (see the module).

    Comparisons are elementwise, so, like :class:`numpy.ndarray`, the array is unhashable.
    """

    __slots__ = ()
    __hash__: ClassVar[None]  # type: ignore[assignment]
    # above CuPy's (100): cupy_array + a defers to a.__radd__, which unwraps a
    __array_priority__ = 200.0

    # supplied by the array ----------------------------------------------------------------
    @property
    def array(self) -> Any:
        """The zero-copy native array (NumPy on ``cpu``, CuPy on CUDA)."""
        raise NotImplementedError

    @property
    def readonly(self) -> bool:
        """Whether writes through this view are refused."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, ...]:
        """Length of each axis."""
        raise NotImplementedError

    @property
    def dtype(self) -> np.dtype[Any]:
        """Element type."""
        raise NotImplementedError

    def _layout(self) -> np.ndarray[Any, Any]:
        """A NumPy array with this view's address, dtype, shape and strides that must never be
        read: NumPy works out the layout of a shape view on it."""
        raise NotImplementedError

    def _derive(
        self: _A, layout: np.ndarray[Any, Any], view: np.ndarray[Any, Any], dtype: np.dtype[Any]
    ) -> _A:
        """A view of the same allocation with ``view``'s shape and strides, ``dtype``, and
        ``view``'s start relative to ``layout``'s (from :meth:`_layout`)."""
        raise NotImplementedError

    def _set_writeable(self, writeable: bool) -> None:
        """Make this view writable or read-only (:meth:`setflags`' ``write``)."""
        raise NotImplementedError

    def _writable_native(self) -> Any:
        """The native array, for a write: ClosedArrayError when closed, NumPy's ValueError
        when read-only (CuPy arrays have no read-only flag, so this checks)."""
        native = self.array
        if self.readonly:
            raise ValueError(_READONLY)
        return native

    def _inplace(self: _A, op: Callable[[Any, Any], Any], other: Any) -> _A:
        op(self._writable_native(), _native(other))
        return self

    # comparisons ------------------------------------------------------------------------
    def __eq__(self, other: object) -> Any:
        return self.array == _native(other)

    def __ne__(self, other: object) -> Any:
        return self.array != _native(other)

    def __lt__(self, other: object) -> Any:
        return self.array < _native(other)

    def __le__(self, other: object) -> Any:
        return self.array <= _native(other)

    def __gt__(self, other: object) -> Any:
        return self.array > _native(other)

    def __ge__(self, other: object) -> Any:
        return self.array >= _native(other)

    # arithmetic and bitwise -------------------------------------------------------------
    def __add__(self, other: object) -> Any:
        return self.array + _native(other)

    def __radd__(self, other: object) -> Any:
        return _native(other) + self.array

    def __iadd__(self: _A, other: object) -> _A:
        return self._inplace(operator.iadd, other)

    def __sub__(self, other: object) -> Any:
        return self.array - _native(other)

    def __rsub__(self, other: object) -> Any:
        return _native(other) - self.array

    def __isub__(self: _A, other: object) -> _A:
        return self._inplace(operator.isub, other)

    def __mul__(self, other: object) -> Any:
        return self.array * _native(other)

    def __rmul__(self, other: object) -> Any:
        return _native(other) * self.array

    def __imul__(self: _A, other: object) -> _A:
        return self._inplace(operator.imul, other)

    def __truediv__(self, other: object) -> Any:
        return self.array / _native(other)

    def __rtruediv__(self, other: object) -> Any:
        return _native(other) / self.array

    def __itruediv__(self: _A, other: object) -> _A:
        return self._inplace(operator.itruediv, other)

    def __floordiv__(self, other: object) -> Any:
        return self.array // _native(other)

    def __rfloordiv__(self, other: object) -> Any:
        return _native(other) // self.array

    def __ifloordiv__(self: _A, other: object) -> _A:
        return self._inplace(operator.ifloordiv, other)

    def __mod__(self, other: object) -> Any:
        return self.array % _native(other)

    def __rmod__(self, other: object) -> Any:
        return _native(other) % self.array

    def __imod__(self: _A, other: object) -> _A:
        return self._inplace(operator.imod, other)

    def __divmod__(self, other: object) -> Any:
        return divmod(self.array, _native(other))

    def __rdivmod__(self, other: object) -> Any:
        return divmod(_native(other), self.array)

    def __pow__(self, other: object) -> Any:
        return self.array ** _native(other)

    def __rpow__(self, other: object) -> Any:
        return _native(other) ** self.array

    def __ipow__(self: _A, other: object) -> _A:
        return self._inplace(operator.ipow, other)

    def __matmul__(self, other: object) -> Any:
        return self.array @ _native(other)

    def __rmatmul__(self, other: object) -> Any:
        return _native(other) @ self.array

    def __imatmul__(self: _A, other: object) -> _A:
        return self._inplace(operator.imatmul, other)

    def __and__(self, other: object) -> Any:
        return self.array & _native(other)

    def __rand__(self, other: object) -> Any:
        return _native(other) & self.array

    def __iand__(self: _A, other: object) -> _A:
        return self._inplace(operator.iand, other)

    def __or__(self, other: object) -> Any:
        return self.array | _native(other)

    def __ror__(self, other: object) -> Any:
        return _native(other) | self.array

    def __ior__(self: _A, other: object) -> _A:
        return self._inplace(operator.ior, other)

    def __xor__(self, other: object) -> Any:
        return self.array ^ _native(other)

    def __rxor__(self, other: object) -> Any:
        return _native(other) ^ self.array

    def __ixor__(self: _A, other: object) -> _A:
        return self._inplace(operator.ixor, other)

    def __lshift__(self, other: object) -> Any:
        return self.array << _native(other)

    def __rlshift__(self, other: object) -> Any:
        return _native(other) << self.array

    def __ilshift__(self: _A, other: object) -> _A:
        return self._inplace(operator.ilshift, other)

    def __rshift__(self, other: object) -> Any:
        return self.array >> _native(other)

    def __rrshift__(self, other: object) -> Any:
        return _native(other) >> self.array

    def __irshift__(self: _A, other: object) -> _A:
        return self._inplace(operator.irshift, other)

    # unary ------------------------------------------------------------------------------
    def __neg__(self) -> Any:
        return -self.array

    def __pos__(self) -> Any:
        return +self.array

    def __invert__(self) -> Any:
        return ~self.array

    def __abs__(self) -> Any:
        return abs(self.array)

    def __round__(self, ndigits: int | None = None) -> Any:
        native = self.array
        if native.ndim == 0:  # its scalar's round, as NumPy's indexing would have given
            value: Any = native[()] if isinstance(native, np.ndarray) else native.item()
            return round(value) if ndigits is None else round(value, ndigits)
        return round(native) if ndigits is None else round(native, ndigits)  # (its own error)

    # scalars (size 1 only, NumPy's errors otherwise) --------------------------------------
    def __bool__(self) -> bool:
        return bool(self.array)

    def __float__(self) -> float:
        return float(self.array)

    def __int__(self) -> int:
        return int(self.array)

    def __complex__(self) -> complex:
        return complex(self.array)

    def __index__(self) -> int:
        native = self.array
        if isinstance(native, np.ndarray):
            return operator.index(native)
        if native.size != 1 or native.dtype.kind not in "iub":  # CuPy has no __index__
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return operator.index(native.item())

    def __contains__(self, value: object) -> bool:
        return bool(_native(value) in self.array)

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

    # shape views: SharedDeviceArrays over the same memory ---------------------------------
    @property
    def flags(self) -> ArrayFlags:
        """Memory layout, like :attr:`numpy.ndarray.flags` (``owndata`` is False)."""
        flags = self._layout().flags
        return ArrayFlags(
            self, bool(flags.c_contiguous), bool(flags.f_contiguous), bool(flags.aligned)
        )

    def setflags(self, write: object = None, align: object = None, uic: object = None) -> None:
        """Set the array's flags, like :meth:`numpy.ndarray.setflags`.

        ``write=False`` makes this view read-only: later writes through it (and through the
        views and native arrays made from it after that) raise NumPy's ``ValueError``, as
        NumPy's do; a native array taken from :attr:`array` before stays writable, as a
        NumPy view taken before does. ``write=True`` makes it writable again, only where
        ``write=False`` made it read-only (a view made read-only elsewhere, by a read-only
        export, a pickle of a read-only view, or a view derived from one, raises NumPy's
        ``ValueError``). ``align=True`` checks the alignment; ``uic=False`` does nothing.

        Raises
        ------
        ValueError
            ``write=True`` on a view that cannot be made writable, ``align=True`` on a
            misaligned view, ``align=False`` (the alignment follows the view's address),
            ``uic=True``.
        """
        if write is not None:
            self._set_writeable(bool(write))
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

    @property
    def real(self: _A) -> _A:
        """The real part, a shared view like :attr:`numpy.ndarray.real` (of real values: a
        view of the same elements)."""
        layout = self._layout()
        part = layout.real
        return self._derive(layout, part, part.dtype)

    @real.setter
    def real(self, value: Any) -> None:
        cast(Any, self.real)[...] = value  # (as NumPy's a.real = x: writes them in place)

    @property
    def imag(self) -> Any:
        """The imaginary part, like :attr:`numpy.ndarray.imag`: a shared view of complex
        values; of real values a new native array of zeros, read-only, as NumPy gives."""
        if self.dtype.kind != "c":
            return self.array.imag
        layout = self._layout()
        part = layout.imag
        return self._derive(layout, part, part.dtype)

    @imag.setter
    def imag(self, value: Any) -> None:
        if self.dtype.kind != "c":
            raise TypeError("array does not have imaginary part to set")  # (NumPy's words)
        self.imag[...] = value

    @property
    def T(self: _A) -> _A:  # NumPy's name
        """The transposed view (shared), like :attr:`numpy.ndarray.T`."""
        return self.transpose()

    @property
    def mT(self: _A) -> _A:  # NumPy's name
        """The view (shared) with the last two axes swapped, like :attr:`numpy.ndarray.mT`."""
        if len(self.shape) < 2:
            raise ValueError("matrix transpose with ndim < 2 is undefined")
        return self.swapaxes(-1, -2)

    def transpose(self: _A, *axes: Any) -> _A:
        """A transposed view (shared): ``a.transpose()``, ``a.transpose(1, 0, 2)`` or
        ``a.transpose((1, 0, 2))``."""
        layout = self._layout()
        return self._derive(layout, layout.transpose(*axes), self.dtype)

    def swapaxes(self: _A, axis1: int, axis2: int) -> _A:
        """A view (shared) with two axes swapped."""
        layout = self._layout()
        return self._derive(layout, layout.swapaxes(axis1, axis2), self.dtype)

    def squeeze(self: _A, axis: int | tuple[int, ...] | None = None) -> _A:
        """A view (shared) without the axes of length one (or only ``axis``); where there
        is none to remove, this view itself, as NumPy returns the array itself."""
        layout = self._layout()
        squeezed = layout.squeeze(axis)
        return self if squeezed is layout else self._derive(layout, squeezed, self.dtype)

    def getfield(self: _A, dtype: Any, offset: int = 0) -> _A:
        """A view (shared) of the bytes at ``offset`` of each element as ``dtype``, like
        :meth:`numpy.ndarray.getfield` (NumPy's checks: the field fits in the element).

        Raises
        ------
        TypeError
            A dtype a shared array cannot hold (as :meth:`view`):
            ``a.array.getfield(dtype, offset)`` is a native view."""
        new = shareable_dtype(dtype, f"a.array.getfield({dtype!r}, ...) is a native view of it")
        layout = self._layout()
        return self._derive(layout, layout.getfield(new, offset), new)

    def setfield(self, val: Any, dtype: Any, offset: int = 0) -> None:
        """Write ``val`` into the field :meth:`getfield` names, in shared memory, like
        :meth:`numpy.ndarray.setfield`."""
        self._writable_native()
        field: Any = self.getfield(dtype, offset)
        field[...] = val

    @property
    def data(self) -> Any:
        """The native array's ``data``: on the host NumPy's :class:`memoryview` of the
        values (it keeps the memory mapped while it exists), on CUDA CuPy's
        ``MemoryPointer``."""
        return self._native_attribute("data")

    @property
    def ctypes(self) -> Any:
        """The native array's ``ctypes`` (:attr:`numpy.ndarray.ctypes`: the address, shape
        and strides for ctypes; it keeps the memory mapped while it exists). Host memory
        only: CuPy arrays have none (:attr:`address` is the address on any device)."""
        return self._native_attribute("ctypes")

    def to_device(self, device: Any, /, *, stream: Any = None) -> Any:
        """The native array's ``to_device`` (the array API's): on the host NumPy's, which
        takes ``"cpu"`` and returns this view itself. The array API passes a device object
        as the array's :attr:`~sharedarrays.SharedDeviceArray.device` gives it
        (``a.to_device(a.device)``): a :class:`~sharedarrays.Device` goes to the native as
        its name. CuPy arrays have none."""
        to_device = self._native_attribute("to_device")
        native = self.array
        if isinstance(device, Device):
            device = str(device)
        result = to_device(device) if stream is None else to_device(device, stream=stream)
        return self if result is native else result

    def _native_attribute(self, name: str) -> Any:
        """The native array's attribute ``name``, or an AttributeError that names this
        class and the native's."""
        native = self.array
        try:
            return getattr(native, name)
        except AttributeError:
            kind = f"{type(native).__module__.partition('.')[0]}.{type(native).__name__}"
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute {name!r} here: its native "
                f"array, a {kind}, has none"
            ) from None

    def view(self: _A, dtype: Any = None, type: Any = None) -> Any:
        """A view (shared) of the same bytes as another dtype, with NumPy's rules for a
        different item size (the last axis must be contiguous, and its bytes divide). With
        ``type`` (or an ndarray class as the first argument, as NumPy takes it), a native
        view of that type over the same memory (on the host: ``np.ndarray`` and its
        subclasses), which pickles as a copy.

        Raises
        ------
        TypeError
            A dtype a shared array cannot hold (object, string, datetime, structured): its
            view could not be pickled; ``a.array.view(dtype)`` is a native view.
        MisalignedView
            On device memory, a view whose offset or strides are not multiples of the new
            dtype's alignment (a GPU kernel would fail reading it; host memory allows it)."""
        if isinstance(dtype, builtins.type) and issubclass(dtype, np.ndarray):
            dtype, type = None, dtype  # (NumPy's a.view(np.ndarray): a type, not a dtype)
        if type is not None:  # an ndarray (subclass) view over the same memory: native
            native = self.array
            return native.view(type=type) if dtype is None else native.view(dtype, type)
        layout = self._layout()
        if dtype is None:
            return self._derive(layout, layout, self.dtype)
        new = shareable_dtype(dtype, f"a.array.view({dtype!r}) is a native view of it")
        return self._derive(layout, layout.view(new), new)

    def reshape(self, *shape: Any, order: str = "C", copy: bool | None = None) -> Any:
        """A view (shared) with a new shape when NumPy's reshape would not copy; otherwise,
        as NumPy does, a native copy (``copy=False`` raises ValueError instead;
        ``copy=True`` always returns a native copy)."""
        if not shape:
            raise TypeError("reshape() takes exactly 1 argument (0 given)")  # (NumPy's words)
        new: Any = shape[0] if len(shape) == 1 else shape
        # checks the shape with NumPy's errors, reading nothing (every stride is 0)
        np.broadcast_to(np.False_, self.shape).reshape(new, order=order)  # type: ignore[call-overload]
        if copy:
            return self.array.reshape(new, order=order).copy(order="K")
        layout = self._layout()
        try:
            view = _reshape_view(layout, new, order)
        except ValueError:
            if copy is False:
                raise
            return self.array.reshape(new, order=order)
        return self._derive(layout, view, self.dtype)

    def ravel(self, order: str | None = "C") -> Any:
        """A one-dimensional view (shared) when NumPy's ravel would return a view (the
        elements are contiguous in ``order``), else a native copy, like
        :meth:`numpy.ndarray.ravel`."""
        if order is None:  # (NumPy's ravel(None) is ravel("C"))
            order = "C"
        elif not isinstance(order, str):
            raise TypeError(f"order must be str, not {type(order).__name__}")
        layout = self._layout()
        flags = layout.flags
        if order in ("A", "a"):
            order = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
        if order in ("C", "c") and flags.c_contiguous:
            return self._derive(layout, layout.reshape(-1), self.dtype)
        if order in ("F", "f") and flags.f_contiguous:
            return self._derive(layout, layout.reshape(-1, order="F"), self.dtype)
        if order in ("K", "k"):
            # contiguous in the order of its strides (e.g. a transpose): a view
            perm = sorted(range(layout.ndim), key=lambda i: -layout.strides[i])
            permuted = layout.transpose(perm)
            forward = all(
                s >= 0 for s, n in zip(layout.strides, layout.shape, strict=True) if n > 1
            )
            if permuted.flags.c_contiguous and forward:
                return self._derive(layout, permuted.reshape(-1), self.dtype)
        if order not in ("C", "c", "F", "f", "K", "k"):
            raise ValueError(f"order must be one of 'C', 'F', 'A', or 'K' (got {order!r})")
        return self.array.ravel(order)
