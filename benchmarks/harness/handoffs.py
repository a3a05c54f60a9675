"""The warm and cold rounds' ``bound`` and ``safe`` entries: objects that hand an array to a
worker the least way that orders it after the sender's stream (``bound``), or that and the
least more the library's guarantees need (``safe``), in code of their own, so that each
round shows what the library's structure costs beyond them (:mod:`harness.report`'s
targets name them). Their loaders run in the worker (module-level, found by name)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from harness.worker import _map, _worker_state
from sharedarrays.backends.device import parse_name

__all__ = ["LeastHandoff", "SafeHandoff", "SafeColdHandoff"]


class LeastHandoff:
    """The warm rounds' ``bound`` entry: the least any warm handoff costs that orders the
    receiver after the sender's stream, measured in the same rounds as the methods.

    Pickled, it does what this library's ordering fence does when the current stream is
    idle (as it is between the bench's rounds): on CUDA ``cuCtxGetCurrent`` (the device's
    context must be the current one) and ``cuStreamQuery`` of CuPy's current stream, through
    cuda-bindings, in code of its own (so that it warms none of the library's code for the
    entry after it in the round); a busy stream or another current context goes to the
    backend's own ``export_fence`` (which records an event or makes the context current). It
    carries the token (``None`` when idle) with bytes of the size of a sharedarrays payload
    and a view tuple. Loaded, it is a :class:`_Kept`, whose ``.array`` is a native array this
    worker made once. No lookup, lease, count or check: what is left of a warm handoff is one
    pickle hook, one reconstructor call and the fence, so a goal below this entry's figure
    cannot be reached by any object that pickles through Python and orders that way.

    Parameters
    ----------
    blob, view
        What it carries (the sizes of a sharedarrays array's payload and view tuple).
    backend
        The sharedarrays backend whose ``export_fence`` it stands for.
    device
        ``None`` on the host (no fence: the host backend's is ``None``), else the CUDA
        device's index.
    """

    __slots__ = ("blob", "view", "backend", "device", "context", "busy", "_driver", "_stream")

    def __init__(
        self, blob: bytes, view: tuple[Any, ...], backend: Any, device: int | None = None
    ) -> None:
        self.blob = blob
        self.view = view
        self.backend = backend
        self.device = device
        self.context: int | None = None
        self.busy = 0  # picklings that found the stream busy (or another context current)
        # (imported here, once: a pickling looks them up on the entry, as the library's
        # fence does on its device, not through an import statement)
        self._driver: Any = None
        self._stream: Any = None  # (CuPy's current stream of a device)
        if device is not None:
            import cupy
            from cuda.bindings import driver

            with cupy.cuda.Device(device):  # (CuPy's runtime makes the primary context current)
                cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(1))
                err, ctx = driver.cuCtxGetCurrent()
            self.context = int(ctx) if int(err) == 0 and ctx is not None else None
            self._driver, self._stream = driver, cupy.cuda.get_current_stream

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        idle = False
        if self.device is not None:
            driver = self._driver
            err, current = driver.cuCtxGetCurrent()
            if int(err) == 0 and current is not None and int(current) == self.context:
                stream = int(self._stream(self.device).ptr)
                idle = int(driver.cuStreamQuery(stream)[0]) == 0
            if not idle:  # (a busy stream, or another current context)
                self.busy += 1
        token = None
        if not idle:  # the backend's own fence (the host backend's: None)
            fence = self.backend.export_fence()
            token = None if fence is None else fence.token
        return _least_loaded, (self.blob, self.view, token)


class _Kept:
    """A loaded :class:`LeastHandoff`: ``.array`` and ``close()``, as a view has."""

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def close(self) -> None:
        self.array = None


def _least_loaded(blob: bytes, view: tuple[Any, ...], token: bytes | None) -> _Kept:
    kept = _worker_state.get("kept")
    if kept is None:
        if _worker_state.get("cuda"):
            import cupy

            kept = cupy.zeros(1 << 18, dtype=cupy.float32)
        else:
            kept = np.zeros(1 << 18, dtype=np.float32)
        _worker_state["kept"] = kept
    return _Kept(kept)


class SafeHandoff(LeastHandoff):
    """The warm rounds' ``safe`` entry: :class:`LeastHandoff` and the least more that a warm
    handoff keeping this library's guarantees must do, in code of its own (one frame on
    each side besides the bound's hook; nothing of the library's code is run or warmed).

    Pickled (after the bound's own pickling, for its fence): it refuses a closed view, and
    counts one payload in flight under a lock with the time (so that the memory outlives a
    sender that lets go of it while the payload travels: :class:`~sharedarrays.memory.
    inflight.InFlight`). Loaded (:func:`_safe_loaded`): the mapping is found by the payload's
    bytes and checked to be still mapped; its last use is stamped (parking's order); the
    loader asks whether it owes the payload's sender a return count (one set lookup); the
    token is waited for; the view's fields are checked against the mapping's extent; the
    hold that the mapping's views share is taken; and a view object is made, whose
    ``.array`` hands out the native array made before only where nothing else holds it and
    its layout is unchanged (a CuPy or NumPy array's shape can be set). Without any of these
    a handoff loses data (memory freed under a payload in flight or a view), reads outside
    the memory (an altered message), or hands one native array to two owners.

    The difference between this entry and ``sharedarrays`` in the same rounds is what the
    library's structure costs beyond its guarantees; the difference between this entry and
    ``bound``, what the guarantees cost.
    """

    __slots__ = ("closed", "_lock", "_sent", "_sent_at", "_last")

    def __init__(
        self, blob: bytes, view: tuple[Any, ...], backend: Any, device: int | None = None
    ) -> None:
        super().__init__(blob, view, backend, device)
        import threading

        self.closed = False
        self._lock = threading.Lock()
        self._sent = 0
        self._sent_at = 0.0
        self._last: tuple[Any, ...] | None = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.closed:
            raise ValueError("this SafeHandoff is closed")
        # One count and one fence per message, however many views of the memory it carries:
        # the arguments of the last pickling live on in its pickler's memo while that message
        # is being pickled (a later view of it then takes its token and counts nothing).
        last = self._last
        if last is not None and sys.getrefcount(last) > _SLOT_ALONE:
            token = last[2]
        else:
            token = LeastHandoff.__reduce__(self)[1][2]
            with self._lock:
                self._sent += 1
                self._sent_at = time.monotonic()
        args = self._last = (self.blob, self.view, token)
        return _safe_loaded, args


class _Slot:
    __slots__ = ("item",)

    item: tuple[Any, ...]

    def count(self) -> int:
        item = self.item
        return sys.getrefcount(item)


_slot = _Slot()
_slot.item = (object(),)
_SLOT_ALONE = _slot.count()
"""What ``sys.getrefcount`` says, in a method, of a slot's item that the slot alone holds
(measured, as the library's ``_ALONE`` is)."""
del _slot


class _SafeRecord:
    """A worker's record of one :class:`SafeHandoff`'s mapping: what a warm load reads."""

    __slots__ = (
        "released",
        "last_used",
        "server",
        "served",
        "size",
        "layout",
        "hold",
        "native",
        "native_layout",
        "key",
        "token_wait",
    )

    def __init__(self, view: tuple[Any, ...]) -> None:
        from sharedarrays.protocol.payload import check_view

        native = _least_loaded(b"", view, None).array.view()  # (held by this record alone)
        self.released = False
        self.last_used = 0
        self.server = "bench"  # (the payload's sender, not among those this worker served)
        self.served: set[str] = set()
        offset, shape, strides, dtype_str, readonly = view
        dtype, low, high = check_view(view, 1 << 62)
        self.size = offset + high  # (the mapping the payload names: the view's extent)
        self.layout = (shape, strides, dtype_str, dtype, low, high)
        self.hold = object()  # (the hold that a parked mapping keeps, shared by its views)
        self.native = native
        self.native_layout = (native.shape, native.strides)
        self.key = (offset, dtype, shape, strides, readonly)
        self.token_wait: Any = None


_safe: dict[bytes, _SafeRecord] = {}


def _safe_loaded(blob: bytes, view: tuple[Any, ...], token: bytes | None) -> _SafeView:
    record = _safe.get(blob)
    if record is None:  # (the first load: mapped, as sharedarrays' first warm round is)
        record = _safe[blob] = _SafeRecord(view)
    if record.released:
        raise ValueError("released")
    record.last_used = time.monotonic_ns()
    if record.server in record.served:
        raise AssertionError("never served")
    if token is not None:
        if record.token_wait is None:
            from sharedarrays.backends.registry import get_backend

            device = parse_name(f"cuda:{_worker_state['index']}")
            record.token_wait = get_backend(device).import_sync
        record.token_wait(token)
    offset, shape, strides, dtype_str, readonly = view
    layout = record.layout
    if not (
        type(offset) is int
        and type(readonly) is bool
        and (shape is layout[0] or (type(shape) is tuple and shape == layout[0]))
        and (strides is layout[1] or (type(strides) is tuple and strides == layout[1]))
        and (dtype_str is layout[2] or (type(dtype_str) is str and dtype_str == layout[2]))
        and offset >= 0
        and offset + layout[4] >= 0
        and offset + layout[5] <= record.size
    ):
        raise ValueError("a view outside the mapping")
    return _SafeView(record, record.hold, layout[3], shape, strides, offset, readonly)


class _SafeView:
    """A loaded :class:`SafeHandoff`: ``.array`` and ``close()``, as a view has."""

    __slots__ = (
        "_record",
        "_hold",
        "_dtype",
        "_shape",
        "_strides",
        "_offset",
        "_readonly",
        "_native",
    )

    def __init__(
        self,
        record: _SafeRecord,
        hold: object,
        dtype: Any,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        readonly: bool,
    ) -> None:
        self._record = record
        self._hold: object | None = hold
        self._dtype = dtype
        self._shape = shape
        self._strides = strides
        self._offset = offset
        self._readonly = readonly
        self._native: Any = None

    @property
    def array(self) -> Any:
        native = self._native
        if native is None:
            if self._hold is None:
                raise ValueError("closed")
            record = self._record
            native = record.native
            # made for this layout, held by the record (and this frame) alone, and its layout
            # as made: else a new native array
            key = (self._offset, self._dtype, self._shape, self._strides, self._readonly)
            if not (
                key == record.key
                and sys.getrefcount(native) <= _SLOT_ALONE
                and native.shape == record.native_layout[0]
                and native.strides == record.native_layout[1]
            ):
                native = native.view()
            self._native = native
        return native

    def close(self) -> None:
        self._native = None
        self._hold = None


class SafeColdHandoff(LeastHandoff):
    """The cold rounds' ``safe`` entry: the cold bound's two steps (the handle request and
    the mapping, :func:`task_cold_bound`) and the least more that a cold handoff keeping
    this library's guarantees must do, in code of its own besides those two steps.

    It stands for a new sharedarrays ``array`` (made before the round, as the
    ``sharedarrays`` entry's is). Pickled: the bound's fence (:class:`LeastHandoff`), a
    closed array refused, one payload counted in flight under a lock (the memory outlives a
    sender that lets go of it while the payload travels), and what names the memory, as a
    tuple (the exporter's handle server, pid, the allocation's id and secret, its chunk sizes
    and backend) with the view's fields. Loaded (:func:`_safe_cold_loaded`): every field
    checked (types, the chunks, the view against their extent), the chunk handles asked of
    the exporter's handle server (the secret shown; the library's client and server), their
    sizes checked, the memory mapped with its record (the library's mapping, as the bound's),
    the token waited for, the mapping's hold taken and the native array made
    (``Allocation.native_view``); ``close()`` lets the hold go (the mapping parks, as a
    sharedarrays view's does; the round's end drops it).

    The difference between ``sharedarrays`` and this entry in the same rounds is what the
    library's structure costs a cold handoff beyond its guarantees.
    """

    __slots__ = ("array", "closed", "_lock", "_sent")

    def __init__(self, array: Any, device: int | None = None) -> None:
        import threading

        super().__init__(b"", array._view_tuple(), array.allocation.backend, device)
        self.array = array
        self.closed = False
        self._lock = threading.Lock()
        self._sent = 0

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.closed:
            raise ValueError("this SafeColdHandoff is closed")
        from sharedarrays.transport.handles import server_address

        token = LeastHandoff.__reduce__(self)[1][2]
        with self._lock:
            self._sent += 1
        alloc = self.array.allocation
        names = (
            server_address(),
            os.getpid(),
            alloc.id,
            alloc.secret,
            tuple(alloc.chunk_sizes()),
            alloc.backend.name,
            alloc.device.index,
        )
        return _safe_cold_loaded, (names, self.view, token)

    def close(self) -> None:
        self.closed = True
        self.array.close()


def _safe_cold_loaded(
    names: tuple[Any, ...], view: tuple[Any, ...], token: bytes | None
) -> _SafeColdView:
    from sharedarrays import importing
    from sharedarrays.protocol.payload import Payload, check_view
    from sharedarrays.transport import client
    from sharedarrays.transport.handles import server_address

    server, pid, alloc_id, secret, chunks, backend, device = names
    if not (
        type(server) is str
        and server.startswith("/")
        and type(pid) is int
        and type(alloc_id) is str
        and len(alloc_id) == 32
        and type(secret) is bytes
        and len(secret) == 32
        and type(chunks) is tuple
        and all(type(n) is int and n > 0 for n in chunks)
        and type(backend) is str
        and type(device) is int
    ):
        raise ValueError("malformed names")
    size = sum(chunks)
    dtype = check_view(view, size)[0]  # (raises unless the view lies inside the chunks)
    offset, shape, strides, _, readonly = view
    sizes, fds, exports = client.fetch_handles(server, pid, alloc_id, secret, server_address())
    if sizes != list(chunks):
        for fd in fds:
            os.close(fd)
        raise ValueError("the exporter's chunks differ")
    payload = Payload(  # (its fields checked above)
        backend=backend,
        device=device,
        alloc_id=alloc_id,
        secret=secret,
        pid=pid,
        server=server,
        chunks=chunks,
        dtype=np.dtype(np.uint8),
        shape=(size,),
        strides=(1,),
        offset=0,
        readonly=False,
    )
    alloc = _map(importing, importing.Request(payload), sizes, fds, exports)
    hold = alloc.lease()
    if token is not None:
        alloc.backend.import_sync(token)
    return _SafeColdView(alloc.native_view(offset, dtype, shape, strides, readonly), hold)


class _SafeColdView:
    """A loaded :class:`SafeColdHandoff`: ``.array`` and ``close()``, as a view has."""

    __slots__ = ("array", "_hold")

    def __init__(self, array: Any, hold: Any) -> None:
        self.array = array
        self._hold = hold

    def close(self) -> None:
        self.array = None
        self._hold = None
