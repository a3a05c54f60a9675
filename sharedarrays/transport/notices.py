"""Notices: what this process tells other processes' handle servers, off-thread.

A finalizer (a view's lease going away, an allocation released) must never block, so the
messages it causes are queued here and sent by one daemon thread, the notifier:

* ``RELEASED``: this process released an allocation it served to others (they drop their
  parked mappings of it), with how many of their payloads it loaded;
* ``CLOSED``: this process closed its import of exporter-owned memory (cuda-ipc, cuda-pool),
  so that its exporter may free it;
* ``LOADED``: warm-load counts (:func:`report_load`), sent on kept connections, no reply.

Each carries the allocation's secret, so each goes only to a socket whose peer runs as this
user (``SO_PEERCRED``, as every connection of the handle server's client is checked).
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any

from sharedarrays.errors import PermissionDenied
from sharedarrays.process import STATE, NoticesState
from sharedarrays.protocol.handles import REPLY_SIZE, Kind, Request
from sharedarrays.protocol.unix import check_same_user
from sharedarrays.transport import client

__all__ = ["report_load", "pending_notices", "queue_notice", "start_notifier"]

# (the state, ``STATE.notices``: the queue, the thread, the warm loads not yet reported)


def report_load(server: str, alloc_id: str, secret: bytes) -> None:
    """Tell the exporter of exporter-owned memory (cuda-ipc, cuda-pool), whose handle server
    is ``server``, that this process loaded one of its payloads from a mapping it already
    had, so that it does not wait for that payload (:meth:`Allocation.in_flight`). (Not done
    for other memory: it costs the warm handoff about 80 us on the H200, two threads woken.)

    Counted here and sent by the notifier thread, one message (``SAL1`` with the count, no
    reply) per sender and allocation for all the loads since the last, and only on a
    connection this process keeps to that sender (a warm handoff connects to nothing)."""
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
    """How many release and close notices this process has queued and not yet sent (each
    holds a socket open while it is sent)."""
    return len(STATE.notices.in_flight)


def queue_notice(
    servers: list[str],
    kind: Kind,
    alloc_id: str,
    secret: bytes,
    alloc: Any = None,
    count: int = 0,
) -> None:
    """Queue a notice (``RELEASED``, ``CLOSED`` or ``DONE`` with ``count``) for the notifier
    thread. Never blocks: it runs from finalizers.

    A release notice tells each server how many of its process's payloads of ``alloc`` this
    process loaded (:meth:`Allocation.returned`)."""
    if kind is Kind.DONE:
        messages = [Request(kind, alloc_id, secret, count).encode()]
    elif kind is Kind.ASK:
        messages = [Request(kind, alloc_id, secret).encode()] * len(servers)
    elif kind is Kind.RELEASED:
        messages = [
            Request(
                kind, alloc_id, secret, min(alloc.flight.returned(path) if alloc else 0, 1 << 31)
            ).encode()
            for path in servers
        ]
    else:
        messages = [Request(kind, alloc_id, secret).encode()] * len(servers)
    notices = STATE.notices
    notices.in_flight.append(None)
    notices.queue.put((servers, messages))


def _send_notices(notices: NoticesState) -> None:
    while True:
        servers, messages = notices.queue.get()
        if not servers:  # (queued by report_load)
            _send_reports()
        for path, message in zip(servers, messages):
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
                try:
                    sock.settimeout(1.0)
                    sock.connect(path)
                    # (a notice carries the allocation's secret: never to a socket that
                    # another user listens on, whatever path an importer gave as its own)
                    check_same_user(sock, f"the handle server {path}")
                    sock.sendall(message)
                    sock.recv(REPLY_SIZE)
                except (OSError, PermissionDenied):
                    continue  # that process is gone (or another user's): nothing to tell
        notices.in_flight.pop()


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
