"""The base of :class:`~sharedarrays.SharedDeviceArray`: its state, operators, NumPy dispatch,
ndarray methods, display and device work over its native array. New memory (``a + 1``,
``np.sqrt(a)``) is native; in-place operations (``a += 1``, ``out=a``) write the shared memory.
"""

from __future__ import annotations

import html
import operator
import sys
from collections.abc import Callable, Iterator, Mapping
from types import EllipsisType, FrameType, MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, runtime_checkable

import numpy as np

from sharedarrays._cpython import caller_frame, frame_function, frame_local
from sharedarrays.backends import Access
from sharedarrays.backends.device import Device, DeviceLike, parse_device
from sharedarrays.errors import ClosedArrayError

if TYPE_CHECKING:
    from sharedarrays.memory import Allocation, Lease
    from sharedarrays.protocol.payload import Payload, ViewTuple

__all__ = ["ArrayBase", "Semaphore", "shareable_dtype"]

_A = TypeVar("_A", bound="ArrayBase")
_Op = Callable[[Any, Any], Any]
_Method = Callable[[Any, object], Any]

_READONLY = "assignment destination is read-only"  # NumPy's message for the same misuse


def shareable_dtype(dtype: Any, instead: str) -> np.dtype[Any]:
    """``dtype`` if a shared array can hold it (bool, int, float, complex), else TypeError."""
    dt: np.dtype[Any] = np.dtype(dtype)
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(
            f"dtype {dt} is not supported: shared arrays hold bool, integer, float or complex "
            f"numbers (object, string, datetime and structured dtypes cannot be shared); {instead}"
        )
    return dt


def _native(obj: Any) -> Any:
    return obj.array if isinstance(obj, ArrayBase) else obj


def _native_nested(obj: Any) -> Any:
    """:func:`_native` through lists, tuples and dicts (``np.concatenate([a, b])``)."""
    if type(obj) in (list, tuple):
        return type(obj)(_native_nested(x) for x in obj)
    if type(obj) is dict:
        return {k: _native_nested(v) for k, v in obj.items()}
    return _native(obj)


def _apply(
    func: Callable[..., Any], args: Any, kwargs: dict[str, Any], native_out: bool = False
) -> Any:
    """``func`` on the native arrays; shared ``out=`` arrays (unless ``native_out``) returned."""
    out = kwargs.get("out")
    outs = out if isinstance(out, tuple) else () if out is None else (out,)
    # the shared outs by their native arrays (refused as NumPy refuses: read-only or closed)
    shared = {id(o._writable_native()): o for o in outs if isinstance(o, ArrayBase)}
    result = func(*_native_nested(args), **_native_nested(kwargs))
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
    if shape is None and newshape is None:
        raise TypeError("reshape() missing 1 required positional argument: 'shape'")
    return a.reshape(newshape if shape is None else shape, order=order, copy=copy)


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


def _methods(writes: bool, *names: str) -> tuple[Callable[..., Any], ...]:
    """The native array's methods ``names`` as the view's (``writes``: in shared memory)."""

    def make(name: str) -> Callable[..., Any]:
        def method(self: ArrayBase, *args: Any, **kwargs: Any) -> Any:
            if writes:
                getattr(self._writable_native(), name)(*[_native(x) for x in args], **kwargs)
                return None
            native = self.array  # (``out=`` as for ufuncs; itself: this view)
            result = _apply(getattr(native, name), args, kwargs)
            return self if result is native else result

        method.__name__ = method.__qualname__ = name
        how = ", in shared memory" if writes else "; a native result"
        method.__doc__ = f"Like :meth:`numpy.ndarray.{name}`{how}."
        return method

    return tuple(map(make, names))


@runtime_checkable
class Semaphore(Protocol):
    """What :meth:`SharedDeviceArray.wait_for` and :meth:`~SharedDeviceArray.signal` take:
    an :class:`~sharedarrays.ExternalSemaphore`, a :class:`~sharedarrays.Timeline`, or any
    object with a ``device`` and these methods ordering that device's current stream."""

    @property
    def device(self) -> Device: ...
    def wait(self, value: int | None) -> None: ...
    def signal(self, value: int | None) -> None: ...


class ArrayBase:
    """The view's state, operators, NumPy dispatch, ndarray methods, display and device work
    over :attr:`array`; unhashable, as comparisons are elementwise."""

    __slots__ = (
        *("_lease", "_dtype", "_shape", "_strides", "_offset", "_readonly", "_native"),
        *("_packed", "_locked"),
    )
    _lease: Lease[Allocation] | None
    _dtype: np.dtype[Any]
    _shape: tuple[int, ...]
    _strides: tuple[int, ...]
    _offset: int
    _readonly: bool
    _native: Any
    _packed: ViewTuple | None
    _locked: bool  # made read-only by setflags(write=False): may be made writable again
    __hash__: ClassVar[None]  # type: ignore[assignment]

    if TYPE_CHECKING:  # supplied by the array (sharedarrays.api.array)

        @property
        def array(self) -> Any: ...
        @property
        def allocation(self) -> Allocation: ...
        def __getitem__(self, key: object) -> Any: ...
        def _layout(self, writeable: bool = False) -> np.ndarray[Any, Any]: ...
        def _derive(self: _A, layout: np.ndarray[Any, Any], view: np.ndarray[Any, Any]) -> _A: ...
        def _on_layout(self: _A, how: Callable[[Any], Any]) -> _A: ...
        def payload(self) -> Payload: ...

    @staticmethod
    def _closed() -> ClosedArrayError:
        return ClosedArrayError("this SharedDeviceArray is closed; attach or load it again")

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

    def get(self) -> np.ndarray[Any, Any]:
        """Copy the data into a new NumPy array in host memory."""
        native = self.array
        if isinstance(native, np.ndarray):
            return np.array(native, copy=True)
        if not hasattr(native, "get") and hasattr(native, "cpu"):  # a torch tensor (torch_npu)
            return np.array(native.detach().cpu().numpy(), copy=True)
        return native.get()  # type: ignore[no-any-return]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        if self.allocation.device.needs_context:
            raise TypeError(
                "Implicit conversion of a CUDA SharedDeviceArray to a NumPy array is not "
                "allowed; use a.get() to copy it to the host"
            )
        native: np.ndarray[Any, Any] = self.array
        if dtype is not None and np.dtype(dtype) != native.dtype:
            if copy is False:
                raise ValueError("a dtype conversion needs a copy")
            return native.astype(dtype)  # (a copy)
        return native.copy() if copy else native

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()  # type: ignore[no-any-return]

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d array")
        return self._shape[0]

    def __iter__(self) -> Iterator[Any]:
        """``a[0]``, ``a[1]``, ... along the first axis."""
        if not self._shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._shape[0]))

    # above CuPy's (100): cupy_array + a defers to a.__radd__, which unwraps a
    __array_priority__ = 200.0

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """Ufuncs on the native arrays; shared ``out=`` arrays are written and returned."""
        # NumPy's x.mean(out=a) divides the sum in place only where it is an ndarray: the
        # native array (the same memory) is returned to be divided there
        native_out = "out" in kwargs and method == "reduce" and _numpy_averages(caller_frame())
        return _apply(getattr(ufunc, method), inputs, kwargs, native_out)

    def __array_function__(
        self, func: Any, types: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """NumPy functions on the native arrays (also in lists, tuples, dicts); ``out=`` and
        ``np.copyto``'s destination write shared memory; layout functions give shared views."""
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
        """The native array's namespace (``numpy``, ``cupy``); asked by array-api-compat, the
        one it gives the native array, so that mixed arrays resolve to one namespace."""
        native = self.array
        frame = caller_frame()
        helpers = frame_function(frame)[0]  # array-api-compat's, or a vendored copy's
        if helpers.endswith("array_api_compat.common._helpers"):
            compat = sys.modules[helpers[: -len(".common._helpers")]]
            use_compat = frame_local(frame, "use_compat")  # (its argument: None, True, False)
            return compat.array_namespace(native, api_version=api_version, use_compat=use_compat)
        namespace = getattr(native, "__array_namespace__", None)
        if namespace is not None:
            return namespace(api_version=api_version)
        return sys.modules[type(native).__module__.partition(".")[0]]

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

    def _allocation_line(self) -> str:
        """One line about the shared memory behind this open view."""
        a = self.allocation
        who = a.origin.role
        served = len({s.pid for s in a.served})
        if served:
            who += f", served to {served} importer{'s' if served != 1 else ''}"
        ro = ", read-only view" if self._readonly else ""
        return (
            f"SharedDeviceArray on {a.device} ({a.backend.name}), allocation {a.id[:12]} "
            f"offset {self._offset}, {who}{ro}"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """Jupyter display: the values and a line about the allocation."""
        bundle = {"text/plain": repr(self)}
        if self._lease is not None:
            bundle["text/html"] = (
                f'<pre class="sa-values">{html.escape(repr(self.array))}</pre>'
                f'<div class="sa-allocation" style="font-size:smaller;opacity:0.75">'
                f"{html.escape(self._allocation_line())} &middot; <code>.show()</code> draws "
                "its memory map</div>"
            )
        return {
            k: v
            for k, v in bundle.items()
            if (not include or k in include) and not (exclude and k in exclude)
        }

    def __repr__(self) -> str:
        """The values as the native array shows them, and a line about the allocation."""
        if self._lease is None:
            return f"<SharedDeviceArray shape={self._shape} dtype={self._dtype} closed>"
        return f"{self.array!r}\n{self._allocation_line()}"

    def __str__(self) -> str:
        """The values alone, as ``str`` of the native array shows them."""
        return repr(self) if self._lease is None else str(self.array)

    def __format__(self, spec: str) -> str:
        """``format(a, spec)`` as the native array formats (``f"{a[0]:.2f}"``)."""
        return format(repr(self) if self._lease is None else self.array, spec)

    def synchronize(self) -> None:
        """Wait until the work queued so far on this array's device is done (every stream
        of its context on CUDA): before another process reads what this one wrote."""
        self.allocation.backend.synchronize()

    @property
    def access(self) -> dict[str, str]:
        """Which devices may touch this array's memory here: ``"rw"`` or ``"r"`` by name."""
        return {str(d): a for d, a in self.allocation.access_by_device.items()}

    def grant(self, device: DeviceLike, mode: Access = "rw") -> None:
        """Let another CUDA device read (``"r"``) or read and write (``"rw"``) this array's
        whole allocation in this process, without copying (``cuMemSetAccess``). ValueError
        for a non-cuda-vmm array, the memory's own device or a bad mode; PeerAccessUnavailable
        where that device cannot reach it; BackendUnavailable: no such device."""
        dev = parse_device(device)
        if not dev.needs_context:
            raise ValueError(f"grant() takes a CUDA device, not {dev}")
        self.allocation.grant(dev.index, mode)

    def wait_for(self, sem: Semaphore, value: int | None = None) -> None:
        """Make later work on this array's device (its current stream) wait for ``sem``, a
        :class:`Semaphore` on that device; ``value``: for timelines, not binary semaphores."""
        self._same_device(sem).wait(value)

    def signal(self, sem: Semaphore, value: int | None = None) -> None:
        """Signal ``sem`` once the work queued so far on this array's device (its current
        stream) is done: a timeline is set to ``value``; a binary semaphore takes none."""
        self._same_device(sem).signal(value)

    def _same_device(self, sem: Semaphore) -> Semaphore:
        if not isinstance(sem, Semaphore):
            raise TypeError(
                f"expected an ExternalSemaphore or a Timeline (an object with a device, wait "
                f"and signal), not {type(sem).__name__}"
            )
        if sem.device != self.allocation.device:
            raise ValueError(
                f"the semaphore is on {sem.device}, this array on {self.allocation.device}"
            )
        return sem


_BASIC_INDEX = (int, slice, EllipsisType, type(None), np.integer)


def assignable(native: Any, value: Any) -> Any:
    """``value`` as ``native[key] = value`` takes it: a ``torch.Tensor`` native (Ascend)
    takes tensors and numbers only; anything else becomes a tensor on its device."""
    torch = sys.modules.get("torch")
    if (
        torch is None
        or not isinstance(native, torch.Tensor)
        or isinstance(value, (torch.Tensor, bool, int, float, complex))
    ):
        return value
    return torch.tensor(np.asarray(value), device=native.device)


def operator_index(n: object, what: str = "size") -> int:
    """``operator.index`` that refuses bools."""
    if isinstance(n, (bool, np.bool_)):
        raise TypeError(f"a bool is not a valid {what}")
    return operator.index(n)  # type: ignore[arg-type]


def check_key(key: object) -> tuple[Any, ...] | None:
    """``key`` as a tuple of basic indices, or ``None`` for an advanced or invalid index (the
    native array's to take or refuse). A basic key (the hot path) pays only type checks."""
    items = key if isinstance(key, tuple) else (key,)
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, _BASIC_INDEX):
            if _as_index(item) is item:
                return None
            return check_key(tuple(_as_index(i) for i in items))
    return items


def _as_index(item: object) -> object:
    """An integer to NumPy (a 0-d integer array, an ``__index__`` object) as its int."""
    if isinstance(item, (bool, np.bool_, int)):
        return item
    dtype = getattr(item, "dtype", None)
    if isinstance(dtype, np.dtype):
        shape = item._shape if isinstance(item, ArrayBase) else getattr(item, "shape", None)
        zero_d = (isinstance(item, ArrayBase) or type(item) is np.ndarray) and shape == ()
        if not (zero_d and dtype.kind in "iu"):
            return item
    elif not hasattr(type(item), "__index__"):
        return item
    return operator.index(item)  # type: ignore[arg-type]


def native_key(key: object) -> object:
    """``key`` with its views replaced by their native arrays."""
    if isinstance(key, ArrayBase):
        return key.array
    if type(key) is tuple and any(isinstance(i, ArrayBase) for i in key):
        return tuple(i.array if isinstance(i, ArrayBase) else i for i in key)
    return key
