"""Importing: turn a payload into the allocation it names, mapped in this process.

A payload (see :mod:`sharedarrays.protocol.payload`) names an allocation by id, secret and
chunk sizes. Loading it asks a chain of *resolvers*, in order; each answers one question and
either returns the allocation or passes (returns ``None``) to the next:

1. :func:`mapped_here`: does this process map it already? (a warm load: nothing is asked)
2. :func:`reused_block`: does it map, parked, the memory the exporter reused for it?
3. :func:`in_message`: did its handles travel with the message? (multiprocessing's DupFd
   while a Process is being spawned, or the keeper's reply to ``attach``)
4. :func:`from_exporter`: does the exporter's handle server still serve them?
5. :func:`from_keeper`: does this user's keeper hold them? (a parked or named array)

A resolver that finds nothing records why (a :class:`HandleUnavailable`); when all passed,
the last of those is raised (it says what was tried). Other errors (a malformed payload,
another user, a backend unusable here) are raised at once.

Growable arrays
---------------
Only its exporter resizes an array made with ``capacity=``; a payload of it names that
exporter and carries the chunk list of its moment. An importer that maps fewer chunks fetches
the missing ones (:func:`sharedarrays.transport.client.fetch_growth`) before the view is
made; :func:`catch_up` asks for the current length (``refresh``). No keeper holds one.

This layer returns allocations; :mod:`sharedarrays.api.array` makes the views.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sharedarrays import process
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
from sharedarrays.memory.lease import use_clock
from sharedarrays.memory.registry import lookup, revive
from sharedarrays.node import NODE_VARIABLE, this_node
from sharedarrays.process import STATE
from sharedarrays.protocol.payload import Payload
from sharedarrays.transport import client, keeper, notices
from sharedarrays.transport import handles as transport

RELEASE_WAIT = 2 * keeper.TIMEOUT
"""Seconds a load waits for another thread's release of the allocation it found to end (the
keeper's hand-over: its requests' time limit, twice) before it fails."""

__all__ = [
    "Request",
    "Handles",
    "Resolver",
    "RESOLVERS",
    "load_payload",
    "load_again",
    "check_token",
    "resolve",
    "mapped_here",
    "reused_block",
    "in_message",
    "from_exporter",
    "from_keeper",
    "catch_up",
]


@dataclass
class Handles:
    """Chunk handles found for an allocation not mapped here yet (the fds are owned): the
    chunk sizes as reported, the fds (one per chunk for a mapping backend), a pointer
    backend's portable handles, and a growable array's capacity and length (0: not said)."""

    sizes: list[int]
    fds: list[int]
    exports: tuple[bytes, ...] = ()
    capacity: int = 0
    used: int = 0


class Request:
    """One payload being loaded, what the resolvers share: the decoded ``payload``, the fds
    ``carried`` with it (owned here until a resolver uses or closes them; ``None``: none),
    and the ``failures`` of the sources asked so far (why each gave no handles)."""

    # (slots, no container per request: every object the collector tracks lengthens a pass)
    __slots__ = ("payload", "carried", "failures", "_backend")

    def __init__(self, payload: Payload, carried: list[int] | None = None) -> None:
        self.payload = payload
        self.carried = carried
        self.failures: tuple[HandleUnavailable, ...] = ()
        self._backend: Backend | None = None

    def failed(self, why: HandleUnavailable) -> None:
        """Record that a source gave no handles (no traceback: its frames hold this request)."""
        self.failures = (*self.failures, why.with_traceback(None))

    def backend(self) -> Backend:
        """The payload's memory system in this process (closes the carried fds if it
        cannot be used here)."""
        if self._backend is None:
            p = self.payload
            try:
                self._backend = get_backend(device_of(p.backend, p.device), p.backend)
            except BaseException:
                _close(self.carried or [])
                raise
        return self._backend

    def unavailable(self) -> HandleUnavailable:
        """The error to raise when every resolver passed: the last source's, which says
        what was tried."""
        if self.failures:
            return self.failures[-1]
        return HandleUnavailable(  # pragma: no cover - from_exporter always records one
            f"allocation {self.payload.alloc_id} is not mapped here and no source of its "
            "handles answered"
        )


Resolver = Callable[[Request], Allocation | None]
"""A step of the chain: the allocation, or ``None`` to pass to the next step."""


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# the resolvers ------------------------------------------------------------------------------
def mapped_here(req: Request) -> Allocation | None:
    """The allocation if this process maps it already (a growable one catches up with the
    chunks the payload names); the carried fds are then closed, or used to catch up."""
    return _mapped(req.payload, req.carried)


def _mapped(p: Payload, carried: list[int] | None) -> Allocation | None:
    """:func:`mapped_here` for a payload and its carried fds (asked first by
    :func:`load_payload`, before any :class:`Request` is made)."""
    alloc = lookup(p.alloc_id)
    if alloc is not None and alloc.released:
        # Another thread is releasing it: it stays registered while the keeper takes its
        # handles (a load elsewhere still finds this process's handle server). Once it
        # has left, the payload loads as any other does (from the keeper, if in flight).
        STATE.memory.wait_unregistered(alloc, RELEASE_WAIT)
        alloc = lookup(p.alloc_id)
    pid = os.getpid()
    if alloc is None and p.pid == pid:  # back at its exporter, which let go of it
        alloc = revive(p.alloc_id)
    if alloc is None:
        return None
    received = carried or []
    import hmac  # (not at module level: hashlib's import costs ``import sharedarrays`` 2 ms)

    if not hmac.compare_digest(p.secret, alloc.secret):  # (as the handle server checks it)
        _close(received)
        raise PermissionDenied(
            f"allocation {p.alloc_id} is mapped here, but the payload's secret is not its "
            "secret; the payload does not belong to that allocation"
        )
    if alloc.pid != pid and alloc.device.needs_context:
        # inherited through fork: CUDA cannot be used here (no driver call may notice it
        # later when the stream was idle and the token is None)
        why = why_unusable(alloc.backend.name, alloc.device.index)
        if why is not None:
            _close(received)
            raise BackendUnavailable(f"cannot use {alloc.device}: {why}")
    if p.capacity is not None:  # a growable array: maps the chunks added since, if any
        return _catch_up_to(alloc, p, received)
    if received:
        _close(received)
    if not alloc.has_chunk_sizes(p.chunks) or alloc.backend.name != p.backend:
        device_of(p.backend, p.device)  # a backend unknown here says so (else: a mismatch)
        raise PayloadError(f"payload does not match allocation {p.alloc_id} mapped here")
    _count_load(alloc, p, pid)
    return alloc


def _count_load(alloc: Allocation, p: Payload, pid: int) -> None:
    """Count a load here of ``p``, a payload of ``alloc`` (``pid``: this process's)."""
    if p.block is not None and p.pid != pid:
        alloc.flight.note_block_load()
    if p.pid == pid:  # one of this process's payloads came back: not in flight
        alloc.flight.note_loaded()
        if p.block is not None:  # (and no importer's: its views here hold the memory)
            alloc.flight.note_done(1)
    else:  # its sender counts it in flight until told
        alloc.flight.note_returned(p.server)  # (when this process releases it, if it served it)
        if alloc.backend.exporter_owned:  # the exporter waits for its payloads: say so
            notices.report_load(p.server, p.alloc_id, p.secret)


def load_again(alloc: Allocation, p: Payload, sync: bytes | None) -> bool:
    """Load ``p`` again where it was loaded before as ``alloc`` (the same bytes, checked
    then): count the load and wait for the token ``sync`` without asking a resolver (the
    commonest warm load is written out in :func:`sharedarrays.api.message.import_part`).

    Returns ``False``, having done nothing, when ``alloc`` is no longer mapped here under
    that id (released, reused, inherited through fork) or grows: load it anew then. Raises
    :class:`PayloadError` for a malformed token.
    """
    pid = process.STATE.pid  # (os.getpid(): a system call, microseconds on a cold path)
    if alloc.released or alloc.pid != pid or p.capacity is not None or alloc.id != p.alloc_id:
        return False  # (another id: its block was reused since, under a new one)
    if sync is not None:
        check_token(sync)
    alloc.last_used = use_clock()  # (its views may share a lease kept alive: no lease() call)
    _count_load(alloc, p, pid)
    if sync is not None:
        alloc.backend.import_sync(sync)
    return True


def reused_block(req: Request) -> Allocation | None:
    """The allocation this process maps parked on the payload's block, which its exporter
    reused for a new array (:mod:`sharedarrays.memory.cache`): taken under the new id and
    secret (nothing asked, nothing mapped); the carried fds are closed."""
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
        alloc.flight.note_block_load(first=True)
        memory.registry[alloc.id] = alloc
        memory.parked[alloc.id] = alloc
    _close(req.carried or [])
    return alloc


def in_message(req: Request) -> Allocation | None:
    """The allocation mapped from the fds that travelled with the payload, if any did."""
    if req.carried is None:
        return None
    req.backend()
    alloc = _map(req, Handles(list(req.payload.chunks), req.carried))
    # (this process's handle server answers the node view's questions, as it does for an
    # importer that fetched: without it a child given arrays as Process arguments would
    # hold memory that `top` cannot see)
    transport.server_address()
    return alloc


def from_exporter(req: Request) -> Allocation | None:
    """The allocation mapped from handles the exporter's handle server sends, or ``None``
    (recorded in ``req.failures``) when it is gone or no longer has them."""
    p = req.payload
    req.backend()
    try:
        if p.capacity is not None:
            sizes, capacity, used, fds = client.fetch_growth(
                p.server, p.pid, p.alloc_id, p.secret, 0, reply_to=transport.server_address()
            )
            found = Handles(sizes, fds, capacity=capacity, used=used)
        else:
            sizes, fds, exports = client.fetch_handles(
                p.server, p.pid, p.alloc_id, p.secret, reply_to=transport.server_address()
            )
            found = Handles(sizes, fds, exports)
    except HandleUnavailable as gone:  # the exporter is gone: a keeper may hold it
        req.failed(gone)
        return None
    return _map(req, found)


def from_keeper(req: Request) -> Allocation | None:
    """The allocation mapped from handles this user's keeper holds (a parked or named
    array; no keeper is started), or ``None`` (recorded) when it does not; at once for
    memory no keeper holds (exporter-owned, growable)."""
    p = req.payload
    if not req.failures or p.capacity is not None or req.backend().exporter_owned:
        return None
    try:
        sizes, fds, relayed = keeper.fetch_handles(p.alloc_id, p.secret, req.failures[-1])
    except HandleUnavailable as gone:  # its message says the exporter was asked too
        req.failed(gone)
        return None
    alloc = _map(req, Handles(sizes, fds))
    alloc.in_keeper = True
    if relayed:  # (its exporter left it in flight: parked, it would hold memory for nothing)
        alloc.orphan(now=False)
    return alloc


RESOLVERS: tuple[Resolver, ...] = (
    mapped_here,
    reused_block,
    in_message,
    from_exporter,
    from_keeper,
)
"""The chain :func:`load_payload` asks, in order."""


def resolve(req: Request, resolvers: tuple[Resolver, ...] = RESOLVERS) -> Allocation:
    """Ask ``resolvers`` in order for ``req``'s allocation; the first answer wins. Raises
    :class:`HandleUnavailable` when every one passed (its message says what was tried)."""
    for resolver in resolvers:
        alloc = resolver(req)
        if alloc is not None:
            return alloc
    raise req.unavailable()


def load_payload(
    p: Payload, sync: bytes | None = None, fds: tuple[Any, ...] | None = None
) -> Allocation:
    """Find the allocation of the decoded payload ``p`` through :data:`RESOLVERS`, mapping
    it on first sight; then wait for the ordering token ``sync``, if one travelled with it.

    :func:`mapped_here` is asked before a :class:`Request` is made: most loads (every warm
    one) end there. ``sync`` and ``fds`` are as for :func:`sharedarrays.load` (``fds``:
    objects whose ``detach()`` gives an fd, such as multiprocessing's DupFd).

    Raises
    ------
    PayloadError
        A malformed token or carried handles, or a payload that does not match.
    HandleUnavailable
        Not mapped here, and no source of its handles is left.
    PermissionDenied
        Another user, or the wrong secret.
    BackendUnavailable
        Its memory system cannot be used in this process.
    WrongNode
        Made on another node (:mod:`sharedarrays.node`): nothing is opened.
    """
    check_token(sync)
    carried: list[int] | None = None
    if fds is not None:
        if type(fds) is not tuple or len(fds) != len(p.chunks):
            raise PayloadError("the handles that travelled with the payload do not match it")
        carried = _detach(fds)
    alloc = _mapped(p, carried)
    fresh = alloc is None
    if alloc is None:  # (one mapped here is on this node)
        try:
            _check_node(p)
        except WrongNode:
            _close(carried or [])
            raise
        alloc = resolve(Request(p, carried), RESOLVERS[1:])
        if p.block is not None and p.pid != STATE.pid:  # (counted by _mapped otherwise)
            _take_block(alloc, p)
    if sync is not None:
        try:
            alloc.backend.import_sync(sync)
        except BaseException:
            if fresh:  # (mapped for this load alone: not left mapped, unused)
                _let_go(alloc)
            raise
    return alloc


def _take_block(alloc: Allocation, p: Payload) -> None:
    """List a newly mapped allocation by its block and count the load (one taken by
    :func:`reused_block` is counted there); say ``DONE`` when idle if its exporter asked
    for that before it was listed."""
    block = p.block
    if block is None or alloc.block is not None or alloc.origin.created_here:
        return
    alloc.block, alloc.pool_server = block, p.server
    alloc.flight.note_block_load()
    with STATE.memory.lock:
        STATE.memory.blocks[block] = alloc
        asked = STATE.memory.asked.pop(block, False) is None
    if asked:
        alloc.ask_done()


def _detach(fds: tuple[Any, ...]) -> list[int]:
    """The fds that travelled with a payload, received (``detach()``); those received are
    closed where a later one cannot be.

    Raises
    ------
    HandleUnavailable
        A handle could not be received (this process has as many files open as it may, or
        the sender's resource sharer is gone).
    PayloadError
        One is not a handle (an object without ``detach()`` giving an fd).
    """
    carried: list[int] = []
    try:
        for travelled in fds:
            detach = getattr(travelled, "detach", None)
            fd = detach() if callable(detach) else None
            if type(fd) is not int or fd < 0:  # (those received are closed below)
                raise PayloadError(
                    "the handles that travelled with the payload are malformed: "
                    f"{type(travelled).__name__} gives no fd"
                )
            carried.append(fd)
    except (OSError, EOFError) as exc:
        _close(carried)
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error(
                "cannot receive the handles that travelled with the payload", str(exc.strerror)
            ) from None
        raise HandleUnavailable(
            f"cannot receive the handles that travelled with the payload ({exc}); its sender "
            "may have exited. Send the array again"
        ) from None
    except BaseException:
        _close(carried)
        raise
    return carried


def _let_go(alloc: Allocation) -> None:
    """An allocation mapped for a load that then failed: parked or released as when a view's
    lease ends (it has none: left as it is, it would stay mapped, unused, until exit)."""
    try:
        lease = alloc.lease()
    except ClosedArrayError:  # released meanwhile
        return
    del lease


def check_token(sync: object) -> None:
    """Refuse a malformed ordering token (:class:`PayloadError`)."""
    if sync is not None and (type(sync) is not bytes or not 0 < len(sync) <= 256):
        raise PayloadError("the ordering token that travelled with the payload is malformed")


def _check_node(p: Payload) -> None:
    """Refuse a payload made on another node (:mod:`sharedarrays.node`) before anything is
    opened."""
    if p.node is None:
        return
    here = this_node()
    if p.node != here:
        raise WrongNode(
            f"this payload was made on node {p.node} and this process is on node {here} "
            "(another machine, user, or mount or pid namespace; or a claimed "
            f"{NODE_VARIABLE}): its handles cannot be opened here. Send the array's data "
            "instead (a.get()), or let the engine do it: Dask sends a scattered array or a "
            "task's result as data to another node, but pickles an array placed directly "
            "in a task (client.submit(f, a), a sa.to_dask graph) with the task, as this "
            "payload; scatter it first: client.submit(f, client.scatter(a))"
        )


# mapping what was found ----------------------------------------------------------------------
def _map(req: Request, found: Handles) -> Allocation:
    """Map an allocation from the handles a resolver found (takes ``found.fds``)."""
    p = req.payload
    backend = req.backend()
    access: Access = "r" if p.readonly else "rw"
    if p.capacity is not None:
        if found.sizes[: len(p.chunks)] != list(p.chunks):
            _close(found.fds)
            raise PayloadError(
                f"allocation {p.alloc_id} was shrunk since this payload was made; pickle the "
                "array again"
            )
        alloc = Allocation.import_(
            backend,
            p.alloc_id,
            p.secret,
            found.sizes,
            found.fds,
            p.pid,
            access,
            capacity=max(found.capacity, p.capacity),
        )
        if alloc.source_server is None:
            alloc.source_server = p.server
            alloc.used = found.used or p.size
        return alloc
    if found.sizes != list(p.chunks):
        _close(found.fds)
        raise PayloadError("payload's chunk sizes do not match its exporter's allocation")
    here = backend.current_device() if backend.peer_access else p.device
    peers = {here: access} if here != p.device else None
    alloc = Allocation.import_(
        backend,
        p.alloc_id,
        p.secret,
        found.sizes,
        found.fds,
        p.pid,
        access,
        exports=found.exports,
        peers=peers,
    )
    if peers:  # this process works on another device: it reads the memory as a peer
        alloc.native_device = here
    if backend.exporter_owned:  # payloads made here name the exporter, which must
        alloc.source_server = p.server  # see every importer; told when this one closes
    return alloc


# growable arrays: catching up with the exporter -----------------------------------------------
def _catch_up_to(alloc: Allocation, p: Payload, received: list[int]) -> Allocation:
    """``alloc``, a growable array mapped here, with at least the chunks payload ``p``
    names: one with fewer maps the new ones (from ``received``, the fds that travelled
    with it, if any, else from its exporter); one with more (an older payload) is used as
    it is. Takes ownership of ``received``."""
    with alloc.growth_lock:
        local = alloc.chunk_sizes()
        n = len(p.chunks)
        if (
            not alloc.growable
            or alloc.backend.name != p.backend
            or list(p.chunks[: len(local)]) != local[:n]
        ):
            _close(received)
            raise PayloadError(f"payload does not match allocation {p.alloc_id} mapped here")
        if n <= len(local):  # the same or an older generation: all mapped already
            _close(received)
            return alloc
        if alloc.origin.created_here:
            _close(received)
            raise PayloadError(
                f"allocation {p.alloc_id} was shrunk since this payload was made; pickle the "
                "array again"
            )
        if received:
            _close(received[: len(local)])
            alloc.extend(list(p.chunks[len(local) :]), received[len(local) :], p.capacity or 0)
            return alloc
        sizes, capacity, used, fds = client.fetch_growth(
            p.server, p.pid, p.alloc_id, p.secret, len(local), reply_to=transport.server_address()
        )
        _extend(alloc, local, sizes, capacity, fds)
        alloc.used = used
        return alloc


def catch_up(alloc: Allocation) -> None:
    """Map the chunks the exporter of ``alloc`` (a growable array imported here) added
    since, and take its current length (``alloc.used``), asking its handle server.

    Raises
    ------
    PayloadError
        The exporter shrank and grew it again since (its chunks differ from those mapped
        here), or ``alloc`` does not know its exporter.
    HandleUnavailable, PermissionDenied
        As :func:`sharedarrays.transport.client.fetch_growth`.
    """
    server = alloc.source_server
    if server is None:  # (inherited through fork: every growable import sets it)
        raise PayloadError(
            f"allocation {alloc.id} does not know its exporter's handle server: this process "
            f"inherited it through fork from pid {alloc.origin.pid}; load a new payload of "
            "it (pickled there) to see its current length"
        )
    with alloc.growth_lock:
        local = alloc.chunk_sizes()
        sizes, capacity, used, fds = client.fetch_growth(
            server,
            alloc.origin.pid,
            alloc.id,
            alloc.secret,
            len(local),
            reply_to=transport.server_address(),
        )
        _extend(alloc, local, sizes, capacity, fds)
        alloc.used = used


def _extend(
    alloc: Allocation, local: list[int], sizes: list[int], capacity: int, fds: list[int]
) -> None:
    """Map the chunks an exporter reported beyond those mapped here (takes ``fds``)."""
    if sizes[: len(local)] != local:
        _close(fds)
        raise PayloadError(
            f"allocation {alloc.id} was shrunk and grown again since this process mapped it "
            "(its chunks differ); close its views here and load a new payload"
        )
    if len(sizes) > len(local):
        alloc.extend(sizes[len(local) :], fds, capacity)
    else:
        _close(fds)
