"""A message's parts as loaded here (:class:`ReceivedPart`; a warm handoff takes the last one
again) and the allocation a payload names, found or mapped by :data:`RESOLVERS`."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from sharedarrays.backends import Access, Backend, device_of, get_backend, why_unusable
from sharedarrays.errors import (
    BackendUnavailable,
    ClosedArrayError,
    HandleUnavailable,
    PayloadError,
    PermissionDenied,
    WrongNode,
    fd_limit_error,
)
from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.info import use_clock
from sharedarrays.memory.lease import Lease
from sharedarrays.memory.registry import lookup, revive
from sharedarrays.memory.reservation import close_fds
from sharedarrays.memory.takeable import took_what_it_named
from sharedarrays.node import NODE_VARIABLE, this_node
from sharedarrays.process import STATE
from sharedarrays.protocol.handles import Kind
from sharedarrays.protocol.payload import Payload, check_view, remember
from sharedarrays.protocol.unix import take_fds
from sharedarrays.settings import env_number
from sharedarrays.transport import client, keeper
from sharedarrays.transport import handles as transport
from sharedarrays.transport.growth import catch_up_to, shrunk

RELEASE_WAIT = 2 * keeper.TIMEOUT  # seconds a load waits for another thread's release to end
_RECEIVED_LIMIT = 1024  # parts kept by payload bytes for warm loads (STATE.pickling.received)
_WARM_TYPES = (int, tuple, tuple, str, bool)  # a view tuple's fields, as a sender writes them


def use_reconstructor(fn: Callable[..., Any]) -> None:
    """Make ``fn`` (taking :func:`import_part`'s arguments) what a re-pickled part calls."""
    STATE.pickling.reconstructor = fn


def import_part(blob: bytes, token: object = None, fds: object = None) -> ReceivedPart:
    """A pickled part's reconstructor: a new part, or that of an earlier message of the same
    bytes still mapped here (load counted, token waited for)."""
    if token is not None:  # (no call for none: a warm load per message)
        token = check_token(token)
    if fds is None and type(blob) is bytes:
        part: ReceivedPart | None = STATE.pickling.received.get(blob)
        if part is not None:
            alloc = part.allocation
            if alloc is not None and load_again(alloc, part.payload, token):
                part.pending += 1  # (a new message: see ReceivedPart.take)
                return part
            STATE.pickling.received.pop(blob, None)
    elif fds is not None and type(fds) is not tuple:
        raise PayloadError("the handles that travelled with the payload do not match it")
    return ReceivedPart(Payload.from_bytes(blob), token, fds, blob)


class ReceivedPart:
    """One allocation's part of a message loaded here, its allocation and last view layout."""

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
        "pending",
        "_lease_thread",
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
        # messages loaded whose first view has not taken a lease yet: a block's load is
        # counted then, so a DONE said meanwhile never counts it (memory/inflight.py)
        self.pending = 1
        self._lease_thread = 0  # (the thread that took the lease referred to)
        # (shape, strides, dtype string, dtype, low, high, alignment mask) of the last view
        self._layout: tuple[Any, ...] | None = None
        device = STATE.pickling.on_device.get(payload.backend)
        if device is None:  # (an unknown backend counts as a device: its load is refused)
            try:
                device = device_of(payload.backend, payload.device).needs_context
            except PayloadError:
                device = True
            else:
                STATE.pickling.on_device[payload.backend] = device
        self._device = device  # a device's memory: its views must be aligned

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        blob = self.blob if self.blob is not None else self.payload.to_bytes()
        return STATE.pickling.reconstructor or import_part, (blob, self.token)

    def bind(self, alloc: Allocation) -> None:
        """Take ``alloc`` as the allocation of every view of the part."""
        self.allocation = alloc
        self._lease = None
        self._growable = alloc.growable
        self.readonly = self.payload.readonly or alloc.access != "rw"

    def lease(self, readonly: bool) -> tuple[Allocation, Lease[Allocation] | None]:
        """The allocation (:meth:`find` on first use) and a new lease for the part's views
        (``None`` if growable); ClosedArrayError if it was released here since."""
        alloc = self.allocation
        if alloc is None:
            alloc = self.find(readonly)
        lease = None
        if not self._growable:
            lease = alloc.lease()
            self._lease = weakref.ref(lease)
            self._lease_thread = threading.get_ident()
        return alloc, lease

    def find(self, readonly: bool) -> Allocation:
        """Find or map the allocation (read-only if the first view is); fds are used once."""
        p = self.payload
        if readonly and not p.readonly:
            p = dataclasses.replace(p, readonly=True)
        fds, self.fds = self.fds, None
        alloc = load_payload(p, self.token, fds)
        self.token = None  # (waited for; kept where the load failed, for a re-pickle)
        self.bind(alloc)
        blob = self.blob
        # kept for the next message with these bytes: a warm load takes ~20 us on the host
        # with it, 11-16 us more without (ab_trees.py --off parts, 1,000 pairs x 4)
        if blob is not None and fds is None and not alloc.growable:
            remember(STATE.pickling.received, blob, self, _RECEIVED_LIMIT)
        return alloc

    def take(self, view: object) -> tuple[Any, ...]:
        """``(allocation, lease, dtype, shape, strides, offset, readonly, end)`` of a checked
        view; one frame for the layout checked last (every view of a warm handoff). A view
        shares the lease of the views before only where a parked allocation keeps it, or in
        the thread that took it for this message (else its end may run in another thread)."""
        fields = None
        layout = self._layout
        if type(view) is tuple and len(view) == 5 and layout is not None:
            offset, shape, strides, dtype_str, readonly = view
            # the last layout (fields the sender interned: identical objects)? Only the
            # fields checked then are used, so a crafted ``__eq__`` gains nothing. It buys
            # ~1 us a view: a 10,000-view message (bench --only many) loads ~10% faster
            try:
                same = (
                    type(offset),
                    type(shape),
                    type(strides),
                    type(dtype_str),
                    type(readonly),
                ) == _WARM_TYPES and (shape, strides, dtype_str) == layout[:3]
            except Exception:  # (checked in full below)
                same = False
            low, high, mask = layout[4:]
            fits = same and offset >= 0 and offset + low >= 0 and offset + high <= self.size
            if fits and not offset & mask:
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
        pending = self.pending
        if (
            lease is None
            or alloc is None
            or not (
                lease is alloc.kept_lease
                or (not pending and self._lease_thread == threading.get_ident())
            )
        ):
            try:
                alloc, lease = self.lease(fields[4])
            except ClosedArrayError:  # a parked mapping dropped since it was found: map anew
                self.find(fields[4])
                alloc, lease = self.lease(fields[4])
        if pending:  # a new message's first view
            self.pending = pending - 1
            if alloc.pool_server is not None:  # a block's load, now leased
                alloc.flight.note_block_lease()
        return (alloc, lease, *fields)


@dataclasses.dataclass(slots=True)
class Request:
    """What the resolvers share: the ``payload``, the fds ``carried`` with it (owned here
    until used or closed), and the ``failures`` of the sources asked so far."""

    payload: Payload
    carried: list[int] | None = None
    failures: tuple[HandleUnavailable, ...] = ()
    _backend: Backend | None = None

    def failed(self, why: HandleUnavailable) -> None:
        """Record that a source gave no handles (no traceback: its frames hold this request)."""
        self.failures = (*self.failures, why.with_traceback(None))

    def backend(self) -> Backend:
        """The payload's memory system here (the carried fds closed if it is unusable)."""
        if self._backend is None:
            p = self.payload
            try:
                self._backend = get_backend(device_of(p.backend, p.device), p.backend)
            except BaseException:
                close_fds(self.carried or [])
                raise
        return self._backend


Resolver = Callable[[Request], Allocation | None]  # (None: pass to the next step)


def mapped_here(req: Request) -> Allocation | None:
    """The allocation if mapped here already (a growable one catches up)."""
    return _mapped(req.payload, req.carried)


def _mapped(p: Payload, carried: list[int] | None) -> Allocation | None:  # (no Request: warm)
    alloc = lookup(p.alloc_id)
    if alloc is not None and alloc.released:
        # another thread releases it (registered while the keeper takes its handles): once
        # it has left, the payload loads as any other does
        STATE.memory.wait_unregistered(alloc, RELEASE_WAIT)
        alloc = lookup(p.alloc_id)
    pid = os.getpid()
    if alloc is None and p.pid == pid:  # back at its exporter, which let go of it
        alloc = revive(p.alloc_id)
    if alloc is None:
        return None
    received = carried or []
    import hmac  # (not at module level: hashlib's import costs ``import sharedarrays`` 2 ms)

    if not hmac.compare_digest(p.secret, alloc.secret):
        close_fds(received)
        raise PermissionDenied(
            f"allocation {p.alloc_id} is mapped here, but the payload's secret is not its "
            "secret; the payload does not belong to that allocation"
        )
    if alloc.pid != pid and alloc.device.needs_context:  # inherited through fork
        why = why_unusable(alloc.backend.name, alloc.device.index)
        if why is not None:
            close_fds(received)
            raise BackendUnavailable(f"cannot use {alloc.device}: {why}")
    if p.capacity is not None:  # a growable array: maps the chunks added since, if any
        return catch_up_to(alloc, p, received)
    close_fds(received)
    if not alloc.has_chunk_sizes(p.chunks) or alloc.backend.name != p.backend:
        device_of(p.backend, p.device)  # a backend unknown here says so (else: a mismatch)
        raise PayloadError(f"payload does not match allocation {p.alloc_id} mapped here")
    _count_load(alloc, p, pid)
    return alloc


def _count_load(alloc: Allocation, p: Payload, pid: int) -> None:
    if p.pid != pid:  # its sender counts it in flight until told
        alloc.flight.note_returned(p.server)
        if alloc.backend.exporter_owned:  # the exporter waits for its payloads: say so
            client.report_load(p.server, p.alloc_id, p.secret)
    else:  # one of this process's payloads came back: not in flight
        alloc.flight.note_loaded()
        if p.block is not None:  # (and no importer's: its views here hold the memory)
            alloc.flight.note_done(1)


def load_again(alloc: Allocation, p: Payload, sync: bytes | None) -> bool:
    """Load ``p`` again as ``alloc``: count it, wait for ``sync`` (checked); ``False``, doing
    nothing, where ``alloc`` is no longer mapped here under that id or grows."""
    pid = STATE.pid  # (os.getpid(): a system call, microseconds on a cold path)
    if alloc.released or alloc.pid != pid or p.capacity is not None or alloc.id != p.alloc_id:
        return False
    alloc.last_used = use_clock()  # (its views may share a lease kept alive)
    _count_load(alloc, p, pid)
    if sync is not None:
        alloc.backend.import_sync(sync)
    return True


def reused_block(req: Request) -> Allocation | None:
    """The allocation parked here on the payload's block (its exporter reused the memory for
    a new array: :mod:`sharedarrays.memory.cache`), renamed to the new id and secret."""
    p = req.payload
    if p.block is None:
        return None
    memory = STATE.memory
    with memory.lock:
        alloc: Allocation | None = memory.blocks.get(p.block)
        if (
            alloc is None
            or not alloc.parked
            or alloc.pool_server != p.server
            or alloc.backend.name != p.backend
            or not alloc.has_chunk_sizes(p.chunks)
        ):
            return None
        del memory.registry[alloc.id]
        memory.parked.pop(alloc.id, None)
        alloc.id, alloc.secret = p.alloc_id, p.secret
        alloc.generation += 1
        alloc.flight.note_block_renamed()
        memory.registry[alloc.id] = alloc
        memory.parked[alloc.id] = alloc
    close_fds(req.carried or [])
    return alloc


def in_message(req: Request) -> Allocation | None:
    """The allocation mapped from the fds that travelled with the payload, if any did."""
    if req.carried is None:
        return None
    alloc = _map(req, list(req.payload.chunks), req.carried)
    transport.server_address()  # (so that the node view sees what this child holds)
    return alloc


def from_exporter_fds(req: Request) -> Allocation | None:
    """The allocation mapped from chunk fds taken out of the exporter (no request, no wait),
    proven by its take table (:mod:`~sharedarrays.memory.takeable`), then told so; ``None``
    where the payload names none, the kernel refuses or the proof fails."""
    p, fds = req.payload, req.payload.fds
    if fds is None or p.pid == STATE.pid or req.carried is not None:
        return None
    if not env_number("SHAREDARRAYS_TAKE_FDS", 1, 0):
        return None
    here = transport.server_address()  # (first: where no thread can start, nothing is taken)
    taken = take_fds(p.pid, [*fds.chunks, fds.table])  # (the table last)
    if taken is None:
        return None
    table = taken.pop()
    try:
        proven = took_what_it_named(table, fds, p.alloc_id, p.secret)
    finally:
        os.close(table)
    if not proven:  # released since, or a wrong secret: the exporter says which
        close_fds(taken)
        return None
    alloc = _map(req, list(p.chunks), taken)
    # (sent now, not queued: the exporter learns of it before any result of this process)
    client.send_notice(p.server, Kind.TOOK, p.alloc_id, p.secret, len(taken), here)
    return alloc


def from_exporter(req: Request) -> Allocation | None:
    """The allocation mapped from the exporter's handles, or ``None`` (recorded)."""
    p = req.payload
    req.backend()
    try:
        ask, here = (p.server, p.pid, p.alloc_id, p.secret), transport.server_address()
        if p.capacity is not None:
            sizes, capacity, used, fds = client.fetch_growth(*ask, 0, reply_to=here)
            exports: tuple[bytes, ...] = ()
        else:
            sizes, fds, exports = client.fetch_handles(*ask, reply_to=here)
            capacity = used = 0
    except HandleUnavailable as gone:  # the exporter is gone: a keeper may hold it
        req.failed(gone)
        return None
    return _map(req, sizes, fds, exports, capacity, used)


def from_keeper(req: Request) -> Allocation | None:
    """The allocation mapped from handles this user's keeper holds, or ``None`` (recorded;
    at once for memory no keeper holds: exporter-owned, growable)."""
    p = req.payload
    if not req.failures or p.capacity is not None or req.backend().exporter_owned:
        return None
    try:
        sizes, fds, relayed = keeper.fetch_handles(p.alloc_id, p.secret, req.failures[-1])
    except HandleUnavailable as gone:
        req.failed(gone)
        return None
    alloc = _map(req, sizes, fds)
    STATE.keeper.kept[alloc] = None
    if relayed:  # (its exporter left it in flight: parked, it would hold memory for nothing)
        alloc.orphan(now=False)
    return alloc


RESOLVERS = (mapped_here, reused_block, in_message, from_exporter_fds, from_exporter, from_keeper)
"""The chain :func:`load_payload` asks, in order; the first answer wins."""


def resolve(req: Request, resolvers: tuple[Resolver, ...] = RESOLVERS) -> Allocation:
    """The first answer of ``resolvers`` for ``req``; else the last HandleUnavailable."""
    for resolver in resolvers:
        alloc = resolver(req)
        if alloc is not None:
            return alloc
    if req.failures:
        raise req.failures[-1]
    raise HandleUnavailable(
        f"allocation {req.payload.alloc_id} is not mapped here and no source of its "
        "handles answered"
    )


def load_payload(
    p: Payload, sync: bytes | None = None, fds: tuple[Any, ...] | None = None
) -> Allocation:
    """Find or map ``p``'s allocation, then wait for the ordering token ``sync``; ``fds``:
    objects whose ``detach()`` gives an fd (multiprocessing's DupFd)."""
    check_token(sync)
    carried: list[int] | None = None
    if fds is not None:
        if type(fds) is not tuple or len(fds) != len(p.chunks):
            raise PayloadError("the handles that travelled with the payload do not match it")
        carried = _detach(fds)
    alloc = _mapped(p, carried)  # (most loads, every warm one, end here: no Request)
    fresh = alloc is None
    if alloc is None:
        _check_node(p, carried)
        alloc = resolve(Request(p, carried), RESOLVERS[1:])
        if p.block is not None and p.pid != STATE.pid:  # (counted by _mapped otherwise)
            _take_block(alloc, p)
    if sync is not None:
        try:
            alloc.backend.import_sync(sync)
        except BaseException:
            if fresh:  # mapped for this load alone: parked or released as a lease ends
                with contextlib.suppress(ClosedArrayError):  # (released meanwhile)
                    alloc.lease()  # (dropped at once: its end parks or releases it)
            raise
    return alloc


def _take_block(alloc: Allocation, p: Payload) -> None:
    """List a newly mapped allocation by its block; say ``DONE`` if asked."""
    block = p.block
    if block is None or alloc.block is not None or alloc.origin.created_here:
        return
    alloc.block, alloc.pool_server = block, p.server
    with STATE.memory.lock:
        STATE.memory.blocks[block] = alloc
        asked = STATE.memory.asked.pop(block, False) is None
    if asked:
        alloc.ask_done()


def _detach(fds: tuple[Any, ...]) -> list[int]:
    """The fds that travelled with a payload; all closed where one fails."""
    carried: list[int] = []
    try:
        for travelled in fds:
            detach = getattr(travelled, "detach", None)
            fd = detach() if callable(detach) else None
            if type(fd) is not int or fd < 0:
                raise PayloadError(
                    "the handles that travelled with the payload are malformed: "
                    f"{type(travelled).__name__} gives no fd"
                )
            carried.append(fd)
    except BaseException as exc:
        close_fds(carried)
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error(
                "cannot receive the handles that travelled with the payload", str(exc.strerror)
            ) from None
        if isinstance(exc, (OSError, EOFError)):
            raise HandleUnavailable(
                f"cannot receive the handles that travelled with the payload ({exc}); its "
                "sender may have exited. Send the array again"
            ) from None
        raise
    return carried


def check_token(sync: object) -> bytes | None:
    """``sync`` if an ordering token or ``None``; else PayloadError."""
    if sync is not None and (type(sync) is not bytes or not 0 < len(sync) <= 256):
        raise PayloadError("the ordering token that travelled with the payload is malformed")
    return sync


def _check_node(p: Payload, carried: list[int] | None) -> None:
    """Refuse a payload made on another node before anything is opened (``carried`` closed)."""
    if p.node is not None and p.node != (here := this_node()):
        close_fds(carried or [])
        raise WrongNode(
            f"this payload was made on node {p.node} and this process is on node {here} "
            "(another machine, user, or mount or pid namespace; or a claimed "
            f"{NODE_VARIABLE}): its handles cannot be opened here. Send the array's data "
            "instead (a.get()), or let the engine do it: Dask sends a scattered array or a "
            "task's result as data to another node, but pickles an array placed directly "
            "in a task (client.submit(f, a), a sa.to_dask graph) with the task, as this "
            "payload; scatter it first: client.submit(f, client.scatter(a))"
        )


def _map(
    req: Request,
    sizes: list[int],
    fds: list[int],
    exports: tuple[bytes, ...] = (),
    capacity: int = 0,
    used: int = 0,
) -> Allocation:
    """Map an allocation from the chunks a resolver found (taking ``fds``)."""
    p = req.payload
    backend = req.backend()
    access: Access = "r" if p.readonly else "rw"
    head = (backend, p.alloc_id, p.secret, sizes, fds, p.pid, access)
    if p.capacity is not None:
        if sizes[: len(p.chunks)] != list(p.chunks):
            close_fds(fds)
            raise shrunk(p.alloc_id)
        alloc = Allocation.import_(*head, capacity=max(capacity, p.capacity))
        if alloc.source_server is None:
            alloc.source_server = p.server
            alloc.used = used or p.size
        return alloc
    if sizes != list(p.chunks):
        close_fds(fds)
        raise PayloadError("payload's chunk sizes do not match its exporter's allocation")
    here = backend.current_device() if backend.peer_access else p.device
    peers = {here: access} if here != p.device else None
    alloc = Allocation.import_(*head, exports=exports, peers=peers)
    if peers:  # this process works on another device: it reads the memory as a peer
        alloc.native_device = here
    if backend.exporter_owned:  # its payloads made here name the exporter, which must see
        alloc.source_server = p.server  # every importer; told when this one closes
    return alloc
