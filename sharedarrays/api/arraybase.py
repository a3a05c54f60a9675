"""The base of :class:`~sharedarrays.SharedDeviceArray`: its state and what makes it act
like its native array (:class:`ArrayBase`: operators, NumPy dispatch, the array API
namespace, ndarray methods), its shape views and flags (:class:`ShapeViews`).

New memory (``a + 1``, ``a.sum()``, ``np.sqrt(a)``) is a native array, not shared; in-place
operations (``a += 1``, ``np.add(a, 1, out=a)``) write the shared memory and give the view;
shape views (``a.T``, ``a.reshape(...)``, ``a.view(dtype)``), laid out by NumPy on the layout
probe, are shared.
"""

from __future__ import annotations

import builtins
import contextlib
import operator
import sys
from collections.abc import Callable, Mapping
from types import FrameType, MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import numpy as np

from sharedarrays._cpython import caller_frame, frame_function, frame_local
from sharedarrays.backends.device import Device

if TYPE_CHECKING:
    from sharedarrays.memory import Allocation, Lease
    from sharedarrays.protocol.payload import ViewTuple

__all__ = ["ArrayBase", "ArrayFlags", "ShapeViews", "shareable_dtype"]

_A = TypeVar("_A", bound="ArrayBase")
_S = TypeVar("_S", bound="ShapeViews")
_Op = Callable[[Any, Any], Any]
_Method = Callable[[Any, object], Any]

_READONLY = "assignment destination is read-only"  # NumPy's message for the same misuse


def shareable_dtype(dtype: Any, instead: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype a shared array can hold (bool, integer, float, complex);
    else a TypeError saying ``instead``."""
    dt: np.dtype[Any] = np.dtype(dtype)
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(
            f"dtype {dt} is not supported: shared arrays hold bool, integer, float or complex "
            f"numbers (object, string, datetime and structured dtypes cannot be shared); {instead}"
        )
    return dt


def _native(obj: Any) -> Any:
    """The native array of a view; anything else as it is."""
    return obj.array if isinstance(obj, ArrayBase) else obj


def _native_nested(obj: Any) -> Any:
    """:func:`_native` through lists, tuples and dicts (``np.concatenate([a, b])``)."""
    if type(obj) is list:
        return [_native_nested(x) for x in obj]
    if type(obj) is tuple:
        return tuple(_native_nested(x) for x in obj)
    if type(obj) is dict:
        return {k: _native_nested(v) for k, v in obj.items()}
    return _native(obj)


def _apply(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], native_out: bool = False
) -> Any:
    """``func`` on the native arrays of ``args`` and ``kwargs``; shared ``out=`` arrays are
    written and (unless ``native_out``) returned in place of their native arrays."""
    out = kwargs.get("out")
    outs = out if isinstance(out, tuple) else () if out is None else (out,)
    for o in outs:  # (refused as NumPy refuses, where read-only or closed)
        if isinstance(o, ArrayBase):
            o._writable_native()
    result = func(*_native_nested(args), **_native_nested(kwargs))
    shared = {id(o.array): o for o in outs if isinstance(o, ArrayBase)}
    if native_out or not shared:
        return result
    if isinstance(result, tuple):
        return tuple(shared.get(id(r), r) for r in result)
    return shared.get(id(result), result)


def _forms(op: _Op, iop: _Op | None = None) -> tuple[_Method, ...]:
    """The operator ``op``, its reflected form and (given ``iop``) its in-place form."""

    def binary(self: ArrayBase, other: object) -> Any:
        return op(self.array, _native(other))

    def reflected(self: ArrayBase, other: object) -> Any:
        return op(_native(other), self.array)

    if iop is None:
        return binary, reflected

    def inplace(self: ArrayBase, other: object) -> Any:
        iop(self._writable_native(), _native(other))
        return self

    return binary, reflected, inplace


def _unary(op: Callable[[Any], Any]) -> Callable[[ArrayBase], Any]:
    return lambda self: op(self.array)


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


# NumPy functions answered by the view's method (a shared view where NumPy gives a view)
_SHAPE_VIEWS: Mapping[Callable[..., Any], Callable[..., Any]] = MappingProxyType(
    {np.reshape: _np_reshape, np.ravel: lambda a, order="C": a.ravel(order)}
)

# NumPy functions that only rearrange their first argument's layout, answered on its layout
# probe: shared views (a list of them for the splits)
_LAYOUT_VIEWS: frozenset[Callable[..., Any]] = frozenset(
    (
        *(np.transpose, np.swapaxes, np.squeeze, np.moveaxis, np.rollaxis, np.expand_dims),
        *(np.atleast_1d, np.atleast_2d, np.atleast_3d),
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
        def method(self: ArrayBase, *args: Any, **kwargs: Any) -> Any:
            if not writes:
                return self._call(name, *args, **kwargs)
            getattr(self._writable_native(), name)(*[_native(x) for x in args], **kwargs)
            return None

        method.__name__ = method.__qualname__ = name
        how = ", in shared memory" if writes else "; a native result"
        method.__doc__ = f"Like :meth:`numpy.ndarray.{name}`{how}."
        return method

    return tuple(map(make, names))


class ArrayBase:
    """The view's state, operators, NumPy dispatch and ndarray methods over :attr:`array`
    (see the module). Comparisons are elementwise: like :class:`numpy.ndarray`, the array
    is unhashable."""

    __slots__ = (
        "_lease",
        "_dtype",
        "_shape",
        "_strides",
        "_offset",
        "_readonly",
        "_native",
        "_packed",
    )
    _lease: Lease[Allocation] | None
    _dtype: np.dtype[Any]
    _shape: tuple[int, ...]
    _strides: tuple[int, ...]
    _offset: int
    _readonly: bool
    _native: Any
    _packed: ViewTuple | None
    __hash__: ClassVar[None]  # type: ignore[assignment]

    if TYPE_CHECKING:  # supplied by the array (sharedarrays.api.array)

        @property
        def array(self) -> Any: ...
        @property
        def allocation(self) -> Allocation: ...
        @property
        def dtype(self) -> np.dtype[Any]: ...
        def _layout(self, writeable: bool = False) -> np.ndarray[Any, Any]: ...
        def _derive(
            self: _A, layout: np.ndarray[Any, Any], view: np.ndarray[Any, Any], dtype: np.dtype[Any]
        ) -> _A: ...
        def _set_writeable(self, writeable: bool) -> None: ...
        def _on_layout(self: _A, how: Callable[[Any], Any]) -> _A: ...

    def _writable_native(self) -> Any:
        """The native array, for a write: NumPy's ValueError where read-only (also on CuPy)."""
        native = self.array
        if self._readonly:
            raise ValueError(_READONLY)
        return native

    __eq__, __ne__, __lt__, __le__, __gt__, __ge__ = (
        _forms(getattr(operator, name))[0] for name in ("eq", "ne", "lt", "le", "gt", "ge")
    )
    __add__, __radd__, __iadd__ = _forms(operator.add, operator.iadd)
    __sub__, __rsub__, __isub__ = _forms(operator.sub, operator.isub)
    __mul__, __rmul__, __imul__ = _forms(operator.mul, operator.imul)
    __truediv__, __rtruediv__, __itruediv__ = _forms(operator.truediv, operator.itruediv)
    __floordiv__, __rfloordiv__, __ifloordiv__ = _forms(operator.floordiv, operator.ifloordiv)
    __mod__, __rmod__, __imod__ = _forms(operator.mod, operator.imod)
    __divmod__, __rdivmod__ = _forms(divmod)
    __pow__, __rpow__, __ipow__ = _forms(operator.pow, operator.ipow)
    __matmul__, __rmatmul__, __imatmul__ = _forms(operator.matmul, operator.imatmul)
    __and__, __rand__, __iand__ = _forms(operator.and_, operator.iand)
    __or__, __ror__, __ior__ = _forms(operator.or_, operator.ior)
    __xor__, __rxor__, __ixor__ = _forms(operator.xor, operator.ixor)
    __lshift__, __rlshift__, __ilshift__ = _forms(operator.lshift, operator.ilshift)
    __rshift__, __rrshift__, __irshift__ = _forms(operator.rshift, operator.irshift)
    __neg__ = _unary(operator.neg)
    __pos__ = _unary(operator.pos)
    __invert__ = _unary(operator.invert)
    __abs__ = _unary(abs)
    # scalars (size 1 only, NumPy's errors otherwise)
    __bool__, __float__, __int__, __complex__ = map(_unary, (bool, float, int, complex))

    def __round__(self, ndigits: int | None = None) -> Any:
        native = self.array
        if native.ndim == 0:  # its scalar's round, as NumPy's indexing would have given
            native = native[()] if isinstance(native, np.ndarray) else native.item()
        return round(native) if ndigits is None else round(native, ndigits)

    def __index__(self) -> int:
        native = self.array
        if isinstance(native, np.ndarray):
            return operator.index(native)
        if native.size != 1 or native.dtype.kind not in "iub":  # CuPy has no __index__
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return operator.index(native.item())

    def __contains__(self, value: object) -> bool:
        return bool(_native(value) in self.array)

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
        if args and args[0] is self:
            if func in _SHAPE_VIEWS:
                return _SHAPE_VIEWS[func](*args, **kwargs)
            several = len(args) > 1 and func in (np.atleast_1d, np.atleast_2d, np.atleast_3d)
            # (flip of a 0-d array reads its value)
            if func in _LAYOUT_VIEWS and not several and (self._shape or func is not np.flip):
                return self._on_layout(lambda layout: func(layout, *args[1:], **kwargs))
        if func in _WRITES_FIRST and args and isinstance(args[0], ArrayBase):
            args[0]._writable_native()
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


# the settable flags: setflags' keyword by attribute, the attribute by item
_SETTABLE = MappingProxyType({"writeable": "write", "aligned": "align", "writebackifcopy": "uic"})
_SETTABLE_ITEMS = MappingProxyType(
    {"W": "writeable", "WRITEABLE": "writeable", "A": "aligned", "ALIGNED": "aligned"}
    | {"X": "writebackifcopy", "WRITEBACKIFCOPY": "writebackifcopy"}
)


class ArrayFlags:
    """A view's flags, read as :attr:`numpy.ndarray.flags` (``flags.c_contiguous``,
    ``flags["C"]``); ``writeable`` follows the view, and sets as :meth:`ShapeViews.setflags`
    (also ``aligned``, ``writebackifcopy``)."""

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
    """Shape views and flags over the layout probe."""

    __slots__ = ()

    def _on_layout(self: _S, how: Callable[[Any], Any], dtype: np.dtype[Any] | None = None) -> _S:
        """The shared view (of ``dtype``, default this view's) of what ``how`` makes of the
        layout probe (a list or tuple of them for one of views); this view for the probe."""
        layout = self._layout()
        new = self._dtype if dtype is None else dtype
        return cast(_S, self._derive_all(layout, how(layout), new))

    def _derive_all(self, layout: np.ndarray[Any, Any], result: Any, dtype: np.dtype[Any]) -> Any:
        if isinstance(result, (list, tuple)):
            return type(result)(self._derive_all(layout, r, dtype) for r in result)
        return self if result is layout else self._derive(layout, result, dtype)

    @property
    def flags(self) -> ArrayFlags:
        """Memory layout, like :attr:`numpy.ndarray.flags` (``owndata`` is False)."""
        return ArrayFlags(self)

    def setflags(self, write: object = None, align: object = None, uic: object = None) -> None:
        """Like :meth:`numpy.ndarray.setflags`: ``write=False`` makes this view (and views
        made from it after) read-only; ``write=True`` undoes only that, not a read-only
        export. ValueError where NumPy's would refuse, and for ``align=False``."""
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

    def _part(self: _S, name: str) -> _S:
        layout = self._layout()
        part = getattr(layout, name)  # (real of real values: the probe, still a new view)
        return self._derive(layout, part, part.dtype)

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
        """A view (shared) like :meth:`numpy.ndarray.getfield`; TypeError as :meth:`view`."""
        new = shareable_dtype(dtype, f"a.array.getfield({dtype!r}, ...) is a native view of it")
        return self._on_layout(lambda layout: layout.getfield(new, offset), new)

    def setfield(self, val: Any, dtype: Any, offset: int = 0) -> None:
        """Like :meth:`numpy.ndarray.setfield`, in shared memory."""
        self._writable_native()
        field: Any = self.getfield(dtype, offset)
        field[...] = val

    @property
    def data(self) -> Any:
        """The native array's ``data`` (a :class:`memoryview`, CuPy's ``MemoryPointer``)."""
        return self._native_attribute("data")

    @property
    def ctypes(self) -> Any:
        """The native array's ``ctypes`` (host memory only)."""
        return self._native_attribute("ctypes")

    def to_device(self, device: Any, /, *, stream: Any = None) -> Any:
        """The native array's ``to_device`` (the array API's); this view where that gives
        the native array itself (``"cpu"`` on the host)."""
        to_device = self._native_attribute("to_device")
        native = self.array
        if isinstance(device, Device):
            device = str(device)
        result = to_device(device) if stream is None else to_device(device, stream=stream)
        return self if result is native else result

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
        """A view (shared) of the same bytes as another dtype, with NumPy's rules; with
        ``type`` (or an ndarray class first), a native view of that type. TypeError for a
        dtype a shared array cannot hold; MisalignedView where device memory would be."""
        if isinstance(dtype, builtins.type) and issubclass(dtype, np.ndarray):
            dtype, type = None, dtype  # (NumPy's a.view(np.ndarray): a type, not a dtype)
        if type is not None:  # an ndarray (subclass) view over the same memory: native
            native = self.array
            return native.view(type=type) if dtype is None else native.view(dtype, type)
        layout = self._layout()
        if dtype is None:
            return self._derive(layout, layout, self._dtype)
        new = shareable_dtype(dtype, f"a.array.view({dtype!r}) is a native view of it")
        return self._derive(layout, layout.view(new), new)

    def reshape(self, *shape: Any, order: str = "C", copy: bool | None = None) -> Any:
        """A view (shared) with a new shape where NumPy's reshape would not copy, else a
        native copy (``copy=False``: ValueError instead; ``copy=True``: always a copy)."""
        if not shape:
            raise TypeError("reshape() takes exactly 1 argument (0 given)")  # (NumPy's words)
        new: Any = shape[0] if len(shape) == 1 else shape
        # checks the shape with NumPy's errors, reading nothing (every stride is 0)
        np.broadcast_to(np.False_, self._shape).reshape(new, order=order)  # type: ignore[call-overload]
        if copy:
            return self.array.reshape(new, order=order).copy(order="K")
        layout = self._layout()
        try:
            view = _reshape_view(layout, new, order)
        except ValueError:
            if copy is False:
                raise
            return self.array.reshape(new, order=order)
        return self._derive(layout, view, self._dtype)

    def ravel(self, order: str | None = "C") -> Any:
        """A 1-d view (shared) where NumPy's ravel gives a view, else a native copy."""
        if order is None:  # (NumPy's ravel(None) is ravel("C"))
            order = "C"
        elif not isinstance(order, str):
            raise TypeError(f"order must be str, not {type(order).__name__}")
        if order not in ("C", "c", "F", "f", "A", "a", "K", "k"):
            raise ValueError(f"order must be one of 'C', 'F', 'A', or 'K' (got {order!r})")
        layout = self._layout()
        flags = layout.flags
        kind = order.upper()
        if kind == "A":
            kind = "F" if flags.f_contiguous and not flags.c_contiguous else "C"
        if (kind == "C" and flags.c_contiguous) or (kind == "F" and flags.f_contiguous):
            return self._derive(layout, layout.reshape(-1, order=cast(Any, kind)), self._dtype)
        if kind == "K":  # contiguous in the order of its strides (e.g. a transpose): a view
            perm = sorted(range(layout.ndim), key=lambda i: -layout.strides[i])
            permuted = layout.transpose(perm)
            forward = all(
                s >= 0 for s, n in zip(layout.strides, layout.shape, strict=True) if n > 1
            )
            if permuted.flags.c_contiguous and forward:
                return self._derive(layout, permuted.reshape(-1), self._dtype)
        return self.array.ravel(order)
