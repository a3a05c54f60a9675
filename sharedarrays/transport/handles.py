"""This process's handle server at start and exit, and the memory layer's hooks that queue
notices (release, DONE, ASK). Nothing here knows about arrays."""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from collections.abc import Iterable

from sharedarrays.errors import HandleUnavailable
from sharedarrays.memory import allocation, registry
from sharedarrays.memory.cache import DONE_WAIT, block_id
from sharedarrays.process import STATE, at_exit, running
from sharedarrays.protocol.handles import Kind
from sharedarrays.protocol.unix import MAX_PATH, runtime_dir, socket_pid
from sharedarrays.settings import env_number
from sharedarrays.transport import client
from sharedarrays.transport.node import handle_servers, settle
from sharedarrays.transport.server import HandleServer, tell_loads

SETTLE_TIMEOUT = 0.5  # seconds a hand-over waits for those served, then its own server


def server_address() -> str:
    """The path of this process's handle server, starting it on first call: PermissionDenied
    without a private runtime directory, HandleUnavailable where its socket cannot be made."""
    state = STATE.server
    server: HandleServer | None = state.server
    if server is not None:
        return server.path
    with state.lock:
        if state.server is None:
            try:
                state.server = HandleServer()
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    what = (
                        f"Free space or inodes there (df -i {runtime_dir()}), or set "
                        "XDG_RUNTIME_DIR to a private directory (mode 0700) that has room"
                    )
                else:
                    what = (
                        f"Unix socket paths are limited to {MAX_PATH} bytes: set "
                        "XDG_RUNTIME_DIR to a short private directory, or close some files"
                    )
                raise HandleUnavailable(
                    f"cannot start this process's handle server in {runtime_dir()}: "
                    f"{e.strerror or e}. {what}"
                ) from None
            client.start_notifier()  # (now: release hooks may run in a finalizer)
            STATE.memory.takeable.open()  # (with the server: files a process keeps for life)
        return str(state.server.path)


def shutdown_server() -> None:
    """Stop this process's handle server (at exit; importers then get HandleUnavailable)."""
    state = STATE.server
    with state.lock:
        if state.server is not None:
            state.server.close()
            state.server = None


at_exit(shutdown_server, "transport", order=2, processes=False)


def open_connections() -> int:
    """How many sockets this process keeps open for handle traffic, both directions."""
    server: HandleServer | None = STATE.server.server
    return len(STATE.connections.by_server) + (len(server.conns) if server is not None else 0)


def _notify_on_release(alloc: allocation.Allocation) -> None:
    """Queue notices that ``alloc`` was released here, to whoever it was served or imported from."""
    if alloc.pid != os.getpid():
        return  # inherited across fork: the parent still holds it
    if alloc.backend.exporter_owned and not alloc.origin.created_here and alloc.source_server:
        client.queue_notice([alloc.source_server], Kind.CLOSED, alloc.id, alloc.secret)
    # a block's import unmapped (evicted): its loads are closed, unless the keeper now holds
    # the memory for payloads of it in flight (then the exporter must not reuse it)
    if alloc.pool_server is not None and not alloc.flight.was_handed_over:
        _notify_done(alloc, alloc.flight.take_block_loads())
    server: HandleServer | None = STATE.server.server
    own = server.path if server is not None else None
    servers = [p for p in alloc.served_servers() if p != own]
    block = alloc.block if alloc.origin.created_here else None
    if servers:  # a block kept for reuse goes by its token: importers may know an older id
        key = (alloc.id, alloc.secret) if block is None else (block_id(block), block)
        client.queue_notice(servers, Kind.RELEASED, *key, alloc)


def _notify_done(alloc: allocation.Allocation, loads: int) -> None:
    """Tell a block's exporter that its last view here closed, after ``loads`` payloads."""
    if alloc.pool_server is not None and loads:
        client.queue_notice([alloc.pool_server], Kind.DONE, alloc.id, alloc.secret, count=loads)


def _ask_done(alloc: allocation.Allocation, servers: list[str]) -> None:
    """Ask ``servers`` to say ``DONE`` when their last view of the released block ``alloc`` goes
    (and tell each how many of its payloads came back here: not in flight there any more)."""
    block = alloc.block
    if block is None:
        return
    for server in servers:
        count = min(alloc.flight.take_returned(server), 1 << 31)
        client.queue_notice([server], Kind.ASK, block_id(block), block, count=count)


def ask_done_before_exit(pids: Iterable[int]) -> None:
    """Ask processes ``pids`` (a pool's idle workers about to stop) to say ``DONE`` for the
    blocks made here that they loaded, and wait for it (at most ``DONE_WAIT`` seconds), and to
    tell their warm loads of this process's other arrays (``TELL``): warm loads are told only
    when asked, and a process stopped unasked leaves the memory out of reuse, or with the
    keeper, until the in-flight bound. (Their own arrays: each asks at its exit hand-over.)"""
    pids = set(pids)
    with STATE.memory.lock:
        live = list(STATE.memory.registry.values())
    blocks = [a for a in live if a.cacheable()]
    # (each worker's server, served or not: one that took the fds may not have said so yet)
    theirs = [path for pid, path in handle_servers() if pid in pids]
    if any(a.in_flight()[0] for a in live):
        gather_loads(theirs)  # (this process's arrays they loaded warm: told now or never)
    asked = []
    for alloc in blocks:
        servers = sorted({*theirs, *(s for s in alloc.served_servers() if socket_pid(s) in pids)})
        if servers and alloc.flight.undone()[0]:
            _ask_done(alloc, servers)
            asked.append(alloc)
    deadline = time.monotonic() + DONE_WAIT
    while time.monotonic() < deadline and any(a.flight.undone()[0] for a in asked):
        time.sleep(0.002)


def gather_loads(servers: Iterable[str]) -> None:
    """Have ``servers`` (processes served this process's memory) tell their warm loads of its
    payloads, and this process's own server read that and every ``TOOK`` sent to it so far:
    payloads loaded stop counting in flight. Not asked from the server's own thread (which
    would wait for itself), nor of a server that once left it unanswered (an exit with many
    arrays in flight must not wait for it each time); :data:`SETTLE_TIMEOUT` for the others
    (asked at once), and as long for this process's own."""
    server: HandleServer | None = STATE.server.server
    if server is None or threading.current_thread() is server.thread:
        return
    own, silent = server.path, server.silent
    asked = [p for p in servers if p not in silent and p != own and running(socket_pid(p) or 0)]
    silent.update(settle(asked, SETTLE_TIMEOUT, asker=own))  # (all at once)
    if own not in silent:
        silent.update(settle([own], SETTLE_TIMEOUT))


def _gather_served(alloc: allocation.Allocation) -> None:
    gather_loads(alloc.served_servers())


STATE.memory.release_hooks.append(_notify_on_release)
STATE.memory.settle_hooks.append(_gather_served)
STATE.memory.done_hooks.append(_notify_done)
STATE.memory.ask_hooks.append(_ask_done)

EXIT_WAIT = 10.0  # seconds to wait at exit for importers (SHAREDARRAYS_EXIT_WAIT)


def _drain_at_exit() -> None:
    """At exit: wait for importers of exporter-owned memory made here, naming those left (a
    second run waits only for what is left of the first's bound)."""
    state = STATE.server
    held = registry.held_elsewhere()
    if not held:
        return
    for alloc in held:  # its importers may have it parked (also those served since the
        servers = alloc.served_servers()  # release, which loaded payloads in flight)
        if servers:
            client.queue_notice(servers, Kind.RELEASED, alloc.id, alloc.secret, alloc)
    if state.drain_bound is None:
        try:
            timeout = env_number("SHAREDARRAYS_EXIT_WAIT", EXIT_WAIT, 0.0)
        except ValueError as e:  # at exit: say so, and wait the default
            print(f"sharedarrays: {e}; waiting {EXIT_WAIT:g} s", file=sys.stderr)
            timeout = EXIT_WAIT
        state.drain_bound = (time.monotonic() + timeout, timeout)
    ends, timeout = state.drain_bound
    waited = registry.wait_draining(max(0.0, ends - time.monotonic()))
    left = [a for a in waited if a.id not in state.drain_said]
    state.drain_said.update(a.id for a in left)
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
at_exit(tell_loads, "transport")  # (before the drain waits: exporters learn what loaded here)
