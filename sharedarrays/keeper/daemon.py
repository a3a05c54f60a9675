"""The keeper: one process per user holding the chunk handles of named, parked and in-flight
arrays, so that their memory outlives its producer. Each connection holds what it kept or
attached (an unlinked array is freed when its last holder goes); idle, it exits."""

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharedarrays.backends import handle_check
from sharedarrays.errors import HandleUnavailable, PayloadError
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol.unix import peer_credentials, recv_fds, runtime_dir, send_fds
from sharedarrays.settings import env_number

MAX_CONNECTIONS = 1024  # connections open at most, by default
SOCKET_CHECK = 0.2  # seconds between checks that the socket file is still there
FDS_WAIT = 2.0  # seconds to wait for the fds of a ``keep`` that follow its message
ASIDE_NAME = "keeper.closing"  # the socket file while the keeper exits: no process connects

_Answer = tuple[int, dict[str, Any], list[int]]  # a reply's status, body and fds

_NO_ROOM = (
    "the keeper has no room for the handles sent: it holds as many open files as its limit "
    "allows (ulimit -n of the process that started it; python -m sharedarrays status shows "
    "its fds). Unlink names or unpark arrays it holds (python -m sharedarrays ls --all, rm), "
    "or start the keeper from a shell with a higher ulimit -n"
)


def idle_seconds() -> float:
    """Seconds the keeper waits, holding and asked nothing, before it exits:
    ``SHAREDARRAYS_KEEPER_IDLE`` (inherited from the process that started it), default 30."""
    return env_number("SHAREDARRAYS_KEEPER_IDLE", 30.0, 0.0)


def _say(message: str) -> None:
    print(f"sharedarrays keeper: {message}", file=sys.stderr, flush=True)


class _Refused(Exception):
    """A handler's refusal: ``args`` are the reply's status and error."""


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
    expires: float | None = None  # in flight: unlinked at this time.monotonic()
    loads: int = 0  # in flight: unlinked after this many fetches
    linked: bool = True
    holders: set[int] = field(default_factory=set)  # peer keys (connection fds)


@dataclass
class _Peer:
    sock: socket.socket
    pid: int
    held: set[str] = field(default_factory=set)
    asked: bool = False  # sent a request (one accepted and not yet read keeps the keeper)


class Keeper:
    """The keeper's server loop in ``directory`` (BlockingIOError where another holds it)."""

    def __init__(self, directory: Path, idle: float, max_connections: int) -> None:
        self.idle = idle
        self.max_connections = max_connections
        self._lock_fd, self._listener, self._bound, self.path = _bind(directory)
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
        # each request's handler is the method named after its op; None: no reply
        self._handlers: dict[type, Callable[..., _Answer | None]] = {
            cls: getattr(self, f"_{cls.op}") for cls in wire.OPS.values()
        }

    # loop ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler)."""
        self._stop = True

    def serve_forever(self) -> None:
        """Serve until stopped, or idle for :attr:`idle` seconds and :meth:`_may_exit`."""
        try:
            while not self._stop:
                self._listen_again()
                for key, _ in self._selector.select(timeout=0.25):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                now = time.monotonic()
                for entry in list(self._entries.values()):  # payloads in flight past due
                    if entry.expires is not None and entry.expires <= now:
                        self._unlink_entry(entry)
                if self._entries:
                    self._idle_since = now
                elif now - self._idle_since > self.idle and self._may_exit():
                    return
        finally:
            self.close()

    def _may_exit(self) -> bool:
        """Whether all accepted was read and none waits (the socket file moved aside first)."""
        if not all(peer.asked for peer in self._peers.values()):
            return False
        aside = os.path.join(os.path.dirname(self.path), ASIDE_NAME)
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, aside)
        if not self._selector.select(0):
            return True
        with contextlib.suppress(FileNotFoundError):
            os.rename(aside, self.path)
        return False

    def close(self) -> None:
        """Remove the socket, drop every connection, close every held fd, free the lock."""
        for name in (self.path, os.path.join(os.path.dirname(self.path), ASIDE_NAME)):
            if _file_id(name) == self._bound:  # (not another keeper's, bound since)
                Path(name).unlink(missing_ok=True)
        for peer in list(self._peers.values()):
            self._hang_up(peer)
        for entry in list(self._entries.values()):
            self._free(entry)
        self._listener.close()
        self._selector.close()
        os.close(self._lock_fd)

    def _listen_again(self) -> None:
        """Listen again where the socket file was removed (a tmp cleaner, a logout)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + SOCKET_CHECK
        if _file_id(self.path) == self._bound:
            return
        try:
            lock_fd, listener, bound, path = _bind(runtime_dir(), self._lock_fd)
        except BlockingIOError:
            return  # another keeper holds the directory now
        except OSError as e:
            self._next_check = now + 5.0
            _say(f"cannot listen again: {e}")
            return
        if lock_fd != self._lock_fd:
            os.close(self._lock_fd)
        self._selector.unregister(self._listener)
        self._listener.close()
        self._lock_fd, self._listener, self._bound, self.path = lock_fd, listener, bound, path
        self._selector.register(listener, selectors.EVENT_READ, None)
        _say(f"its socket was removed; listening again at {path}")

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE) and self._peers:
                self._hang_up(self._idlest())  # no fd left: make room, the next round accepts
                return
            _say(f"accept failed: {e}")
            time.sleep(0.05)  # back off, keep serving the others
            return
        try:
            creds = peer_credentials(conn)
            if creds.uid != os.getuid():
                conn.send(wire.Reply(wire.DENIED, {"error": "another user"}).encode())
                conn.close()
                return
            conn.setblocking(False)
        except OSError:
            conn.close()
            return
        while len(self._peers) >= self.max_connections:
            self._hang_up(self._idlest())
        peer = _Peer(conn, creds.pid)
        self._peers[conn.fileno()] = peer
        self._selector.register(conn, selectors.EVENT_READ, peer)
        self._idle_since = time.monotonic()

    def _read(self, peer: _Peer) -> None:
        try:
            msg, fds, flags, _ = socket.recv_fds(peer.sock, wire.MAX_MESSAGE, wire.MAX_FDS)
        except BlockingIOError:
            return
        except OSError:
            msg, fds, flags = b"", [], 0
        if not msg and not fds:
            self._hang_up(peer)  # EOF (or an error): the process closed its connection or died
            return
        self._idle_since = time.monotonic()
        peer.asked = True
        key = peer.sock.fileno()
        if self._peers.get(key) is peer:
            self._peers[key] = self._peers.pop(key)  # most recently used last
        reply: _Answer | None
        try:  # by the handler of its op: _<op>(peer, request, fds) -> reply (None: no reply)
            if flags & socket.MSG_TRUNC or (flags & socket.MSG_CTRUNC and len(fds) >= wire.MAX_FDS):
                raise wire.BadRequest(wire.TOO_LONG)
            if flags & socket.MSG_CTRUNC:  # (fewer than MAX_FDS came: no room here for them)
                raise wire.BadRequest(_NO_ROOM)
            req = wire.decode_request(msg, len(fds))
            handler = self._handlers.get(type(req))
            if handler is None:
                raise wire.BadRequest(f"unknown op {req.op!r}")
            reply = handler(peer, req, fds)
        except _Refused as e:
            reply = e.args[0], {"error": e.args[1]}, []
        except wire.BadRequest as e:
            self.errors += 1
            reply = wire.ERROR, {"error": str(e)}, []
        except Exception as e:  # a bug here must not take the keeper down
            self.errors += 1
            traceback.print_exc(file=sys.stderr)
            reply = wire.ERROR, {"error": f"internal error: {type(e).__name__}: {e}"}, []
        finally:
            for fd in fds:  # whatever a handler did not adopt
                os.close(fd)
        if reply is None:
            return
        status, body, send = reply
        try:
            send_fds(peer.sock, wire.Reply(status, body).encode(), send)
        except OSError:
            self._hang_up(peer)  # gone, or not reading its replies

    def _idlest(self) -> _Peer:
        """The longest idle connection of those that hold nothing, else the longest idle."""
        peers = self._peers.values()
        return next((p for p in peers if not p.held), None) or next(iter(peers))

    def _hang_up(self, peer: _Peer) -> None:
        key = peer.sock.fileno()
        if self._peers.get(key) is not peer:
            return
        del self._peers[key]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(peer.sock)
        peer.sock.close()
        for alloc_id in peer.held:
            self._let_go(key, alloc_id)

    def _unlink_entry(self, entry: _Entry) -> None:
        """Drop ``entry``'s name and payloads in flight: freed once no process holds it."""
        entry.expires, entry.loads, entry.linked = None, 0, False
        if entry.name is not None and self._names.get(entry.name) == entry.id:
            del self._names[entry.name]
        if not entry.holders:
            self._free(entry)

    def _let_go(self, key: int, alloc_id: str) -> None:
        """Connection ``key`` no longer holds ``alloc_id``: freed if unlinked and unheld."""
        entry = self._entries.get(alloc_id)
        if entry is not None:
            entry.holders.discard(key)
            if not entry.linked and not entry.holders:
                self._free(entry)

    def _free(self, entry: _Entry) -> None:
        self._entries.pop(entry.id, None)
        fds, entry.fds = entry.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # requests ----------------------------------------------------------------------------
    def _hello(self, peer: _Peer, req: wire.Hello, fds: list[int]) -> _Answer:
        return wire.OK, {"pid": os.getpid(), "version": 1}, []

    def _release(self, peer: _Peer, req: wire.Release, fds: list[int]) -> None:
        if req.alloc_id in peer.held:
            peer.held.discard(req.alloc_id)
            self._let_go(peer.sock.fileno(), req.alloc_id)

    def _list(self, peer: _Peer, req: wire.List, fds: list[int]) -> _Answer:
        arrays: list[dict[str, Any]] = []
        size = 0
        for i in sorted(i for i in self._entries if req.after is None or i > req.after):
            described = self._describe(self._entries[i])
            size += len(json.dumps(described, separators=(",", ":"))) + 1
            if arrays and size > wire.LIST_PAGE:  # (a page ends here: ask for the rest after it)
                return wire.OK, {"arrays": arrays, "more": arrays[-1]["id"]}, []
            arrays.append(described)
        return wire.OK, {"arrays": arrays}, []

    def _keep(self, peer: _Peer, req: wire.Keep, fds: list[int]) -> _Answer:
        if len(fds) == wire.MAX_FDS < len(req.sizes):  # the rest come on messages of their own
            try:
                recv_fds(peer.sock, len(req.sizes), fds, time.monotonic() + FDS_WAIT)
            except (OSError, HandleUnavailable) as e:  # (HandleUnavailable: no room for them)
                raise wire.BadRequest(
                    f"the rest of the file descriptors did not come: {e}"
                ) from None
            finally:
                peer.sock.setblocking(False)
        if len(fds) != len(req.sizes):
            raise wire.BadRequest(f"{len(req.sizes)} chunk sizes but {len(fds)} file descriptors")
        check = handle_check(req.doc.get("backend")) or (lambda fd, size: None)
        try:  # an unsealed memfd would let its sender crash every attacher (SIGBUS)
            for fd, size in zip(fds, req.sizes):
                check(fd, size)
        except PayloadError as e:
            raise wire.BadRequest(str(e)) from None
        flight = req.in_flight
        expires = None if flight is None else time.monotonic() + flight.seconds
        loads = 0 if flight is None else flight.loads
        entry = self._entries.get(req.alloc_id)
        name = req.name
        if entry is None:
            if name is not None and name in self._names:
                raise _Refused(wire.EXISTS, f"an array named {name!r} exists")
            fields = (req.alloc_id, req.secret, name, req.sizes, list(fds), req.doc)
            entry = _Entry(*fields, req.allow_pids, peer.pid, time.time(), expires, loads)
            fds.clear()  # adopted
            self._entries[entry.id] = entry
        else:  # held already: named, parked, or in flight once more
            if not hmac.compare_digest(req.secret, entry.secret):
                raise _Refused(wire.DENIED, "wrong secret for an allocation the keeper holds")
            named = entry.name if entry.linked else None  # (unlinked: its name went)
            if name is not None and name != named and (named is not None or name in self._names):
                error = f"the allocation is kept as {named!r}" if named else f"{name!r} exists"
                raise _Refused(wire.EXISTS, error)
            if not entry.linked:  # unlinked, still mapped somewhere: kept again
                entry.linked, entry.name, entry.expires, entry.loads = True, None, expires, loads
            elif expires is None:  # named or parked now: kept until unlinked
                entry.expires, entry.loads = None, 0
            elif entry.expires is not None:  # more payloads in flight
                entry.expires, entry.loads = max(entry.expires, expires), entry.loads + loads
        if name is not None:
            entry.name = name
            self._names[name] = entry.id
        self._hold(peer, entry)
        return wire.OK, self._describe(entry), []

    def _hold(self, peer: _Peer, entry: _Entry) -> None:
        peer.held.add(entry.id)
        entry.holders.add(peer.sock.fileno())

    def _attach(self, peer: _Peer, req: wire.Attach | wire.Fetch, fds: list[int]) -> _Answer:
        """``attach`` (by name) and ``fetch`` (by id and secret)."""
        if isinstance(req, wire.Attach):
            entry = self._named(req.name)
        else:
            entry = self._linked(req.alloc_id, req.secret)
        if not (entry.allow_pids is None or peer.pid in (entry.creator, *entry.allow_pids)):
            raise _Refused(wire.DENIED, f"pid {peer.pid} is not in the array's allow_pids")
        self._hold(peer, entry)
        self.served += 1
        relayed = entry.expires is not None and entry.name is None  # (a hand-over only)
        if entry.expires is not None:  # one payload in flight less
            entry.loads -= 1
            if entry.loads <= 0:
                self._unlink_entry(entry)  # (the fetcher holds it now)
        body: dict[str, Any] = {"id": entry.id, "secret": entry.secret.hex(), "sizes": entry.sizes}
        body.update(doc=entry.doc, creator=entry.creator, relayed=relayed)
        return wire.OK, body, list(entry.fds)

    _fetch = _attach

    def _named(self, name: str) -> _Entry:
        entry = self._entries.get(self._names.get(name, ""))
        if entry is None or not entry.linked:  # (unlink drops the name)
            raise _Refused(wire.NOT_FOUND, f"no array named {name!r}")
        return entry

    def _linked(self, alloc_id: str, secret: bytes | None = None) -> _Entry:
        """The linked entry of ``alloc_id``, its secret checked unless ``None``."""
        entry = self._entries.get(alloc_id)
        if entry is None or not entry.linked:
            raise _Refused(wire.NOT_FOUND, f"the keeper does not hold allocation {alloc_id}")
        if secret is not None and not hmac.compare_digest(secret, entry.secret):
            raise _Refused(wire.DENIED, "wrong secret")
        return entry

    def _unlink(self, peer: _Peer, req: wire.Unlink, fds: list[int]) -> _Answer:
        if req.name is not None:
            entry = self._named(req.name)
        else:  # by id and secret: unpark, which drops only a parked array
            entry = self._linked(str(req.alloc_id), req.secret or b"")
            if entry.name is not None:
                raise _Refused(
                    wire.NOT_FOUND,
                    f"allocation {entry.id} is named {entry.name!r}, not parked: remove its "
                    "name with sa.unlink (or python -m sharedarrays rm)",
                )
            if entry.expires is not None:
                raise _Refused(
                    wire.NOT_FOUND,
                    f"allocation {entry.id} is not parked (the keeper holds it only for "
                    "payloads of it in flight, until they load or time out)",
                )
        self._unlink_entry(entry)
        return wire.OK, {}, []

    def _drop(self, peer: _Peer, req: wire.Drop, fds: list[int]) -> _Answer:
        """Unlink an unnamed entry by id alone (the peer is this user's, checked at accept)."""
        entry = self._linked(req.alloc_id)
        if entry.name is not None:
            error = f"allocation {req.alloc_id} is named {entry.name!r}: unlink it by its name"
            raise _Refused(wire.DENIED, error)
        self._unlink_entry(entry)  # freed now unless a process holds it
        return wire.OK, {"freed": entry.id not in self._entries}, []

    def _describe(self, e: _Entry) -> dict[str, Any]:
        doc = e.doc
        return {
            "name": e.name,
            "id": e.id,
            **{key: doc.get(key) for key in ("shape", "dtype", "backend", "device")},
            "size": sum(e.sizes),
            "creator": e.creator,
            "created": e.created,
            "pids": sorted({self._peers[k].pid for k in e.holders if k in self._peers}),
            "linked": e.linked,
            "readonly": doc.get("readonly") is True,
            "allow_pids": e.allow_pids,
            "in_flight": e.loads if e.expires is not None else 0,
            "used": doc["used"] if type(doc.get("used")) is int else None,
        }

    def _status(self, peer: _Peer, req: wire.Status, fds: list[int]) -> _Answer:
        body = {
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
        return wire.OK, body, []


def _bind(directory: Path, lock_fd: int = -1) -> tuple[int, socket.socket, Any, str]:
    """Lock ``directory`` (unless ``lock_fd`` holds it), listen: lock fd, socket, file id, path."""
    path = str(directory / wire.SOCKET_NAME)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    new = -1
    try:
        if lock_fd < 0 or _file_id(directory / wire.LOCK_NAME) != _file_id(lock_fd):
            new = lock_fd = os.open(directory / wire.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(new, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(new, 0)
            os.write(new, f"{os.getpid()}\n".encode())
        for name in (path, directory / ASIDE_NAME):  # left by a keeper that died
            Path(name).unlink(missing_ok=True)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        if new >= 0:
            os.close(new)
        raise
    return lock_fd, sock, _file_id(path), path


def _file_id(file: str | Path | int) -> tuple[int, int] | None:
    """The device and inode of a path (not followed) or fd; ``None`` if gone."""
    try:
        st = os.fstat(file) if isinstance(file, int) else os.lstat(file)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def main() -> int:
    """Run the keeper in this process until it is idle: 0, or 3 where another one runs."""
    idle = idle_seconds()
    limit = env_number("SHAREDARRAYS_KEEPER_CONNECTIONS", MAX_CONNECTIONS, 1)
    # a connection per process and a handle per chunk: raise the soft limit of open files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        keeper = Keeper(runtime_dir(), idle, limit)
    except BlockingIOError:
        return 3  # a live keeper holds the lock: never a second one
    signal.signal(signal.SIGTERM, lambda *_: keeper.stop())
    with contextlib.suppress(KeyboardInterrupt):
        keeper.serve_forever()
    return 0
