"""The keeper's client: what every process that names, parks, attaches or lists arrays
runs to talk to this user's keeper (:mod:`sharedarrays.keeper`, started here on first need).

Each process keeps **one connection** to the keeper (:func:`request`), through which the
keeper counts it as a holder of what it created, attached or fetched (:func:`hold`,
:func:`release`); payloads in flight are handed over on a connection of their own
(:func:`hand_over`). The messages are :mod:`sharedarrays.protocol.keeper`'s records.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing import spawn
from pathlib import Path
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
from sharedarrays.process import STATE, at_exit
from sharedarrays.protocol.keeper import (
    DENIED,
    ERROR,
    EXISTS,
    LOCK_NAME,
    MAX_FDS,
    MAX_IN_FLIGHT,
    MAX_MESSAGE,
    NOT_FOUND,
    OK,
    SOCKET_NAME,
    Fetch,
    Hello,
    InFlight,
    Keep,
    Release,
    Reply,
    Request,
)
from sharedarrays.protocol.unix import (
    check_same_user,
    check_truncated,
    connect_unix,
    recv_fds,
    recv_into,
    runtime_dir,
    send_fds,
)

__all__ = [
    "TIMEOUT",
    "RETRY",
    "socket_path",
    "lock_path",
    "ensure_running",
    "running_pid",
    "request",
    "raise_for",
    "refusal",
    "hold",
    "release",
    "hand_over",
    "fetch_handles",
    "disconnect",
    "NoRoomForFiles",
]

TIMEOUT = 10.0
"""Seconds a client waits for the keeper to start or to answer: the most one call waits (a
request; a close that hands its payloads in flight over), and the most one exit waits in
all (its hand-overs share it). Once the keeper did not answer in time, :data:`RETRY`."""
RETRY = 1.0
"""Seconds a client waits, per call and per exit, for a keeper that did not answer it in
time before (stopped or overloaded), until it answers again: a stopped keeper costs a
process :data:`TIMEOUT` once, not at every close."""


def socket_path() -> Path:
    """The keeper's socket in this user's runtime directory."""
    return runtime_dir() / SOCKET_NAME


def lock_path() -> Path:
    """The lock file a live keeper holds (``fcntl.flock``)."""
    return runtime_dir() / LOCK_NAME


def log_path() -> Path:
    """The file a keeper started here writes its output to."""
    return runtime_dir() / "keeper.log"


# (the state, ``STATE.keeper``: the connection, what it holds, the exit's wait)


def _patience(path: str) -> float:
    """Seconds to wait now for the keeper at ``path``: :data:`TIMEOUT`, or :data:`RETRY`
    while it is late."""
    return RETRY if STATE.keeper.late == path else TIMEOUT


def _answered(path: str, answered: bool) -> None:
    """Note whether the keeper at ``path`` answered in time (``STATE.keeper.late``)."""
    state = STATE.keeper
    if not answered:
        state.late = path
    elif state.late == path:
        state.late = None


def running_pid() -> int | None:
    """The pid of this user's live keeper, or ``None`` (starts nothing)."""
    try:
        _, body, _ = request(Hello(), start=False)
    except HandleUnavailable:
        return None
    pid = body.get("pid")
    return pid if type(pid) is int else None


def _launch() -> subprocess.Popen[bytes] | None:
    """Start a keeper in the background, as multiprocessing starts its resource tracker:
    a fresh interpreter with this one's flags. It runs in a session of its own, so that it
    outlives this process and a Ctrl-C in a terminal does not reach it.

    It runs in the private runtime directory, with this package's root first on
    ``PYTHONPATH`` and only the absolute entries of the caller's after it: ``-c`` puts the
    working directory first on ``sys.path``, and an empty or relative ``PYTHONPATH`` entry
    means it too, so in the caller's directory (a shared ``/tmp`` folder, say) another user's
    ``json.py`` would run as this user.

    Raises
    ------
    HandleUnavailable
        Its log cannot be made in the runtime directory (no space or inodes left there), or
        no process can be started.
    """
    directory = runtime_dir()
    exe = spawn.get_executable()
    cmd = [
        exe,
        *interpreter_flags(),
        "-c",
        "import sys; from sharedarrays.keeper.daemon import main; sys.exit(main())",
    ]
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])  # above sharedarrays/
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    env["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    try:
        log = os.open(log_path(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as e:  # (ENOSPC, EDQUOT: the keeper could make neither socket nor lock)
        raise HandleUnavailable(
            f"cannot start the sharedarrays keeper: its log {log_path()} cannot be made "
            f"({e.strerror}). Free space or inodes where the runtime directory is (df -i "
            f"{directory}), or set XDG_RUNTIME_DIR to a private directory (mode 0700) that has "
            "room"
        ) from None
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
    except OSError as e:  # (EAGAIN: no process left for this user; ENOMEM)
        raise HandleUnavailable(
            f"cannot start the sharedarrays keeper ({exe}): {e.strerror or e}. Free some "
            "processes or memory and try again, or start it yourself: python -m sharedarrays "
            "keeper"
        ) from None
    finally:
        os.close(log)
    # reap it if it exits before we do (it usually outlives us: then init reaps it)
    if sys.is_finalizing():  # no thread starts now (it would hang): init reaps it
        return None
    try:
        threading.Thread(target=proc.wait, name="sharedarrays-keeper-reaper", daemon=True).start()
    except RuntimeError:  # at interpreter shutdown (a hand-over at exit): init reaps it
        return None
    return proc


def _log_tail(path: Path) -> str:
    """The last line of the keeper's log at ``path`` (what a keeper that failed said)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line]
    except OSError:
        return "(its log cannot be read)"
    return lines[-1][:300] if lines else "(its log is empty)"


def _no_room(directory: Path) -> str:
    """A note that the file system of ``directory`` is full (no block or no inode left for
    this user: the keeper can write neither its lock, its socket nor its log), or ``""``."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    if st.f_bavail and st.f_favail:
        return ""
    return (
        f"; the file system of {directory} is full (no {'space' if not st.f_bavail else 'inode'} "
        f"left: df -i {directory}). Free room there, or set XDG_RUNTIME_DIR to a private "
        "directory (mode 0700) that has room"
    )


class NoRoomForFiles(KeeperError):
    """The keeper could not be asked, or its reply taken, because this process has as many
    files open as its limit allows (``ulimit -n``): said first, whatever else failed."""


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
    wait = max(deadline - time.monotonic(), 0.001)
    try:
        sock = connect_unix(path, deadline, wait)
    except TimeoutError:
        _answered(path, False)
        raise KeeperError(
            f"the keeper ({path}) did not accept a connection within {wait:g} s: it is "
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
            raise NoRoomForFiles(
                f"cannot open a socket to the keeper: {e.strerror}. Close some files in this "
                "process (or raise its ulimit -n) and try again"
            ) from None
        raise KeeperError(f"cannot connect to the keeper {path}: {e.strerror or e}") from None
    try:
        check_same_user(sock, f"the keeper {path}")
    except OSError as e:
        sock.close()
        raise KeeperError(f"cannot connect to the keeper {path}: {e.strerror or e}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def _open(path: str, start: bool, deadline: float) -> socket.socket:
    """A new connection to the keeper at ``path``, starting one first if ``start``, by
    ``deadline`` (``time.monotonic()``; the socket's timeout is what is left of it)."""
    sock = _try_connect(path, deadline)
    if sock is None and start:
        proc = _launch()
        while sock is None and time.monotonic() < deadline:
            time.sleep(0.02)
            sock = _try_connect(path, deadline)
            if sock is None and proc is not None and proc.poll() is not None:
                sock = _try_connect(path, deadline)  # (another keeper may have started)
                if sock is None:  # it failed as it started (a bad setting, say): say why
                    raise HandleUnavailable(
                        f"the sharedarrays keeper exited as it started (exit status "
                        f"{proc.returncode}): {_log_tail(log_path())} (its log: {log_path()})"
                        + _no_room(log_path().parent)
                    )
    if sock is None:
        if start:
            _answered(path, False)
        raise HandleUnavailable(
            "no sharedarrays keeper is running for this user"
            + (f" (it did not start in time; see {log_path()})" if start else "")
        )
    return sock


def _connect(start: bool) -> tuple[socket.socket, str, float]:
    """This process's connection to the keeper (opened, starting it if ``start``, where
    none is open), the keeper's socket, and the seconds to wait for its answer (set as the
    connection's timeout)."""
    state = STATE.keeper
    path = str(socket_path())
    wait = _patience(path)
    conn = state.conn
    if conn is None or state.path != path:
        disconnect()
        conn = state.conn = _open(path, start, time.monotonic() + wait)
        state.path = path
    if conn.gettimeout() != wait:
        conn.settimeout(wait)
    return conn, path, wait


def disconnect(wait: float = -1) -> None:
    """Close this process's connection to the keeper (it then holds nothing for us).

    ``wait``: the most seconds to wait for a request another thread is making (the default:
    as long as it takes); past it the connection is left as it is."""
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
    req: Request, fds: Sequence[int] = (), start: bool = True
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
        A keeper runs but did not accept or answer within :data:`TIMEOUT` (:data:`RETRY`
        once it was late; it is overloaded or stopped), the connection failed otherwise, or
        it sent something that is not a keeper reply. Never "no keeper": a name it holds is
        not reported missing.
    """
    data = req.encode()
    with STATE.keeper.lock:
        _flush_deferred()
        for attempt in (1, 2, 3):
            sock, path, wait = _connect(start)
            got: list[int] = []
            try:
                msg, flags = _send_and_receive(sock, req, data, fds, got)
            except TimeoutError:
                disconnect()
                _answered(path, False)
                raise KeeperError(
                    f"the keeper did not answer within {wait:g} s: it is overloaded or "
                    "stopped. The request was sent and may still be carried out when it "
                    "resumes: see python -m sharedarrays status and ls --all before trying "
                    "it again"
                ) from None
            except OSError as e:
                disconnect()
                if e.errno in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN) and attempt < 3:
                    continue
                raise KeeperError(f"asking the keeper failed: {e.strerror or e}") from None
            except BaseException:
                # An interrupt (Ctrl-C, an alarm's exception) before the reply was taken: the
                # keeper's reply, when it comes, would be read as the reply of this
                # connection's next request (another array's fds for an attach).
                disconnect()
                raise
            if isinstance(req, Release):
                return OK, {}, []
            handed = False
            try:
                try:
                    check_truncated(flags)
                except HandleUnavailable:
                    raise NoRoomForFiles(
                        "this process has no room for the handles the keeper sent: it has as "
                        "many files open as its limit allows (ulimit -n). Close some and try "
                        "again"
                    ) from None
                if not msg:
                    disconnect()  # the keeper exited (idle) or died: reconnect, maybe restart
                    if attempt == 3:
                        raise KeeperError("the keeper closed the connection three times; try again")
                    continue
                reply = Reply.decode(msg)
                _answered(path, True)
                if len(fds) > MAX_FDS and reply.status == ERROR:
                    disconnect()  # (refused before its last fds came: read as requests)
                _take_rest(sock, reply, got, wait)
                handed = True
                return reply.status, reply.body, got
            finally:
                if not handed:  # (a refusal, an interrupt: not the caller's)
                    for fd in got:
                        os.close(fd)
    raise AssertionError("unreachable")  # pragma: no cover


def _send_and_receive(
    sock: socket.socket, req: Request, data: bytes, fds: Sequence[int], got: list[int]
) -> tuple[bytes, int]:
    """Send one request on ``sock`` and take its reply (none for a ``release``: ``b""``),
    its fds appended to ``got``; those are closed here when this raises (an interrupt as
    they came)."""
    try:
        if fds:
            send_fds(sock, data, fds)
        else:
            sock.send(data)
        if isinstance(req, Release):
            return b"", 0
        return recv_into(sock, MAX_MESSAGE, MAX_FDS, got)
    except BaseException:
        for fd in got:
            os.close(fd)
        got.clear()
        raise


def _take_rest(sock: socket.socket, reply: Reply, got: list[int], wait: float) -> None:
    """Receive the fds of an ``attach`` or ``fetch`` reply that follow it (one per chunk of
    its ``sizes``, :data:`MAX_FDS` a message) into ``got``, within ``wait`` seconds.

    Raises
    ------
    KeeperError
        They did not all come (the connection is closed: its state is unknown).
    """
    sizes = reply.body.get("sizes")
    if len(got) != MAX_FDS or type(sizes) is not list or len(sizes) <= MAX_FDS:
        return
    why = "it stopped"
    try:
        complete = recv_fds(sock, len(sizes), got, time.monotonic() + wait)
        sock.settimeout(wait)  # (recv_fds left it at what remained)
    except (OSError, HandleUnavailable) as e:
        complete, why = False, str(e)
    if not complete:
        disconnect()
        raise KeeperError(f"the keeper did not send all the handles: {why}")


def hand_over(alloc: allocation.Allocation, loads: int, seconds: float) -> None:
    """Give the keeper (started if needed) ``alloc``'s handles for ``loads`` payloads in
    flight, for at most ``seconds``: they then load after this process let go of the
    memory or exited (a ``hand_over_hooks`` hook of the memory state).

    Uses a connection of its own, opened and closed here: it runs from finalizers, in any
    thread, maybe while this thread is inside :func:`request`. The keeper serves the handles
    by id and secret, and drops them after ``loads`` fetches or ``seconds``, whichever comes
    first (and once no process it served holds them).

    Waits for the keeper :data:`TIMEOUT` at most (:data:`RETRY` once it was late); at exit,
    what is left of the exit's wait (:func:`_hand_over_at_exit`).

    Raises
    ------
    KeeperError
        The keeper did not take the handles in time, or refused them.
    HandleUnavailable
        No keeper could be started.
    """
    path = str(socket_path())
    now = time.monotonic()
    exit_wait = STATE.keeper.exit_wait
    began, left = (now, TIMEOUT) if exit_wait is None else exit_wait
    deadline = began + min(left, _patience(path))
    if deadline <= now:
        raise KeeperError(
            f"the keeper did not answer in time earlier at this exit, which waits for it "
            f"{TIMEOUT:g} s at most in all"
        )
    doc = {"backend": alloc.backend.name, "device": alloc.device.index}
    doc["readonly"] = alloc.export_readonly
    doc["used"] = alloc.used  # (the bytes asked for: the rest is lost to granularity)
    req = Keep(
        alloc.id,
        alloc.secret,
        None,
        alloc.chunk_sizes(),
        doc,
        None if alloc.allow_pids is None else sorted(alloc.allow_pids),
        InFlight(min(loads, 1 << 31), min(seconds, MAX_IN_FLIGHT)),
    )
    data = req.encode()
    handles, temporary = alloc.handles_for_importers()  # read-only ones for readonly arrays
    got: list[int] = []  # (none are expected: closed, whatever happens)
    try:
        try:
            with _open(path, True, deadline) as sock:
                send_fds(sock, data, handles)
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                msg, _ = recv_into(sock, MAX_MESSAGE, MAX_FDS, got)
        except TimeoutError:
            _answered(path, False)
            raise KeeperError(
                f"the keeper did not take the handles within {deadline - now:.3g} s: it is "
                "stopped or overloaded"
            ) from None
        except OSError as e:
            raise KeeperError(f"the keeper did not take the handles: {e}") from None
        finally:
            for fd in temporary:
                os.close(fd)
        reply = Reply.decode(msg)
        _answered(path, True)
    finally:
        for fd in got:
            os.close(fd)
    raise_for(reply.status, reply.body, f"the keeper refused allocation {alloc.id}")


def _hand_over_at_exit() -> None:
    """At exit: hand the payloads in flight of every allocation still mapped here to the
    keeper (a Queue's feeder thread has pickled its items by then), waiting for it
    :data:`TIMEOUT` at most in all, however many allocations there are.

    The hook may run twice (at a Process's end, or multiprocessing's exit function, and at
    the interpreter's exit): the second run hands over what was pickled since, within what
    is left of that wait, and does not try again what failed."""
    state = STATE.keeper
    began = time.monotonic()
    left = TIMEOUT if state.exit_left is None else state.exit_left
    state.exit_wait = (began, left)
    failed: list[tuple[int, str]] = []
    try:
        # (and the released blocks that wait for their importers: memory/cache.py)
        for alloc in registry.live_allocations() + registry.draining_allocations():
            if alloc.id in state.said:
                continue
            failure = alloc.hand_over(say=False)
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
    """At the interpreter's exit, last in this layer: close the connection to the keeper (the
    kernel would; closed here, no unclosed socket is reported). Not while another thread is
    in a request for more than a second: the kernel closes it then."""
    disconnect(wait=1.0)


def ensure_running() -> int:
    """Start this user's keeper unless one is running; return its pid."""
    _, body, _ = request(Hello())
    return int(body["pid"])


def refusal(what: str, error: object) -> str:
    """The message of a keeper's refusal (``what: error``), saying so when the keeper running
    is older than this library (it answers ``unknown op`` to an op it does not know)."""
    message = f"{what}: {error}"
    if "unknown op" in str(error):
        message += (
            f"; the running keeper (pid {running_pid()}) predates this version of "
            "sharedarrays: stop it once it holds nothing you need (kill PID), and the next "
            "use starts a new one"
        )
    return message


def raise_for(status: int, body: dict[str, Any], what: str) -> None:
    """Turn a keeper reply's status into the library's exception (OK returns)."""
    message = refusal(what, body.get("error", "refused"))
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
    with STATE.keeper.lock:
        _flush_deferred()  # first: a deferred release of the same id predates this hold
        STATE.keeper.held.add(alloc_id)


def release(alloc_id: str) -> None:
    """Tell the keeper this process no longer holds ``alloc_id`` (no reply, best effort).

    Never blocks: it runs from finalizers (a view's lease going away), which may run in any
    thread, at any allocation, while another thread holds the client's lock (and may even
    be waiting for the finalizing thread to start). Then the release is deferred to this
    process's next keeper request, or to its exit, which the keeper sees anyway.
    """
    lock = STATE.keeper.lock
    if not lock.acquire(blocking=False):
        STATE.keeper.deferred.append(alloc_id)
        return
    try:
        _release_locked(alloc_id)
    finally:
        lock.release()


def _release_locked(alloc_id: str) -> None:
    state = STATE.keeper
    if alloc_id not in state.held:
        return
    state.held.discard(alloc_id)
    if state.conn is None:
        return
    try:
        state.conn.send(Release(alloc_id).encode())
    except OSError:
        pass


def _flush_deferred() -> None:
    """Send the releases deferred by :func:`release` (the caller holds the lock)."""
    deferred = STATE.keeper.deferred
    while deferred:
        _release_locked(deferred.pop())


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
        status, body, fds = request(Fetch(alloc_id, secret), start=False)
    except HandleUnavailable:
        raise HandleUnavailable(f"{gone}; no keeper holds it either (see a.park())") from None
    except NoRoomForFiles as e:  # (the cause, said first: the keeper may well hold it)
        raise HandleUnavailable(f"{e} (allocation {alloc_id}; its exporter: {gone})") from None
    except KeeperError as e:
        raise HandleUnavailable(f"{gone}; nor could the keeper be asked: {e}") from None
    try:
        if status == NOT_FOUND:
            raise HandleUnavailable(f"{gone}; the keeper does not hold it either") from None
        raise_for(status, body, f"the keeper refused allocation {alloc_id}")
        hold(alloc_id)
        sizes = body.get("sizes")
        creator = body.get("creator")
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
    return sizes, fds, creator


def _on_release(alloc: allocation.Allocation) -> None:
    if alloc.pid == os.getpid():
        release(alloc.id)


STATE.memory.release_hooks.append(_on_release)
STATE.memory.hand_over_hooks.append(hand_over)
at_exit(_hand_over_at_exit, "transport", order=0)
at_exit(_close_at_exit, "transport", order=4, processes=False)  # after the hand-over
