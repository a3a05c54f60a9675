"""The handle server's client: chunk handles fetched from their exporter on one connection
per exporter, kept between requests; notices (finalizers cause them: never blocking) queued
on ``STATE.notices`` and sent by one daemon thread, only to a peer of this user."""

from __future__ import annotations

import errno
import os
import select
import socket
import time
from types import MappingProxyType
from typing import Any, cast

from sharedarrays.errors import HandleUnavailable, PayloadError, PermissionDenied, SharedArrayError
from sharedarrays.process import STATE, at_exit, start_thread
from sharedarrays.protocol.handles import REPLY_SIZE, Growth, Handles, Kind, Reply, Request, Status
from sharedarrays.protocol.unix import (
    BACKOFF,
    FDS_PER_MESSAGE,
    MAX_PATH,
    check_truncated,
    connect_unix,
    recv_fds,
    recv_into,
)
from sharedarrays.sections import NoticesState

_INCONSISTENT = "the handle server sent an inconsistent reply"
_GONE = (  # what a load says when the exporter no longer serves the allocation
    "the handles of allocation {alloc_id} are no longer available: the process that "
    "shared it (pid {pid}) has exited or closed every view of it, and the payload was not "
    "kept in flight (killed; older than SHAREDARRAYS_IN_FLIGHT seconds; or already loaded "
    "as many times as it was pickled: each pickle.dumps counts one load, so bytes pickled "
    "once and loaded by two processes load only in the first). Keep that "
    "process and one open view alive until every importer has loaded the array, or name "
    "or park() it (a named or parked array is gone too when the keeper that held it was "
    "killed: python -m sharedarrays status shows whether one runs)"
)
_REFUSED: MappingProxyType[int, tuple[type[SharedArrayError], str]] = MappingProxyType(
    {  # what a handle server's refusal raises; others: malformed
        Status.GONE: (HandleUnavailable, "{gone}"),
        Status.BAD_SECRET: (
            PermissionDenied,
            "the process that shared allocation {alloc_id} (pid {pid}) refused the payload's "
            "secret; the payload does not belong to that allocation",
        ),
        Status.BAD_UID: (PermissionDenied, "the handle server refused this process: another user"),
        Status.NOT_ALLOWED: (
            PermissionDenied,
            "process {me} is not in the allow_pids of allocation {alloc_id}",
        ),
    }
)
_MALFORMED = (PayloadError, "the handle server rejected the request as malformed")
TIMEOUT = 10.0  # seconds an importer waits for a handle server
MAX_CLIENT_CONNECTIONS = 64  # connections to handle servers kept open at most (oldest closed)
TIDY_CONNECTIONS = 4  # kept connections from which a new one first closes those hung up
NOTICE_TIMEOUT = 1.0  # seconds the notifier waits for a handle server to take one notice


def fetch_handles(
    server: str, pid: int, alloc_id: str, secret: bytes, reply_to: str | None = None
) -> tuple[list[int], list[int], tuple[bytes, ...]]:
    """An allocation's chunk sizes, fds (the caller's) and a pointer backend's portable
    handles from its handle server; HandleUnavailable, or PermissionDenied where refused."""
    handles, fds = _fetch(server, pid, alloc_id, secret, reply_to, None)
    return handles.sizes, fds, cast(Handles, handles).exports or ()


def fetch_growth(
    server: str, pid: int, alloc_id: str, secret: bytes, first: int, reply_to: str | None = None
) -> tuple[list[int], int, int, list[int]]:
    """:func:`fetch_handles` of a growable array: sizes, capacity, length, fds from ``first``."""
    body, fds = _fetch(server, pid, alloc_id, secret, reply_to, first)
    growth = cast(Growth, body)
    return growth.sizes, growth.capacity, growth.used, fds


def close_connections() -> None:
    """Close this process's idle connections to handle servers."""
    with STATE.connections.lock:
        socks = list(STATE.connections.by_server.values())
        STATE.connections.by_server.clear()
    for sock in socks:
        sock.close()


def _connect(server: str, gone: str, pid: int | None = None) -> socket.socket:
    """A connection to the handle server at ``server`` of this user (a full queue, or a
    missing socket while ``pid`` runs, retried until :data:`TIMEOUT`)."""
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            try:
                return connect_unix(server, deadline, TIMEOUT, f"the handle server {server}")
            except FileNotFoundError:
                if pid is None or not _runs(pid) or time.monotonic() >= deadline:
                    raise
                time.sleep(BACKOFF)
    except TimeoutError:
        raise HandleUnavailable(
            f"the handle server {server} did not accept a connection within {TIMEOUT:g} s: its "
            "process is stopped or overloaded. Try again when it runs"
        ) from None
    except (FileNotFoundError, ConnectionRefusedError):
        raise HandleUnavailable(gone) from None
    except PermissionDenied:  # (another user's)
        raise
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


def _runs(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def keep_connection(server: str, sock: socket.socket) -> None:
    """Put a connection back for the next request (or close it if another one is kept);
    past :data:`TIDY_CONNECTIONS` kept, those whose server hung up are closed first."""
    with STATE.connections.lock:
        by_server = STATE.connections.by_server
        if server not in by_server:
            if len(by_server) >= TIDY_CONNECTIONS:
                _close_hung_up(by_server)
            while len(by_server) >= MAX_CLIENT_CONNECTIONS:
                by_server.pop(next(iter(by_server))).close()
            by_server[server] = sock
            return
    sock.close()


def _close_hung_up(by_server: dict[str, socket.socket]) -> None:
    """Close the kept connections that poll readable (hung up); under the connections lock."""
    poller = select.poll()
    by_fd = {}
    for path, kept in by_server.items():
        poller.register(kept, select.POLLIN | select.POLLHUP | select.POLLERR)
        by_fd[kept.fileno()] = path
    for fd, _ in poller.poll(0):
        by_server.pop(by_fd[fd]).close()


def _fetch(
    server: str, pid: int, alloc_id: str, secret: bytes, reply_to: str | None, first: int | None
) -> tuple[Handles | Growth, list[int]]:
    """One ``FETCH`` (``first`` None) or ``GROW`` request: the reply's body and fds (retried
    once on a kept connection the server had closed)."""
    gone = _GONE.format(alloc_id=alloc_id, pid=pid)
    tail = reply_to if reply_to and len(reply_to.encode()) <= MAX_PATH else ""
    kind = Kind.FETCH if first is None else Kind.GROW
    request = Request(kind, alloc_id, secret, first or 0, tail).encode()
    sock = take_connection(server)
    reused = sock is not None
    fds: list[int] = []
    try:
        while True:
            if sock is None:
                sock = _connect(server, gone, pid)
            deadline = time.monotonic() + TIMEOUT  # (the whole reply, its fds included)
            try:
                sock.sendall(request)
                msg, flags = recv_into(sock, 1 << 20, FDS_PER_MESSAGE, fds)
            except (BrokenPipeError, ConnectionResetError):
                msg, flags = b"", 0
            check_truncated(flags)
            if msg or not reused:
                break
            sock.close()  # a kept connection the server had closed: once more, anew
            sock, reused = None, False
        conn = sock  # (the loop ends holding a connection)
        if len(msg) < REPLY_SIZE:
            raise HandleUnavailable(f"{gone} (the server closed the connection)")
        try:
            reply = Reply.decode(msg)
        except PayloadError:
            raise PayloadError(f"{server} is not a sharedarrays handle server") from None
        if reply.status not in (Status.OK, Status.BAD_UID):  # a refusal: the connection
            sock = None  # serves on
            keep_connection(server, conn)
        if reply.status != Status.OK:
            error, message = _REFUSED.get(reply.status, _MALFORMED)
            raise error(message.format(gone=gone, alloc_id=alloc_id, pid=pid, me=os.getpid()))
        more = reply.fds > len(fds)  # (handles in more messages: recv_fds sets the timeout)
        if not recv_fds(conn, reply.fds, fds, deadline):
            raise HandleUnavailable(f"{gone} (the server stopped while sending)")
        if len(fds) != reply.fds:
            raise PayloadError(_INCONSISTENT)
        sock = None
        if more:  # (recv_fds left it at what remained of the deadline)
            conn.settimeout(TIMEOUT)
        keep_connection(server, conn)
        body: Handles | Growth
        if first is None:
            body = Handles.decode(reply.body)
            consistent = len(fds) <= len(body.sizes)
        else:
            body = Growth.decode(reply.body)
            consistent = len(fds) == max(len(body.sizes) - first, 0)
        if not consistent:
            raise PayloadError(_INCONSISTENT)
        result, fds = fds, []
        return body, result
    except SharedArrayError:
        raise
    except OSError as e:  # (TimeoutError too)
        raise _fetch_failed(e, gone, alloc_id, pid) from None
    finally:
        for fd in fds:
            os.close(fd)
        if sock is not None:
            sock.close()


def _fetch_failed(e: OSError, gone: str, alloc_id: str, pid: int) -> HandleUnavailable:
    if isinstance(e, TimeoutError):
        return HandleUnavailable(
            f"the process that shared allocation {alloc_id} (pid {pid}) did not answer (with "
            f"all its handles) within {TIMEOUT:g} s: it is stopped or overloaded. Try again "
            "when it runs"
        )
    if e.errno in (errno.ECONNRESET, errno.EPIPE):
        return HandleUnavailable(gone)
    return HandleUnavailable(
        f"asking the process that shared allocation {alloc_id} (pid {pid}) for its "
        f"handles failed: {e.strerror or e}. Close some files in this process if it has "
        "too many open, and try again"
    )


def take_connection(server: str) -> socket.socket | None:
    """This process's kept connection to ``server``, taken out, or ``None``."""
    with STATE.connections.lock:
        return STATE.connections.by_server.pop(server, None)


at_exit(close_connections, "transport", order=3)  # after the handle server's shutdown


# notices ---------------------------------------------------------------------------------------
def report_load(server: str, alloc_id: str, secret: bytes) -> None:
    """Tell the exporter of exporter-owned memory that one of its payloads loaded here warm
    (counted, sent by the notifier only on a connection already kept to that sender)."""
    key = (server, alloc_id, secret)
    notices = STATE.notices
    with notices.unreported_lock:
        first = not notices.unreported
        notices.unreported[key] = notices.unreported.get(key, 0) + 1
    if first:  # the notifier sends what has gathered by the time it gets to it
        start_notifier()
        notices.in_flight.append(None)
        notices.queue.put(([], []))


def pending_notices() -> int:
    """How many notices this process has queued and not yet sent."""
    return len(STATE.notices.in_flight)


def queue_notice(
    servers: list[str],
    kind: Kind,
    alloc_id: str,
    secret: bytes,
    alloc: Any = None,
    count: int = 0,
    reply_to: str = "",
) -> None:
    """Queue a notice for each of ``servers`` (with ``alloc``: the count of its payloads each
    returned, taken: told once, by this notice or a ``TELL``; else ``count``) and start the
    notifier if it does not run; never blocks."""
    counts = [min(alloc.flight.take_returned(p), 1 << 31) if alloc else count for p in servers]
    messages = [Request(kind, alloc_id, secret, n, reply_to).encode() for n in counts]
    start_notifier()
    STATE.notices.in_flight.append(None)
    STATE.notices.queue.put((servers, messages))


def send_notice(
    server: str, kind: Kind, alloc_id: str, secret: bytes, count: int, reply_to: str
) -> None:
    """Send a notice (one of no reply) from this thread now: it reaches ``server``'s socket
    before anything this thread sends after it, on any channel. Never waits: a connection
    whose buffer is full (the server stopped) is left for a new one, else it is dropped."""
    _send(server, Request(kind, alloc_id, secret, count, reply_to).encode(), timeout=0.0)


def _send_notices(notices: NoticesState) -> None:
    while True:
        servers, messages = notices.queue.get()
        if not servers:  # the warm-load counts gathered by report_load (LOADED: no reply)
            with notices.unreported_lock:
                reports, notices.unreported = notices.unreported, {}
            for (server, alloc_id, secret), count in reports.items():
                # (on a kept connection only: else the sender counts them in flight till the bound)
                _send(server, Request(Kind.LOADED, alloc_id, secret, count).encode(), False)
        for path, message in zip(servers, messages):
            _send(path, message)
        notices.in_flight.pop()


def _send(path: str, message: bytes, connect: bool = True, timeout: float = NOTICE_TIMEOUT) -> None:
    """Send one notice on the connection kept to ``path`` (``connect``: a new one where none
    is kept; replaced once if the server had closed it or, within ``timeout``, not taken it)
    and wait for its reply where its kind has one; a server gone, stopped or overloaded, or
    another user's, is told nothing."""
    replied = Kind(message[:4]).replied
    sock = take_connection(path)
    while sock is not None or connect:
        try:
            if sock is None:  # (a full queue: TimeoutError at once; never another user's)
                connect = False  # (once)
                sock = connect_unix(path, 0.0, timeout, f"the handle server {path}")
            sock.settimeout(timeout)
            sock.sendall(message)
            if replied and not sock.recv(REPLY_SIZE):
                raise ConnectionResetError  # (the server had closed it)
            sock.settimeout(TIMEOUT)
            keep_connection(path, sock)
            return
        except TimeoutError:
            connect = False  # (stopped or overloaded: not asked twice)
        except (OSError, PermissionDenied):
            pass
        if sock is not None:
            sock.close()
        sock = None


def start_notifier() -> None:
    """Start the notices' thread if it does not run (after a fork); none starts at shutdown:
    those it would tell see that the process ended for themselves."""
    notices = STATE.notices
    if notices.thread is None or not notices.thread.is_alive():
        notices.thread = start_thread(_send_notices, "sharedarrays-notices", notices)
