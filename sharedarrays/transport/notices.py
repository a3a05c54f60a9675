"""Notices: what this process tells other processes' handle servers, off-thread.

Finalizers must never block, so the notices they cause are queued here (``STATE.notices``)
and sent by one daemon thread, each only to a peer of this user (it carries the secret).
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any

from sharedarrays.errors import PermissionDenied
from sharedarrays.process import STATE
from sharedarrays.protocol.handles import REPLY_SIZE, Kind, Request
from sharedarrays.protocol.unix import check_same_user
from sharedarrays.sections import NoticesState
from sharedarrays.transport import client


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


def _send_reports() -> None:
    """Send the warm-load counts gathered by :func:`report_load` (in the notifier thread)."""
    notices = STATE.notices
    with notices.unreported_lock:
        reports, notices.unreported = notices.unreported, {}
    for (server, alloc_id, secret), count in reports.items():
        sock = client.take_connection(server)
        if sock is None:
            continue  # (the sender counts them in flight until the bound: the safe side)
        try:
            sock.send(Request(Kind.LOADED, alloc_id, secret, count).encode())
        except OSError:
            sock.close()
            continue
        client.keep_connection(server, sock)


def pending_notices() -> int:
    """How many release and close notices this process has queued and not yet sent."""
    return len(STATE.notices.in_flight)


def queue_notice(
    servers: list[str],
    kind: Kind,
    alloc_id: str,
    secret: bytes,
    alloc: Any = None,
    count: int = 0,
) -> None:
    """Queue a notice for each of ``servers`` (``RELEASED``: with the count of ``alloc``'s
    payloads each returned) and start the notifier if it does not run; never blocks."""
    if kind is Kind.RELEASED:
        messages = [
            Request(
                kind, alloc_id, secret, min(alloc.flight.returned(path) if alloc else 0, 1 << 31)
            ).encode()
            for path in servers
        ]
    else:
        messages = [Request(kind, alloc_id, secret, count).encode()] * len(servers)
    start_notifier()
    notices = STATE.notices
    notices.in_flight.append(None)
    notices.queue.put((servers, messages))


NOTICE_TIMEOUT = 1.0  # seconds the notifier waits for a handle server to take one notice


def _send_notices(notices: NoticesState) -> None:
    while True:
        servers, messages = notices.queue.get()
        if not servers:  # (queued by report_load)
            _send_reports()
        for path, message in zip(servers, messages):
            _send(path, message)
        notices.in_flight.pop()


def _send(path: str, message: bytes) -> None:
    """Send one notice and wait for its reply, on the connection kept to ``path`` (replaced
    once if the server had closed it); a process that is gone, or another user's, is told
    nothing."""
    sock = client.take_connection(path)
    reused = sock is not None
    while True:
        try:
            if sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                sock.settimeout(NOTICE_TIMEOUT)
                sock.connect(path)
                # (it carries the secret: never to another user's socket)
                check_same_user(sock, f"the handle server {path}")
            else:
                sock.settimeout(NOTICE_TIMEOUT)
            sock.sendall(message)
            if sock.recv(REPLY_SIZE):
                sock.settimeout(client.TIMEOUT)
                client.keep_connection(path, sock)
                return
        except TimeoutError:
            reused = False  # (stopped or overloaded: not asked twice)
        except (OSError, PermissionDenied):
            pass
        if sock is not None:
            sock.close()
        if not reused:
            return
        sock, reused = None, False


def start_notifier() -> None:
    """Start the thread that sends release notices, if it does not run (after a fork)."""
    notices = STATE.notices
    if sys.is_finalizing():  # no thread starts now (it would hang): the process is ending,
        return  # and those it would tell see that for themselves
    if notices.thread is None or not notices.thread.is_alive():
        notifier = threading.Thread(
            target=_send_notices, args=(notices,), name="sharedarrays-notices", daemon=True
        )
        try:
            notifier.start()
        except RuntimeError:  # at interpreter shutdown (3.12: no new threads)
            return
        notices.thread = notifier
