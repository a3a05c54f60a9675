"""The base of the array's method families: its state, what the array supplies, and the
helpers that unwrap SharedDeviceArrays into their native arrays (arguments, ``out=``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from sharedarrays.backends.device import Device
    from sharedarrays.memory import Allocation, Lease
    from sharedarrays.protocol.payload import ViewTuple

__all__ = ["ArrayBase", "shareable_dtype"]

_A = TypeVar("_A", bound="ArrayBase")

_READONLY = "assignment destination is read-only"  # NumPy's message for the same misuse


def shareable_dtype(dtype: Any, instead: str) -> np.dtype[Any]:
    """``dtype`` as a NumPy dtype, where a shared array can hold it (bool, integer, float or
    complex); else a TypeError saying ``instead``."""
    dt: np.dtype[Any] = np.dtype(dtype)
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(
            f"dtype {dt} is not supported: shared arrays hold bool, integer, float or complex "
            f"numbers (object, string, datetime and structured dtypes cannot be shared); {instead}"
        )
    return dt


def _native(obj: Any) -> Any:
    """The native array of a SharedDeviceArray; anything else as it is."""
    return obj.array if isinstance(obj, ArrayBase) else obj


def _native_nested(obj: Any) -> Any:
    """:func:`_native` through lists, tuples and dicts (``np.concatenate([a, b])``)."""
    if isinstance(obj, ArrayBase):
        return obj.array
    if type(obj) is list:
        return [_native_nested(x) for x in obj]
    if type(obj) is tuple:
        return tuple(_native_nested(x) for x in obj)
    if type(obj) is dict:
        return {k: _native_nested(v) for k, v in obj.items()}
    return obj


def _check_writable(target: Any) -> None:
    """Refuse to write a read-only (or closed) SharedDeviceArray, as NumPy refuses."""
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
    """``result`` with the native arrays of SharedDeviceArray outputs replaced by those."""
    if outs is None:
        return result
    shared = {id(o.array): o for o in outs if isinstance(o, ArrayBase)}
    if isinstance(result, tuple):
        return tuple(shared.get(id(r), r) for r in result)
    return shared.get(id(result), result)


class ArrayBase:
    """The view's state, and what the array supplies to its methods."""

    # the view's state, set by the array
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
        def _layout(self) -> np.ndarray[Any, Any]: ...
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

    def _inplace(self: _A, op: Callable[[Any, Any], Any], other: Any) -> _A:
        op(self._writable_native(), _native(other))
        return self
