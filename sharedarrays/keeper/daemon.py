"""The keeper: one process per user that holds the handles of named and parked arrays.

A chunk's exported handle (a file descriptor) keeps its memory alive, on the host backend
(a memfd) and on CUDA alike (a process that only holds the exported fd, with no CUDA context
at all, keeps a VMM chunk alive). The keeper is such a process: it holds the fds of

* **named arrays** (``sa.empty(..., name="features")``), served to any process of the same
  user that asks for the name (:func:`sharedarrays.attach`), and
* **parked arrays** (``a.park()``), served to any process of the same user that presents the
  allocation's secret from a payload, so that a plain-pickle payload still loads after its
  exporter exited.

It never maps memory and never imports CUDA: it is a program of its own, built on the
keeper's wire format (:mod:`sharedarrays.protocol.keeper`), the Unix-socket helper
(:mod:`sharedarrays.protocol.unix`) and the checks backends register for received handles
(the host backend's seal check).

Process model (like :mod:`multiprocessing.resource_tracker`)
------------------------------------------------------------
The keeper is started on first need by :func:`sharedarrays.transport.keeper.ensure_running`
(or explicitly with ``python -m sharedarrays keeper``): a fresh interpreter, in its own
session, that outlives the process that started it, running in the private runtime
directory (never in its starter's working directory, where another user may have planted
modules: :func:`sharedarrays.transport.keeper._launch`). It listens on ``keeper.sock`` in
that directory (:func:`sharedarrays.protocol.unix.runtime_dir`, mode 0700) and holds
``keeper.lock`` there with ``fcntl.flock`` for its whole life, so a second keeper never runs
beside a live one; a socket file left by a keeper that died is replaced by the next one, and
where its socket file is removed (the runtime directory with it), the keeper takes the lock
and listens there again (:meth:`Keeper._listen_again`). It exits when it has held nothing
and been asked nothing for :func:`idle_seconds` (``SHAREDARRAYS_KEEPER_IDLE``, default 30 s;
0: as soon as it holds nothing), never while a connection waits to be accepted, one it
accepted has sent nothing yet, or a request waits to be read (:meth:`Keeper._may_exit`).
Connections it served do not keep it: their process reconnects on its next request,
starting a keeper again.

Every process that uses it keeps **one connection** open (at most :func:`max_connections`:
past it the longest idle is closed, one holding nothing first, and so on ``EMFILE``). The
keeper records, per connection, the arrays that process holds (created, attached or
fetched), so ``ls`` shows true attached pids and an unlinked array's fds are closed as soon
as the last holder releases it, exits or is killed (the kernel closes a dead process's
connection).

It checks the peer's uid with ``SO_PEERCRED`` on accept; anything malformed gets an
``ERROR`` reply (or, if it cannot even be parsed as a message, the connection is dropped)
and never stops the keeper. Each request type has its handler (:attr:`Keeper._handlers`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import json
import os
import resource
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharedarrays.backends import handle_check
from sharedarrays.errors import HandleUnavailable, PayloadError
from sharedarrays.protocol.keeper import (
    DENIED,
    ERROR,
    EXISTS,
    LIST_PAGE,
    LOCK_NAME,
    MAX_FDS,
    MAX_MESSAGE,
    NOT_FOUND,
    OK,
    SOCKET_NAME,
    Attach,
    BadRequest,
    Drop,
    Fetch,
    Hello,
    Keep,
    List,
    Release,
    Reply,
    Request,
    Status,
    Unlink,
    decode_request,
)
from sharedarrays.protocol.unix import peer_credentials, recv_fds, runtime_dir, send_fds
from sharedarrays.settings import env_number

__all__ = ["Keeper", "MAX_CONNECTIONS", "idle_seconds", "max_connections", "main"]

MAX_CONNECTIONS = 1024
"""Connections the keeper keeps open at most, by default (:func:`max_connections`)."""
SOCKET_CHECK = 0.2
"""Seconds between the keeper's checks that its socket file is still there."""
FDS_WAIT = 2.0
"""Seconds the keeper waits for the fds of a ``keep`` that come after its message (its
sender sends them at once; one that stops sending stalls the keeper this long at most)."""

ASIDE_NAME = "keeper.closing"
"""The keeper's socket file while it exits (:meth:`Keeper._may_exit`): no process connects."""

_Answer = tuple[int, dict[str, Any], list[int]]
"""A reply to send: status, body and the fds that go with it."""


def idle_seconds() -> float:
    """Seconds the keeper waits, holding nothing and asked nothing, before it exits.

    ``SHAREDARRAYS_KEEPER_IDLE`` in the keeper's environment (inherited from the process that
    started it), default 30.
    """
    return env_number("SHAREDARRAYS_KEEPER_IDLE", 30.0, 0.0)


def max_connections() -> int:
    """Connections the keeper keeps open at most: past it, a new one closes the longest idle
    (one whose process holds nothing through it first; a process whose connection was
    closed reconnects on its next request, and the keeper no longer counts it as a holder).

    ``SHAREDARRAYS_KEEPER_CONNECTIONS`` in the keeper's environment, default
    :data:`MAX_CONNECTIONS`.
    """
    return env_number("SHAREDARRAYS_KEEPER_CONNECTIONS", MAX_CONNECTIONS, 1)


@dataclass
class _Entry:
    """One kept allocation: its handles and who holds it."""

    id: str
    secret: bytes
    name: str | None
    sizes: list[int]
    fds: list[int]
    doc: dict[str, Any]
    allow_pids: list[int] | None
    creator: int
    created: float
    linked: bool = True
    holders: set[int] = field(default_factory=set)  # peer keys (connection fds)
    expires: float | None = None  # payloads in flight: unlinked at this time.monotonic()
    loads: int = 0  # payloads in flight: unlinked after this many fetches

    def allows(self, pid: int) -> bool:
        return self.allow_pids is None or pid == self.creator or pid in self.allow_pids


@dataclass
class _Peer:
    sock: socket.socket
    pid: int
    held: set[str] = field(default_factory=set)
    asked: bool = False  # sent a request (one accepted and not yet read keeps the keeper)


class Keeper:
    """The keeper's server loop (runs in the keeper process).

    Parameters
    ----------
    directory : Path
        The private runtime directory (its socket and lock file go there).
    idle : float
        Seconds to wait, holding nothing and asked nothing, before :meth:`serve_forever`
        returns.
    max_connections : int
        Connections kept open at most (the longest idle is closed for a new one).

    Raises
    ------
    BlockingIOError
        Another keeper holds the lock in ``directory``.
    """

    def __init__(
        self, directory: Path, idle: float, max_connections: int = MAX_CONNECTIONS
    ) -> None:
        self.idle = idle
        self.max_connections = max_connections
        self.path = str(directory / SOCKET_NAME)
        self._lock_fd = _take_lock(directory)
        with contextlib.suppress(FileNotFoundError):  # left by a keeper that died
            os.unlink(directory / ASIDE_NAME)
        try:
            self._listener, self._bound = _listen(self.path)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._next_check = time.monotonic() + SOCKET_CHECK
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._entries: dict[str, _Entry] = {}
        self._names: dict[str, str] = {}
        self._peers: dict[int, _Peer] = {}  # by connection fd, the longest idle first
        self._idle_since = time.monotonic()
        self._stop = False
        self.served = 0
        self.errors = 0
        self._handlers: dict[type, Callable[[_Peer, Request, list[int]], _Answer | None]] = {
            Hello: self._hello,
            Keep: self._keep,
            Attach: self._serve,
            Fetch: self._serve,
            Release: self._release,
            Unlink: self._unlink,
            Drop: self._drop_unnamed,
            List: self._list,
            Status: self._status_reply,
        }
        """The handler of each request type (returns the reply, or ``None``: no reply)."""

    # loop ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler)."""
        self._stop = True

    def serve_forever(self) -> None:
        """Serve until stopped, or until idle: holding nothing and asked nothing (no
        connection accepted, no request read) for :attr:`idle` seconds, and :meth:`_may_exit`."""
        try:
            while not self._stop:
                self._listen_again()
                for key, _ in self._selector.select(timeout=0.25):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                self._expire()
                if self._entries:
                    self._idle_since = time.monotonic()
                elif time.monotonic() - self._idle_since > self.idle and self._may_exit():
                    return
        finally:
            self.close()

    @property
    def _aside(self) -> str:
        """Where :meth:`_may_exit` moves the socket file (beside it)."""
        return os.path.join(os.path.dirname(self.path), ASIDE_NAME)

    def _may_exit(self) -> bool:
        """Whether the idle keeper may exit now: every connection it accepted has been read,
        and no connection or request waits. The socket file is moved aside first, so that no
        connection comes after the check (one that finds no keeper starts one), and back
        when something waits (it is served, and the keeper goes on)."""
        if not all(peer.asked for peer in self._peers.values()):
            return False
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, self._aside)
        if not self._selector.select(0):
            return True
        with contextlib.suppress(FileNotFoundError):
            os.rename(self._aside, self.path)
        return False

    def close(self) -> None:
        """Remove the socket, drop every connection, close every held fd, free the lock."""
        for name in (self.path, self._aside):  # (not another keeper's, bound since)
            if _file_id(name) == self._bound:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
        for peer in list(self._peers.values()):
            self._drop(peer)
        for entry in list(self._entries.values()):
            self._free(entry)
        try:
            self._selector.unregister(self._listener)
        except (KeyError, ValueError):
            pass
        self._listener.close()
        self._selector.close()
        os.close(self._lock_fd)

    def _listen_again(self) -> None:
        """Every :data:`SOCKET_CHECK` seconds: where the socket file was removed (with the
        runtime directory: a tmp cleaner; systemd at a user's last logout), take the lock
        and listen again in the runtime directory made again, so that clients find this
        keeper and its arrays there and start no other. Where another keeper took it first,
        this one serves its connections on until it is idle."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + SOCKET_CHECK
        if _file_id(self.path) == self._bound:
            return
        lock_fd = self._lock_fd
        try:
            directory = runtime_dir()  # (made again)
            if _file_id(directory / LOCK_NAME) != _file_id(lock_fd):
                lock_fd = _take_lock(directory)
            path = str(directory / SOCKET_NAME)
            listener, bound = _listen(path)
        except BlockingIOError:
            return  # another keeper holds the directory now
        except OSError as e:  # (PermissionDenied too: a PermissionError)
            if lock_fd != self._lock_fd:
                os.close(lock_fd)
            self._next_check = now + 5.0
            print(f"sharedarrays keeper: cannot listen again: {e}", file=sys.stderr, flush=True)
            return
        if lock_fd != self._lock_fd:
            os.close(self._lock_fd)
            self._lock_fd = lock_fd
        self._selector.unregister(self._listener)
        self._listener.close()
        self._listener, self._bound, self.path = listener, bound, path
        self._selector.register(listener, selectors.EVENT_READ, None)
        print(
            f"sharedarrays keeper: its socket was removed; listening again at {path}",
            file=sys.stderr,
            flush=True,
        )

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE) and self._peers:
                self._drop(self._idlest())  # no fd left: make room, the next round accepts
                return
            print(f"sharedarrays keeper: accept failed: {e}", file=sys.stderr, flush=True)
            time.sleep(0.05)  # back off, keep serving the others
            return
        try:
            peer_creds = peer_credentials(conn)
            pid = peer_creds.pid
            if peer_creds.uid != os.getuid():
                conn.send(Reply(DENIED, {"error": "another user"}).encode())
                conn.close()
                return
            conn.setblocking(False)
        except OSError:
            conn.close()
            return
        while len(self._peers) >= self.max_connections:
            self._drop(self._idlest())
        peer = _Peer(conn, pid)
        self._peers[conn.fileno()] = peer
        self._selector.register(conn, selectors.EVENT_READ, peer)
        self._idle_since = time.monotonic()

    def _read(self, peer: _Peer) -> None:
        fds: list[int] = []
        try:
            msg, fds, flags, _ = socket.recv_fds(peer.sock, MAX_MESSAGE, MAX_FDS)
        except BlockingIOError:
            return
        except OSError:
            self._drop(peer)
            return
        if not msg and not fds:
            self._drop(peer)  # EOF: the process closed its connection or died
            return
        self._idle_since = time.monotonic()
        peer.asked = True
        key = peer.sock.fileno()
        if self._peers.get(key) is peer:
            self._peers[key] = self._peers.pop(key)  # most recently used last
        try:
            if flags & socket.MSG_TRUNC or (flags & socket.MSG_CTRUNC and len(fds) >= MAX_FDS):
                raise BadRequest(f"message too long (at most {MAX_MESSAGE} bytes, {MAX_FDS} fds)")
            if flags & socket.MSG_CTRUNC:  # (fewer than MAX_FDS came: no room here for them)
                raise BadRequest(
                    "the keeper has no room for the handles sent: it holds as many open "
                    "files as its limit allows (ulimit -n of the process that started it; "
                    "python -m sharedarrays status shows its fds). Unlink names or unpark "
                    "arrays it holds (python -m sharedarrays ls --all, rm), or start the "
                    "keeper from a shell with a higher ulimit -n"
                )
            reply = self._handle(peer, msg, fds)
        except BadRequest as e:
            self.errors += 1
            reply = (ERROR, {"error": str(e)}, [])
        except Exception as e:  # a bug here must not take the keeper down
            self.errors += 1
            traceback.print_exc(file=sys.stderr)
            reply = (ERROR, {"error": f"internal error: {type(e).__name__}: {e}"}, [])
        finally:
            for fd in fds:  # whatever a handler did not adopt
                os.close(fd)
        if reply is None:
            return
        status, body, send = reply
        try:
            data = Reply(status, body).encode()
            if send:
                send_fds(peer.sock, data, send)
            else:
                peer.sock.send(data)
        except OSError:
            self._drop(peer)  # gone, or not reading its replies

    def _idlest(self) -> _Peer:
        """The connection to close for room: the longest idle of those that hold nothing,
        else the longest idle."""
        return next((p for p in self._peers.values() if not p.held), None) or next(
            iter(self._peers.values())
        )

    def _drop(self, peer: _Peer) -> None:
        key = peer.sock.fileno()
        if self._peers.get(key) is not peer:
            return
        del self._peers[key]
        try:
            self._selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()
        for alloc_id in peer.held:
            entry = self._entries.get(alloc_id)
            if entry is not None:
                entry.holders.discard(key)
                self._maybe_free(entry)

    def _expire(self) -> None:
        """Unlink the entries of payloads in flight whose bound has passed."""
        now = time.monotonic()
        for entry in list(self._entries.values()):
            if entry.expires is not None and entry.expires <= now:
                self._end_flight(entry)

    def _end_flight(self, entry: _Entry) -> None:
        entry.expires, entry.loads, entry.linked = None, 0, False
        self._maybe_free(entry)

    def _maybe_free(self, entry: _Entry) -> None:
        if not entry.linked and not entry.holders:
            self._free(entry)

    def _free(self, entry: _Entry) -> None:
        self._entries.pop(entry.id, None)
        if entry.name is not None and self._names.get(entry.name) == entry.id:
            del self._names[entry.name]
        fds, entry.fds = entry.fds, []
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    # requests -----------------------------------------------------------------------------
    def _handle(self, peer: _Peer, msg: bytes, fds: list[int]) -> _Answer | None:
        """Answer one message (``None``: no reply), by the handler of its request's type."""
        req = decode_request(msg, len(fds))
        handler = self._handlers.get(type(req))
        if handler is None:
            raise BadRequest(f"unknown op {req.op!r}")
        return handler(peer, req, fds)

    def _hello(self, peer: _Peer, req: Request, fds: list[int]) -> _Answer:
        return OK, {"pid": os.getpid(), "version": 1}, []

    def _release(self, peer: _Peer, req: Request, fds: list[int]) -> None:
        assert isinstance(req, Release)
        entry = self._entries.get(req.alloc_id)
        if entry is not None and entry.id in peer.held:
            peer.held.discard(entry.id)
            entry.holders.discard(peer.sock.fileno())
            self._maybe_free(entry)

    def _list(self, peer: _Peer, req: Request, fds: list[int]) -> _Answer:
        assert isinstance(req, List)
        after = req.after
        ids = sorted(i for i in self._entries if after is None or i > after)
        arrays: list[dict[str, Any]] = []
        size = 0
        for i in ids:
            described = self._describe(self._entries[i])
            size += len(json.dumps(described, separators=(",", ":"))) + 1
            if arrays and size > LIST_PAGE:  # (a page ends here: ask for the rest after it)
                return OK, {"arrays": arrays, "more": arrays[-1]["id"]}, []
            arrays.append(described)
        return OK, {"arrays": arrays}, []

    def _status_reply(self, peer: _Peer, req: Request, fds: list[int]) -> _Answer:
        return OK, self._status(), []

    def _keep(self, peer: _Peer, req: Request, fds: list[int]) -> _Answer:
        assert isinstance(req, Keep)
        alloc_id, secret, name, sizes = req.alloc_id, req.secret, req.name, req.sizes
        flight = req.in_flight
        if flight is not None:
            loads, expires = flight.loads, time.monotonic() + flight.seconds
        if len(fds) == MAX_FDS < len(sizes):  # the rest come on messages of their own
            self._take_rest(peer, len(sizes), fds)
        if len(fds) != len(sizes):
            raise BadRequest(f"{len(sizes)} chunk sizes but {len(fds)} file descriptors")
        check_chunk_fd = handle_check(req.doc.get("backend"))
        if check_chunk_fd is not None:
            for fd, size in zip(fds, sizes):
                try:  # an unsealed memfd would let its sender crash every attacher (SIGBUS)
                    check_chunk_fd(fd, size)
                except PayloadError as e:
                    raise BadRequest(str(e)) from None
        existing = self._entries.get(alloc_id)
        if existing is not None:
            if not hmac.compare_digest(secret, existing.secret):
                return DENIED, {"error": "wrong secret for an allocation the keeper holds"}, []
            # (an unlinked entry lost its name with the unlink: it may be named again)
            named = existing.name if existing.linked else None
            if name is not None and name != named and (named is not None or name in self._names):
                error = f"the allocation is kept as {named!r}" if named else f"{name!r} exists"
                return EXISTS, {"error": error}, []
            if not existing.linked:  # unlinked, still mapped somewhere: kept again
                existing.linked, existing.name = True, None
                existing.expires, existing.loads = (None, 0) if flight is None else (expires, loads)
            elif flight is None:  # named or parked now: kept until unlinked
                existing.expires, existing.loads = None, 0
            elif existing.expires is not None:  # more payloads in flight
                existing.expires = max(existing.expires, expires)
                existing.loads += loads
            if name is not None and name != existing.name:
                existing.name = name
                self._names[name] = alloc_id
            self._hold(peer, existing)
            return OK, self._describe(existing), []
        if name is not None and name in self._names:
            return EXISTS, {"error": f"an array named {name!r} exists"}, []
        entry = _Entry(
            alloc_id, secret, name, sizes, list(fds), req.doc, req.allow_pids, peer.pid, time.time()
        )
        if flight is not None:
            entry.expires, entry.loads = expires, loads
        fds.clear()  # adopted
        self._entries[alloc_id] = entry
        if name is not None:
            self._names[name] = alloc_id
        self._hold(peer, entry)
        return OK, self._describe(entry), []

    def _take_rest(self, peer: _Peer, count: int, fds: list[int]) -> None:
        """Receive the fds of a request that follow its message until ``fds`` holds
        ``count`` (they stay in ``fds``, the caller's to close), within :data:`FDS_WAIT`."""
        try:
            recv_fds(peer.sock, count, fds, time.monotonic() + FDS_WAIT)
        except (OSError, HandleUnavailable) as e:  # (HandleUnavailable: no room for them)
            raise BadRequest(f"the rest of the file descriptors did not come: {e}") from None
        finally:
            peer.sock.setblocking(False)

    def _hold(self, peer: _Peer, entry: _Entry) -> None:
        peer.held.add(entry.id)
        entry.holders.add(peer.sock.fileno())

    def _serve(self, peer: _Peer, req: Request, fds: list[int]) -> _Answer:
        """``attach`` (by name) and ``fetch`` (by id and secret)."""
        assert isinstance(req, (Attach, Fetch))
        entry, refusal = self._find(req)
        if entry is None:
            return refusal
        if not entry.allows(peer.pid):
            return DENIED, {"error": f"pid {peer.pid} is not in the array's allow_pids"}, []
        self._hold(peer, entry)
        self.served += 1
        if entry.expires is not None:  # one payload in flight less
            entry.loads -= 1
            if entry.loads <= 0:
                self._end_flight(entry)  # (the fetcher holds it now)
        body = {
            "id": entry.id,
            "secret": entry.secret.hex(),
            "sizes": entry.sizes,
            "doc": entry.doc,
            "creator": entry.creator,
        }
        return OK, body, list(entry.fds)

    def _find(self, req: Attach | Fetch | Unlink) -> tuple[_Entry | None, _Answer]:
        """The linked entry a request names (by name, or by id with its secret), or ``None``
        and the reply that refuses it. (A name maps only to linked entries: unlink drops it.)"""
        name = req.name if isinstance(req, (Attach, Unlink)) else None
        if name is not None:
            alloc_id = self._names.get(name)
            entry = None if alloc_id is None else self._entries.get(alloc_id)
            if entry is None or not entry.linked:
                return None, (NOT_FOUND, {"error": f"no array named {name!r}"}, [])
            return entry, (OK, {}, [])
        assert not isinstance(req, Attach) and req.alloc_id is not None and req.secret is not None
        entry = self._entries.get(req.alloc_id)
        if entry is None or not entry.linked:
            error = f"the keeper does not hold allocation {req.alloc_id}"
            return None, (NOT_FOUND, {"error": error}, [])
        if not hmac.compare_digest(req.secret, entry.secret):
            return None, (DENIED, {"error": "wrong secret"}, [])
        return entry, (OK, {}, [])

    def _unlink(self, peer: _Peer, req: Request, fds: list[int]) -> _Answer:
        assert isinstance(req, Unlink)
        entry, refusal = self._find(req)
        if entry is None:
            return refusal
        if req.name is None:  # by id and secret: unpark, which drops only a parked array
            if entry.name is not None:
                error = (
                    f"allocation {entry.id} is named {entry.name!r}, not parked: remove its "
                    "name with sa.unlink (or python -m sharedarrays rm)"
                )
                return NOT_FOUND, {"error": error}, []
            if entry.expires is not None:
                error = (
                    f"allocation {entry.id} is not parked (the keeper holds it only for "
                    "payloads of it in flight, until they load or time out)"
                )
                return NOT_FOUND, {"error": error}, []
        entry.linked = False
        if entry.name is not None and self._names.get(entry.name) == entry.id:
            del self._names[entry.name]
        self._maybe_free(entry)
        return OK, {}, []

    def _drop_unnamed(self, peer: _Peer, req: Request, fds: list[int]) -> _Answer:
        """``drop``: unlink an unnamed entry (parked, or payloads in flight) by id alone (the
        peer is this user's, checked at accept); a named one is refused (unlink its name)."""
        assert isinstance(req, Drop)
        entry = self._entries.get(req.alloc_id)
        if entry is None or not entry.linked:
            return NOT_FOUND, {"error": f"the keeper does not hold allocation {req.alloc_id}"}, []
        if entry.name is not None:
            error = f"allocation {req.alloc_id} is named {entry.name!r}: unlink it by its name"
            return DENIED, {"error": error}, []
        self._end_flight(entry)  # unlinked; freed now unless a process holds it
        return OK, {"freed": entry.id not in self._entries}, []

    def _describe(self, e: _Entry) -> dict[str, Any]:
        doc = e.doc
        pids = sorted({self._peers[k].pid for k in e.holders if k in self._peers})
        return {
            "name": e.name,
            "id": e.id,
            "shape": doc.get("shape"),
            "dtype": doc.get("dtype"),
            "backend": doc.get("backend"),
            "device": doc.get("device"),
            "size": sum(e.sizes),
            "creator": e.creator,
            "created": e.created,
            "pids": pids,
            "linked": e.linked,
            "readonly": doc.get("readonly") is True,
            "allow_pids": e.allow_pids,
            "in_flight": e.loads if e.expires is not None else 0,
            "used": doc["used"] if type(doc.get("used")) is int else None,
        }

    def _status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "socket": self.path,
            "arrays": len(self._entries),
            "named": len(self._names),
            "bytes": sum(sum(e.sizes) for e in self._entries.values()),
            "fds": sum(len(e.fds) for e in self._entries.values()),
            "connections": len(self._peers),
            "max_connections": self.max_connections,
            "served": self.served,
            "errors": self.errors,
            "idle": self.idle,
        }


def _take_lock(directory: Path) -> int:
    """The lock file of ``directory``, opened and locked (``flock``), this pid written in it.

    Raises
    ------
    BlockingIOError
        Another keeper holds it.
    """
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


def _listen(path: str) -> tuple[socket.socket, tuple[int, int] | None]:
    """A non-blocking socket listening at ``path`` (mode 0600; a file left there by a keeper
    that died is replaced: the caller holds the lock), and the file's :func:`_file_id`."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock, _file_id(path)


def _file_id(file: str | Path | int) -> tuple[int, int] | None:
    """The device and inode of a file (a path, not followed, or an fd); ``None`` if gone."""
    try:
        st = os.fstat(file) if isinstance(file, int) else os.lstat(file)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def main(argv: Sequence[str] | None = None) -> int:
    """Run the keeper in this process until it is idle (``python -m sharedarrays keeper
    --foreground`` and the background launcher both end up here).

    Returns 0 when it served and exited, 3 when another keeper already runs.
    """
    idle, limit = idle_seconds(), max_connections()
    _raise_fd_limit()
    try:
        keeper = Keeper(runtime_dir(), idle, limit)
    except BlockingIOError:
        return 3  # a live keeper holds the lock: never a second one
    signal.signal(signal.SIGTERM, lambda *_: keeper.stop())
    try:
        keeper.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


def _raise_fd_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit (the keeper holds a
    connection per process and a handle per chunk; 1024 is a common soft limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
