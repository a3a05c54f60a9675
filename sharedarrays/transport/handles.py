"""Moving chunk handles (file descriptors) between processes.

Two ways, both ending in ``SCM_RIGHTS``:

* **The handle server.** Every process that pickles an array runs one small thread that
  listens on a Unix ``SOCK_SEQPACKET`` socket in a private directory (mode 0700, owned by the
  user). An importer connects, names the allocation and proves it holds the payload's
  32-byte secret; the server checks the peer's uid with ``SO_PEERCRED`` (same user only) and
  the secret, then sends the chunks' fds. This serves plain ``pickle.loads`` in any process
  of the same user, and multiprocessing's pools and queues alike: an importer that already
  maps the allocation never connects at all.
* **At process spawn**, arrays in a ``multiprocessing.Process``'s arguments carry their fds
  with :func:`multiprocessing.reduction.DupFd`, so the child needs no connection.

Nothing here knows about arrays; it moves ``(sizes, fds)`` for an allocation id.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import os
import queue
import selectors
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sharedarrays.errors import HandleUnavailable, PayloadError, PermissionDenied, SharedArrayError
from sharedarrays.memory import allocation
from sharedarrays.memory.state import state
from sharedarrays.process import at_exit, at_fork, running
from sharedarrays.settings import env_number

__all__ = ["runtime_dir", "server_address", "fetch_handles", "fetch_growth", "shutdown_server"]

_REQUEST = struct.Struct("4s16s32s")  # then, optionally, the importer's own server path
_REQUEST_MAGIC = b"SAH1"
_GROW = struct.Struct("4s16s32sI")  # the chunks from index k, and the size and capacity
_GROW_MAGIC = b"SAG1"
_NOTICE_MAGIC = b"SAX1"  # exporter -> importer "I released this allocation": _GROW's layout,
# the count being how many of the importer's payloads of it the exporter loaded
_CLOSED_MAGIC = b"SAC1"  # importer -> exporter of exporter-owned memory: "I closed it"
_LOADED_MAGIC = b"SAL1"  # importer -> sender, _GROW's layout: "I loaded this many of your
# payloads from the mapping I had" (no reply: sent on the kept connection, see report_load)
_MAX_PATH = 107
_REPLY = struct.Struct("4sBI")  # magic, status, number of chunks; then JSON sizes
_REPLY_MAGIC = b"SAR1"
_OK, _GONE, _BAD_SECRET, _BAD_UID, _BAD_REQUEST, _NOT_ALLOWED = range(6)
_FDS_PER_MESSAGE = 250  # SCM_MAX_FD is 253
_CRED = struct.Struct("3i")
TIMEOUT = 10.0
"""Seconds an importer waits for a handle server (and a server for a client)."""
MAX_CONNECTIONS = 256
"""Importer connections a handle server keeps open at most (the longest idle is closed)."""
HOUSEKEEPING = 5.0
"""Seconds between the server's checks for parked mappings whose source process died."""
BACKOFF = 0.05
"""Seconds a server waits after an error it cannot blame on one connection (EMFILE with no
idle connection to close) before it serves again."""
RUN_USER = Path("/run/user")
"""Where systemd makes each logged-in user's private runtime directory (``<uid>``)."""
RUNTIME_DIR_TRIES = 100
"""Names the fallback runtime directory under the temporary directory may take
(``sharedarrays-<uid>``, then ``-1``, ``-2``, ...) while other users hold the earlier ones."""


def runtime_dir() -> Path:
    """The private directory of this user's sockets, created with mode 0700 if missing.

    The first of these, the same in every process of the user:

    * ``$XDG_RUNTIME_DIR/sharedarrays`` when that is set;
    * ``/run/user/<uid>/sharedarrays`` when ``/run/user/<uid>`` is this user's and closed to
      others (systemd makes it at login);
    * ``<tmp>/sharedarrays-<uid>``; where another user made that name first (``/tmp`` is
      open to everyone), ``<tmp>/sharedarrays-<uid>-1``, then ``-2``, ... up to
      :data:`RUNTIME_DIR_TRIES` names: the first that is this user's or can be made.

    Raises
    ------
    PermissionDenied
        The directory cannot be made, is this user's but open to others, or (for
        ``$XDG_RUNTIME_DIR``) belongs to another user or is a symlink; or every fallback name
        belongs to another user.
    """
    uid = os.getuid()
    login = _login_dir(uid)
    if login is not None:
        path = login / "sharedarrays"
        if _make_private(path, uid) is None:
            _refuse(path, os.lstat(path))
        return path
    tmp = Path(tempfile.gettempdir())
    for n in range(RUNTIME_DIR_TRIES):
        path = tmp / (f"sharedarrays-{uid}-{n}" if n else f"sharedarrays-{uid}")
        if _make_private(path, uid) is not None:
            return path
    raise PermissionDenied(
        f"{tmp / f'sharedarrays-{uid}'} and the next {RUNTIME_DIR_TRIES - 1} names after it "
        "belong to other users; set XDG_RUNTIME_DIR to a private directory of this user "
        "(mode 0700)"
    )


def _login_dir(uid: int) -> Path | None:
    """``$XDG_RUNTIME_DIR`` when set, else ``/run/user/<uid>`` when it is ``uid``'s and closed
    to others, else ``None``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base)
    login = RUN_USER / str(uid)
    try:
        st = os.stat(login)
    except OSError:
        return None
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
        return login
    return None


def _make_private(path: Path, uid: int) -> Path | None:
    """``path``, made with mode 0700 unless it exists; ``None`` where it is not a directory
    of ``uid`` (another user took the name).

    Raises
    ------
    PermissionDenied
        It cannot be made, or it is this user's but open to others.
    """
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as e:
        raise PermissionDenied(
            f"cannot make the runtime directory {path}: {e.strerror}; set XDG_RUNTIME_DIR to "
            "a private directory of this user (mode 0700)"
        ) from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        return None
    if st.st_mode & 0o077:
        _refuse(path, st)
    return path


def _refuse(path: Path, st: os.stat_result) -> typing.NoReturn:
    """Raise PermissionDenied: ``path`` is not a private directory of this user."""
    raise PermissionDenied(
        f"{path} is not a private directory of this user (owner uid {st.st_uid}, mode "
        f"{stat.filemode(st.st_mode)}); remove it or set XDG_RUNTIME_DIR to a private directory"
    )


def _peer(sock: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


class HandleServer:
    """Serves this process's allocations' fds to authenticated importers.

    One per process, started on first need by :func:`server_address`, stopped at exit. An
    importer may keep its connection open and send one request after another on it (each
    is checked on its own: the uid and pid from ``SO_PEERCRED`` at connect, the secret per
    request); the server keeps at most :data:`MAX_CONNECTIONS` open, closing the longest
    idle first, and closes one when its importer hangs up or exits.
    """

    def __init__(self) -> None:
        directory = runtime_dir()
        _remove_stale_sockets(directory)
        name = f"{os.getpid()}-{os.urandom(4).hex()}"
        self.path = str(directory / f"{name}.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:  # bound under another name until it listens: a "<pid>-*.sock" always accepts
            self._sock.bind(str(directory / f"{name}.new"))
            os.chmod(directory / f"{name}.new", 0o600)
            self._sock.listen(64)
            os.rename(directory / f"{name}.new", self.path)
        except BaseException:
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(directory / f"{name}.new")
            raise
        self._pid = os.getpid()
        self._closed = False
        self._conns: dict[socket.socket, tuple[int, int, int]] = {}  # oldest use first
        self._thread = threading.Thread(
            target=self._serve, name="sharedarrays-handles", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def connections(self) -> int:
        """How many importer connections are open now."""
        return len(self._conns)

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        next_housekeeping = time.monotonic() + HOUSEKEEPING
        failing = False  # reported the current run of errors already
        try:
            while not self._closed:
                try:
                    events = sel.select(max(next_housekeeping - time.monotonic(), 0.0))
                    if time.monotonic() >= next_housekeeping:
                        allocation.drop_parked(only_orphans=True)
                        allocation.reap_draining()
                        next_housekeeping = time.monotonic() + HOUSEKEEPING
                    for key, _ in events:
                        if key.fileobj is self._sock:
                            self._accept(sel)
                        else:
                            self._request(sel, key.fileobj)  # type: ignore[arg-type]
                    failing = False
                except Exception as e:  # EMFILE and the like: back off, keep serving
                    if self.closed:
                        return  # closed under the selector
                    if not failing:
                        print(f"sharedarrays: handle server: {e!r}; retrying", file=sys.stderr)
                    failing = True
                    time.sleep(BACKOFF)
        finally:
            for conn in list(self._conns):
                conn.close()
            self._conns.clear()
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        """Accept one importer (its sends never block the server: a peer that does not
        read its replies is dropped when its socket buffer is full)."""
        try:
            conn, _ = self._sock.accept()
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE) or not self._conns:
                raise
            self._drop(sel, next(iter(self._conns)))  # no fd left: the longest idle goes
            return  # and the next round accepts
        try:
            conn.setblocking(False)
            peer = _peer(conn)
        except OSError:
            conn.close()
            return
        while len(self._conns) >= MAX_CONNECTIONS:  # the longest idle goes
            self._drop(sel, next(iter(self._conns)))
        self._conns[conn] = peer
        sel.register(conn, selectors.EVENT_READ)

    def _drop(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        self._conns.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()

    def _request(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        peer = self._conns.pop(conn, None)
        if peer is None:
            self._drop(sel, conn)
            return
        request: bytes | None
        try:
            request = conn.recv(_GROW.size + _MAX_PATH + 1)
        except BlockingIOError:
            request = None  # nothing to read after all: kept
        except OSError:
            request = b""  # the client went away; nothing to clean up beyond the socket
        try:
            if request:
                self._answer(conn, peer, request)
        except OSError:
            request = b""  # gone, or not reading its replies (its socket buffer is full)
        except Exception as e:  # a bug must not stop the server: this client gets EOF
            print(f"sharedarrays: handle server: {e!r} answering pid {peer[0]}", file=sys.stderr)
            request = b""
        if request is None or (request and peer[1] == os.getuid()):
            self._conns[conn] = peer  # most recently used last
        else:  # hung up, or another user (told so once)
            self._drop(sel, conn)

    def _answer(self, conn: socket.socket, peer: tuple[int, int, int], request: bytes) -> None:
        pid, uid, _ = peer
        if uid != os.getuid():
            conn.send(_REPLY.pack(_REPLY_MAGIC, _BAD_UID, 0))
            return
        counted = request.startswith((_GROW_MAGIC, _NOTICE_MAGIC, _LOADED_MAGIC))  # (a count)
        size = _GROW.size if counted else _REQUEST.size
        if len(request) < size or len(request) > size + _MAX_PATH:
            conn.send(_REPLY.pack(_REPLY_MAGIC, _BAD_REQUEST, 0))
            return
        magic, raw_id, secret = _REQUEST.unpack_from(request)
        first = _GROW.unpack_from(request)[3] if counted else 0
        reply_to = request[size:].decode(errors="replace")
        if magic == _LOADED_MAGIC:  # no reply
            self._loaded(conn, raw_id, secret, first)
            return
        if magic not in (_REQUEST_MAGIC, _NOTICE_MAGIC, _GROW_MAGIC, _CLOSED_MAGIC):
            conn.send(_REPLY.pack(_REPLY_MAGIC, _BAD_REQUEST, 0))
            return
        if magic == _CLOSED_MAGIC:  # the peer freed its import: maybe the memory can go now
            alloc = allocation.lookup(raw_id.hex(), draining=True)
            if alloc is not None and hmac.compare_digest(secret, alloc.secret):
                conn.send(_REPLY.pack(_REPLY_MAGIC, _OK, 0))
                alloc.closed_by(pid)
            else:
                conn.send(_REPLY.pack(_REPLY_MAGIC, _GONE, 0))
            return
        # (released, it is served until it leaves the registry, handing its handles to the
        # keeper, and exporter-owned memory while it drains: the new importer holds it too)
        alloc = allocation.lookup(raw_id.hex(), draining=True)
        if alloc is None:
            conn.send(_REPLY.pack(_REPLY_MAGIC, _GONE, 0))
            return
        if not hmac.compare_digest(secret, alloc.secret):
            conn.send(_REPLY.pack(_REPLY_MAGIC, _BAD_SECRET, 0))
            return
        if magic == _NOTICE_MAGIC:
            conn.send(_REPLY.pack(_REPLY_MAGIC, _OK, 0))
            alloc.note_loaded(first)  # its payloads that came back to their exporter
            _off_thread(alloc.orphan)  # a release may hand over to the keeper: not here
            return
        if alloc.allow_pids is not None and pid not in alloc.allow_pids and pid != self._pid:
            conn.send(_REPLY.pack(_REPLY_MAGIC, _NOT_ALLOWED, 0))
            return
        # ``alloc`` is a strong reference: the fds stay open until they are sent.
        with alloc.growth_lock:  # a shrink or a release waits: the fds stay open until sent
            if allocation.lookup(alloc.id, draining=True) is not alloc:  # freed since
                conn.send(_REPLY.pack(_REPLY_MAGIC, _GONE, 0))
                return
            sizes = alloc.chunk_sizes()
            fds, temporary = alloc.handles_for_importers()
            try:
                if magic == _GROW_MAGIC:  # a growable array's importer: chunks from ``first``
                    fds = fds[first:]
                    body = json.dumps(
                        {"sizes": sizes, "capacity": alloc.capacity, "used": alloc.used}
                    )
                elif alloc.backend.maps:
                    body = json.dumps(sizes)
                else:  # a pointer backend: its portable handle, only after the checks above
                    body = json.dumps(
                        {"sizes": sizes, "exports": [e.hex() for e in alloc.exports()]}
                    )
                header = _REPLY.pack(_REPLY_MAGIC, _OK, len(fds)) + body.encode()
                # Record first: the importer may use the array and hand it back before this
                # thread runs again, and a release must then know whom to tell.
                server = reply_to if reply_to.startswith("/") else None
                alloc.record_served(pid, server, len(sizes))
                socket.send_fds(conn, [header], fds[:_FDS_PER_MESSAGE])
                for i in range(_FDS_PER_MESSAGE, len(fds), _FDS_PER_MESSAGE):
                    socket.send_fds(conn, [b"+"], fds[i : i + _FDS_PER_MESSAGE])
            finally:
                for fd in temporary:
                    os.close(fd)
        del alloc

    def _loaded(self, conn: socket.socket, raw_id: bytes, secret: bytes, count: int) -> None:
        """An importer loaded ``count`` of this process's payloads from the mapping it had:
        as many in flight less. Several reports may wait on ``conn`` (they have no reply):
        those that follow are read now too."""
        while True:
            alloc = allocation.lookup(raw_id.hex(), draining=True)
            if alloc is not None and hmac.compare_digest(secret, alloc.secret):
                alloc.note_loaded(count)
            try:
                ahead = conn.recv(_GROW.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                if len(ahead) < _GROW.size or not ahead.startswith(_LOADED_MAGIC):
                    return
                _, raw_id, secret, count = _GROW.unpack_from(conn.recv(_GROW.size))
            except OSError:
                return

    def close(self) -> None:
        """Stop serving and remove the socket file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._pid == os.getpid():
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()


def _off_thread(fn: Callable[[], object]) -> None:
    """Run ``fn`` in a thread of its own (daemon), so that the handle server goes on serving;
    inline where no thread can start (at interpreter shutdown)."""
    if sys.is_finalizing():
        fn()
        return
    try:
        threading.Thread(target=fn, name="sharedarrays-release", daemon=True).start()
    except RuntimeError:
        fn()


def _remove_stale_sockets(directory: Path) -> None:
    """Remove sockets left by processes of this user that died without cleaning up.

    A handle server's socket file is named ``<pid>-<random>.sock`` and listens from the
    moment it has that name. One whose pid runs here is kept; otherwise it is removed only if
    connecting to it is refused (nothing listens there any more): a process in another pid
    namespace that shares this directory, whose pid means nothing here, keeps its socket.
    """
    for entry in directory.glob("*.sock"):
        pid_text = entry.name.split("-", 1)[0]
        if not pid_text.isdigit() or running(int(pid_text)):
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.setblocking(False)
            try:
                probe.connect(str(entry))
            except ConnectionRefusedError:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
            except OSError:
                pass  # it listens with a full queue, is gone already, or is not ours to judge


_server: HandleServer | None = None
_server_lock = threading.Lock()


def server_address() -> str:
    """The path of this process's handle server, starting it on first call.

    Raises
    ------
    PermissionDenied
        No private runtime directory (:func:`runtime_dir`).
    HandleUnavailable
        The server's socket cannot be made there (say, a path longer than Unix sockets
        allow, or no file descriptor left).
    """
    global _server
    server = _server
    if server is not None:
        return server.path
    with _server_lock:
        if _server is None:
            try:
                _server = HandleServer()
            except OSError as e:
                raise HandleUnavailable(
                    f"cannot start this process's handle server in {runtime_dir()}: "
                    f"{e.strerror or e}. Unix socket paths are limited to {_MAX_PATH} bytes: "
                    "set XDG_RUNTIME_DIR to a short private directory, or close some files"
                ) from None
            _start_notifier()  # now, never from a finalizer (see _notify_importers)
        return _server.path


def shutdown_server() -> None:
    """Stop this process's handle server (at exit; importers then get HandleUnavailable)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


def _forget_server_in_child() -> None:
    # A forked child has the parent's listening socket but not its thread: drop both. It
    # also has the parent's connections to other servers, which name the parent's pid.
    # Notices the parent queued are the parent's to send.
    global _server, _server_lock, _connections_lock, _notices, _notifier, _unreported_lock
    _server_lock = threading.Lock()
    _connections_lock = threading.Lock()
    _notices = queue.SimpleQueue()
    _notifier = None
    _in_flight.clear()
    _unreported.clear()
    _unreported_lock = threading.Lock()
    for sock in _connections.values():
        sock.close()
    _connections.clear()
    if _server is not None:
        for conn in _server._conns:
            conn.close()
        _server._conns.clear()
        _server._sock.close()
        _server._closed = True
        _server = None


at_fork("transport", after_in_child=_forget_server_in_child)
at_exit(shutdown_server, "transport", order=2, processes=False)


def fetch_handles(
    server: str, pid: int, alloc_id: str, secret: bytes, reply_to: str | None = None
) -> tuple[list[int], list[int], tuple[bytes, ...]]:
    """Ask the handle server at ``server`` for the chunks of an allocation.

    Returns
    -------
    sizes, fds : list of int
        The chunk sizes and the received fds (owned by the caller): one per chunk for a
        mapping backend; for a pointer backend what its importer needs besides the exports
        (cuda-pool: the pool's fd; cuda-ipc: none), and the server records the caller as a
        holder of the exporter-owned memory.
    exports : tuple of bytes
        A pointer backend's portable chunk handles (cuda-ipc's IPC handle, cuda-pool's pool
        id and pointer data); empty for a mapping backend.

    Raises
    ------
    HandleUnavailable
        The server is gone (its process exited) or no longer has the allocation.
    PermissionDenied
        Another user's server or directory, or the secret is wrong.
    """
    doc, fds = _fetch(server, pid, alloc_id, secret, reply_to, None)
    try:
        sizes, exports = doc, []
        if type(doc) is dict and set(doc) == {"sizes", "exports"}:
            sizes, exports = doc["sizes"], doc["exports"]
        if (
            type(sizes) is not list
            or len(fds) > len(sizes)
            or type(exports) is not list
            or not all(type(e) is str and 0 < len(e) <= 512 for e in exports)
        ):
            raise PayloadError("the handle server sent an inconsistent reply")
        try:
            return sizes, fds, tuple(bytes.fromhex(e) for e in exports)
        except ValueError:
            raise PayloadError("the handle server sent an inconsistent reply") from None
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def fetch_growth(
    server: str, pid: int, alloc_id: str, secret: bytes, first: int, reply_to: str | None = None
) -> tuple[list[int], int, int, list[int]]:
    """Ask the exporter of a growable array for its current chunks from index ``first``.

    Returns
    -------
    sizes : list of int
        All its chunk sizes now (the first ``first`` are those the caller maps, unless the
        array was shrunk meanwhile).
    capacity, used : int
        Its reserved bytes and the bytes of the array now.
    fds : list of int
        The fds of the chunks from ``first`` on (owned by the caller).

    Raises
    ------
    HandleUnavailable, PermissionDenied
        As :func:`fetch_handles`.
    """
    doc, fds = _fetch(server, pid, alloc_id, secret, reply_to, first)
    try:
        if type(doc) is not dict or set(doc) != {"sizes", "capacity", "used"}:
            raise PayloadError("the handle server sent an inconsistent reply")
        sizes, capacity, used = doc["sizes"], doc["capacity"], doc["used"]
        if (
            type(sizes) is not list
            or not all(type(n) is int and n > 0 for n in sizes)
            or type(capacity) is not int
            or type(used) is not int
            or len(fds) != max(len(sizes) - first, 0)
        ):
            raise PayloadError("the handle server sent an inconsistent reply")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return sizes, capacity, used, fds


_connections: dict[str, socket.socket] = {}
"""This process's open connections to handle servers, by server path: one per exporter,
reused by the next request (no connect and accept per import). A request takes its
connection out while it runs, so two threads never share one."""
_connections_lock = threading.Lock()
MAX_CLIENT_CONNECTIONS = 64
"""Connections to handle servers this process keeps open at most (the oldest is closed)."""


def open_connections() -> int:
    """How many sockets this process keeps open for handle traffic between requests: its
    connections to other processes' handle servers and, when it serves, its importers'
    connections to it."""
    server = _server
    return len(_connections) + (server.connections if server is not None else 0)


def close_connections() -> None:
    """Close this process's idle connections to handle servers (the next request connects
    again)."""
    with _connections_lock:
        socks = list(_connections.values())
        _connections.clear()
    for sock in socks:
        sock.close()


def connect_unix(path: str, deadline: float, timeout: float) -> socket.socket:
    """A new ``SOCK_SEQPACKET`` connection to the Unix socket ``path`` (with ``timeout`` set
    on it), for the handle servers and the keeper alike.

    A listener whose queue of connections to accept is full (``EAGAIN``: its process is
    stopped or overloaded) is tried again until ``deadline`` (``time.monotonic()``).

    Raises
    ------
    TimeoutError
        It did not accept by ``deadline``.
    OSError
        Anything else ``socket()`` or ``connect()`` raised (no file, refused, not a socket,
        another user's, no fd left); the caller says what it means.
    """
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{path} did not accept a connection") from None
            time.sleep(BACKOFF)
            continue
        except BaseException:
            sock.close()
            raise
        return sock


def _connect(server: str, gone: str) -> socket.socket:
    """A new connection to the handle server at ``server``, checked to run as this user.

    A server whose queue of connections to accept is full (``EAGAIN``: it is stopped or
    overloaded) is tried again until :data:`TIMEOUT`.

    Raises
    ------
    HandleUnavailable
        Nothing listens there (``gone``), it did not accept in time, or ``server`` is not a
        socket a connection can be made to (the message says why).
    PermissionDenied
        The socket or its server belongs to another user.
    """
    try:
        sock = connect_unix(server, time.monotonic() + TIMEOUT, TIMEOUT)
    except TimeoutError:
        raise HandleUnavailable(
            f"the handle server {server} did not accept a connection within {TIMEOUT:g} s: its "
            "process is stopped or overloaded. Try again when it runs"
        ) from None
    except (FileNotFoundError, ConnectionRefusedError):
        raise HandleUnavailable(gone) from None
    except PermissionError:
        raise PermissionDenied(
            f"cannot connect to the handle server {server}: it belongs to another user. "
            "Arrays are shared only between processes of the same user"
        ) from None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise HandleUnavailable(
                f"cannot open a socket to ask {server} for handles: {e.strerror}. Close some "
                "files or connections in this process and try again"
            ) from None
        raise HandleUnavailable(  # ENOTDIR, ELOOP, EPROTOTYPE, a path too long...
            f"cannot connect to {server}, named as the handle server of the array: "
            f"{e.strerror or e}. It is not a sharedarrays handle server: the payload was "
            "made for another machine or altered; ask its exporter for a new one"
        ) from None
    try:
        _, server_uid, _ = _peer(sock)
        if server_uid != os.getuid():
            raise PermissionDenied(
                f"the handle server {server} runs as another user (uid {server_uid})"
            )
    except BaseException:
        sock.close()
        raise
    return sock


def _keep_connection(server: str, sock: socket.socket) -> None:
    """Put a connection back for the next request (or close it if another one is kept)."""
    with _connections_lock:
        if server not in _connections:
            while len(_connections) >= MAX_CLIENT_CONNECTIONS:
                _connections.pop(next(iter(_connections))).close()
            _connections[server] = sock
            return
    sock.close()


_unreported: dict[tuple[str, str, bytes], int] = {}
"""Warm loads not yet reported, by (sender's server, allocation id, secret)."""
_unreported_lock = threading.Lock()


def report_load(server: str, alloc_id: str, secret: bytes) -> None:
    """Tell the exporter of exporter-owned memory (cuda-ipc, cuda-pool), whose handle server
    is ``server``, that this process loaded one of its payloads from a mapping it already
    had, so that it does not wait for that payload (:meth:`Allocation.in_flight`). (Not done
    for other memory: it costs the warm handoff about 80 us on the H200, two threads woken.)

    Counted here and sent by the notifier thread, one message (``SAL1`` with the count, no
    reply) per sender and allocation for all the loads since the last, and only on a
    connection this process keeps to that sender (a warm handoff connects to nothing)."""
    key = (server, alloc_id, secret)
    with _unreported_lock:
        first = not _unreported
        _unreported[key] = _unreported.get(key, 0) + 1
    if first:  # the notifier sends what has gathered by the time it gets to it
        _start_notifier()
        _in_flight.append(None)
        _notices.put(([], []))


def _send_reports() -> None:
    """Send the warm-load counts gathered by :func:`report_load` (in the notifier thread)."""
    global _unreported
    with _unreported_lock:
        reports, _unreported = _unreported, {}
    for (server, alloc_id, secret), count in reports.items():
        with _connections_lock:
            sock = _connections.pop(server, None)
        if sock is None:
            continue  # (the sender counts them in flight until the bound: the safe side)
        try:
            sock.send(_GROW.pack(_LOADED_MAGIC, bytes.fromhex(alloc_id), secret, count))
        except OSError:
            sock.close()
            continue
        _keep_connection(server, sock)


def _fetch(
    server: str,
    pid: int,
    alloc_id: str,
    secret: bytes,
    reply_to: str | None,
    first: int | None,
) -> tuple[Any, list[int]]:
    """One request to a handle server: the reply's JSON and the fds (owned by the caller).

    Sent on this process's kept connection to that server when there is one; if that
    connection turns out to be closed before any reply came (the server dropped it), the
    request is sent once more on a new one.
    """
    gone = (
        f"the handles of allocation {alloc_id} are no longer available: the process that "
        f"shared it (pid {pid}) has exited or closed every view of it, and the payload was not "
        "kept in flight (killed, or older than SHAREDARRAYS_IN_FLIGHT seconds). Keep that "
        "process and one open view alive until every importer has loaded the array, or name "
        "or park() it"
    )
    tail = reply_to.encode() if reply_to and len(reply_to.encode()) <= _MAX_PATH else b""
    raw_id = bytes.fromhex(alloc_id)
    if first is None:
        request = _REQUEST.pack(_REQUEST_MAGIC, raw_id, secret) + tail
    else:
        request = _GROW.pack(_GROW_MAGIC, raw_id, secret, first) + tail
    with _connections_lock:
        sock = _connections.pop(server, None)
    reused = sock is not None
    fds: list[int] = []
    try:
        while True:
            if sock is None:
                sock = _connect(server, gone)
            try:
                sock.sendall(request)
                msg, got, flags, _ = socket.recv_fds(sock, 1 << 20, _FDS_PER_MESSAGE)
            except (BrokenPipeError, ConnectionResetError):
                msg, got, flags = b"", [], 0
            fds.extend(got)
            _check_truncated(flags)
            if msg or not reused:
                break
            sock.close()  # a kept connection the server had closed: once more, anew
            sock, reused = None, False
        assert sock is not None  # (the loop ends holding a connection)
        conn = sock
        if len(msg) < _REPLY.size:
            raise HandleUnavailable(f"{gone} (the server closed the connection)")
        magic, status, count = _REPLY.unpack_from(msg)
        if magic != _REPLY_MAGIC:
            raise PayloadError(f"{server} is not a sharedarrays handle server")
        if status not in (_OK, _BAD_UID):  # a refusal: the connection serves the next request
            sock = None
            _keep_connection(server, conn)
        if status == _GONE:
            raise HandleUnavailable(gone)
        if status == _BAD_SECRET:
            raise PermissionDenied(
                f"the process that shared allocation {alloc_id} (pid {pid}) refused the "
                "payload's secret; the payload does not belong to that allocation"
            )
        if status == _BAD_UID:
            raise PermissionDenied("the handle server refused this process: another user")
        if status == _NOT_ALLOWED:
            raise PermissionDenied(
                f"process {os.getpid()} is not in the allow_pids of allocation {alloc_id}"
            )
        if status != _OK:
            raise PayloadError("the handle server rejected the request as malformed")
        try:
            sizes = json.loads(msg[_REPLY.size :])
        except ValueError:
            raise PayloadError("the handle server sent an inconsistent reply") from None
        while len(fds) < count:
            _, more, flags, _ = socket.recv_fds(conn, 16, _FDS_PER_MESSAGE)
            fds.extend(more)
            _check_truncated(flags)
            if not more:
                raise HandleUnavailable(f"{gone} (the server stopped while sending)")
        if len(fds) != count:
            raise PayloadError("the handle server sent an inconsistent reply")
        result = fds
        fds = []
        sock = None
        _keep_connection(server, conn)
        return sizes, result
    except SharedArrayError:
        raise
    except TimeoutError:
        raise HandleUnavailable(
            f"the process that shared allocation {alloc_id} (pid {pid}) did not answer within "
            f"{TIMEOUT:g} s: it is stopped or overloaded. Try again when it runs"
        ) from None
    except OSError as e:
        if e.errno in (errno.ECONNRESET, errno.EPIPE):
            raise HandleUnavailable(gone) from None
        raise HandleUnavailable(
            f"asking the process that shared allocation {alloc_id} (pid {pid}) for its "
            f"handles failed: {e.strerror or e}. Close some files in this process if it has "
            "too many open, and try again"
        ) from None
    finally:
        for fd in fds:
            os.close(fd)
        if sock is not None:
            sock.close()


def _check_truncated(flags: int) -> None:
    """Raise if the kernel dropped file descriptors of a reply (this process's fd table was
    full: ``RLIMIT_NOFILE``)."""
    if flags & socket.MSG_CTRUNC:
        raise HandleUnavailable(
            "this process has no room for the handles it was sent: it has as many files open "
            "as its limit allows (ulimit -n). Close some, or raise the limit, and try again"
        )


_notices: queue.SimpleQueue[tuple[list[str], list[bytes]]] = queue.SimpleQueue()
_notifier: threading.Thread | None = None
_in_flight: list[None] = []  # one item per notice queued and not yet sent (append/pop: no lock)


def pending_notices() -> int:
    """How many release and close notices this process has queued and not yet sent (each
    holds a socket open while it is sent)."""
    return len(_in_flight)


def _queue_notice(
    servers: list[str], magic: bytes, raw_id: bytes, secret: bytes, alloc: Any = None
) -> None:
    """Queue a notice for the notifier thread. Never blocks: it runs from finalizers.

    A release notice (``SAX1``) tells each server how many of its process's payloads of
    ``alloc`` this process loaded (:meth:`Allocation.returned`)."""
    if magic == _NOTICE_MAGIC:
        messages = [
            _GROW.pack(magic, raw_id, secret, min(alloc.returned(path) if alloc else 0, 1 << 31))
            for path in servers
        ]
    else:
        messages = [_REQUEST.pack(magic, raw_id, secret)] * len(servers)
    _in_flight.append(None)
    _notices.put((servers, messages))


def _send_notices() -> None:
    while True:
        servers, messages = _notices.get()
        if not servers:  # (queued by report_load)
            _send_reports()
        for path, message in zip(servers, messages):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                try:
                    sock.settimeout(1.0)
                    sock.connect(path)
                    sock.sendall(message)
                    sock.recv(_REPLY.size)
                except OSError:
                    continue  # that process is gone: nothing to tell
        _in_flight.pop()


def _start_notifier() -> None:
    """Start the thread that sends release notices, if it does not run (after a fork)."""
    global _notifier
    if sys.is_finalizing():  # no thread starts now (it would hang): the process is ending,
        return  # and those it would tell see that for themselves
    if _notifier is None or not _notifier.is_alive():
        notifier = threading.Thread(target=_send_notices, name="sharedarrays-notices", daemon=True)
        try:
            notifier.start()
        except RuntimeError:  # at interpreter shutdown (3.12: no new threads)
            return
        _notifier = notifier


def _notify_on_release(alloc: allocation.Allocation) -> None:
    """Tell the processes this one served that it released ``alloc``, so that they drop
    their parked mappings of it (and the memory can return); and, for an imported
    allocation of exporter-owned memory (cuda-ipc, cuda-pool), tell its exporter that this
    process closed it, so that the exporter may free it. Best effort, off-thread: this runs
    from finalizers, so it only queues (the sending thread starts with the handle server)."""
    if alloc.pid != os.getpid():
        return  # inherited across fork: the parent still holds it
    raw_id = bytes.fromhex(alloc.id)
    if alloc.backend.exporter_owned and not alloc.origin.created_here and alloc.source_server:
        _start_notifier()
        _queue_notice([alloc.source_server], _CLOSED_MAGIC, raw_id, alloc.secret)
    own = _server.path if _server is not None else None
    servers = [p for p in alloc.served_servers() if p != own]
    if servers:
        _queue_notice(servers, _NOTICE_MAGIC, raw_id, alloc.secret, alloc)


state.release_hooks.append(_notify_on_release)

EXIT_WAIT = 10.0
"""Seconds a process waits at exit for other processes to close the exporter-owned memory
(cuda-ipc, cuda-pool) it made, before it exits anyway (``SHAREDARRAYS_EXIT_WAIT``)."""


def _drain_at_exit() -> None:
    """At exit, before the handle server stops: wait for the importers of exporter-owned
    memory (cuda-ipc, cuda-pool) made here to close it, telling them to drop what they only
    keep parked; then say who did not (their views of it become invalid when this process's
    CUDA context goes)."""
    held = allocation.held_elsewhere()
    if not held:
        return
    for alloc in held:  # its importers may have it parked (also those served since the
        servers = alloc.served_servers()  # release, which loaded payloads in flight)
        if servers:
            _start_notifier()
            _queue_notice(servers, _NOTICE_MAGIC, bytes.fromhex(alloc.id), alloc.secret, alloc)
    try:
        timeout = env_number("SHAREDARRAYS_EXIT_WAIT", EXIT_WAIT, 0.0)
    except ValueError as e:  # at exit: say so, and wait the default
        print(f"sharedarrays: {e}; waiting {EXIT_WAIT:g} s", file=sys.stderr)
        timeout = EXIT_WAIT
    left = allocation.wait_draining(timeout)
    if left:
        held_by = "; ".join(
            f"{a.backend.name} allocation {a.id[:12]} by "
            + (f"pid {', '.join(map(str, a.holders))}" if a.holders else "")
            + (" and " if a.holders and a.busy() else "")
            + (f"{a.in_flight()[0]} payload(s) in flight, not loaded yet" if a.busy() else "")
            for a in left
        )
        print(
            f"sharedarrays: exiting after {timeout:g} s although other processes still hold "
            f"memory this process made ({held_by}); their views of it are invalid from now "
            "on, and those payloads will not load. Close those views (or end those processes) "
            "and let every payload be loaded before the exporter exits (SHAREDARRAYS_EXIT_WAIT "
            "sets how long it waits)",
            file=sys.stderr,
        )


at_exit(_drain_at_exit, "transport", order=1)  # runs before shutdown_server
