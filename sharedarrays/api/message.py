"""One allocation's part of one pickled message: what every view of it in the message shares.

A pickled view is ``_rebuild_view(part, view)`` (:mod:`sharedarrays.api.array`): ``part`` is
a :class:`MessagePart`, made once per allocation and message, and ``view`` the view's own
fields (:class:`~sharedarrays.protocol.payload.ViewFields` as a tuple). The part pickles as
``import_part(payload, token[, fds])``: the allocation's payload (one bytes object per
allocation, process and generation), the message's ordering token, and the chunk fds where
a spawned Process's arguments carry them. Pickle's memo writes a part once per message and
the unpickler calls :func:`import_part` once: so the importer decodes the payload, finds or
maps the allocation, counts the payload loaded and waits for the token once per allocation
and message, and each further view costs a check of its tuple (:meth:`ReceivedPart.take`).

A warm handoff (a later message with the same payload, whose allocation this process still
maps) takes the part of the last one again (``STATE.pickling.received``): the allocation
found and the layout checked; only the load is counted and the token waited for (for
another process's payload of memory it does not own, the common case, in
:func:`import_part`'s own frame; else :func:`sharedarrays.importing.load_again`), and its
first view takes the lease a parked import keeps (through the part's weak reference, or
:meth:`Allocation.lease`): no lease is made or ended (:meth:`ReceivedPart.take`). Each step
of a warm load is written out in as few frames as its layers allow (docs/performance.md: in a
handoff every frame and every object read is read with cold caches).

Counting in flight follows the same unit: a part counts one payload in flight when a pickler
writes it (:meth:`MessagePart.__reduce__`, once per message that carries the allocation),
and the importer counts one load (its first view). A view's reduction called in place
(``fn(*args)`` of its ``__reduce__``, without a pickler) passes the reconstructor the part
itself: nothing is counted either way. (``copy.copy`` and ``copy.deepcopy`` of a view copy
its values instead, as NumPy's do.)

How a view finds its message's part: as the ordering fence does
(:func:`sharedarrays.backends.cuda.sync.fence`), through a weak reference in this thread. The
pickler's memo holds every object it pickled until the pickler is freed, so while one
``dumps`` runs every view of an allocation finds the same part, and the next message (a new
pickler) makes a new one.
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
from sharedarrays.errors import ClosedArrayError, NotShareable, PayloadError
from sharedarrays.memory import Allocation, Lease, use_clock
from sharedarrays.node import this_node
from sharedarrays.process import STATE
from sharedarrays.protocol.payload import Payload, check_view, remember
from sharedarrays.transport import handles as transport

__all__ = [
    "MessagePart",
    "ReceivedPart",
    "allocation_bytes",
    "allocation_payload",
    "import_part",
    "message_part",
    "use_reconstructor",
]


_BYTES = np.dtype(np.uint8)


def allocation_payload(alloc: Allocation) -> Payload:
    """The payload of the whole allocation (a canonical view: uint8 bytes from offset 0)
    that pickles of its views carry; starts this process's handle server."""
    pid, server = os.getpid(), alloc.source_server  # a growable array names its exporter
    if server is None and alloc.growable and not alloc.origin.created_here:
        # inherited through fork (Allocation.disown): its length is its creator's, which
        # this process's handle server could not tell an importer
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
    size = sum(chunks)
    return Payload(
        backend=alloc.backend.name,
        device=alloc.device.index,
        alloc_id=alloc.id,
        secret=alloc.secret,
        pid=pid,
        server=server,
        chunks=chunks,
        dtype=_BYTES,
        shape=(size,),
        strides=(1,),
        offset=0,
        readonly=alloc.export_readonly,
        capacity=alloc.capacity if alloc.growable else None,
        node=this_node(),
        block=alloc.block if alloc.cacheable() else None,
    )


def allocation_bytes(alloc: Allocation) -> bytes:
    """The encoded :func:`allocation_payload`, made once per allocation, process and
    generation (it changes only when a growable allocation gains or loses chunks, or
    moves): the same bytes object for every message."""
    cached = alloc.encoded
    pid = STATE.pid
    if cached is None or cached[0] != pid or cached[1] != alloc.generation:
        cached = (pid, alloc.generation, allocation_payload(alloc).to_bytes())
        alloc.encoded = cached
    return cached[2]


# the sender's side -------------------------------------------------------------------------
def use_reconstructor(fn: Callable[..., Any]) -> None:
    """Make ``fn`` what a pickled part calls (instead of :func:`import_part`):
    :mod:`sharedarrays.api.array` registers its view reconstructor, which takes a part's
    arguments too (``(payload bytes, token[, fds])``, handed to :func:`import_part`), so that
    a message names one function: pickle writes it once and the unpickler looks up one
    global per message instead of two."""
    STATE.pickling.reconstructor = fn


class MessagePart:
    """One allocation's part of the message being pickled now (see the module's notes).

    Attributes
    ----------
    allocation : Allocation
        The allocation (never pickled: the part pickles as its payload).
    blob : bytes
        The allocation's encoded payload (:func:`allocation_bytes`).
    fence : object or None
        The backend's ordering argument for the message (the part carries its ``token``).
    fds : tuple or None
        The chunk fds (multiprocessing's ``DupFd``) when a spawned Process's arguments carry
        them; the child then asks no handle server, and nothing is counted in flight.
    """

    __slots__ = ("allocation", "blob", "fence", "fds", "__weakref__")

    def __init__(
        self, allocation: Allocation, blob: bytes, fence: object, fds: tuple[Any, ...] | None
    ) -> None:
        self.allocation = allocation
        self.blob = blob
        self.fence = fence
        self.fds = fds

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # called once per pickler that writes this part (then a memo reference): one payload
        # in flight per message, where it names this process's handle server
        alloc = self.allocation
        fence = self.fence  # (its token: the same object for every part of the message)
        token = None if fence is None else fence.token  # type: ignore[attr-defined]
        reconstructor = STATE.pickling.reconstructor or import_part
        if self.fds is not None:
            return reconstructor, (self.blob, token, self.fds)
        if alloc.source_server is None:
            alloc.flight.note_sent()
        return reconstructor, (self.blob, token)

    def received_here(self) -> ReceivedPart:
        """The part as this process's own reconstructor takes it (a view's reduction called
        in place passes the part itself): the allocation is known, nothing is counted or
        waited for."""
        part = ReceivedPart(Payload.from_bytes(self.blob), None, None)
        part.bind(self.allocation)
        return part


_new_part = object.__new__
_PARTS_TIDY = 256  # entries in one thread's table past which dead references are dropped


def message_part(alloc: Allocation, carry_fds: bool) -> MessagePart:
    """The part of ``alloc`` in the message this thread is pickling (made on its first view:
    the allocation's payload, the backend's ordering fence, and with ``carry_fds`` the chunk
    fds for the Process being spawned)."""
    parts = STATE.pickling.parts
    refs: dict[Any, weakref.ref[MessagePart]] | None = getattr(parts, "refs", None)
    if refs is None:
        refs = parts.refs = {}
        # Every view's reduction asks multiprocessing whether a Process is being spawned
        # in this thread (``spawning_process``), and where none ever was, each answer
        # raises and catches an AttributeError inside, 10-15 us on a cold path (a Pool's
        # task thread, at every task): made a plain read, as a spawn leaves it.
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
    if carry_fds:  # (multiprocessing's DupFd, made once per spawn and allocation: this part
        # is that spawn's, found by every view of it, and a spawner refuses an fd passed twice)
        fds = tuple(reduction.DupFd(fd) for fd in alloc.chunk_fds())
    # (MessagePart's constructor without its frame: one part per message of a warm handoff)
    made = _new_part(MessagePart)
    made.allocation, made.blob, made.fence, made.fds = (
        alloc,
        blob,
        alloc.backend.export_fence(),
        fds,
    )
    if len(refs) >= _PARTS_TIDY and len(refs) >= getattr(parts, "tidy_at", _PARTS_TIDY):
        for k in [k for k, r in refs.items() if r() is None]:
            del refs[k]
        # (the next sweep when the table has doubled: a message with many allocations keeps
        # every part alive while it is pickled, and a sweep at each new part would make its
        # pickling quadratic in their number)
        parts.tidy_at = max(_PARTS_TIDY, 2 * len(refs))
    refs[key] = weakref.ref(made)
    return made


# the importer's side -----------------------------------------------------------------------
_RECEIVED_LIMIT = 1024
"""Parts whose allocation was found here kept by their payload bytes at most
(``STATE.pickling.received``): a later message with the same payload (a warm handoff) takes the
part again, its allocation found and its views' layout checked, and only counts the load
and waits for its token (:func:`import_part`)."""


def import_part(blob: bytes, token: object = None, fds: object = None) -> ReceivedPart:
    """What a pickled :class:`MessagePart` calls, once per message: the decoded payload (the
    allocation is found or mapped at the first view, which says whether it maps read-only),
    or the part of an earlier message with the same payload whose allocation this process
    still maps (see :data:`_RECEIVED_LIMIT`).

    Raises
    ------
    PayloadError
        A malformed or altered payload, or a malformed token.
    """
    if token is not None and type(token) is not bytes:
        raise PayloadError("the ordering token that travelled with the payload is malformed")
    if fds is None and type(blob) is bytes:
        part: ReceivedPart | None = STATE.pickling.received.get(blob)
        if part is not None:
            alloc = part.allocation
            served = part._served
            if served is not None and not alloc.released:  # type: ignore[union-attr]
                # A payload of another process, memory it does not own (the common warm load):
                # load_again's steps for it in this frame, from what the part keeps at hand
                # (STATE.pickling.received is emptied in a forked child, and holds no
                # growable allocation)
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
    """Whether ``p``'s memory is a device's (GPU, NPU: not the CPU's), whose views must be
    aligned for their dtype (:func:`~sharedarrays.protocol.payload.misaligned`). A backend
    not registered here counts as one (loading its payload is refused anyway)."""
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

    Pickled again (a view that :class:`~sharedarrays.api.othernode.OtherNodeArray` stands
    for), it is its payload and token.
    """

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
        # the lease its views share (not growable), weakly: the views hold it, so that a part
        # kept alive (a traceback of a message that failed to load) holds no mapping
        self._lease: weakref.ref[Lease[Allocation]] | None = None
        self.readonly = payload.readonly  # every view of it is read-only here
        self._growable = False  # (its allocation's, once bound)
        self._stale = False  # (the lease referred to is an earlier message's: see lease)
        self._lease_thread = 0  # (the thread that took the lease referred to: see lease)
        self._served: set[str] | None = None  # (see bind)
        self._server = payload.server
        # (shape, strides, dtype string) of the last view checked, its dtype, extent and the
        # bits its offset must not have (alignment on device memory, else none)
        self._layout: tuple[Any, ...] | None = None
        self._device = _on_device(payload)  # (its views must be aligned: check_view)

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
        # a payload of another process, of memory it does not own: a warm load only stamps
        # the use and counts a return to a process this one served (import_part)
        plain = p.pid != STATE.pid and not alloc.backend.exporter_owned and not alloc.growable
        plain = plain and p.block is None  # (a block's loads are counted: load_again)
        self._served = alloc.flight.servers if plain else None

    def lease(self, readonly: bool) -> tuple[Allocation, Lease[Allocation] | None]:
        """The allocation (found or mapped by :meth:`find` on first use) and a new lease for
        the part's views to share (:meth:`take` hands out the one they share where a view
        may take it): one hold on the allocation per message, not per view, taken at the
        first view and ended when the last view of them closes or goes (the part holds it
        weakly; ``None`` for a growable allocation, whose views each keep their own ``end``
        for shrinking).

        When a view takes the lease of the views before (:meth:`take`): a later message's
        part (a warm handoff) takes the last message's lease only where it is the one a
        parked allocation keeps (``Allocation.lease`` hands it out), else leases through the
        allocation, under its lock: through the weak reference alone it could take a lease
        whose end is running in another thread (a ``__del__`` still finds itself through a
        weak reference), which would live on uncounted, and the allocation could be
        released under the view. The kept lease cannot be such a one: the allocation lets it
        go before it ends. For the same reason a view takes another view's lease through the
        weak reference only in the thread that took it (two threads may load messages with
        the same payload at once, and the part is shared): in that thread the message being
        loaded holds its earlier views, and their lease.

        Raises
        ------
        ClosedArrayError
            The allocation was released here since the part found it.
        """
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
        """Find or map the allocation (:func:`sharedarrays.importing.load_payload`: counts the
        payload loaded and waits for the token), read-only on first sight if the first view
        is; the carried fds are used once."""
        p = self.payload
        if readonly and not p.readonly:  # a read-only view maps read-only on first sight
            p = dataclasses.replace(p, readonly=True)
        fds, self.fds = self.fds, None
        alloc = importing.load_payload(p, self.token, fds)
        # (waited for; kept where the load failed: a part pickled again, the payload of another
        # node's array, carries it on)
        self.token = None
        self.bind(alloc)
        blob = self.blob
        if blob is not None and fds is None and not alloc.growable:
            # (the next message with this payload takes this part: see import_part)
            remember(STATE.pickling.received, blob, self, _RECEIVED_LIMIT)
        return alloc

    def take(self, view: object) -> tuple[Any, ...]:
        """The checked fields of a view of this part, with the allocation and the lease the
        view takes (:meth:`lease`): ``(allocation, lease, dtype, shape, strides, offset,
        readonly, end)`` (``end``: one past the last byte it touches; the view is read-only
        if ``readonly`` or the part says so).

        One frame for a view of the layout checked last with a lease it may share (every
        view of a warm handoff): the checks below, written out.

        Raises
        ------
        PayloadError
            As :meth:`~sharedarrays.protocol.payload.ViewFields.from_tuple` (on device
            memory a misaligned view too: :func:`~sharedarrays.protocol.payload.misaligned`).
        ClosedArrayError, HandleUnavailable, WrongNode, ...
            As :meth:`lease` (the allocation cannot be found or mapped).
        """
        fields = None
        layout = self._layout
        if type(view) is tuple and len(view) == 5 and layout is not None:
            offset, shape, strides, dtype_str, readonly = view
            # The layout of the view before (in this message, or the last with this payload)?
            # Each field the same object (the sender interns them: within a message they
            # are) or an equal one of the same type (a later message); anything whose
            # comparison raises is checked in full below. Then only the bounds are checked,
            # and the checked fields are used.
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
        # The lease of the views before, where this view may take it (see lease: when)
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
            except ClosedArrayError:
                # A parked mapping was dropped (a release notice, the limit) since it was
                # found: it is gone from the registry now, so this maps it anew.
                self.find(fields[4])
                alloc, lease = self.lease(fields[4])
        return (alloc, lease, *fields)
