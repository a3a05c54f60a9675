"""SharedDeviceArray: a view (dtype, shape, strides, byte offset) over an allocation.

Views of one allocation share it; pickling a view never copies data: it writes a payload
(see :mod:`sharedarrays.protocol.payload`) that another process of the same user turns back
into a view of the same memory (:func:`load`: :mod:`sharedarrays.importing` finds or maps
the allocation, this module makes the view).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import sys
from collections.abc import Callable, Iterator
from multiprocessing import reduction
from types import EllipsisType
from typing import Any, Protocol, TypeVar, cast, overload, runtime_checkable

import numpy as np

from sharedarrays import importing
from sharedarrays._cpython import caller_frame, spawning_process
from sharedarrays.api import keeping, message, othernode, views
from sharedarrays.api.arraybase import _READONLY
from sharedarrays.api.arraymethods import NativeArrayMethods
from sharedarrays.backends import Access, NativeView, get_backend
from sharedarrays.backends.device import Device, DeviceLike, parse_device
from sharedarrays.errors import (
    ClosedArrayError,
    MisalignedView,
    PayloadError,
    ResizeRefused,
    WrongNode,
)
from sharedarrays.memory import Allocation, Lease, live_allocations
from sharedarrays.protocol.payload import (
    Payload,
    ViewFields,
    ViewTuple,
    contiguous_strides,
    misaligned,
    view_extent,
)

__all__ = ["SharedDeviceArray", "Semaphore", "load", "synchronize"]

_T = TypeVar("_T")
_BASIC_INDEX = (int, slice, EllipsisType, type(None), np.integer)


@runtime_checkable
class Semaphore(Protocol):
    """What :meth:`SharedDeviceArray.wait_for` and :meth:`~SharedDeviceArray.signal` take:
    a :class:`~sharedarrays.ExternalSemaphore`, a :class:`~sharedarrays.Timeline`, or any
    object with a ``device`` and these two methods, which order the work of the current
    stream on that device."""

    @property
    def device(self) -> Device: ...

    def wait(self, value: int | None) -> None: ...

    def signal(self, value: int | None) -> None: ...


def _check_key(key: object) -> tuple[Any, ...] | None:
    """Return ``key`` as a tuple of basic indices, or ``None`` where it is not one: an
    advanced index (an integer or boolean array, a list, a range, a bool), which a view cannot
    hold, or no index at all (a float, a string), which the native array refuses with its own
    ``IndexError``.

    The cheap type checks come first: a basic key (the hot path) pays for nothing else."""
    items = key if isinstance(key, tuple) else (key,)
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, _BASIC_INDEX):
            kind = _index_kind(item)
            if kind == "i" and _is_zero_d(item):
                # a 0-d integer array or view indexes as its value does (as in NumPy)
                return _check_key(tuple(_zero_d_index(i) for i in items))
            if kind == "" and hasattr(type(item), "__index__"):
                # any object with __index__ is an integer index to NumPy
                return _check_key(tuple(_as_index(i) for i in items))
            return None
    return items


def _as_index(item: object) -> object:
    """``item`` as NumPy takes it in a key: an object with ``__index__`` (not an array, not a
    bool) as its integer."""
    if (
        not isinstance(item, (bool, np.bool_, int))
        and _index_kind(item) == ""
        and hasattr(type(item), "__index__")
    ):
        return operator.index(item)  # type: ignore[arg-type]
    return item


def _index_kind(item: object) -> str:
    """The dtype kind of an array-like or NumPy scalar key item (``"b"``, ``"i"``, ``"u"``,
    ``"f"``, ...), ``"i"`` for an int, ``""`` for a list or anything else."""
    if isinstance(item, (bool, np.bool_)):
        return "b"
    if isinstance(item, int):
        return "i"
    dtype = getattr(item, "dtype", None)
    if isinstance(dtype, np.dtype):
        return "i" if dtype.kind == "u" else dtype.kind
    return ""


def _is_zero_d(item: object) -> bool:
    """Whether ``item`` is a 0-d view or NumPy array (of any dtype: see
    :func:`_index_kind`)."""
    return (type(item) is SharedDeviceArray or type(item) is np.ndarray) and item.ndim == 0


def _zero_d_index(item: object) -> object:
    """``item``, or its value where it is a 0-d integer view or NumPy array (another 0-d
    one stays, for :func:`_check_key` to leave to the native array)."""
    if _index_kind(item) == "i" and _is_zero_d(item):
        return operator.index(item)  # type: ignore[arg-type]
    return item


def _native_key(key: object) -> object:
    """``key`` for the native array's own indexing (reads and writes): its views as native
    arrays."""
    if type(key) is SharedDeviceArray:
        return key.array
    if type(key) is tuple and any(type(i) is SharedDeviceArray for i in key):
        return tuple(i.array if type(i) is SharedDeviceArray else i for i in key)
    return key


class _Probe:
    """A NumPy array interface over an address that is never read: used to let NumPy work
    out the layout of a basic-indexing view without touching (possibly device) memory."""

    __slots__ = ("__array_interface__",)

    def __init__(
        self, address: int, dtype: np.dtype[Any], shape: tuple[int, ...], strides: tuple[int, ...]
    ) -> None:
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": dtype.str,
            "strides": strides,
            "data": (address, True),
        }


class SharedDeviceArray(NativeArrayMethods):
    """An array in memory that other processes can map without copying.

    Create one with :func:`sharedarrays.empty`, :func:`~sharedarrays.zeros`,
    :func:`~sharedarrays.full` or :func:`~sharedarrays.from_array`; pass it to another process
    by pickling it (multiprocessing does this for you).

    Lifecycle
    ---------
    :meth:`close` closes this view: later use of its data raises :class:`ClosedArrayError`.
    The allocation's mapping in this process is released when no open view and no native array
    (from :attr:`array`) refers to it any more; other processes are not affected. The memory
    itself is freed when the last process that maps it or holds one of its handles lets go.

    Arithmetic
    ----------
    It acts like its native array (see :mod:`sharedarrays.api.arraymethods`): operators,
    methods and NumPy functions compute on :attr:`array`; new results are native arrays,
    in-place operations write the shared memory, and shape views (``a.T``, ``a.reshape``,
    ...) are SharedDeviceArrays of the same allocation.
    """

    __slots__ = (
        "_lease",
        "_dtype",
        "_shape",
        "_strides",
        "_offset",
        "_readonly",
        "_locked",
        "_native",
        "_interfaced",
        "_packed",
        "_base",
        "__weakref__",
    )

    def __init__(
        self,
        allocation: Allocation,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        readonly: bool = False,
    ) -> None:
        low, high = view_extent(dtype.itemsize, shape, strides)
        if (
            offset + low < 0
            or offset + high > allocation.size
            or not 0 <= offset <= allocation.size
        ):
            raise ValueError("view reaches outside its allocation")
        if allocation.device.needs_context:  # device memory: aligned views only
            why = misaligned(dtype, shape, strides, offset)
            if why:
                raise MisalignedView(
                    f"{why}. Copy the bytes first (a.array[...].copy().view(dtype))"
                )
        self._init(allocation, dtype, shape, strides, offset, readonly, offset + high)

    def _init(
        self,
        allocation: Allocation,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        readonly: bool,
        end: int,
        lease: Lease[Allocation] | None = None,
    ) -> None:
        # (``lease``: one this view shares, which a message's views of one allocation do)
        self._lease: Lease[Allocation] | None = allocation.lease(end) if lease is None else lease
        self._dtype = dtype
        self._shape = shape
        self._strides = strides
        self._offset = offset
        self._readonly = readonly
        self._locked = False  # (made read-only by setflags(write=False): may be unlocked)
        self._native: Any = None
        # (the native array whose __cuda_array_interface__ was handed out: kept until this
        # view goes, since the consumer holds this view and not the native array)
        self._interfaced: Any = None
        self._packed: ViewTuple | None = None  # the view's fields as a pickle carries them
        self._base: SharedDeviceArray | None = None
        if views.tracking:
            views.track(self)

    # metadata ---------------------------------------------------------------------------
    @property
    def base(self) -> SharedDeviceArray | None:
        """The view this one was derived from (indexing, ``T``, ``reshape``, ... of it), as
        :attr:`numpy.ndarray.base` names the array a view looks into; ``None`` for a view made
        by a constructor or loaded from a payload (whose provenance is :attr:`allocation`:
        every view of the same memory shares it)."""
        return self._base

    @property
    def shape(self) -> tuple[int, ...]:
        """Length of each axis."""
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        """Element type."""
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        """Bytes to step in each axis (may be negative)."""
        return self._strides

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for s in self._shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the elements (``size * itemsize``)."""
        return self.size * self._dtype.itemsize

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._dtype.itemsize

    @property
    def offset(self) -> int:
        """Byte offset of the first element from the start of the allocation."""
        return self._offset

    @property
    def readonly(self) -> bool:
        """Whether writes through this view are refused."""
        return self._readonly

    def _set_writeable(self, writeable: bool) -> None:
        if self._lease is None:
            raise _closed()
        if writeable == (not self._readonly):
            return
        if writeable and not self._locked:
            # (read-only as made: a read-only export, its pickle, or derived from such a view)
            raise ValueError("cannot set WRITEABLE flag to True of this array")  # (NumPy's)
        self._readonly = not writeable
        self._locked = not writeable
        self._native = None  # (the next native array and pickle carry the new flag)
        self._packed = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called on this view."""
        return self._lease is None

    @property
    def allocation(self) -> Allocation:
        """The reservation, chunks, mappings and origin behind this view."""
        lease = self._lease
        if lease is None:
            raise _closed()
        return lease.allocation

    @property
    def device(self) -> Device:
        """Where the memory lives; equal to its name too (``a.device == "cuda:0"``)."""
        return self.allocation.device

    def synchronize(self) -> None:
        """Wait until the work queued so far on this array's device is done (on CUDA every
        stream of the device's context, ``cuCtxSynchronize``; nothing to wait for on the
        host). Call it before another process reads what this one wrote."""
        self.allocation.backend.synchronize()

    @property
    def access(self) -> dict[str, str]:
        """Which devices may touch this array's memory in this process, and how (``"rw"``,
        ``"r"``): the memory's own device and every peer granted access."""
        return {str(d): a for d, a in self.allocation.access_by_device.items()}

    def grant(self, device: DeviceLike, mode: Access = "rw") -> None:
        """Let another CUDA device read (``"r"``) or read and write (``"rw"``) this array's
        memory in this process, over NVLink or PCIe, without copying (``cuMemSetAccess``).
        The grant covers the whole allocation (every view of it) in this process; other
        processes grant their own devices (an importer whose current device is another one
        is granted it when it loads the array).

        Raises
        ------
        ValueError
            Not a cuda-vmm array, the memory's own device, or a bad mode.
        PeerAccessUnavailable
            That device cannot reach this memory (``cuDeviceCanAccessPeer`` is 0).
        BackendUnavailable
            No such device.
        """
        dev = parse_device(device)
        if not dev.needs_context:
            raise ValueError(f"grant() takes a CUDA device, not {dev}")
        self.allocation.grant(dev.index, mode)

    @property
    def backend(self) -> str:
        """Name of the memory system: ``"host"``, ``"cuda-vmm"``, ``"cuda-ipc"`` or
        ``"cuda-pool"``."""
        return self.allocation.backend.name

    @property
    def address(self) -> int:
        """Address of the first element in this process."""
        return self.allocation.address + self._offset

    # data -------------------------------------------------------------------------------
    @property
    def array(self) -> Any:
        """The zero-copy native array: a :class:`numpy.ndarray` on ``cpu``, a
        :class:`cupy.ndarray` on CUDA (and ROCm with CuPy's ROCm build), a ``torch.Tensor``
        on Ascend with torch_npu (see the user guide). It keeps the mapping alive while it
        exists."""
        native = self._native
        if native is None:
            lease = self._lease
            if lease is None:
                raise _closed()
            alloc = lease.allocation  # (self.allocation, without its frame)
            if alloc.derives_natives:  # one native memory per allocation
                native = self._native = alloc.native_view(
                    self._offset, self._dtype, self._shape, self._strides, self._readonly
                )
                return native
            native = alloc.backend.as_native(
                NativeView(
                    alloc.address,
                    alloc.size,
                    self._offset,
                    # the native array holds the mapping (and its addresses) through this view's
                    # lease, pinned: it ends when both are gone (the native may outlive the view)
                    alloc.pin(lease),
                    self._dtype,
                    self._shape,
                    self._strides,
                    self._readonly,
                    alloc.native_device,
                )
            )
            self._native = native
        return native

    def __getitem__(self, key: object) -> Any:
        """``a[key]`` as the native array reads it.

        A basic index (integers, slices, ``...``, ``None``) gives a view of the same
        allocation; where it picks one element (integers for every axis, no ``...``), what
        the native array gives: on host memory NumPy's scalar (a copy of the value: ``a[0],
        a[1] = a[1], a[0]`` swaps, ``x = a[0]`` keeps its value), on a GPU CuPy's 0-d view.

        An advanced index (an integer or boolean array, a list, a range, a bool) gives what
        NumPy and CuPy give: a new native array, a **copy** (not shared, so later writes to
        either are not seen by the other). Writes through one (``a[mask] = 0``,
        ``a[[0, 2]] += 1``) go in place to the shared memory (:meth:`__setitem__`)."""
        items = _check_key(key)
        if items is None:  # (after the basic path's cheap type checks only)
            return self.array[_native_key(key)]
        ellipsis = any(i is Ellipsis for i in items)
        if not ellipsis:
            items = (*items, Ellipsis)  # keeps NumPy from returning a scalar it would read
        layout = self._layout()
        view = layout[items]
        if not ellipsis and not view.ndim:
            native = self.array
            if type(native) is np.ndarray:  # (NumPy's scalar; CuPy's and torch's: 0-d)
                return native[cast(Any, _native_key(key))]
        return self._derive(layout, view, self._dtype)

    def _layout(self) -> np.ndarray[Any, Any]:
        base = self.allocation.address + self._offset
        return np.asarray(_Probe(base, self._dtype, self._shape, self._strides))

    def _derive(
        self, layout: np.ndarray[Any, Any], view: np.ndarray[Any, Any], dtype: np.dtype[Any]
    ) -> SharedDeviceArray:
        delta = view.__array_interface__["data"][0] - layout.__array_interface__["data"][0]
        derived = SharedDeviceArray(
            self.allocation,
            dtype,
            tuple(view.shape),
            tuple(view.strides),
            self._offset + delta,
            self._readonly,
        )
        derived._base = self if self._base is None else self._base
        return derived

    def __setitem__(self, key: object, value: object) -> None:
        """Write through to shared memory: any index the native array takes (basic, or
        advanced: ``a[mask] = 0``, ``a[[0, 2]] = x`` write the elements in place)."""
        if self._readonly:
            raise ValueError(_READONLY)
        native = self.array
        if not isinstance(value, type(native)) and (
            isinstance(value, (np.ndarray, SharedDeviceArray))
            or hasattr(value, "__cuda_array_interface__")
            or hasattr(value, "__dlpack__")
        ):
            value = self.allocation.backend.to_native(value)  # e.g. NumPy into CuPy
        native[_native_key(key)] = assignable(native, value)

    def get(self) -> np.ndarray[Any, Any]:
        """Copy the data into a new NumPy array in host memory."""
        native = self.array
        if isinstance(native, np.ndarray):
            return np.array(native, copy=True)
        if not hasattr(native, "get") and hasattr(native, "cpu"):  # a torch tensor (torch_npu)
            return np.array(native.detach().cpu().numpy(), copy=True)
        return native.get()  # type: ignore[no-any-return]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        if self.device.needs_context:
            raise TypeError(
                "Implicit conversion of a CUDA SharedDeviceArray to a NumPy array is not "
                "allowed; use a.get() to copy it to the host"
            )
        native: np.ndarray[Any, Any] = self.array
        if copy:
            native = native.copy()
        if dtype is not None and np.dtype(dtype) != native.dtype:
            if copy is False:
                raise ValueError("a dtype conversion needs a copy")
            native = native.astype(dtype)
        return native

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.array.__dlpack_device__()  # type: ignore[no-any-return]

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface (v3) of CUDA arrays; absent on ``cpu`` arrays.

        A consumer (``cupy.asarray(a)``, ``torch.as_tensor(a, device="cuda")``, Numba) keeps
        this view alive, not the native array whose pointer it reads: so the memory stays
        mapped here until this view is gone, also after :meth:`close` (which then refuses
        further access through the view, and releases the mapping when the consumer lets
        go of the view)."""
        if not self.device.is_cuda:
            raise AttributeError("a cpu SharedDeviceArray has no __cuda_array_interface__")
        native = self.array
        self._interfaced = native
        return native.__cuda_array_interface__  # type: ignore[no-any-return]

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d array")
        return self._shape[0]

    def __iter__(self) -> Iterator[Any]:
        """``a[0]``, ``a[1]``, ... along the first axis: views, or for a 1-d array what the
        native array gives (NumPy's scalars on host memory, CuPy's 0-d views on a GPU)."""
        if not self._shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._shape[0]))

    # lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Close this view.

        Later data access through it raises :class:`ClosedArrayError`. When no open view and
        no native array in this process refers to the allocation any more, its mapping is
        released (synchronised first on CUDA) and its handles closed here. Other processes
        keep their mappings. Closing twice is allowed. (A view whose
        ``__cuda_array_interface__`` was read keeps the mapping until the view itself is
        gone: the consumer's array holds the view.)
        """
        self._native = None
        self._lease = None

    def __enter__(self) -> SharedDeviceArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def show(self, *, interval: float = 2.0, auto_refresh: bool = False) -> Any:
        """The memory map of this view's allocation (see :func:`sharedarrays.show`): a live
        ipywidgets ``VBox`` in a Jupyter kernel, else a :class:`~sharedarrays.MemoryMap`."""
        from sharedarrays.api.widgets import show

        return show(self, interval=interval, auto_refresh=auto_refresh)

    def _allocation_line(self) -> str:
        """One line about the shared memory behind this view: backend, device, allocation,
        and who shares it. Reads metadata only."""
        lease = self._lease
        if lease is None:
            return f"SharedDeviceArray shape={self._shape} dtype={self._dtype}, closed"
        a = lease.allocation
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
        """Jupyter display: the values (text, and HTML ``<pre>``) and a line about the
        allocation; :meth:`show` draws its memory map. A closed view is text only."""
        if self._lease is None:
            bundle: dict[str, Any] = {"text/plain": repr(self)}
        else:
            import html  # (only Jupyter asks: not at ``import sharedarrays``)

            values, line = repr(self.array), self._allocation_line()
            bundle = {
                "text/plain": f"{values}\n{line}",
                "text/html": (
                    f'<pre class="sa-values">{html.escape(values)}</pre>'
                    f'<div class="sa-allocation" style="font-size:smaller;opacity:0.75">'
                    f"{html.escape(line)} &middot; <code>.show()</code> draws its memory map"
                    "</div>"
                ),
            }
        if include:
            bundle = {k: v for k, v in bundle.items() if k in include}
        if exclude:
            bundle = {k: v for k, v in bundle.items() if k not in exclude}
        return bundle

    def __repr__(self) -> str:
        """The values as NumPy (on the host) or CuPy (on CUDA) show them, and a line about
        the allocation; a closed view says so without touching memory."""
        if self._lease is None:
            return f"<SharedDeviceArray shape={self._shape} dtype={self._dtype} closed>"
        return f"{self.array!r}\n{self._allocation_line()}"

    def __str__(self) -> str:
        """The values as ``str`` of the native array shows them, and nothing else (as
        NumPy's: ``print(a)`` and ``f"{a[0]}"`` show values; :func:`repr` and a notebook's
        display add the line about the allocation)."""
        if self._lease is None:
            return repr(self)
        return str(self.array)

    def __format__(self, spec: str) -> str:
        """``format(a, spec)`` and f-strings, as the native array formats: a 0-d view takes
        a number's format (``f"{a[0]:.2f}"``); any other takes only an empty one."""
        if self._lease is None:
            return format(repr(self), spec)
        return format(self.array, spec)

    # pickling ---------------------------------------------------------------------------
    def payload(self) -> Payload:
        """What a pickle of this view carries (starts this process's handle server), as one
        payload: its allocation's fields and this view's."""
        return dataclasses.replace(
            message.allocation_payload(self.allocation),
            dtype=self._dtype,
            shape=self._shape,
            strides=self._strides,
            offset=self._offset,
            readonly=self._readonly or self.allocation.export_readonly,
        )

    def _view_tuple(self) -> ViewTuple:
        """The view's fields as a pickle carries them beside its allocation's payload (made
        once per view: they change only when a growable array's view is resized)."""
        packed = self._packed
        if packed is None:
            view = ViewFields(
                self._offset,
                _intern(self._shape),
                _intern(self._strides),
                self._dtype,
                self._readonly,
            )
            offset, shape, strides, dtype, readonly = view.to_tuple()
            packed = self._packed = (offset, shape, strides, _intern(dtype), readonly)
        return packed

    # growth -----------------------------------------------------------------------------
    def resize(self, length: int) -> None:
        """Change the length along axis 0 of a growable array, in place, without copying.

        Growing maps new chunks at the end of the reservation: existing data and the
        address of every element stay where they are, and the new rows are uninitialised
        (zeros on the host). Growing past the capacity moves the allocation to a reservation
        of at least twice the capacity (the slow path: the same chunks mapped again, still
        no copy); :attr:`address` then changes, while native arrays made before keep the old
        addresses, which stay mapped until they are gone. Shrinking unmaps the whole chunks
        past the new end.

        Only an array made with ``capacity=`` can resize, only in the process that created
        it, and only through a C-contiguous view that starts at the allocation's first byte
        (the array as created, or ``a[:k]``). Other views keep their shape and stay valid.
        Importers see the growth on their next load or :meth:`refresh`; the exporter
        refuses to unmap chunks that a still-running process was served.

        Parameters
        ----------
        length : int
            The new length of axis 0.

        Raises
        ------
        ValueError
            Not a growable array, not such a view, or a negative length.
        ResizeRefused
            A shrink would unmap chunks that a view or native array here, or a running
            process that imported them, may still use; or this process is an importer.
        """
        if isinstance(length, (bool, np.bool_)):
            raise TypeError("a bool is not a valid length")
        n = operator.index(length)
        if n < 0:
            raise ValueError(f"a length is not negative, got {n}")
        alloc, row = self._row_bytes("resize")
        if not alloc.origin.created_here:
            how = (
                "inherited it through fork"
                if alloc.source_server is None
                else "imported it; call a.refresh() to see its current length"
            )
            raise ResizeRefused(
                f"only the process that created a growable array resizes it (pid "
                f"{alloc.origin.pid}); this one {how}"
            )
        nbytes = n * row
        with alloc.growth_lock:
            if nbytes > alloc.size:
                alloc.grow(nbytes)
            elif n < self._shape[0]:
                if self._native is not None and self._lease is not None:
                    # the native array shares the view's lease, which reaches the old end:
                    # the view takes a lease of its own; the old one ends with the native
                    # (no other reference to it may stay here while shrinking)
                    end = self._lease.end
                    self._native = None
                    self._lease = alloc.lease(end)
                alloc.shrink(nbytes, exclude=self._lease)
            alloc.used = nbytes
            self._set_length(n)

    def append(self, values: Any) -> None:
        """Append one row (shape ``a.shape[1:]``) or rows (shape ``(k, *a.shape[1:])``)
        along axis 0 of a growable array, in place (see :meth:`resize`)."""
        alloc, _ = self._row_bytes("append to")
        if self._readonly:
            raise ValueError(_READONLY)
        src = alloc.backend.to_native(values)
        if src.ndim == self.ndim - 1:
            src = src.reshape((1, *src.shape))
        if src.ndim != self.ndim or tuple(src.shape[1:]) != self._shape[1:]:
            raise ValueError(
                f"cannot append values of shape {tuple(src.shape)} to an array of shape "
                f"{self._shape}: give one row of shape {self._shape[1:]} or rows of shape "
                f"(k, {', '.join(map(str, self._shape[1:]))})".replace(", )", ")")
            )
        start = self._shape[0]
        self.resize(start + src.shape[0])
        try:
            self.array[start:] = src
        except BaseException:
            self.resize(start)
            raise

    def refresh(self) -> None:
        """Set the length along axis 0 of a growable array to its exporter's current length.

        In an importer this asks the exporter's handle server and maps the chunks it added
        since (never copying, :func:`sharedarrays.importing.catch_up`); in the exporter it
        takes the length of the last resize. Same view conditions as :meth:`resize`.
        """
        alloc, row = self._row_bytes("refresh")
        if not alloc.origin.created_here:
            importing.catch_up(alloc)
        self._set_length(min(alloc.used, alloc.size) // row)

    def _row_bytes(self, what: str) -> tuple[Allocation, int]:
        """The allocation and the bytes per row of a view that may change its length."""
        alloc = self.allocation
        if not alloc.growable:
            raise ValueError(
                f"cannot {what} an array made without capacity=: only arrays created with "
                "sa.empty(..., capacity=...) (or zeros/full/from_array with capacity=) can grow"
            )
        if self.ndim == 0:
            raise ValueError(f"cannot {what} a 0-d array")
        if self._offset != 0 or self._strides != contiguous_strides(self._shape, self.itemsize):
            raise ValueError(
                f"cannot {what} this view: only a C-contiguous view that starts at the "
                "allocation's first byte (the array as created, or a[:k]) changes length along "
                f"axis 0; this one has offset {self._offset} and strides {self._strides}"
            )
        row = self.itemsize
        for n in self._shape[1:]:
            row *= n
        if row == 0:
            raise ValueError(f"cannot {what} an array whose rows hold no bytes")
        return alloc, row

    def _set_length(self, length: int) -> None:
        """Give this view ``length`` rows: a new lease reaching its new end, no cached
        native array or payload."""
        alloc = self.allocation
        shape = (length, *self._shape[1:])
        _, high = view_extent(self.itemsize, shape, self._strides)
        lease = alloc.lease(self._offset + high)
        self._shape = shape
        self._native = None
        self._packed = None
        self._lease = lease

    # ordering ---------------------------------------------------------------------------
    def wait_for(self, sem: Semaphore, value: int | None = None) -> None:
        """Make later work on this array's device (its current stream) wait for ``sem``.

        Parameters
        ----------
        sem : ExternalSemaphore or Timeline
            A semaphore another API exported (:meth:`ExternalSemaphore.from_fd`), or a
            :class:`~sharedarrays.Timeline` counter (any :class:`Semaphore`); it must be on
            this array's device.
        value : int, optional
            The value to wait for: required for timelines, omitted for binary semaphores.
        """
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
        if sem.device != self.device:
            raise ValueError(f"the semaphore is on {sem.device}, this array on {self.device}")
        return sem

    def park(self) -> None:
        """Hand this array's handles to this user's keeper (started if needed), so that a
        payload of it (``pickle.dumps(a)``) still loads after this process exits.

        Idempotent. The keeper holds the memory until :meth:`unpark` is called in some
        process; see :mod:`sharedarrays.api.named` and :mod:`sharedarrays.api.keeping`.
        """
        keeping.keep(self, None)

    def unpark(self) -> None:
        """Let the keeper drop this parked array: the memory returns once no process maps
        it. Raises :class:`~sharedarrays.NameNotFound` if the keeper does not hold it."""
        keeping.unpark(self.allocation)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce(False, self)

    def __dask_tokenize__(self) -> tuple[Any, ...]:
        """Dask's token of this view, made without pickling it (a pickle would count a
        payload in flight that no one loads): its allocation and layout. Like a pickle's, it
        does not change when the values do: submit tasks that must see new values with
        ``pure=False``."""
        alloc = self.allocation
        return (
            "sharedarrays",
            alloc.id,
            self._offset,
            self._dtype.str,
            self._shape,
            self._strides,
            self._readonly,
        )


views.register(SharedDeviceArray)

reduce_hooks: dict[str, Callable[[], None]] = {}
"""Hooks that wait for a module: ``{module name: hook}``; when a view is pickled by any
pickler but multiprocessing's and the module is imported, the hook is called once and
dropped. ``api/dask.py`` waits here for distributed's serialization, to register with it
(distributed pickles with ``pickle`` or cloudpickle, never with multiprocessing's
``ForkingPickler``, so a Pool's handoffs need not ask)."""


_interned: dict[Any, Any] = {}
"""Shapes, strides and dtype strings of pickled views, one object each (up to 4,096): pickle's
memo writes each once per message, and the importer makes one object for all its views."""


def _intern(value: _T) -> _T:
    """The one object equal to ``value`` (a shape, strides or dtype string of this process's
    views: only ints and strs, whose equality is their type's)."""
    if len(_interned) >= 4096:
        _interned.clear()
    return _interned.setdefault(value, value)  # type: ignore[no-any-return]


def _reduce(for_multiprocessing: bool, a: SharedDeviceArray) -> tuple[Any, tuple[Any, ...]]:
    """The one reduction of a view ``a``: :func:`_rebuild_view`, its allocation's part of
    the message being pickled (:func:`sharedarrays.api.message.message_part`: the
    allocation's payload, the message's ordering fence and, where the chunks' fds travel
    with it, those fds as multiprocessing's DupFd; written once per message) and the view's
    own fields.

    ``for_multiprocessing``: pickled by multiprocessing's ``ForkingPickler`` (registered
    with it as ``partial(_reduce, True)``: one frame per view), where the arguments of a
    Process being spawned carry the chunk fds themselves, so that the child needs no
    connection; ``False``: any other pickler (:meth:`SharedDeviceArray.__reduce__`).

    Raises
    ------
    ClosedArrayError
        The view is closed.
    """
    lease = a._lease
    if lease is None:
        raise _closed()
    alloc = lease.allocation  # (a.allocation, without its frame)
    # (a growable array's chunks come from its handle server, which records who maps them)
    # (and exporter-owned memory's exporter must see every importer, to outlive it)
    carry_fds = (
        for_multiprocessing
        and spawning_process() is not None
        and alloc.allow_pids is None
        and not alloc.growable
        and alloc.backend.maps
    )
    # The hooks wait for a module that pickles with a pickler of its own (distributed's
    # serialization, api/dask.py), never with multiprocessing's: only other picklers ask.
    # (against sys.modules' keys view: isdisjoint then walks the smaller side, the hooks,
    # where a plain dict argument would be walked whole, every module, for every view)
    if (
        reduce_hooks
        and not for_multiprocessing
        and not reduce_hooks.keys().isdisjoint(sys.modules.keys())
    ):
        for name in [name for name in reduce_hooks if name in sys.modules]:
            reduce_hooks.pop(name)()
    packed = a._packed
    if packed is None:
        packed = a._view_tuple()
    return _rebuild_view, (message.message_part(alloc, carry_fds), packed)


reduction.ForkingPickler.register(SharedDeviceArray, functools.partial(_reduce, True))


def load(
    data: bytes | Payload, sync: bytes | None = None, fds: tuple[Any, ...] | None = None
) -> SharedDeviceArray:
    """Turn a payload back into a view, mapping its allocation on first sight.

    The allocation is found by :func:`sharedarrays.importing.load_payload`: already mapped
    here, else from the handles that travelled with the payload, its exporter's handle
    server, or this user's keeper.

    Parameters
    ----------
    data : bytes or Payload
        The payload: :meth:`SharedDeviceArray.payload` or its ``to_bytes()`` (the bytes of
        ``pickle.dumps(a)`` are a pickle, not a payload: ``pickle.loads`` them).
    sync : bytes, optional
        The ordering token that travelled with it (an IPC event on CUDA): this process's
        current stream waits for it before the view is returned.
    fds : tuple, optional
        Handles that travelled with it (multiprocessing's DupFd objects), if any.

    Raises
    ------
    PayloadError
        Malformed or altered payload, or one that does not match the allocation.
    HandleUnavailable
        The allocation is not mapped here and its exporter is gone.
    PermissionDenied
        Another user, or the wrong secret.
    BackendUnavailable
        Its memory system cannot be used in this process.
    """
    if isinstance(data, (str, os.PathLike)):
        hint = ""
        if os.path.isfile(data):
            hint = (
                f"; {os.fspath(data)!r} is a file: to share an array saved with NumPy, "
                "use sa.from_array(numpy.load(path))"
            )
        raise PayloadError(
            "sa.load takes a payload (a.payload() or a.payload().to_bytes()), "
            f"not a {type(data).__name__}" + hint
        )
    if isinstance(data, Payload):
        data = data.to_bytes()
    elif isinstance(data, (bytes, bytearray)) and bytes(data[:1]) == b"\x80":
        raise PayloadError(
            "these bytes are a pickle (of pickle.dumps(a)), not a payload: load them with "
            "pickle.loads(data); sa.load takes a.payload() or a.payload().to_bytes()"
        )
    p = Payload.from_bytes(data)
    part = message.ReceivedPart(p, sync, fds)
    # (the payload's view as a pickle carries one, checked against the part as a pickled
    # view is: one way to a view)
    view = p.view_fields().to_tuple()
    return cast("SharedDeviceArray", _rebuild_view(part, view))  # (not read by distributed)


def synchronize(device: DeviceLike = None) -> None:
    """Wait until the work queued so far on a device is done (as
    :meth:`SharedDeviceArray.synchronize`).

    Parameters
    ----------
    device : str, int, torch.device, cupy.cuda.Device or None
        The device; ``None`` (the default): every device on which this process has shared
        memory mapped. Nothing to wait for on ``"cpu"``.

    Raises
    ------
    BackendUnavailable
        The device asked for cannot be used here.
    """
    if device is not None:
        get_backend(parse_device(device)).synchronize()
        return
    done: set[int] = set()
    for alloc in live_allocations():
        backend = alloc.backend
        if id(backend) not in done:
            done.add(id(backend))
            backend.synchronize()


def assignable(native: Any, value: Any) -> Any:
    """``value`` as ``native[key] = value`` takes it.

    A ``torch.Tensor`` (the native array of Ascend memory where torch_npu is installed)
    takes tensors and Python numbers, not NumPy arrays ("can't assign a numpy.ndarray to a
    torch.FloatTensor"): anything else becomes a tensor on the native's device (a copy of
    the values, as assigning makes anyway). Every other native takes ``value`` as it is.
    """
    torch = sys.modules.get("torch")
    if (
        torch is None
        or not isinstance(native, torch.Tensor)
        or isinstance(value, (torch.Tensor, bool, int, float, complex))
    ):
        return value
    return torch.tensor(np.asarray(value), device=native.device)


@overload
def _rebuild_view(part: bytes, view: object = None, fds: object = None) -> message.ReceivedPart: ...


@overload
def _rebuild_view(
    part: message.ReceivedPart | message.MessagePart, view: object
) -> SharedDeviceArray | othernode.OtherNodeArray: ...


def _rebuild_view(
    part: object = None, view: object = None, fds: object = None, *extra: object
) -> SharedDeviceArray | othernode.OtherNodeArray | message.ReceivedPart:
    """What a pickled view calls: its allocation's part of the message (a
    :class:`~sharedarrays.api.message.ReceivedPart`, made once per message by the
    unpickler: the payload decoded, the allocation found or mapped at its first view) and
    the view's own fields ``view`` (a :class:`ViewFields` tuple, checked against the
    allocation's payload).

    The part calls it too, with the allocation's payload bytes, the message's ordering
    token and the carried fds, if any: that is
    :func:`~sharedarrays.api.message.import_part` (registered with
    :func:`~sharedarrays.api.message.use_reconstructor`: a message names one function).

    A payload of another node raises :class:`~sharedarrays.WrongNode`, except where
    distributed's own unpickler reads it (a task's specification on a worker of another
    node): there the refusal is deferred to the first use of the array, an
    :class:`~sharedarrays.api.othernode.OtherNodeArray`, so that the task fails and the
    worker stays (see :mod:`sharedarrays.api.othernode`).

    Raises
    ------
    PayloadError
        Arguments no pickled view has (a crafted pickle): too many, a part that is neither
        a part nor a payload's bytes, malformed view fields, token or carried handles.
    """
    if extra:
        raise PayloadError(
            f"a pickled view is corrupted: its reconstructor got {3 + len(extra)} "
            "arguments, not at most 3"
        )
    if type(part) is not message.ReceivedPart:
        if type(part) is bytes:  # the allocation's part of the message
            return message.import_part(part, view, fds)
        if type(part) is not message.MessagePart:
            raise PayloadError("a pickled view is corrupted: its allocation's part is missing")
        part = part.received_here()  # a reduction called in place: this process's own part
    # a view (fields checked against the part's payload) of the allocation of the part,
    # found or mapped by its first view (ReceivedPart.find): read-only if either says so, or
    # if this process maps the allocation read-only; the part's views share one lease
    # (ReceivedPart.take)
    try:
        alloc, lease, dtype, shape, strides, offset, readonly, end = part.take(view)
    except WrongNode as refused:
        # raised while distributed reads a message, the refusal would break the worker's
        # connection instead of failing the task: deferred to the array's first use
        if not othernode.read_by_distributed(caller_frame()):
            raise
        return othernode.OtherNodeArray(str(refused), _rebuild_view, (part, view))
    made = SharedDeviceArray.__new__(SharedDeviceArray)  # (fields checked: not __init__)
    made._init(alloc, dtype, shape, strides, offset, readonly or part.readonly, end, lease)
    return made


message.use_reconstructor(_rebuild_view)


def operator_index(n: object) -> int:
    """``operator.index`` that refuses bools."""
    if isinstance(n, (bool, np.bool_)):
        raise TypeError("a bool is not a valid size")
    return operator.index(n)  # type: ignore[arg-type]


def _closed() -> ClosedArrayError:
    """The error for a closed view's data or memory (what :attr:`SharedDeviceArray.allocation`
    raises)."""
    return ClosedArrayError("this SharedDeviceArray is closed; attach or load it again")
