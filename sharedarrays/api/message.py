"""The handoff's message parts: one allocation's part of a pickled message, sent and loaded.

Sender: a pickled view is ``_rebuild_view(part, view)`` (:mod:`sharedarrays.api.array`),
``part`` a :class:`MessagePart` made once per allocation and message (:func:`message_part`).
It pickles as ``reconstructor(payload bytes, token[, fds])``, written once per message by
pickle's memo: one payload in flight per message, one load by the importer.

Importer: :func:`import_part` decodes the payload once per message into a
:class:`ReceivedPart` (a warm handoff, the same bytes still mapped, takes the last part
again); each view costs a check of its tuple (:meth:`ReceivedPart.take`). The first view
finds or maps the allocation through :func:`sharedarrays.importing.load_payload`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import numpy as np

from sharedarrays import importing
from sharedarrays._cpython import mark_no_spawn_in_thread, spawning_process
from sharedarrays.backends import device_of
from sharedarrays.errors import (
    ClosedArrayError,
    NotShareable,
    PayloadError,
)
from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.lease import Lease, use_clock
from sharedarrays.node import this_node
from sharedarrays.process import STATE
from sharedarrays.protocol.payload import Payload, check_view, remember
from sharedarrays.transport import handles as transport

_BYTES = np.dtype(np.uint8)
_PARTS_TIDY = 256  # entries in one thread's parts table past which dead references go
_RECEIVED_LIMIT = 1024  # parts kept by payload bytes for warm loads (STATE.pickling.received)


# the sender's side ---------------------------------------------------------------------------
def allocation_payload(alloc: Allocation) -> Payload:
    """The payload of the whole allocation (uint8 bytes from offset 0) that pickles of its
    views carry; starts this process's handle server."""
    pid, server = os.getpid(), alloc.source_server  # a growable array names its exporter
    if server is None and alloc.growable and not alloc.origin.created_here:
        # inherited through fork: its length is its creator's, which this server cannot tell
        raise NotShareable(
            f"a growable array inherited through fork cannot be handed on from this process: "
            f"its length changes in the process that made it (pid {alloc.origin.pid}); "
            "pickle it there, or hand on a copy (sa.from_array(a.get()))"
        )
    if server is None:
        server = transport.server_address()
    else:
        pid = alloc.origin.pid
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
    )


def allocation_bytes(alloc: Allocation) -> bytes:
    """The encoded :func:`allocation_payload`, made once per allocation, process and
    generation (which changes when a growable allocation's chunks change)."""
    cached = alloc.encoded
    pid = STATE.pid
    if cached is None or cached[0] != pid or cached[1] != alloc.generation:
        cached = (pid, alloc.generation, allocation_payload(alloc).to_bytes())
        alloc.encoded = cached
    return cached[2]


def use_reconstructor(fn: Callable[..., Any]) -> None:
    """Make ``fn`` what a pickled part calls instead of :func:`import_part` (the api's view
    reconstructor takes a part's arguments too: a message names one function)."""
    STATE.pickling.reconstructor = fn


class MessagePart:
    """One allocation's part of the message being pickled now: the ``allocation`` (never
    pickled), its encoded payload ``blob``, the backend's ordering ``fence`` (its token
    travels) and, where a spawned Process carries them, the chunk ``fds`` (DupFd)."""

    __slots__ = ("allocation", "blob", "fence", "fds", "__weakref__")

    def __init__(
        self, allocation: Allocation, blob: bytes, fence: object, fds: tuple[Any, ...] | None
    ) -> None:
        self.allocation = allocation
        self.blob = blob
        self.fence = fence
        self.fds = fds

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # once per pickler that writes this part: one payload in flight per message
        fence = self.fence
        token = None if fence is None else fence.token  # type: ignore[attr-defined]
        reconstructor = STATE.pickling.reconstructor or import_part
        if self.fds is not None:
            return reconstructor, (self.blob, token, self.fds)
        if self.allocation.source_server is None:
            self.allocation.flight.note_sent()
        return reconstructor, (self.blob, token)

    def received_here(self) -> ReceivedPart:
        """The part as this process's reconstructor takes it (a reduction called in place):
        the allocation known, nothing counted or waited for."""
        part = ReceivedPart(Payload.from_bytes(self.blob), None, None)
        part.bind(self.allocation)
        return part


_new_part = object.__new__


def message_part(alloc: Allocation, carry_fds: bool) -> MessagePart:
    """The part of ``alloc`` in the message this thread is pickling, made at its first view
    (with ``carry_fds``, the chunk fds for the Process being spawned)."""
    parts = STATE.pickling.parts
    refs: dict[Any, weakref.ref[MessagePart]] | None = getattr(parts, "refs", None)
    if refs is None:
        refs = parts.refs = {}
        # spawning_process() raises and catches inside where no spawn ever ran in this
        # thread (10-15 us per view on a cold path): made a plain read
        mark_no_spawn_in_thread()
    # (the spawn's id, not the Popen: a key would keep it, and its pipes, open)
    key = (alloc.id, id(spawning_process())) if carry_fds else alloc.id
    ref = refs.get(key)
    found = None if ref is None else ref()
    cached = alloc.encoded  # (allocation_bytes' cache, checked here: a frame less per view)
    if cached is not None and cached[0] == STATE.pid and cached[1] == alloc.generation:
        blob = cached[2]
    else:
        blob = allocation_bytes(alloc)
    if found is not None and found.blob is blob and found.allocation is alloc:
        return found
    fds = None
    if carry_fds:  # (once per spawn and allocation: a spawner refuses an fd passed twice)
        fds = tuple(reduction.DupFd(fd) for fd in alloc.chunk_fds())
    made = _new_part(MessagePart)  # (without the constructor's frame)
    made.allocation, made.blob, made.fds = alloc, blob, fds
    made.fence = alloc.backend.export_fence()
    if len(refs) >= _PARTS_TIDY and len(refs) >= getattr(parts, "tidy_at", _PARTS_TIDY):
        for k in [k for k, r in refs.items() if r() is None]:
            del refs[k]
        # (next sweep when the table has doubled: a sweep per part would be quadratic)
        parts.tidy_at = max(_PARTS_TIDY, 2 * len(refs))
    refs[key] = weakref.ref(made)
    return made


# the importer's side: a message's parts ------------------------------------------------------
def import_part(blob: bytes, token: object = None, fds: object = None) -> ReceivedPart:
    """What a pickled :class:`MessagePart` calls, once per message: a new part of the
    decoded payload, or that of an earlier message with the same payload whose allocation
    this process still maps (load counted, token waited for). PayloadError for a malformed
    or altered payload or token."""
    if token is not None and type(token) is not bytes:
        raise PayloadError("the ordering token that travelled with the payload is malformed")
    if fds is None and type(blob) is bytes:
        part: ReceivedPart | None = STATE.pickling.received.get(blob)
        if part is not None:
            alloc = part.allocation
            served = part._served
            if served is not None and not alloc.released:  # type: ignore[union-attr]
                # another process's payload of memory it does not own (the common warm
                # load): load_again's steps, written out from what the part keeps
                if token is not None:
                    importing.check_token(token)
                alloc.last_used = use_clock()  # type: ignore[union-attr]
                if part._server in served:  # (counted for a process this one served it to)
                    alloc.flight.note_returned(part._server)  # type: ignore[union-attr]
                if token is not None:
                    alloc.backend.import_sync(token)  # type: ignore[union-attr]
                part._stale = True  # (a new message: see ReceivedPart.take)
                return part
            if alloc is not None and importing.load_again(alloc, part.payload, token):
                part._stale = True
                return part
            STATE.pickling.received.pop(blob, None)
    elif fds is not None and type(fds) is not tuple:
        raise PayloadError("the handles that travelled with the payload do not match it")
    return ReceivedPart(Payload.from_bytes(blob), token, fds, blob)


def _on_device(p: Payload) -> bool:
    """Whether ``p``'s memory is a device's, whose views must be aligned (an unknown
    backend counts as one: its load is refused anyway)."""
    known = STATE.pickling.on_device.get(p.backend)
    if known is None:
        try:
            known = device_of(p.backend, p.device).needs_context
        except PayloadError:
            return True
        STATE.pickling.on_device[p.backend] = known
    return known


class ReceivedPart:
    """One allocation's part of a message being loaded here: its payload (decoded once), the
    allocation once the first view found or mapped it, and the last view layout checked.
    Pickled again (inside an OtherNodeArray), it is its payload and token."""

    __slots__ = (
        "payload",
        "size",
        "blob",
        "token",
        "fds",
        "allocation",
        "readonly",
        "_lease",
        "_layout",
        "_device",
        "_growable",
        "_stale",
        "_lease_thread",
        "_served",
        "_server",
    )

    def __init__(
        self,
        payload: Payload,
        token: bytes | None,
        fds: tuple[Any, ...] | None,
        blob: bytes | None = None,
    ) -> None:
        self.payload = payload
        self.size = payload.size
        self.blob = blob
        self.token = token
        self.fds = fds
        self.allocation: Allocation | None = None
        # the lease its views share, weakly: a part kept alive (a traceback) holds no mapping
        self._lease: weakref.ref[Lease[Allocation]] | None = None
        self.readonly = payload.readonly  # every view of it is read-only here
        self._growable = False  # (its allocation's, once bound)
        self._stale = False  # (the lease referred to is an earlier message's)
        self._lease_thread = 0  # (the thread that took the lease referred to)
        self._served: set[str] | None = None  # (see bind)
        self._server = payload.server
        # (shape, strides, dtype string, dtype, low, high, alignment mask) of the last view
        self._layout: tuple[Any, ...] | None = None
        self._device = _on_device(payload)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        blob = self.blob if self.blob is not None else self.payload.to_bytes()
        return STATE.pickling.reconstructor or import_part, (blob, self.token)

    def bind(self, alloc: Allocation) -> None:
        """Take ``alloc`` as the allocation of every view of the part."""
        p = self.payload
        self.allocation = alloc
        self._lease = None
        self._growable = alloc.growable
        self.readonly = p.readonly or alloc.access != "rw"
        # another process's payload of memory it does not own, no block: a warm load only
        # stamps the use and counts a return (import_part)
        plain = p.pid != STATE.pid and not alloc.backend.exporter_owned and not alloc.growable
        self._served = alloc.flight.servers if plain and p.block is None else None

    def lease(self, readonly: bool) -> tuple[Allocation, Lease[Allocation] | None]:
        """The allocation (found or mapped by :meth:`find` on first use) and a new lease for
        the part's views to share (``None`` if growable: each view keeps its own ``end``).
        ClosedArrayError if it was released here since. (A view takes the lease of the views
        before only where a parked allocation keeps it, or in the thread that took it for
        this message: else its end could be running in another thread.)"""
        alloc = self.allocation
        if alloc is None:
            alloc = self.find(readonly)
        self._stale = False
        lease = None
        if not self._growable:
            lease = alloc.lease()
            self._lease = weakref.ref(lease)
            self._lease_thread = threading.get_ident()
        return alloc, lease

    def find(self, readonly: bool) -> Allocation:
        """Find or map the allocation (:func:`~sharedarrays.importing.load_payload`),
        read-only on first sight if the first view is; the carried fds are used once."""
        p = self.payload
        if readonly and not p.readonly:
            p = dataclasses.replace(p, readonly=True)
        fds, self.fds = self.fds, None
        alloc = importing.load_payload(p, self.token, fds)
        self.token = None  # (waited for; kept where the load failed, for a re-pickle)
        self.bind(alloc)
        blob = self.blob
        if blob is not None and fds is None and not alloc.growable:
            remember(STATE.pickling.received, blob, self, _RECEIVED_LIMIT)
        return alloc

    def take(self, view: object) -> tuple[Any, ...]:
        """A view's checked fields with the allocation and the lease it takes: ``(allocation,
        lease, dtype, shape, strides, offset, readonly, end)``, ``end`` one past its last
        byte; raises as :func:`~sharedarrays.protocol.payload.check_view` and :meth:`lease`.
        One frame for a view of the layout checked last (every view of a warm handoff)."""
        fields = None
        layout = self._layout
        if type(view) is tuple and len(view) == 5 and layout is not None:
            offset, shape, strides, dtype_str, readonly = view
            # the last layout? each field the same object (interned by the sender) or an
            # equal one of the same type; a comparison that raises is checked in full below
            try:
                same = (
                    type(offset) is int
                    and type(readonly) is bool
                    and (shape is layout[0] or (type(shape) is tuple and shape == layout[0]))
                    and (strides is layout[1] or (type(strides) is tuple and strides == layout[1]))
                    and (
                        dtype_str is layout[2]
                        or (type(dtype_str) is str and dtype_str == layout[2])
                    )
                )
            except Exception:
                same = False
            if same:
                low, high = layout[4], layout[5]
                if (
                    offset + low >= 0
                    and offset + high <= self.size
                    and offset >= 0
                    and not offset & layout[6]
                ):
                    fields = (layout[3], layout[0], layout[1], offset, readonly, offset + high)
        if fields is None:
            dtype, low, high = check_view(view, self.size, self._device)
            offset, shape, strides, dtype_str, readonly = view  # type: ignore[misc]
            mask = dtype.alignment - 1 if self._device else 0
            self._layout = (shape, strides, dtype_str, dtype, low, high, mask)
            fields = (dtype, shape, strides, offset, readonly, offset + high)
        alloc = self.allocation
        ref = self._lease
        lease = None if ref is None else ref()
        if (
            lease is not None
            and alloc is not None
            and (
                lease is alloc.kept_lease
                or (not self._stale and self._lease_thread == threading.get_ident())
            )
        ):
            self._stale = False
        else:
            try:
                alloc, lease = self.lease(fields[4])
            except ClosedArrayError:  # a parked mapping dropped since it was found: map anew
                self.find(fields[4])
                alloc, lease = self.lease(fields[4])
        return (alloc, lease, *fields)
