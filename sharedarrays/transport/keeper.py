"""The keeper's client: one connection per process to this user's keeper (started on first
need), which counts it as a holder of what it made or attached; payloads in flight are handed
over on a connection of their own (:func:`hand_over`)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing import spawn
from pathlib import Path
from types import MappingProxyType
from typing import Any

from sharedarrays._cpython import interpreter_flags
from sharedarrays.errors import (
    HandleUnavailable,
    KeeperError,
    NameExists,
    NameNotFound,
    PermissionDenied,
)
from sharedarrays.memory import allocation, registry
from sharedarrays.process import STATE, at_exit, start_thread
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol import unix

TIMEOUT = 10.0  # seconds to wait for the keeper to start or answer, per call and per exit
RETRY = 1.0  # seconds to wait for a keeper that was late before, until it answers again


class NoRoomForFiles(KeeperError):
    """The keeper could not be asked because this process is at its open-files limit."""


def socket_path() -> Path:
    """The keeper's socket in this user's runtime directory."""
    return unix.runtime_dir() / wire.SOCKET_NAME


def _log_path() -> Path:
    return unix.runtime_dir() / "keeper.log"


def _answered(path: str, answered: bool) -> None:
    state = STATE.keeper
    if not answered:
        state.late = path
    elif state.late == path:
        state.late = None


def running_pid() -> int | None:
    """The pid of this user's live keeper, or ``None`` (starts nothing)."""
    try:
        _, body, _ = request(wire.Hello(), start=False)
    except HandleUnavailable:
        return None
    pid = body.get("pid")
    return pid if type(pid) is int else None


def ensure_running() -> int:
    """Start this user's keeper unless one is running; return its pid."""
    _, body, _ = request(wire.Hello())
    return int(body["pid"])


def _launch() -> subprocess.Popen[bytes] | None:
    """Start a keeper in a session of its own, in the runtime directory with only absolute
    ``PYTHONPATH`` entries (no other user's module shadows the standard library)."""
    directory = unix.runtime_dir()
    exe = spawn.get_executable()
    code = "import sys; from sharedarrays.keeper.daemon import main; sys.exit(main())"
    package_root = str(Path(__file__).resolve().parents[2])  # above sharedarrays/
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, *paths])}
    try:
        log = os.open(_log_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as e:  # (ENOSPC, EDQUOT: the keeper could make neither socket nor lock)
        raise HandleUnavailable(
            f"cannot start the sharedarrays keeper: its log {_log_path()} cannot be made "
            f"({e.strerror}). Free space or inodes where the runtime directory is (df -i "
            f"{directory}), or set XDG_RUNTIME_DIR to a private directory (mode 0700) that has "
            "room"
        ) from None
    try:
        proc = subprocess.Popen(
            [exe, *interpreter_flags(), "-c", code],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            cwd=directory,
            start_new_session=True,
        )
    except OSError as e:  # (EAGAIN: no process left for this user; ENOMEM)
        raise HandleUnavailable(
            f"cannot start the sharedarrays keeper ({exe}): {e.strerror or e}. Free some "
            "processes or memory and try again, or start it yourself: python -m sharedarrays "
            "keeper"
        ) from None
    finally:
        os.close(log)
    # reaped if it exits before we do; where no thread starts (at shutdown) init reaps it
    return proc if start_thread(proc.wait, "sharedarrays-keeper-reaper") else None


def _why_it_exited(status: int | None) -> str:
    """Why a keeper exited at start: its log's last line, and a disk-full note."""
    path = _log_path()
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line]
        said = lines[-1][:300] if lines else "(its log is empty)"
    except OSError:
        said = "(its log cannot be read)"
    why = f"the sharedarrays keeper exited as it started (exit status {status}): "
    why += f"{said} (its log: {path})"
    with contextlib.suppress(OSError):
        st = os.statvfs(path.parent)
        if not st.f_bavail or not st.f_favail:
            return (
                f"{why}; the file system of {path.parent} is full (no "
                f"{'space' if not st.f_bavail else 'inode'} left: df -i {path.parent}). Free "
                "room there, or set XDG_RUNTIME_DIR to a private directory (mode 0700) that "
                "has room"
            )
    return why


def _try_connect(path: str, deadline: float) -> socket.socket | None:
    """A connection to the keeper at ``path``, or ``None`` where none listens there."""
    wait = max(deadline - time.monotonic(), 0.001)
    try:
        return unix.connect_unix(path, deadline, wait, f"the keeper {path}")
    except TimeoutError:
        _answered(path, False)
        raise KeeperError(
            f"the keeper ({path}) did not accept a connection within {wait:g} s: it is "
            "overloaded or stopped. Try again; python -m sharedarrays status shows it"
        ) from None
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except PermissionDenied:  # (another user's)
        raise
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise NoRoomForFiles(
                f"cannot open a socket to the keeper: {e.strerror}. Close some files in this "
                "process (or raise its ulimit -n) and try again"
            ) from None
        raise KeeperError(f"cannot connect to the keeper {path}: {e.strerror or e}") from None


def _relisting_keeper(directory: Path) -> bool:
    """Whether a keeper of this user runs in ``directory`` (its working directory) or in one
    removed at that path: it listens there again within a quarter second (keeper/daemon.py)."""
    names = (str(directory), f"{directory} (deleted)")
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):  # (gone, or another user's)
                if os.readlink(f"/proc/{entry}/cwd") in names:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if b"sharedarrays.keeper.daemon" in f.read():
                            return True
    return False


def _open(path: str, start: bool, deadline: float) -> socket.socket:
    """A new connection to the keeper at ``path`` by ``deadline``, starting one if ``start``
    (a keeper whose socket was removed listens again: waited for, not started again)."""
    sock = _try_connect(path, deadline)
    if sock is None and _relisting_keeper(Path(path).parent):
        wait = min(deadline, time.monotonic() + 1.0)
        while sock is None and time.monotonic() < wait:
            time.sleep(0.02)
            sock = _try_connect(path, deadline)
    if sock is None and start:
        proc = _launch()
        while sock is None and time.monotonic() < deadline:
            time.sleep(0.02)
            sock = _try_connect(path, deadline)
            if sock is None and proc is not None and proc.poll() is not None:
                sock = _try_connect(path, deadline)  # (another keeper may have started)
                if sock is None:  # it failed as it started (a bad setting, say): say why
                    raise HandleUnavailable(_why_it_exited(proc.returncode))
    if sock is None:
        if start:
            _answered(path, False)
        raise HandleUnavailable(
            "no sharedarrays keeper is running for this user"
            + (f" (it did not start in time; see {_log_path()})" if start else "")
        )
    return sock


def disconnect(wait: float = -1) -> None:
    """Close this process's connection to the keeper, waiting at most ``wait`` seconds."""
    state = STATE.keeper
    if not state.lock.acquire(timeout=wait):
        return
    try:
        if state.conn is not None:
            state.conn.close()
        state.conn = state.path = None
        state.held.clear()
    finally:
        state.lock.release()


def request(
    req: wire.Request, fds: Sequence[int] = (), start: bool = True
) -> tuple[int, dict[str, Any], list[int]]:
    """Send one request to the keeper; return ``(status, body, fds)``, the fds the caller's.
    HandleUnavailable where none runs (or starts), KeeperError where it did not answer well."""
    data = req.encode()
    state = STATE.keeper
    with state.lock:
        _flush_deferred()
        for attempt in (1, 2, 3):
            path = str(socket_path())
            wait = RETRY if state.late == path else TIMEOUT
            if state.conn is None or state.path != path:
                disconnect()
                state.conn, state.path = _open(path, start, time.monotonic() + wait), path
            sock = state.conn
            if sock.gettimeout() != wait:
                sock.settimeout(wait)
            got: list[int] = []
            reply = None
            try:
                try:
                    unix.send_fds(sock, data, fds)
                    msg, flags = unix.recv_into(sock, wire.MAX_MESSAGE, wire.MAX_FDS, got)
                except BaseException as e:
                    disconnect()  # (an interrupt too: its reply would be read as the next's)
                    if isinstance(e, TimeoutError):
                        _answered(path, False)
                        raise KeeperError(
                            f"the keeper did not answer within {wait:g} s: it is overloaded or "
                            "stopped. The request was sent and may still be carried out when "
                            "it resumes: see python -m sharedarrays status and ls --all before "
                            "trying it again"
                        ) from None
                    if not isinstance(e, OSError):
                        raise
                    if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN) and attempt < 3:
                        continue
                    raise KeeperError(f"asking the keeper failed: {e.strerror or e}") from None
                reply = _reply(sock, msg, flags, got, path, wait, len(fds))
            finally:
                if reply is None:  # (an error, an interrupt, an end of file: not the caller's)
                    for fd in got:
                        os.close(fd)
            if reply is not None:
                return reply.status, reply.body, got
            disconnect()  # the keeper exited (idle) or died: reconnect, maybe restart
    raise KeeperError("the keeper closed the connection three times; try again")


def _reply(
    sock: socket.socket, msg: bytes, flags: int, got: list[int], path: str, wait: float, sent: int
) -> wire.Reply | None:
    """The reply in ``msg``, its later fds appended to ``got``; ``None`` at end of file."""
    if flags & socket.MSG_CTRUNC:  # (the kernel dropped fds: this process's fd table is full)
        raise NoRoomForFiles(
            "this process has no room for the handles the keeper sent: it has as many files "
            "open as its limit allows (ulimit -n). Close some and try again"
        )
    if not msg:
        return None
    reply = wire.Reply.decode(msg)
    _answered(path, True)
    if sent > wire.MAX_FDS and reply.status == wire.ERROR:
        disconnect()  # (refused before its last fds came: read as requests)
    sizes = reply.body.get("sizes")
    if len(got) != wire.MAX_FDS or type(sizes) is not list or len(sizes) <= wire.MAX_FDS:
        return reply
    try:  # the fds of an attach or fetch past the first message's
        if not unix.recv_fds(sock, len(sizes), got, time.monotonic() + wait):
            raise EOFError("it stopped")
        sock.settimeout(wait)  # (recv_fds left it at what remained)
    except (OSError, EOFError, HandleUnavailable) as e:
        disconnect()
        raise KeeperError(f"the keeper did not send all the handles: {e}") from None
    return reply


def hand_over(alloc: allocation.Allocation, loads: int, seconds: float) -> None:
    """Give the keeper ``alloc``'s handles for ``loads`` payloads in flight, for ``seconds``,
    on a connection of its own (this runs from finalizers, in any thread)."""
    path = str(socket_path())
    now = time.monotonic()
    began, left = STATE.keeper.exit_wait or (now, TIMEOUT)
    deadline = began + min(left, RETRY if STATE.keeper.late == path else TIMEOUT)
    if deadline <= now:
        raise KeeperError(
            f"the keeper did not answer in time earlier at this exit, which waits for it "
            f"{TIMEOUT:g} s at most in all"
        )
    doc = {"backend": alloc.backend.name, "device": alloc.device.index}
    doc.update(readonly=alloc.export_readonly, used=alloc.used)  # (used: the bytes asked for)
    allow = None if alloc.allow_pids is None else sorted(alloc.allow_pids)
    flight = wire.InFlight(min(loads, 1 << 31), min(seconds, wire.MAX_IN_FLIGHT))
    data = wire.Keep(alloc.id, alloc.secret, None, alloc.chunk_sizes(), doc, allow, flight).encode()
    handles, temporary = alloc.handles_for_importers()  # read-only ones for readonly arrays
    got: list[int] = []  # (none are expected: closed, whatever happens)
    try:
        with _open(path, True, deadline) as sock:
            unix.send_fds(sock, data, handles)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            msg, _ = unix.recv_into(sock, wire.MAX_MESSAGE, wire.MAX_FDS, got)
    except TimeoutError:
        _answered(path, False)
        raise KeeperError(
            f"the keeper did not take the handles within {deadline - now:.3g} s: it is "
            "stopped or overloaded"
        ) from None
    except OSError as e:
        raise KeeperError(f"the keeper did not take the handles: {e}") from None
    finally:
        for fd in [*temporary, *got]:
            os.close(fd)
    reply = wire.Reply.decode(msg)
    _answered(path, True)
    raise_for(reply.status, reply.body, f"the keeper refused allocation {alloc.id}")


def _hand_over_at_exit() -> None:
    """At exit: hand what was pickled since the last run and is in flight to the keeper."""
    state = STATE.keeper
    began = time.monotonic()
    left = TIMEOUT if state.exit_left is None else state.exit_left
    state.exit_wait = (began, left)
    failed: list[tuple[int, str]] = []
    try:
        # (and the released blocks that wait for their importers: memory/cache.py)
        for alloc in registry.live_allocations() + registry.draining_allocations():
            failure = None if alloc.id in state.said else alloc.hand_over(say=False)
            if failure is not None:
                state.said.add(alloc.id)
                failed.append(failure)
    finally:
        state.exit_wait = None
        state.exit_left = max(0.0, left - (time.monotonic() - began))
    if failed:  # (one line for all: a keeper out of room refuses every one alike)
        more = ""
        if len(failed) > 1:
            payloads = sum(count for count, _ in failed[1:])
            more = f" (and {payloads} payload(s) of {len(failed) - 1} more allocation(s), alike)"
        print(failed[0][1] + more, file=sys.stderr)


def _close_at_exit() -> None:
    disconnect(wait=1.0)  # (unless another thread's request holds it over 1 s)


def refusal(what: str, error: object) -> str:
    """The message of a keeper's refusal, noting a keeper older than this library."""
    message = f"{what}: {error}"
    if "unknown op" in str(error):
        message += (
            f"; the running keeper (pid {running_pid()}) predates this version of "
            "sharedarrays: stop it once it holds nothing you need (kill PID), and the next "
            "use starts a new one"
        )
    return message


_ERRORS = MappingProxyType(
    {wire.NOT_FOUND: NameNotFound, wire.EXISTS: NameExists, wire.DENIED: PermissionDenied}
)


def raise_for(status: int, body: dict[str, Any], what: str) -> None:
    """Turn a keeper reply's status into the library's exception (OK returns)."""
    if status != wire.OK:
        raise _ERRORS.get(status, KeeperError)(refusal(what, body.get("error", "refused")))


def hold(alloc_id: str) -> None:
    """Note that the keeper counts this process as a holder of ``alloc_id``."""
    with STATE.keeper.lock:
        _flush_deferred()  # first: a deferred release of the same id predates this hold
        STATE.keeper.held.add(alloc_id)


def release(alloc_id: str) -> None:
    """Tell the keeper this process no longer holds ``alloc_id``: never blocks (finalizers
    call it), sent later where another thread asks the keeper."""
    lock = STATE.keeper.lock
    STATE.keeper.deferred.append(alloc_id)
    if lock.acquire(blocking=False):
        try:
            _flush_deferred()
        finally:
            lock.release()


def _flush_deferred() -> None:
    """Send the releases deferred by :func:`release` (the caller holds the lock)."""
    state = STATE.keeper
    while state.deferred:
        alloc_id = state.deferred.pop()
        if alloc_id in state.held:
            state.held.discard(alloc_id)
            if state.conn is not None:
                with contextlib.suppress(OSError):
                    state.conn.send(wire.Release(alloc_id).encode())


def fetch_handles(
    alloc_id: str, secret: bytes, gone: HandleUnavailable
) -> tuple[list[int], list[int], bool]:
    """``(sizes, fds, relayed)`` of an allocation a running keeper holds, which then counts
    this process as a holder: HandleUnavailable (``gone``, noted) where it holds none."""
    try:
        status, body, fds = request(wire.Fetch(alloc_id, secret), start=False)
    except HandleUnavailable:
        raise HandleUnavailable(f"{gone}; no keeper holds it either (see a.park())") from None
    except NoRoomForFiles as e:  # (the cause, said first: the keeper may well hold it)
        raise HandleUnavailable(f"{e} (allocation {alloc_id}; its exporter: {gone})") from None
    except KeeperError as e:
        raise HandleUnavailable(f"{gone}; nor could the keeper be asked: {e}") from None
    try:
        if status == wire.NOT_FOUND:
            raise HandleUnavailable(f"{gone}; the keeper does not hold it either") from None
        raise_for(status, body, f"the keeper refused allocation {alloc_id}")
        hold(alloc_id)
        sizes, creator = body.get("sizes"), body.get("creator")
        if (
            type(sizes) is not list
            or len(sizes) != len(fds)
            or not all(type(n) is int and n > 0 for n in sizes)
            or type(creator) is not int
        ):
            release(alloc_id)
            raise KeeperError("the keeper sent an inconsistent reply")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return sizes, fds, body.get("relayed") is True


def _on_release(alloc: allocation.Allocation) -> None:
    if alloc.pid == os.getpid():
        release(alloc.id)


STATE.memory.release_hooks.append(_on_release)
STATE.memory.hand_over_hooks.append(hand_over)
at_exit(_hand_over_at_exit, "transport", order=0)
at_exit(_close_at_exit, "transport", order=4, processes=False)  # after the hand-over
