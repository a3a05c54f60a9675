"""SharedDeviceArray: a view (dtype, shape, strides, byte offset) over an allocation.

Views of one allocation share it; pickling a view never copies data: it writes a payload
(see :mod:`sharedarrays.protocol.payload`) that another process of the same user turns back into a
view of the same memory.
"""

from __future__ import annotations

import operator
import os
import weakref
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from types import EllipsisType
from typing import TYPE_CHECKING, Any

import numpy as np

from sharedarrays.backends import Access, cuda_usable, current_cuda_device, get_backend
from sharedarrays.backends.cuda.sync import one_record
from sharedarrays.backends.device import CPU, Device, DeviceLike, parse_device
from sharedarrays.errors import (
    BackendUnavailable,
    ClosedArrayError,
    HandleUnavailable,
    PayloadError,
)
from sharedarrays.memory import Allocation, Lease, lookup, revive
from sharedarrays.protocol.payload import Payload, view_extent
from sharedarrays.transport import handles as transport

if TYPE_CHECKING:
    from sharedarrays.api.semaphore import ExternalSemaphore, Timeline

__all__ = ["SharedDeviceArray"]

_BASIC_INDEX = (int, slice, EllipsisType, type(None), np.integer)

_live_views: weakref.WeakSet[SharedDeviceArray] = weakref.WeakSet()  # read by widgets/


def _check_key(key: object) -> tuple[Any, ...]:
    """Return ``key`` as a tuple of basic indices, or raise TypeError."""
    items = key if isinstance(key, tuple) else (key,)
    for item in items:
        if isinstance(item, (bool, np.bool_)) or not isinstance(item, _BASIC_INDEX):
            raise TypeError(
                f"SharedDeviceArray supports basic indexing only (ints, slices, ..., None), "
                f"not {type(item).__name__}; for advanced indexing use a.array[...], which "
                "returns a native array (a copy where NumPy/CuPy would copy)"
            )
    return items


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


class SharedDeviceArray:
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
    """

    __slots__ = (
        "_lease",
        "_dtype",
        "_shape",
        "_strides",
        "_offset",
        "_readonly",
        "_native",
        "_encoded",
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
        self._lease: Lease | None = allocation.lease(offset + high)
        self._dtype = dtype
        self._shape = shape
        self._strides = strides
        self._offset = offset
        self._readonly = readonly
        self._native: Any = None
        self._encoded: tuple[int, int, bytes] | None = None  # pid, generation, payload
        _live_views.add(self)

    # metadata ---------------------------------------------------------------------------
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

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called on this view."""
        return self._lease is None

    @property
    def allocation(self) -> Allocation:
        """The reservation, chunks, mappings and origin behind this view."""
        lease = self._lease
        if lease is None:
            raise ClosedArrayError("this SharedDeviceArray is closed; attach or load it again")
        return lease.allocation

    @property
    def device(self) -> Device:
        """Where the memory lives."""
        return self.allocation.device

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
        if not dev.is_cuda:
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
        :class:`cupy.ndarray` on CUDA. It keeps the mapping alive while it exists."""
        native = self._native
        if native is None:
            alloc = self.allocation
            assert self._lease is not None  # self.allocation raised if closed
            native = alloc.backend.as_native(
                alloc.address,
                alloc.size,
                self._offset,
                # the native array holds the mapping (and its addresses) through a lease of
                # its own, reaching as far as this view's, which outlives it if it must
                alloc.lease(self._lease.end, pin=True),
                self._dtype,
                self._shape,
                self._strides,
                self._readonly,
                alloc.native_device,
            )
            self._native = native
        return native

    def __getitem__(self, key: object) -> SharedDeviceArray:
        """A view of the same allocation (basic indexing only)."""
        items = _check_key(key)
        if not any(i is Ellipsis for i in items):
            items = (*items, Ellipsis)  # keeps NumPy from returning a scalar it would read
        alloc = self.allocation
        base = alloc.address + self._offset
        probe = np.asarray(_Probe(base, self._dtype, self._shape, self._strides))
        view = probe[items]
        delta = view.__array_interface__["data"][0] - base
        return SharedDeviceArray(
            alloc,
            self._dtype,
            tuple(view.shape),
            tuple(view.strides),
            self._offset + delta,
            self._readonly,
        )

    def __setitem__(self, key: object, value: object) -> None:
        """Write through to shared memory."""
        _check_key(key)
        if self._readonly:
            raise ValueError("this SharedDeviceArray is read-only")
        native = self.array
        if not isinstance(value, type(native)) and (
            isinstance(value, (np.ndarray, SharedDeviceArray))
            or hasattr(value, "__cuda_array_interface__")
            or hasattr(value, "__dlpack__")
        ):
            value = self.allocation.backend.to_native(value)  # e.g. NumPy into CuPy
        native[key] = value

    def get(self) -> np.ndarray[Any, Any]:
        """Copy the data into a new NumPy array in host memory."""
        native = self.array
        if isinstance(native, np.ndarray):
            return np.array(native, copy=True)
        return native.get()  # type: ignore[no-any-return]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray[Any, Any]:
        if self.device.is_cuda:
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
        """The CUDA Array Interface (v3) of CUDA arrays; absent on ``cpu`` arrays."""
        if not self.device.is_cuda:
            raise AttributeError("a cpu SharedDeviceArray has no __cuda_array_interface__")
        return self.array.__cuda_array_interface__  # type: ignore[no-any-return]

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d array")
        return self._shape[0]

    # lifecycle --------------------------------------------------------------------------
    def close(self) -> None:
        """Close this view.

        Later data access through it raises :class:`ClosedArrayError`. When no open view and
        no native array in this process refers to the allocation any more, its mapping is
        released (synchronised first on CUDA) and its handles closed here. Other processes
        keep their mappings. Closing twice is allowed.
        """
        self._native = None
        self._lease = None

    def __enter__(self) -> SharedDeviceArray:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def show(self) -> Any:
        """The memory map of this view's allocation (see :func:`sharedarrays.show`)."""
        from sharedarrays.api.widgets import MemoryMap

        return MemoryMap(self)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """Jupyter display: text, an HTML table, a PNG memory map, the live widget."""
        from sharedarrays.api.widgets import mimebundle

        return mimebundle(self, include, exclude)

    def __repr__(self) -> str:
        if self._lease is None:
            return f"<SharedDeviceArray shape={self._shape} dtype={self._dtype} closed>"
        a = self._lease.allocation
        where = "created here" if a.origin.created_here else f"imported from pid {a.origin.pid}"
        ro = " readonly" if self._readonly else ""
        return (
            f"<SharedDeviceArray shape={self._shape} dtype={self._dtype} device={a.device} "
            f"backend={a.backend.name}{ro} allocation={a.id[:12]} offset={self._offset} "
            f"({len(a.chunks)} chunk{'s' if len(a.chunks) != 1 else ''}, {where})>"
        )

    # pickling ---------------------------------------------------------------------------
    def payload(self) -> Payload:
        """What a pickle of this view carries (starts this process's handle server)."""
        alloc = self.allocation
        pid, server = os.getpid(), alloc.source_server  # a growable array names its exporter
        if server is None:
            server = transport.server_address()
        else:
            pid = alloc.origin.pid
        return Payload(
            backend=alloc.backend.name,
            device=alloc.device.index,
            alloc_id=alloc.id,
            secret=alloc.secret,
            pid=pid,
            server=server,
            chunks=tuple(alloc.chunk_sizes()),
            dtype=self._dtype,
            shape=self._shape,
            strides=self._strides,
            offset=self._offset,
            readonly=self._readonly or alloc.export_readonly,
            capacity=alloc.capacity if alloc.growable else None,
        )

    def _payload_bytes(self) -> bytes:
        """The encoded payload, made once per view, process and generation of the allocation
        (it changes only when a growable allocation gains or loses chunks, or moves)."""
        cached = self._encoded
        generation = self.allocation.generation
        if cached is None or cached[0] != os.getpid() or cached[1] != generation:
            cached = (os.getpid(), generation, self.payload().to_bytes())
            self._encoded = cached
        return cached[2]

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
        from sharedarrays.api.growth import resize

        resize(self, length)

    def append(self, values: Any) -> None:
        """Append one row (shape ``a.shape[1:]``) or rows (shape ``(k, *a.shape[1:])``)
        along axis 0 of a growable array, in place (see :meth:`resize`)."""
        from sharedarrays.api.growth import append

        append(self, values)

    def refresh(self) -> None:
        """Set the length along axis 0 of a growable array to its exporter's current length.

        In an importer this asks the exporter's handle server and maps the chunks it added
        since (never copying); in the exporter it takes the length of the last resize. Same
        view conditions as :meth:`resize`.
        """
        from sharedarrays.api.growth import refresh

        refresh(self)

    # ordering ---------------------------------------------------------------------------
    def wait_for(self, sem: ExternalSemaphore | Timeline, value: int | None = None) -> None:
        """Make later work on this array's device (its current stream) wait for ``sem``.

        Parameters
        ----------
        sem : ExternalSemaphore or Timeline
            A semaphore another API exported (:meth:`ExternalSemaphore.from_fd`), or a
            :class:`~sharedarrays.Timeline` counter; it must be on this array's device.
        value : int, optional
            The value to wait for: required for timelines, omitted for binary semaphores.
        """
        self._same_device(sem).wait(value)

    def signal(self, sem: ExternalSemaphore | Timeline, value: int | None = None) -> None:
        """Signal ``sem`` once the work queued so far on this array's device (its current
        stream) is done: a timeline is set to ``value``; a binary semaphore takes none."""
        self._same_device(sem).signal(value)

    def _same_device(self, sem: ExternalSemaphore | Timeline) -> ExternalSemaphore | Timeline:
        from sharedarrays.api.semaphore import ExternalSemaphore, Timeline

        if not isinstance(sem, (ExternalSemaphore, Timeline)):
            raise TypeError(
                f"expected an ExternalSemaphore or a Timeline, not {type(sem).__name__}"
            )
        if sem.device != self.device:
            raise ValueError(f"the semaphore is on {sem.device}, this array on {self.device}")
        return sem

    def park(self) -> None:
        """Hand this array's handles to this user's keeper (started if needed), so that a
        payload of it (``pickle.dumps(a)``) still loads after this process exits.

        Idempotent. The keeper holds the memory until :meth:`unpark` is called in some
        process; see :mod:`sharedarrays.api.named`.
        """
        from sharedarrays.api.named import park

        park(self)

    def unpark(self) -> None:
        """Let the keeper drop this parked array: the memory returns once no process maps
        it. Raises :class:`~sharedarrays.NameNotFound` if the keeper does not hold it."""
        from sharedarrays.api.named import unpark

        unpark(self)

    def __reduce__(self) -> tuple[Any, tuple[bytes, bytes | None]]:
        blob = self._payload_bytes()
        alloc = self.allocation
        if alloc.source_server is None:  # the payload names this process: it is in flight
            alloc.note_sent()
        return _rebuild, (blob, alloc.backend.export_sync())


def _reduce_for_multiprocessing(a: SharedDeviceArray) -> tuple[Any, tuple[Any, ...]]:
    """Pickle for multiprocessing: while a Process is being spawned, its arguments carry the
    chunk fds themselves (multiprocessing's DupFd), so the child needs no connection."""
    alloc = a.allocation
    # (a growable array's chunks come from its handle server, which records who maps them)
    # (and exporter-owned memory's exporter must see every importer, to outlive it)
    if (
        get_spawning_popen() is not None
        and alloc.allow_pids is None
        and not alloc.growable
        and alloc.backend.maps
    ):  # the handles travel with it: nothing is left in flight
        args = (a._payload_bytes(), alloc.backend.export_sync())
        return _rebuild, (*args, tuple(reduction.DupFd(fd) for fd in alloc.chunk_fds()))
    return a.__reduce__()


reduction.ForkingPickler.register(SharedDeviceArray, _reduce_for_multiprocessing)

_forking_dumps = reduction.ForkingPickler.dumps.__func__  # type: ignore[attr-defined]


def _dumps_with_one_record(
    cls: type[reduction.ForkingPickler], obj: Any, protocol: int | None = None
) -> Any:
    """``ForkingPickler.dumps`` (every pool task, queue item and pipe message), with the
    arrays in one message sharing one ordering event (:func:`sync.one_record`)."""
    with one_record():
        return _forking_dumps(cls, obj, protocol)


reduction.ForkingPickler.dumps = classmethod(_dumps_with_one_record)  # type: ignore[assignment,method-assign]


def load(
    data: bytes, sync: bytes | None = None, fds: tuple[Any, ...] | None = None
) -> SharedDeviceArray:
    """Turn a payload back into a view, mapping its allocation on first sight.

    Parameters
    ----------
    data : bytes
        The payload, as written by pickling a SharedDeviceArray (or by
        :meth:`SharedDeviceArray.payload`).
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
    p = Payload.from_bytes(data)
    if sync is not None and (type(sync) is not bytes or not 0 < len(sync) <= 256):
        raise PayloadError("the ordering token that travelled with the payload is malformed")
    received: list[int] = []
    if fds is not None:
        if type(fds) is not tuple or len(fds) != len(p.chunks):
            raise PayloadError("the handles that travelled with the payload do not match it")
        received = [d.detach() for d in fds]
    alloc = lookup(p.alloc_id)
    if alloc is None and p.pid == os.getpid():  # back at its exporter, which let go of it
        alloc = revive(p.alloc_id)
    if alloc is not None and alloc.pid != os.getpid() and alloc.device.is_cuda:
        # inherited through fork: CUDA cannot be used here (no driver call may notice it
        # later when the stream was idle and the token is None)
        why = cuda_usable(alloc.device.index, alloc.backend.name)
        if why is not None:
            for fd in received:
                os.close(fd)
            raise BackendUnavailable(f"cannot use {alloc.device}: {why}")
    if p.capacity is not None:  # a growable array: maps the chunks added since, if any
        from sharedarrays.api.growth import map_payload

        alloc = map_payload(alloc, p, received)
    elif alloc is not None:
        for fd in received:
            os.close(fd)
        if alloc.chunk_sizes() != list(p.chunks) or alloc.backend.name != p.backend:
            raise PayloadError(f"payload does not match allocation {p.alloc_id} mapped here")
        if p.pid == os.getpid():  # one of this process's payloads came back: not in flight
            alloc.note_loaded()
        else:  # its sender counts it in flight until told
            alloc.note_returned(p.server)  # (when this process releases it, if it served it)
            if alloc.backend.exporter_owned:  # the exporter waits for its payloads: say so
                transport.report_load(p.server, p.alloc_id, p.secret)
    else:
        try:
            device = Device("cuda", p.device) if p.backend.startswith("cuda") else CPU
            backend = get_backend(device, p.backend)
        except BaseException:
            for fd in received:
                os.close(fd)
            raise
        exports: tuple[bytes, ...] = ()
        if fds is None:
            try:
                sizes, received, exports = transport.fetch_handles(
                    p.server, p.pid, p.alloc_id, p.secret, reply_to=transport.server_address()
                )
            except HandleUnavailable as gone:  # the exporter is gone: a keeper may hold it
                if backend.exporter_owned:  # not this memory: it went with its exporter
                    raise
                from sharedarrays.transport import keeper

                sizes, received, _ = keeper.fetch_handles(p.alloc_id, p.secret, gone)
            if sizes != list(p.chunks):
                for fd in received:
                    os.close(fd)
                raise PayloadError("payload's chunk sizes do not match its exporter's allocation")
        access: Access = "r" if p.readonly else "rw"
        here = current_cuda_device(p.device) if backend.maps and device.is_cuda else p.device
        peers = {here: access} if here != p.device else None
        alloc = Allocation.import_(
            backend,
            p.alloc_id,
            p.secret,
            list(p.chunks),
            received,
            p.pid,
            access,
            exports=exports,
            peers=peers,
        )
        if peers:  # this process works on another device: it reads the memory as a peer
            alloc.native_device = here
        if backend.exporter_owned:  # payloads made here name the exporter, which must
            alloc.source_server = p.server  # see every importer; told when this one closes
    if sync is not None:
        alloc.backend.import_sync(sync)
    readonly = p.readonly or alloc.access != "rw"
    try:
        return SharedDeviceArray(alloc, p.dtype, p.shape, p.strides, p.offset, readonly)
    except ClosedArrayError:
        if fds is not None:
            raise
        # A parked mapping was dropped (a release notice, the limit) between the lookup and
        # the new view: it is gone from the registry now, so this maps it anew.
        return load(data, sync)


def _rebuild(
    data: bytes, sync: bytes | None = None, fds: tuple[Any, ...] | None = None
) -> SharedDeviceArray:
    return load(data, sync, fds)


def operator_index(n: object) -> int:
    """``operator.index`` that refuses bools."""
    if isinstance(n, (bool, np.bool_)):
        raise TypeError("a bool is not a valid size")
    return operator.index(n)  # type: ignore[arg-type]
