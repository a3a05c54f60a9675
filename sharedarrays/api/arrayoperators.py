"""The operators of :class:`~sharedarrays.SharedDeviceArray`: computed on the native array,
new memory as native arrays; the in-place forms write the shared memory and return the view.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from sharedarrays.api.arraybase import ArrayBase, _native

__all__ = ["ArrayOperators"]

_Op = Callable[[Any, Any], Any]


def _binary(op: _Op) -> Callable[[ArrayBase, object], Any]:
    def method(self: ArrayBase, other: object) -> Any:
        return op(self.array, _native(other))

    return method


def _reflected(op: _Op) -> Callable[[ArrayBase, object], Any]:
    def method(self: ArrayBase, other: object) -> Any:
        return op(_native(other), self.array)

    return method


_Method = Callable[[Any, object], Any]


def _forms(op: _Op, iop: _Op) -> tuple[_Method, _Method, _Method]:
    """The operator ``op``, its reflected form, and its in-place form ``iop``."""

    def inplace(self: ArrayBase, other: object) -> Any:
        return self._inplace(iop, other)

    return _binary(op), _reflected(op), inplace


def _unary(op: Callable[[Any], Any]) -> Callable[[ArrayBase], Any]:
    def method(self: ArrayBase) -> Any:
        return op(self.array)

    return method


class ArrayOperators(ArrayBase):
    """Operators over :attr:`array`. Comparisons are elementwise, so, like
    :class:`numpy.ndarray`, the array is unhashable."""

    __slots__ = ()
    __hash__: ClassVar[None]  # type: ignore[assignment]

    __eq__ = _binary(operator.eq)
    __ne__ = _binary(operator.ne)
    __lt__ = _binary(operator.lt)
    __le__ = _binary(operator.le)
    __gt__ = _binary(operator.gt)
    __ge__ = _binary(operator.ge)

    __add__, __radd__, __iadd__ = _forms(operator.add, operator.iadd)
    __sub__, __rsub__, __isub__ = _forms(operator.sub, operator.isub)
    __mul__, __rmul__, __imul__ = _forms(operator.mul, operator.imul)
    __truediv__, __rtruediv__, __itruediv__ = _forms(operator.truediv, operator.itruediv)
    __floordiv__, __rfloordiv__, __ifloordiv__ = _forms(operator.floordiv, operator.ifloordiv)
    __mod__, __rmod__, __imod__ = _forms(operator.mod, operator.imod)
    __divmod__, __rdivmod__ = _binary(divmod), _reflected(divmod)
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
            value: Any = native[()] if isinstance(native, np.ndarray) else native.item()
            return round(value) if ndigits is None else round(value, ndigits)
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
