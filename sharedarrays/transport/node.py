"""Asking every process of this user on the node what it holds; dropping what no view uses.
Each socket is asked once, with a short timeout: a process that does not answer is reported,
never waited for. Nothing here maps memory or sees a secret."""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass
from typing import Any

from sharedarrays.errors import KeeperError, PayloadError, PermissionDenied
from sharedarrays.process import running
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol.handles import REPLY_SIZE, Kind, Reply, Request, Snapshot, Status
from sharedarrays.protocol.unix import check_same_user, connect_unix, runtime_dir, socket_pid

ASK_TIMEOUT = 1.0  # seconds one process is given to accept and answer
ASK_AT_ONCE = 32  # handle servers asked at the same time at most (one thread each)

_NO_ID = "0" * 32
_NO_SECRET = bytes(32)


@dataclass(frozen=True)
class Answer:
    """A handle server's answer: ``status`` ``ok`` (``snapshot``), gone, no answer or refused."""

    pid: int
    path: str
    status: str
    snapshot: Snapshot | None = None


@dataclass(frozen=True)
class KeeperAnswer:
    """What the keeper answered: ``status``, its pid and the arrays it holds."""

    status: str
    pid: int | None = None
    arrays: tuple[dict[str, Any], ...] = ()


def handle_servers() -> list[tuple[int, str]]:
    """The handle server sockets in this user's runtime directory: ``(pid, path)``, by pid."""
    found = ((socket_pid(entry), str(entry)) for entry in runtime_dir().glob("*.sock"))
    return sorted((pid, path) for pid, path in found if pid is not None)


def _exchange(path: str, request: bytes, size: int, timeout: float, pids: list[int]) -> bytes:
    """``request`` sent on a new connection to ``path``, the reply read; ``pids`` gets the
    peer's pid once it is checked to run as this user."""
    with connect_unix(path, time.monotonic() + timeout, timeout) as sock:
        pids.append(check_same_user(sock, path).pid)
        sock.send(request)
        return sock.recv(size)


def _ask(path: str, request: Request, timeout: float) -> tuple[int, Reply]:
    """Send ``request`` to the handle server at ``path``: its pid and its reply."""
    pids: list[int] = []
    msg = _exchange(path, request.encode(), 1 << 20, timeout, pids)
    if len(msg) < REPLY_SIZE:
        raise ConnectionResetError("closed without a reply")
    return pids[0], Reply.decode(msg)


def ask(pid: int, path: str, timeout: float = ASK_TIMEOUT) -> Answer:
    """Ask the handle server at ``path`` (of process ``pid``) for its snapshot."""
    try:
        peer, reply = _ask(path, Request(Kind.SNAPSHOT, _NO_ID, _NO_SECRET), timeout)
        if reply.status != Status.OK or peer != pid:
            return Answer(pid, path, "refused")
        return Answer(pid, path, "ok", Snapshot.decode(reply.body))
    except (PermissionDenied, PayloadError):
        return Answer(pid, path, "refused")
    except OSError:  # (a timeout too)
        return Answer(pid, path, "no answer" if running(pid) else "gone")


def ask_all(timeout: float = ASK_TIMEOUT) -> list[Answer]:
    """Ask every other handle server of this user for its snapshot, by pid, in parallel."""
    servers = [(pid, path) for pid, path in handle_servers() if pid != os.getpid()]
    if len(servers) <= 1:
        return [ask(pid, path, timeout) for pid, path in servers]
    from concurrent.futures import ThreadPoolExecutor  # (not at import: it loads logging)

    workers = min(ASK_AT_ONCE, len(servers))
    with ThreadPoolExecutor(workers, thread_name_prefix="sharedarrays-ask") as pool:
        return list(pool.map(lambda server: ask(server[0], server[1], timeout), servers))


def drop_mapping(pid: int, alloc_id: str, timeout: float = ASK_TIMEOUT) -> Status | None:
    """Ask process ``pid`` to drop its parked ``alloc_id``: its status, ``None`` without one."""
    path = next((p for server, p in handle_servers() if server == pid), None)
    if path is None:
        return None
    try:
        _, reply = _ask(path, Request(Kind.DROP, alloc_id, _NO_SECRET), timeout)
        return Status(reply.status)
    except (OSError, PermissionDenied, PayloadError, ValueError):
        return None


def settle(paths: list[str], timeout: float = ASK_TIMEOUT, asker: str = "") -> list[str]:
    """Have the handle servers at ``paths`` read what was sent to them so far (``SETTLE``),
    or, with ``asker`` (this process's server), send it ``LOADED`` for the warm loads there of
    this process's payloads (``TELL``); all asked at once, the paths that did not answer in
    ``timeout`` seconds (a stopped process) returned."""
    request = Request(Kind.TELL if asker else Kind.SETTLE, _NO_ID, _NO_SECRET, reply_to=asker)
    deadline = time.monotonic() + timeout
    silent, waiting = [], {}
    for path in paths:
        try:  # (a full accept queue, a stopped process's: silent at once, not waited for)
            sock = connect_unix(path, 0.0, timeout, f"the handle server {path}")
        except (OSError, PermissionDenied):
            silent.append(path)
            continue
        try:
            sock.send(request.encode())
            waiting[sock.fileno()] = (path, sock)
        except OSError:
            sock.close()
            silent.append(path)
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting and (left := deadline - time.monotonic()) > 0:
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            path, sock = waiting.pop(fd)
            with sock:
                try:
                    if Reply.decode(sock.recv(REPLY_SIZE)).status == Status.OK:
                        continue
                except (OSError, PayloadError):
                    pass
            silent.append(path)
    for path, sock in waiting.values():
        sock.close()
        silent.append(path)
    return silent


def _keeper_request(
    request: wire.List | wire.Drop, timeout: float, pids: list[int]
) -> tuple[int, dict[str, Any]]:
    """One request on a new keeper connection; ``pids`` gets the keeper's pid."""
    path = str(runtime_dir() / wire.SOCKET_NAME)
    msg = _exchange(path, request.encode(), wire.MAX_MESSAGE, timeout, pids)
    if not msg:
        raise ConnectionResetError("the keeper closed the connection")
    reply = wire.Reply.decode(msg)
    return reply.status, reply.body


def ask_keeper(timeout: float = ASK_TIMEOUT) -> KeeperAnswer:
    """The arrays this user's keeper holds (``status`` ``"none"`` when none runs)."""
    pids: list[int] = []
    try:
        status, body = wire.list_pages(lambda req: _keeper_request(req, timeout, pids))
    except (TimeoutError, BlockingIOError):  # (connected, but stopped or busy: its pid)
        return KeeperAnswer("no answer", pids[0] if pids else None)
    except (PermissionDenied, KeeperError):
        return KeeperAnswer("refused")
    except OSError:  # (no keeper listens)
        return KeeperAnswer("none")
    arrays = body.get("arrays")
    if status != wire.OK or type(arrays) is not list or not all(type(a) is dict for a in arrays):
        return KeeperAnswer("refused", pids[0])
    return KeeperAnswer("ok", pids[0], tuple(arrays))


def drop_kept(alloc_id: str, timeout: float = ASK_TIMEOUT) -> tuple[int, str]:
    """Ask the keeper to let go of ``alloc_id``: its status and error (or KeeperError)."""
    try:
        status, body = _keeper_request(wire.Drop(alloc_id), timeout, [])
    except (OSError, PermissionDenied) as e:
        raise KeeperError(f"the keeper cannot be asked: {e}") from None
    return status, str(body.get("error", ""))
