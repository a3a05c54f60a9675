"""SharedDeviceArray: a view (dtype, shape, strides, byte offset) over an allocation. Pickling
a view never copies data: it writes a payload that another process of the same user turns back
into a view of the same memory (:func:`load`, :func:`_rebuild_view`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import os
import sys
import weakref
from collections.abc import Callable
from multiprocessing import reduction
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import numpy as np

from sharedarrays import importing
from sharedarrays._cpython import caller_frame, mark_no_spawn_in_thread, spawning_process
from sharedarrays.api import keeping, othernode
from sharedarrays.api.arraybase import ArrayBase, assignable, check_key, native_key
from sharedarrays.api.shapeviews import ShapeViews
from sharedarrays.backends import NativeView, get_backend
from sharedarrays.backends.device import Device, DeviceLike, parse_device
from sharedarrays.errors import MisalignedView, NotShareable, PayloadError, WrongNode
from sharedarrays.memory import Allocation, Lease, live_allocations
from sharedarrays.node import this_node
from sharedarrays.process import STATE
from sharedarrays.protocol.payload import Payload, ViewFields, ViewTuple, misaligned, view_extent
from sharedarrays.transport import handles as transport

__all__ = ["SharedDeviceArray", "load", "synchronize"]

_T = TypeVar("_T")
_BYTES = np.dtype(np.uint8)
_PARTS_TIDY = 256  # entries in one thread's parts table past which dead references go


def _field(get: str | Callable[[Any], Any], doc: str) -> Any:
    """A read-only property: the view's attribute ``get``, or ``get(view)``."""
    return property(operator.attrgetter(get) if isinstance(get, str) else get, doc=doc)


class SharedDeviceArray(ShapeViews):
    """An array in memory that other processes can map without copying.

    Made by :func:`sharedarrays.empty`, :func:`~sharedarrays.from_array`, ...; passed to
    another process by pickling it (multiprocessing does). It acts like its native array
    (:attr:`array`): new results are native arrays, in-place operations and shape views
    (``a.T``, ``a.reshape``) are shared. The memory is freed when the last process that maps
    it or holds a handle of it lets go.
    """

    __slots__ = ("_interfaced", "_base", "__weakref__")
    # the bases' public methods, as the class's own (the API reference lists those)
    resize, append, refresh = ShapeViews.resize, ShapeViews.append, ShapeViews.refresh
    synchronize, get = ArrayBase.synchronize, ArrayBase.get
    access, grant = ArrayBase.access, ArrayBase.grant
    wait_for, signal = ArrayBase.wait_for, ArrayBase.signal

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
        if min(offset, offset + low) < 0 or max(offset, offset + high) > allocation.size:
            raise ValueError("view reaches outside its allocation")
        why = allocation.device.needs_context and misaligned(dtype, shape, strides, offset)
        if why:  # device memory: aligned views only
            raise MisalignedView(f"{why}. Copy the bytes first (a.array[...].copy().view(dtype))")
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
        lease: Lease[Allocation] | None = None,  # one shared by a message's views
    ) -> None:
        self._lease: Lease[Allocation] | None = allocation.lease(end) if lease is None else lease
        self._dtype = dtype
        self._shape = shape
        self._strides = strides
        self._offset = offset
        self._readonly = readonly
        self._locked = False
        self._native: Any = None
        self._interfaced: Any = None  # (whose __cuda_array_interface__ a consumer reads)
        self._packed: ViewTuple | None = None  # the view's fields as a pickle carries them
        self._base: SharedDeviceArray | None = None
        if STATE.views.tracking:  # (a live view, for the memory map: sharedarrays.api.views)
            STATE.views.live[id(self)] = self

    base: SharedDeviceArray | None = _field(
        "_base", "The view this one was derived from (``None`` if made or loaded)."
    )
    shape: tuple[int, ...] = _field("_shape", "Length of each axis.")
    dtype: np.dtype[Any] = _field("_dtype", "Element type.")
    strides: tuple[int, ...] = _field("_strides", "Bytes to step in each axis (may be negative).")
    offset: int = _field("_offset", "Byte offset of the first element in the allocation.")
    readonly: bool = _field("_readonly", "Whether writes through this view are refused.")
    ndim: int = _field(lambda a: len(a._shape), "Number of axes.")
    size: int = _field(lambda a: math.prod(a._shape), "Number of elements.")
    nbytes: int = _field(lambda a: a.size * a._dtype.itemsize, "Bytes of the elements.")
    itemsize: int = _field(lambda a: a._dtype.itemsize, "Bytes per element.")
    closed: bool = _field(lambda a: a._lease is None, "Whether :meth:`close` was called.")

    @property
    def allocation(self) -> Allocation:
        """The reservation, chunks, mappings and origin behind this view."""
        lease = self._lease
        if lease is None:
            raise self._closed()
        return lease.allocation

    device: Device = _field(
        lambda a: a.allocation.device, 'Where the memory lives (``a.device == "cuda:0"``).'
    )
    backend: str = _field(
        lambda a: a.allocation.backend.name, 'The memory system (``"host"``, ``"cuda-vmm"``, ...).'
    )
    address: int = _field(
        lambda a: a.allocation.address + a._offset, "Address of the first element here."
    )

    @property
    def array(self) -> Any:
        """The zero-copy native array (NumPy, CuPy, or torch on Ascend); keeps the mapping."""
        native = self._native
        if native is None:
            lease = self._lease
            if lease is None:
                raise self._closed()
            alloc = lease.allocation  # (self.allocation, without its frame)
            layout = (self._dtype, self._shape, self._strides, self._readonly)
            if alloc.derives_natives:  # one native memory per allocation
                native = alloc.native_view(self._offset, *layout)
            else:  # (pinned: the native may outlive the view)
                pinned = alloc.pin(lease)
                view = NativeView(
                    alloc.address, alloc.size, self._offset, pinned, *layout, alloc.native_device
                )
                native = alloc.backend.as_native(view)
            self._native = native
        return native

    def __getitem__(self, key: object) -> Any:
        """``a[key]``: a basic index gives a shared view (one element: NumPy's scalar on
        the host, a 0-d view on a GPU); an advanced index a native **copy**, as NumPy's."""
        items = check_key(key)
        if items is None:
            return self.array[native_key(key)]
        ellipsis = any(i is Ellipsis for i in items)
        if not ellipsis:
            items = (*items, Ellipsis)  # keeps NumPy from returning a scalar it would read
        layout = self._layout()
        view = layout[items]
        if not ellipsis and not view.ndim:
            native = self.array
            if type(native) is np.ndarray:  # (NumPy's scalar; CuPy's and torch's: 0-d)
                return native[cast(Any, native_key(key))]
        return self._derive(layout, view)

    def _layout(self, writeable: bool = False) -> np.ndarray[Any, Any]:
        """A probe with this view's layout, on which NumPy lays out views; never read."""
        interface = {
            "version": 3,
            "shape": self._shape,
            "typestr": self._dtype.str,
            "strides": self._strides,
            "data": (self.allocation.address + self._offset, not writeable),
        }
        return np.asarray(SimpleNamespace(__array_interface__=interface))

    def _derive(
        self, layout: np.ndarray[Any, Any], view: np.ndarray[Any, Any]
    ) -> SharedDeviceArray:
        """A shared view laid out as ``view``, a view of ``layout`` (from :meth:`_layout`)."""
        delta = view.__array_interface__["data"][0] - layout.__array_interface__["data"][0]
        shape, strides = tuple(view.shape), tuple(view.strides)
        # (the probe's dtype is made from a type string: the same one is this view's, with
        # what a type string cannot say, such as metadata)
        dtype = self._dtype if view.dtype == self._dtype else view.dtype
        derived = SharedDeviceArray(
            self.allocation, dtype, shape, strides, self._offset + delta, self._readonly
        )
        derived._base = self if self._base is None else self._base
        return derived

    def __setitem__(self, key: object, value: object) -> None:
        """Write through to shared memory, with any index the native array takes."""
        native = self._writable_native()
        if not isinstance(value, type(native)) and (
            isinstance(value, (np.ndarray, SharedDeviceArray))
            or hasattr(value, "__cuda_array_interface__")
            or hasattr(value, "__dlpack__")
        ):
            value = self.allocation.backend.to_native(value)  # e.g. NumPy into CuPy
        native[native_key(key)] = assignable(native, value)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """The CUDA Array Interface (v3); the memory stays mapped while the view lives."""
        if not self.device.is_cuda:
            raise AttributeError("a cpu SharedDeviceArray has no __cuda_array_interface__")
        native = self.array
        self._interfaced = native
        return native.__cuda_array_interface__  # type: ignore[no-any-return]

    def close(self) -> None:
        """Close this view (later use: ClosedArrayError); the mapping goes with the last user
        here. Idempotent."""
        self._native = None
        self._lease = None

    def show(self, *, interval: float = 2.0, auto_refresh: bool = False) -> Any:
        """The memory map of this view's allocation, as :func:`sharedarrays.show` draws it."""
        from sharedarrays.api.widgets import show

        return show(self, interval=interval, auto_refresh=auto_refresh)

    def __enter__(self) -> SharedDeviceArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def payload(self) -> Payload:
        """What a pickle of this view carries, as one payload (starts the handle server).
        Any number of processes may load it: the memory is never reused (no ``DONE`` counts)."""
        alloc = self.allocation
        alloc.drop_block()
        readonly = self._readonly or alloc.export_readonly
        view = ViewFields(self._offset, self._shape, self._strides, self._dtype, readonly)
        return dataclasses.replace(allocation_payload(alloc), **view._asdict())

    def _view_tuple(self) -> ViewTuple:
        """The view's fields as a pickle carries them (once per view)."""
        if self._packed is None:
            shape, strides = _intern(self._shape), _intern(self._strides)
            offset, shape, strides, dtype, readonly = ViewFields(
                self._offset, shape, strides, self._dtype, self._readonly
            ).to_tuple()
            self._packed = (offset, shape, strides, _intern(dtype), readonly)
        return self._packed

    def park(self) -> None:
        """Hand this array's handles to this user's keeper, so that a payload of it still
        loads after this process exits; held until :meth:`unpark`. Idempotent."""
        keeping.keep(self, None)

    def unpark(self) -> None:
        """Let the keeper drop this parked array: the memory returns once no process maps
        it. Raises :class:`~sharedarrays.NameNotFound` if the keeper does not hold it."""
        keeping.unpark(self.allocation)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce(False, self)

    def __dask_tokenize__(self) -> tuple[Any, ...]:
        """Dask's token: the allocation and layout, not the values (a pickle would count a
        payload in flight). Submit tasks that must see new values with ``pure=False``."""
        layout = (self._offset, self._dtype.str, self._shape, self._strides, self._readonly)
        return ("sharedarrays", self.allocation.id, *layout)


def _intern(value: _T) -> _T:
    """The one object equal to ``value`` (a tuple of ints, or a str): views of one layout then
    share their fields, which a pickle writes once and the importer checks once."""
    interned = STATE.pickling.interned
    if len(interned) >= 4096:
        interned.clear()
    return interned.setdefault(value, value)  # type: ignore[no-any-return]


def _reduce(for_multiprocessing: bool, a: SharedDeviceArray) -> tuple[Any, tuple[Any, ...]]:
    """A view's reduction: its allocation's :func:`message_part` and its fields
    (``for_multiprocessing``: by ``ForkingPickler``, where a spawned Process carries fds)."""
    lease = a._lease
    if lease is None:
        raise a._closed()
    alloc = lease.allocation  # (a.allocation, without its frame)
    if not for_multiprocessing:  # a plain pickle may be loaded by any number of processes,
        alloc.drop_block()  # so no count of DONEs tells when its memory is free for reuse
    # (not for growable memory, whose server records who maps its chunks, nor for
    # exporter-owned memory, whose exporter must see every importer)
    carry_fds = (
        for_multiprocessing
        and spawning_process() is not None
        and alloc.allow_pids is None
        and not alloc.growable
        and alloc.backend.maps
    )
    # (isdisjoint against a keys view walks the smaller side, the hooks)
    hooks = STATE.pickling.reduce_hooks
    if hooks and not for_multiprocessing and not hooks.keys().isdisjoint(sys.modules.keys()):
        for name in [name for name in hooks if name in sys.modules]:
            hooks.pop(name)()
    return _rebuild_view, (message_part(alloc, carry_fds), a._packed or a._view_tuple())


reduction.ForkingPickler.register(SharedDeviceArray, functools.partial(_reduce, True))


def allocation_payload(alloc: Allocation) -> Payload:
    """The payload of the whole allocation (its bytes) that pickles of its views carry."""
    # (a growable array imported from elsewhere names its exporter)
    pid, server, fds = alloc.origin.pid, alloc.source_server, None
    if server is None:
        if alloc.growable and not alloc.origin.created_here:
            # inherited through fork: its length is its creator's, which this server cannot tell
            raise NotShareable(
                f"a growable array inherited through fork cannot be handed on from this process: "
                f"its length changes in the process that made it (pid {alloc.origin.pid}); "
                "pickle it there, or hand on a copy (sa.from_array(a.get()))"
            )
        pid, server, fds = os.getpid(), transport.server_address(), alloc.takeable_fds()
    chunks = tuple(alloc.chunk_sizes())
    return Payload(
        backend=alloc.backend.name,
        device=alloc.device.index,
        alloc_id=alloc.id,
        secret=alloc.secret,
        pid=pid,
        server=server,
        chunks=chunks,
        dtype=_BYTES,
        shape=(sum(chunks),),
        strides=(1,),
        offset=0,
        readonly=alloc.export_readonly,
        capacity=alloc.capacity if alloc.growable else None,
        node=this_node(),
        block=alloc.block if alloc.cacheable() else None,
        fds=fds,
    )


def allocation_bytes(alloc: Allocation) -> bytes:
    """The encoded :func:`allocation_payload`, as pickles of ``alloc``'s views carry it."""
    return allocation_payload(alloc).to_bytes()


@dataclasses.dataclass(eq=False)
class MessagePart:
    """One allocation's part of the message being pickled: its payload ``blob``, ordering
    ``fence`` (its token travels), chunk ``fds`` for a spawned Process, and the process and
    generation it was ``made`` for (the ``allocation`` itself is never pickled)."""

    __slots__ = ("allocation", "blob", "fence", "fds", "made", "__weakref__")
    allocation: Allocation
    blob: bytes
    fence: object
    fds: tuple[Any, ...] | None
    made: tuple[int, int]

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # once per pickler that writes this part: one payload in flight per message
        fence = self.fence
        token = None if fence is None else fence.token  # type: ignore[attr-defined]
        if self.fds is not None:
            return _rebuild_view, (self.blob, token, self.fds)
        if self.allocation.source_server is None:
            self.allocation.flight.note_sent()
        return _rebuild_view, (self.blob, token)


def message_part(alloc: Allocation, carry_fds: bool) -> MessagePart:
    """The part of ``alloc`` in the message this thread is pickling, made at its first view.

    This thread's table keeps, by allocation, ``[the live part (weakly), the allocation
    (weakly), its payload's bytes, (pid, generation) they were made for]``: the payload is
    encoded once, and a warm message's part costs no lookup but this one."""
    parts = STATE.pickling.parts
    refs: dict[Any, list[Any]] | None = getattr(parts, "refs", None)
    if refs is None:
        refs = parts.refs = {}
        # spawning_process() raises and catches inside where no spawn ever ran in this
        # thread (10-15 us per view on a cold path): made a plain read
        mark_no_spawn_in_thread()
    if carry_fds:  # (the spawned process holds the chunks' fds: nobody can ask it for DONE)
        alloc.drop_block()
    # (the spawn's id, not the Popen: a key would keep it, and its pipes, open)
    key = (alloc.id, id(spawning_process())) if carry_fds else alloc.id
    entry = refs.get(key)
    now = (STATE.pid, alloc.generation)
    if entry is not None and entry[1]() is alloc and entry[3] == now:
        found = entry[0]()
        if found is not None:  # (a view after the first of this message)
            return found  # type: ignore[no-any-return]
    else:
        entry = [None, weakref.ref(alloc), allocation_bytes(alloc), now]
        if len(refs) >= _PARTS_TIDY and len(refs) >= getattr(parts, "tidy_at", _PARTS_TIDY):
            for k in [k for k, e in refs.items() if e[1]() is None]:
                del refs[k]
            # (next sweep when the table has doubled: a sweep per part would be quadratic)
            parts.tidy_at = max(_PARTS_TIDY, 2 * len(refs))
        refs[key] = entry
    fds = None
    if carry_fds:  # (once per spawn and allocation: a spawner refuses an fd passed twice)
        fds = tuple(reduction.DupFd(fd) for fd in alloc.chunk_fds())
    made = MessagePart(alloc, entry[2], alloc.backend.export_fence(), fds, now)
    entry[0] = weakref.ref(made)
    return made


def load(
    data: bytes | Payload, sync: bytes | None = None, fds: tuple[Any, ...] | None = None
) -> SharedDeviceArray:
    """Turn a payload back into a view, mapping its allocation on first sight (from the
    handles that travelled with it, its exporter's handle server, or this user's keeper).

    ``data``: :meth:`SharedDeviceArray.payload` or its ``to_bytes()`` (not a pickle);
    ``sync``: the ordering token that travelled with it (the current stream waits for it);
    ``fds``: handles that travelled with it (multiprocessing's DupFd objects). Raises
    PayloadError (malformed, altered or not matching the allocation), HandleUnavailable (not
    mapped here, exporter gone), PermissionDenied (another user, wrong secret),
    BackendUnavailable (its memory system cannot be used here).
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
    part = importing.ReceivedPart(p, sync, fds)
    view = p.view_fields().to_tuple()  # (checked as a pickled view's: one way to a view)
    return cast("SharedDeviceArray", _rebuild_view(part, view))


def _rebuild_view(
    part: object = None, view: object = None, fds: object = None, *extra: object
) -> SharedDeviceArray | othernode.OtherNodeArray | importing.ReceivedPart:
    """What a pickled view calls with its allocation's part and fields ``view``; the part
    itself calls it with the payload's bytes, token and fds (a message names one function).
    Another node's payload raises WrongNode, or where distributed reads it gives an
    :class:`~sharedarrays.api.othernode.OtherNodeArray`; a crafted pickle, PayloadError."""
    if extra:
        raise PayloadError(
            f"a pickled view is corrupted: its reconstructor got {3 + len(extra)} "
            "arguments, not at most 3"
        )
    if type(part) is not importing.ReceivedPart:
        if type(part) is bytes:  # the allocation's part of the message
            return importing.import_part(part, view, fds)
        if type(part) is not MessagePart:
            raise PayloadError("a pickled view is corrupted: its allocation's part is missing")
        # a reduction called in place: this process's own part, nothing counted or waited for
        here = importing.ReceivedPart(Payload.from_bytes(part.blob), None, None)
        here.bind(part.allocation)
        here.pending = 0
        part = here
    try:
        alloc, lease, dtype, shape, strides, offset, readonly, end = part.take(view)
    except WrongNode as refused:
        # (raised in distributed's read it would break the worker's connection)
        if not othernode.read_by_distributed(caller_frame()):
            raise
        return othernode.OtherNodeArray(str(refused), _rebuild_view, (part, view))
    made = SharedDeviceArray.__new__(SharedDeviceArray)  # (fields checked: not __init__)
    made._init(alloc, dtype, shape, strides, offset, readonly or part.readonly, end, lease)
    return made


importing.use_reconstructor(_rebuild_view)


def synchronize(device: DeviceLike = None) -> None:
    """Wait until the work queued so far on ``device`` is done (``None``: every device with
    shared memory mapped here); BackendUnavailable if it cannot be used here."""
    if device is not None:
        get_backend(parse_device(device)).synchronize()
        return
    for backend in {id(a.backend): a.backend for a in live_allocations()}.values():
        backend.synchronize()
