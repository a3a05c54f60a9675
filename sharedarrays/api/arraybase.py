"""The base of the array's method families: its state, its operators (computed on the native
array; the in-place forms write shared memory), and the helpers that unwrap views into native
arrays (arguments, ``out=``)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

if TYPE_CHECKING:
    from sharedarrays.backends.device import Device
    from sharedarrays.memory import Allocation, Lease
    from sharedarrays.protocol.payload import ViewTuple

__all__ = ["ArrayBase", "shareable_dtype"]

_A = TypeVar("_A", bound="ArrayBase")
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


def _check_writable(target: Any) -> None:
    """Refuse to write a read-only (or closed) view, as NumPy refuses."""
    if isinstance(target, ArrayBase):
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
    """``result`` with the native arrays of shared outputs replaced by those."""
    if outs is None:
        return result
    shared = {id(o.array): o for o in outs if isinstance(o, ArrayBase)}
    if isinstance(result, tuple):
        return tuple(shared.get(id(r), r) for r in result)
    return shared.get(id(result), result)


def _apply(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], native_out: bool = False
) -> Any:
    """``func`` on the native arrays of ``args`` and ``kwargs``; shared ``out=`` arrays are
    written and (unless ``native_out``) returned."""
    kwargs = dict(kwargs)
    outs = _outs(kwargs)
    result = func(*_native_nested(args), **_native_nested(kwargs))
    return result if native_out else _with_outs(result, outs)


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


class ArrayBase:
    """The view's state, its operators, and what the array supplies to its methods.
    Comparisons are elementwise, so, like :class:`numpy.ndarray`, the array is unhashable."""

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
        def device(self) -> Device: ...
        @property
        def readonly(self) -> bool: ...
        @property
        def shape(self) -> tuple[int, ...]: ...
        @property
        def dtype(self) -> np.dtype[Any]: ...
        def _layout(self, writeable: bool = False) -> np.ndarray[Any, Any]: ...
        def _derive(
            self: _A, layout: np.ndarray[Any, Any], view: np.ndarray[Any, Any], dtype: np.dtype[Any]
        ) -> _A: ...
        def _set_writeable(self, writeable: bool) -> None: ...

    def _writable_native(self) -> Any:
        """The native array, for a write: NumPy's ValueError where read-only (also on CuPy)."""
        native = self.array
        if self.readonly:
            raise ValueError(_READONLY)
        return native

    __eq__ = _forms(operator.eq)[0]
    __ne__ = _forms(operator.ne)[0]
    __lt__ = _forms(operator.lt)[0]
    __le__ = _forms(operator.le)[0]
    __gt__ = _forms(operator.gt)[0]
    __ge__ = _forms(operator.ge)[0]
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
    __bool__ = _unary(bool)
    __float__ = _unary(float)
    __int__ = _unary(int)
    __complex__ = _unary(complex)

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
