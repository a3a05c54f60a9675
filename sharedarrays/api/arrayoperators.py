"""The operators of :class:`~sharedarrays.SharedDeviceArray` (comparisons, arithmetic and
bitwise, unary, scalar conversions): computed on the native array, new memory as native
arrays; the in-place forms write the shared memory and return the view itself.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import numpy as np

from sharedarrays.api.arraybase import _A, ArrayBase, _native

__all__ = ["ArrayOperators"]


class ArrayOperators(ArrayBase):
    """Operators over :attr:`array`. Comparisons are elementwise, so, like
    :class:`numpy.ndarray`, the array is unhashable."""

    __slots__ = ()
    __hash__: ClassVar[None]  # type: ignore[assignment]

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
