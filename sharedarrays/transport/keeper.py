"""The keeper: one process per user that holds the handles of named and parked arrays.

A chunk's exported handle (a file descriptor) keeps its memory alive, on the host backend
(a memfd) and on CUDA alike (a process that only holds the exported fd, with no CUDA context
at all, keeps a VMM chunk alive). The keeper is such a process: it holds the fds of

* **named arrays** (``sa.empty(..., name="features")``), served to any process of the same
  user that asks for the name (:func:`sharedarrays.attach`), and
* **parked arrays** (``a.park()``), served to any process of the same user that presents the
  allocation's secret from a payload, so that a plain-pickle payload still loads after its
  exporter exited.

It never maps memory and never imports CUDA.

Process model (like :mod:`multiprocessing.resource_tracker`)
------------------------------------------------------------
The keeper is started on first need by :func:`ensure_running` (or explicitly with
``python -m sharedarrays keeper``): a fresh interpreter, in its own session, that outlives the
process that started it, running in the private runtime directory (never in its starter's
working directory, where another user may have planted modules: :func:`_launch`). It
listens on ``keeper.sock`` in that directory (:func:`sharedarrays.transport.handles.runtime_dir`,
mode 0700) and holds ``keeper.lock`` there with ``fcntl.flock`` for its whole life, so a
second keeper never runs beside a live one; a socket file left by a keeper that died is
replaced by the next one. It exits when it has held nothing
for :func:`idle_seconds` (``SHAREDARRAYS_KEEPER_IDLE``, default 30 s).

Every process that uses it keeps **one connection** open (at most :func:`max_connections`:
past it the longest idle is closed, one holding nothing first, and so on ``EMFILE``). The
keeper records, per connection, the arrays that process holds (created, attached or
fetched), so ``ls`` shows true attached pids and an unlinked array's fds are closed as soon
as the last holder releases it, exits or is killed (the kernel closes a dead process's
connection).

Wire format
-----------
``SOCK_SEQPACKET`` messages. A request is ``b"SAK1"`` + a JSON object with an ``"op"``, with
chunk fds attached by ``SCM_RIGHTS`` (``keep`` only). A reply is ``b"SAK1"`` + a status byte
+ a JSON object, with fds attached (``attach`` and ``fetch``). ``release`` has no reply. The
keeper checks the peer's uid with ``SO_PEERCRED`` on accept; anything malformed gets an
``ERROR`` reply (or, if it cannot even be parsed as a message, the connection is dropped)
and never stops the keeper.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hmac
import json
import os
import re
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import spawn, util
from pathlib import Path
from typing import Any

from sharedarrays.errors import (
    HandleUnavailable,
    KeeperError,
    NameExists,
    NameNotFound,
    PermissionDenied,
)
from sharedarrays.memory import allocation
from sharedarrays.memory.state import state
from sharedarrays.process import at_exit, at_fork
from sharedarrays.settings import env_number
from sharedarrays.transport import handles as transport

__all__ = [
    "OK",
    "ERROR",
    "NOT_FOUND",
    "EXISTS",
    "DENIED",
    "MAX_MESSAGE",
    "MAX_FDS",
    "Keeper",
    "check_name",
    "idle_seconds",
    "max_connections",
    "socket_path",
    "lock_path",
    "ensure_running",
    "running_pid",
    "request",
    "disconnect",
    "main",
]

MAGIC = b"SAK1"
_STATUS = struct.Struct("4sB")
OK, ERROR, NOT_FOUND, EXISTS, DENIED = range(5)
MAX_MESSAGE = 1 << 16
"""Largest keeper message in bytes (requests and replies)."""
MAX_FDS = 250
"""Most chunks a kept array may have (one ``SCM_RIGHTS`` message; SCM_MAX_FD is 253)."""
MAX_NAME = 128
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CRED = struct.Struct("3i")
TIMEOUT = 10.0
"""Seconds a client waits for the keeper to start or to answer."""
MAX_IN_FLIGHT = 7 * 86400.0
"""Longest bound the keeper accepts for payloads in flight (seconds)."""
MAX_CONNECTIONS = 1024
"""Connections the keeper keeps open at most, by default (:func:`max_connections`)."""
_MAX_SIZE = 1 << 56


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid array name, else raise.

    A name is 1 to 128 characters from ``A-Z a-z 0-9 . _ -``, not starting with ``.``,
    ``_`` or ``-``.

    Raises
    ------
    TypeError
        ``name`` is not a str.
    ValueError
        Empty, too long, or with other characters.
    """
    if not isinstance(name, str):
        raise TypeError(f"an array name is a str, not {type(name).__name__}")
    if not 0 < len(name) <= MAX_NAME or not _NAME.match(name):
        raise ValueError(
            f"invalid array name {name!r}: use 1 to {MAX_NAME} characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return name


def idle_seconds() -> float:
    """Seconds the keeper waits, holding nothing, before it exits.

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


def socket_path() -> Path:
    """The keeper's socket in this user's runtime directory."""
    return transport.runtime_dir() / "keeper.sock"


def lock_path() -> Path:
    """The lock file a live keeper holds (``fcntl.flock``)."""
    return transport.runtime_dir() / "keeper.lock"


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def _encode_reply(status: int, body: dict[str, Any]) -> bytes:
    return _STATUS.pack(MAGIC, status) + json.dumps(body, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------
# the keeper process


class _BadRequest(Exception):
    """A malformed request: answered with ERROR and the message."""


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


def _field(req: dict[str, Any], key: str, kind: type) -> Any:
    value = req.get(key)
    if type(value) is not kind:
        raise _BadRequest(f"field {key!r} must be a {kind.__name__}")
    return value


def _hex(req: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = _field(req, key, str)
    if not pattern.match(value):
        raise _BadRequest(f"field {key!r} is not valid hex of the right length")
    return str(value)


def _name(req: dict[str, Any], optional: bool = False) -> str | None:
    value = req.get("name")
    if value is None and optional:
        return None
    try:
        return check_name(value)
    except (TypeError, ValueError) as e:
        raise _BadRequest(str(e)) from None


def _int_list(value: object, key: str, low: int, high: int, max_len: int) -> list[int]:
    if type(value) is not list or not 0 < len(value) <= max_len:
        raise _BadRequest(f"field {key!r} must be a list of 1 to {max_len} ints")
    for x in value:
        if type(x) is not int or not low <= x <= high:
            raise _BadRequest(f"field {key!r} has {x!r}, not an int in [{low}, {high}]")
    return list(value)


class Keeper:
    """The keeper's server loop (runs in the keeper process).

    Parameters
    ----------
    directory : Path
        The private runtime directory (its socket and lock file go there).
    idle : float
        Seconds to wait, holding nothing, before :meth:`serve_forever` returns.
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
        self.path = str(directory / "keeper.sock")
        self._lock_fd = os.open(directory / "keeper.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(self._lock_fd)
            raise
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, f"{os.getpid()}\n".encode())
        try:
            os.unlink(self.path)  # left by a keeper that died: we hold the lock, so it is stale
        except FileNotFoundError:
            pass
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o600)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._entries: dict[str, _Entry] = {}
        self._names: dict[str, str] = {}
        self._peers: dict[int, _Peer] = {}  # by connection fd, the longest idle first
        self._idle_since = time.monotonic()
        self._stop = False
        self.served = 0
        self.errors = 0

    # loop ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask :meth:`serve_forever` to return (safe from a signal handler)."""
        self._stop = True

    def serve_forever(self) -> None:
        """Serve until stopped, or until idle for :attr:`idle` seconds holding nothing."""
        try:
            while not self._stop:
                for key, _ in self._selector.select(timeout=0.25):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                self._expire()
                if self._entries:
                    self._idle_since = time.monotonic()
                elif time.monotonic() - self._idle_since > self.idle:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Remove the socket, drop every connection, close every held fd, free the lock."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
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
            pid, uid = _peer(conn)
            if uid != os.getuid():
                conn.send(_encode_reply(DENIED, {"error": "another user"}))
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
        key = peer.sock.fileno()
        if self._peers.get(key) is peer:
            self._peers[key] = self._peers.pop(key)  # most recently used last
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise _BadRequest(f"message too long (at most {MAX_MESSAGE} bytes, {MAX_FDS} fds)")
            reply = self._handle(peer, msg, fds)
        except _BadRequest as e:
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
            data = _encode_reply(status, body)
            if send:
                socket.send_fds(peer.sock, [data], send)
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
    def _handle(
        self, peer: _Peer, msg: bytes, fds: list[int]
    ) -> tuple[int, dict[str, Any], list[int]] | None:
        if not msg.startswith(MAGIC):
            raise _BadRequest("not a sharedarrays keeper request (bad magic)")
        try:
            req = json.loads(msg[len(MAGIC) :])
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise _BadRequest("request body is not valid JSON") from None
        if type(req) is not dict:
            raise _BadRequest("request body must be a JSON object")
        op = req.get("op")
        if op != "keep" and fds:
            raise _BadRequest(f"op {op!r} takes no file descriptors")
        if op == "hello":
            return OK, {"pid": os.getpid(), "version": 1}, []
        if op == "keep":
            return self._keep(peer, req, fds)
        if op in ("attach", "fetch"):
            return self._serve(peer, req, op)
        if op == "release":
            entry = self._entries.get(_hex(req, "id", _HEX32))
            if entry is not None and entry.id in peer.held:
                peer.held.discard(entry.id)
                entry.holders.discard(peer.sock.fileno())
                self._maybe_free(entry)
            return None
        if op == "unlink":
            return self._unlink(req)
        if op == "list":
            return OK, {"arrays": [self._describe(e) for e in self._entries.values()]}, []
        if op == "status":
            return OK, self._status(), []
        raise _BadRequest(f"unknown op {op!r}")

    def _keep(
        self, peer: _Peer, req: dict[str, Any], fds: list[int]
    ) -> tuple[int, dict[str, Any], list[int]]:
        alloc_id = _hex(req, "id", _HEX32)
        secret = bytes.fromhex(_hex(req, "secret", _HEX64))
        name = _name(req, optional=True)
        sizes = _int_list(req.get("sizes"), "sizes", 1, _MAX_SIZE, MAX_FDS)
        doc = req.get("doc")
        if type(doc) is not dict:
            raise _BadRequest("field 'doc' must be a JSON object")
        allow = req.get("allow_pids")
        allow_pids = None if allow is None else _int_list(allow, "allow_pids", 1, 1 << 31, 4096)
        flight = req.get("in_flight")
        if flight is not None:
            if type(flight) is not dict or name is not None:
                raise _BadRequest("field 'in_flight' must be an object, and only without a name")
            loads = _int_list([flight.get("loads")], "in_flight.loads", 1, 1 << 31, 1)[0]
            seconds = flight.get("seconds")
            if not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_IN_FLIGHT:
                raise _BadRequest(f"field 'in_flight.seconds' must be in (0, {MAX_IN_FLIGHT}]")
            expires = time.monotonic() + seconds
        if len(fds) != len(sizes):
            raise _BadRequest(f"{len(sizes)} chunk sizes but {len(fds)} file descriptors")
        if doc.get("backend") == "host":
            from sharedarrays.backends.host import check_chunk_fd
            from sharedarrays.errors import PayloadError

            for fd, size in zip(fds, sizes):
                try:  # an unsealed memfd would let its sender crash every attacher (SIGBUS)
                    check_chunk_fd(fd, size)
                except PayloadError as e:
                    raise _BadRequest(str(e)) from None
        existing = self._entries.get(alloc_id)
        if existing is not None:
            if not hmac.compare_digest(secret, existing.secret):
                return DENIED, {"error": "wrong secret for an allocation the keeper holds"}, []
            if flight is None:  # named or parked now: kept until unlinked
                existing.expires, existing.loads = None, 0
            elif existing.expires is not None:  # more payloads in flight
                existing.expires = max(existing.expires, expires)
                existing.loads += loads
            if flight is not None and not existing.linked:  # an ended flight takes off again
                existing.linked, existing.expires, existing.loads = True, expires, loads
            if name is not None and name != existing.name:
                if existing.name is not None or name in self._names:
                    return EXISTS, {"error": f"the allocation is kept as {existing.name!r}"}, []
                existing.name = name
                self._names[name] = alloc_id
            self._hold(peer, existing)
            return OK, self._describe(existing), []
        if name is not None and name in self._names:
            return EXISTS, {"error": f"an array named {name!r} exists"}, []
        entry = _Entry(
            alloc_id, secret, name, sizes, list(fds), doc, allow_pids, peer.pid, time.time()
        )
        if flight is not None:
            entry.expires, entry.loads = expires, loads
        fds.clear()  # adopted
        self._entries[alloc_id] = entry
        if name is not None:
            self._names[name] = alloc_id
        self._hold(peer, entry)
        return OK, self._describe(entry), []

    def _hold(self, peer: _Peer, entry: _Entry) -> None:
        peer.held.add(entry.id)
        entry.holders.add(peer.sock.fileno())

    def _serve(
        self, peer: _Peer, req: dict[str, Any], op: str
    ) -> tuple[int, dict[str, Any], list[int]]:
        entry, refusal = self._find(req, by_name=op == "attach")
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

    def _find(
        self, req: dict[str, Any], by_name: bool
    ) -> tuple[_Entry | None, tuple[int, dict[str, Any], list[int]]]:
        """The linked entry a request names (by name, or by id with its secret), or ``None``
        and the reply that refuses it. (A name maps only to linked entries: unlink drops it.)"""
        if by_name:
            name = _name(req)
            alloc_id = self._names.get(name or "")
            entry = None if alloc_id is None else self._entries.get(alloc_id)
            if entry is None or not entry.linked:
                return None, (NOT_FOUND, {"error": f"no array named {name!r}"}, [])
            return entry, (OK, {}, [])
        alloc_id = _hex(req, "id", _HEX32)
        secret = bytes.fromhex(_hex(req, "secret", _HEX64))
        entry = self._entries.get(alloc_id)
        if entry is None or not entry.linked:
            error = f"the keeper does not hold allocation {alloc_id}"
            return None, (NOT_FOUND, {"error": error}, [])
        if not hmac.compare_digest(secret, entry.secret):
            return None, (DENIED, {"error": "wrong secret"}, [])
        return entry, (OK, {}, [])

    def _unlink(self, req: dict[str, Any]) -> tuple[int, dict[str, Any], list[int]]:
        entry, refusal = self._find(req, by_name="name" in req)
        if entry is None:
            return refusal
        entry.linked = False
        if entry.name is not None and self._names.get(entry.name) == entry.id:
            del self._names[entry.name]
        self._maybe_free(entry)
        return OK, {}, []

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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the keeper in this process until it is idle (``python -m sharedarrays keeper
    --foreground`` and the background launcher both end up here).

    Returns 0 when it served and exited, 3 when another keeper already runs.
    """
    idle, limit = idle_seconds(), max_connections()
    _raise_fd_limit()
    try:
        keeper = Keeper(transport.runtime_dir(), idle, limit)
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


# ---------------------------------------------------------------------------------------------
# the client side (every process that names, parks, attaches or lists arrays)

_lock = threading.RLock()
_conn: socket.socket | None = None
_conn_path: str | None = None
_held: set[str] = set()
"""Allocation ids this process's connection holds in the keeper (released on release)."""


def running_pid() -> int | None:
    """The pid of this user's live keeper, or ``None`` (starts nothing)."""
    try:
        _, body, _ = request({"op": "hello"}, start=False)
    except HandleUnavailable:
        return None
    pid = body.get("pid")
    return pid if type(pid) is int else None


def _launch() -> None:
    """Start a keeper in the background, as multiprocessing starts its resource tracker:
    a fresh interpreter with this one's flags. It runs in a session of its own, so that it
    outlives this process and a Ctrl-C in a terminal does not reach it.

    It runs in the private runtime directory, with this package's root first on
    ``PYTHONPATH`` and only the absolute entries of the caller's after it: ``-c`` puts the
    working directory first on ``sys.path``, and an empty or relative ``PYTHONPATH`` entry
    means it too, so in the caller's directory (a shared ``/tmp`` folder, say) another user's
    ``json.py`` would run as this user."""
    directory = transport.runtime_dir()
    exe = spawn.get_executable()
    cmd = [
        exe,
        *util._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        "import sys; from sharedarrays.transport.keeper import main; sys.exit(main())",
    ]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    log_path = directory / "keeper.log"
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            cwd=directory,
            start_new_session=True,
            close_fds=True,
        )
    finally:
        os.close(log)
    # reap it if it exits before we do (it usually outlives us: then init reaps it)
    if sys.is_finalizing():  # no thread starts now (it would hang): init reaps it
        return
    try:
        threading.Thread(target=proc.wait, name="sharedarrays-keeper-reaper", daemon=True).start()
    except RuntimeError:  # at interpreter shutdown (a hand-over at exit): init reaps it
        pass


def _try_connect(path: str, deadline: float) -> socket.socket | None:
    """A connection to the keeper at ``path``, or ``None`` where none listens there.

    A keeper whose queue of connections to accept is full (``EAGAIN``: it is overloaded or
    stopped) is tried again until ``deadline`` (``time.monotonic()``).

    Raises
    ------
    KeeperError
        It did not accept by ``deadline``, or connecting failed otherwise.
    PermissionDenied
        The socket or the keeper belongs to another user.
    """
    try:
        sock = transport.connect_unix(path, deadline, TIMEOUT)
    except TimeoutError:
        raise KeeperError(
            f"the keeper ({path}) did not accept a connection within {TIMEOUT:g} s: it is "
            "overloaded or stopped. Try again; python -m sharedarrays status shows it"
        ) from None
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except PermissionError:
        raise PermissionDenied(
            f"cannot connect to the keeper {path}: it belongs to another user"
        ) from None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise KeeperError(
                f"cannot open a socket to the keeper: {e.strerror}. Close some files in this "
                "process and try again"
            ) from None
        raise KeeperError(f"cannot connect to the keeper {path}: {e.strerror or e}") from None
    try:
        _, uid = _peer(sock)
    except OSError as e:
        sock.close()
        raise KeeperError(f"cannot connect to the keeper {path}: {e.strerror or e}") from None
    if uid != os.getuid():
        sock.close()
        raise PermissionDenied(f"the keeper {path} runs as another user (uid {uid})")
    return sock


def _open(path: str, start: bool) -> socket.socket:
    """A new connection to the keeper at ``path``, starting one first if ``start``."""
    sock = _try_connect(path, time.monotonic() + TIMEOUT)
    if sock is None and start:
        _launch()
        deadline = time.monotonic() + TIMEOUT
        while sock is None and time.monotonic() < deadline:
            time.sleep(0.02)
            sock = _try_connect(path, deadline)
    if sock is None:
        raise HandleUnavailable(
            "no sharedarrays keeper is running for this user"
            + (f" (it did not start within {TIMEOUT:g} s; see {path[:-4]}log)" if start else "")
        )
    return sock


def _connect(start: bool) -> socket.socket:
    global _conn, _conn_path
    path = str(socket_path())
    if _conn is not None and _conn_path == path:
        return _conn
    disconnect()
    _conn, _conn_path = _open(path, start), path
    return _conn


def disconnect() -> None:
    """Close this process's connection to the keeper (it then holds nothing for us)."""
    global _conn, _conn_path
    with _lock:
        if _conn is not None:
            _conn.close()
        _conn = _conn_path = None
        _held.clear()


def request(
    req: dict[str, Any], fds: Sequence[int] = (), start: bool = True
) -> tuple[int, dict[str, Any], list[int]]:
    """Send one request to the keeper and return ``(status, body, fds)``.

    Starts the keeper first when ``start`` and none is running. The caller owns the
    returned fds. A connection that broke (the keeper exited or was killed) is reopened once.

    Raises
    ------
    HandleUnavailable
        No keeper runs (nothing listens on its socket), and ``start`` is false or it did not
        start.
    PermissionDenied
        The keeper's socket belongs to another user.
    KeeperError
        A keeper runs but did not accept or answer within :data:`TIMEOUT` (it is overloaded
        or stopped), the connection failed otherwise, or it sent something that is not a
        keeper reply. Never "no keeper": a name it holds is not reported missing.
    """
    data = MAGIC + json.dumps(req, separators=(",", ":")).encode()
    with _lock:
        _flush_deferred()
        for attempt in (1, 2, 3):
            sock = _connect(start)
            try:
                if fds:
                    socket.send_fds(sock, [data], list(fds))
                else:
                    sock.send(data)
                if req.get("op") == "release":
                    return OK, {}, []
                msg, got, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
            except TimeoutError:
                disconnect()
                raise KeeperError(
                    f"the keeper did not answer within {TIMEOUT:g} s: it is overloaded or "
                    "stopped. Try again; python -m sharedarrays status shows it"
                ) from None
            except OSError as e:
                disconnect()
                if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN) and attempt < 3:
                    continue
                raise KeeperError(f"asking the keeper failed: {e.strerror or e}") from None
            if flags & socket.MSG_CTRUNC:
                for fd in got:
                    os.close(fd)
                raise KeeperError(
                    "this process has no room for the handles the keeper sent: it has as many "
                    "files open as its limit allows (ulimit -n). Close some and try again"
                )
            if not msg:
                for fd in got:
                    os.close(fd)
                disconnect()  # the keeper exited (idle) or died: reconnect, maybe restart it
                if attempt == 3:
                    raise KeeperError("the keeper closed the connection three times; try again")
                continue
            return _reply(msg, got)
    raise AssertionError("unreachable")  # pragma: no cover


def _reply(msg: bytes, fds: list[int]) -> tuple[int, dict[str, Any], list[int]]:
    """Decode a keeper reply: ``(status, body, fds)`` (the fds are closed if it is bad)."""
    try:
        if len(msg) < _STATUS.size:
            raise KeeperError("the keeper sent a truncated reply")
        magic, status = _STATUS.unpack_from(msg)
        body = json.loads(msg[_STATUS.size :])
        if magic != MAGIC or type(body) is not dict:
            raise KeeperError("the keeper sent something that is not a keeper reply")
    except (ValueError, KeeperError) as e:
        for fd in fds:
            os.close(fd)
        raise KeeperError(str(e)) from None
    return status, body, fds


def hand_over(alloc: allocation.Allocation, loads: int, seconds: float) -> None:
    """Give the keeper (started if needed) ``alloc``'s handles for ``loads`` payloads in
    flight, for at most ``seconds``: they then load after this process let go of the
    memory or exited (a ``hand_over_hooks`` hook of the memory state).

    Uses a connection of its own, opened and closed here: it runs from finalizers, in any
    thread, maybe while this thread is inside :func:`request`. The keeper serves the handles
    by id and secret, and drops them after ``loads`` fetches or ``seconds``, whichever comes
    first (and once no process it served holds them).
    """
    doc = {"backend": alloc.backend.name, "device": alloc.device.index}
    doc["readonly"] = alloc.export_readonly
    req = {
        "op": "keep",
        "id": alloc.id,
        "secret": alloc.secret.hex(),
        "sizes": alloc.chunk_sizes(),
        "doc": doc,
        "allow_pids": None if alloc.allow_pids is None else sorted(alloc.allow_pids),
        "in_flight": {"loads": min(loads, 1 << 31), "seconds": min(seconds, MAX_IN_FLIGHT)},
    }
    data = MAGIC + json.dumps(req, separators=(",", ":")).encode()
    handles, temporary = alloc.handles_for_importers()  # read-only ones for readonly arrays
    try:
        with _open(str(socket_path()), start=True) as sock:
            socket.send_fds(sock, [data], handles)
            msg, got, _, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
    except OSError as e:
        raise KeeperError(f"the keeper did not take the handles: {e}") from None
    finally:
        for fd in temporary:
            os.close(fd)
    status, body, got = _reply(msg, got)
    for fd in got:
        os.close(fd)
    raise_for(status, body, f"the keeper refused allocation {alloc.id}")


def _hand_over_at_exit() -> None:
    """At exit: hand the payloads in flight of every allocation still mapped here to the
    keeper (a Queue's feeder thread has pickled its items by then)."""
    for alloc in allocation.live_allocations():
        alloc.hand_over()


def ensure_running() -> int:
    """Start this user's keeper unless one is running; return its pid."""
    _, body, _ = request({"op": "hello"})
    return int(body["pid"])


def raise_for(status: int, body: dict[str, Any], what: str) -> None:
    """Turn a keeper reply's status into the library's exception (OK returns)."""
    message = f"{what}: {body.get('error', 'refused')}"
    if status == OK:
        return
    if status == NOT_FOUND:
        raise NameNotFound(message)
    if status == EXISTS:
        raise NameExists(message)
    if status == DENIED:
        raise PermissionDenied(message)
    raise KeeperError(message)


def hold(alloc_id: str) -> None:
    """Note that the keeper counts this process as a holder of ``alloc_id``."""
    with _lock:
        _flush_deferred()  # first: a deferred release of the same id predates this hold
        _held.add(alloc_id)


_deferred: list[str] = []  # releases that found the lock taken, sent with the next request


def release(alloc_id: str) -> None:
    """Tell the keeper this process no longer holds ``alloc_id`` (no reply, best effort).

    Never blocks: it runs from finalizers (a view's lease going away), which may run in any
    thread, at any allocation, while another thread holds the client's lock (and may even
    be waiting for the finalizing thread to start). Then the release is deferred to this
    process's next keeper request, or to its exit, which the keeper sees anyway.
    """
    if not _lock.acquire(blocking=False):
        _deferred.append(alloc_id)
        return
    try:
        _release_locked(alloc_id)
    finally:
        _lock.release()


def _release_locked(alloc_id: str) -> None:
    if alloc_id not in _held:
        return
    _held.discard(alloc_id)
    if _conn is None:
        return
    try:
        _conn.send(MAGIC + json.dumps({"op": "release", "id": alloc_id}).encode())
    except OSError:
        pass


def _flush_deferred() -> None:
    """Send the releases deferred by :func:`release` (the caller holds ``_lock``)."""
    while _deferred:
        _release_locked(_deferred.pop())


def fetch_handles(
    alloc_id: str, secret: bytes, gone: HandleUnavailable
) -> tuple[list[int], list[int], int]:
    """Ask the keeper (if one is running: none is started) for a parked or named
    allocation's handles, after its exporter could not serve them.

    Returns ``(sizes, fds, creator pid)``; this process is then counted as a holder.

    Raises
    ------
    HandleUnavailable
        ``gone``, with a note, when no keeper runs or it does not hold the allocation.
    PermissionDenied
        Wrong secret, or this process is not in the array's ``allow_pids``.
    """
    try:
        status, body, fds = request(
            {"op": "fetch", "id": alloc_id, "secret": secret.hex()}, start=False
        )
    except HandleUnavailable:
        raise HandleUnavailable(f"{gone}; no keeper holds it either (see a.park())") from None
    except KeeperError as e:
        raise HandleUnavailable(f"{gone}; nor could the keeper be asked: {e}") from None
    try:
        if status == NOT_FOUND:
            raise HandleUnavailable(f"{gone}; the keeper does not hold it either") from None
        raise_for(status, body, f"the keeper refused allocation {alloc_id}")
        hold(alloc_id)
        sizes = body.get("sizes")
        creator = body.get("creator")
        if type(sizes) is not list or len(sizes) != len(fds) or type(creator) is not int:
            release(alloc_id)
            raise KeeperError("the keeper sent an inconsistent reply")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return sizes, fds, creator


def _on_release(alloc: allocation.Allocation) -> None:
    if alloc.pid == os.getpid():
        release(alloc.id)


def _forget_in_child() -> None:
    global _lock, _conn, _conn_path
    _lock = threading.RLock()
    if _conn is not None:
        _conn.close()  # the child's copy only: the parent's connection stays open
    _conn = _conn_path = None
    _held.clear()
    _deferred.clear()


state.release_hooks.append(_on_release)
state.hand_over_hooks.append(hand_over)
at_fork("transport", order=1, after_in_child=_forget_in_child)
at_exit(_hand_over_at_exit, "transport", order=0)
