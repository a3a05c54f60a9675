"""Unix sockets of this user: where they live (:func:`runtime_dir`), who is at the other end
(:func:`check_same_user`), fds across them in batches (:func:`send_fds`, :func:`recv_fds`);
fds taken from another process without asking it (:func:`take_fds`)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import signal
import socket
import stat
import struct
import tempfile
import threading
import time
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path

from sharedarrays.errors import HandleUnavailable, PermissionDenied
from sharedarrays.process import STATE, parent_pid
from sharedarrays.protocol.payload import remember

FDS_PER_MESSAGE = 250  # fds sent per message (the kernel's SCM_MAX_FD is 253)
MAX_PATH = 107  # longest Unix socket path in bytes (sun_path less its NUL)
BACKOFF = 0.05  # seconds between tries to connect to a listener whose queue is full
RUN_USER = Path("/run/user")  # where systemd makes each user's runtime directory
RUNTIME_DIR_TRIES = 100  # names tried for the fallback runtime directory
_CRED = struct.Struct("3i")  # pid, uid, gid
_PEEK_LENGTH = int(socket.MSG_PEEK | socket.MSG_TRUNC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # (a plain int: IntFlag's & makes a flag object)
PIDFD_GETFD = 438  # pidfd_getfd(2)'s number on every Linux architecture (Linux 5.6 and later)
REFUSED_LIMIT = 256  # processes remembered as refusing take_fds (each refusal may be logged)


class Credentials(typing.NamedTuple):
    """The process at the other end of a Unix socket, as the kernel saw it at connect."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> Credentials:
    """The credentials of ``sock``'s peer (``SO_PEERCRED``); OSError if not a Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return Credentials(*_CRED.unpack(creds))


def check_same_user(sock: socket.socket, what: str) -> Credentials:
    """``sock``'s peer's credentials; PermissionDenied (naming it ``what``) if another user's."""
    peer = peer_credentials(sock)
    if peer.uid != os.getuid():
        raise PermissionDenied(f"{what} runs as another user (uid {peer.uid})")
    return peer


def connect_unix(path: str, deadline: float, timeout: float, what: str = "") -> socket.socket:
    """A ``SOCK_SEQPACKET`` connection to ``path`` with ``timeout`` set on it; if ``what``
    names it, PermissionDenied where it is another user's (:func:`check_same_user`). A full
    accept queue is retried until ``deadline``, then TimeoutError (other OSErrors raised)."""
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            if what:
                check_same_user(sock, what)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{path} did not accept a connection") from None
            time.sleep(BACKOFF)
        except BaseException as e:
            sock.close()
            if what and type(e) is PermissionError:  # (a socket file of another user)
                raise PermissionDenied(
                    f"cannot connect to {what}: it belongs to another user. Arrays are shared "
                    "only between processes of the same user"
                ) from None
            raise


def send_fds(sock: socket.socket, message: bytes, fds: Sequence[int]) -> None:
    """Send ``message`` with ``fds``, those past :data:`FDS_PER_MESSAGE` in ``b"+"`` messages."""
    fds = list(fds)
    if not fds:
        sock.send(message)
        return
    socket.send_fds(sock, [message], fds[:FDS_PER_MESSAGE])
    for i in range(FDS_PER_MESSAGE, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"+"], fds[i : i + FDS_PER_MESSAGE])


def recv_fds(
    sock: socket.socket, count: int, fds: list[int], deadline: float | None = None
) -> bool:
    """Append the fds :func:`send_fds` sent after its first message to ``fds`` (the caller's
    to close, also where this raises) until ``count``: whether they all came."""
    while len(fds) < count:
        before = len(fds)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left)
        _, flags = recv_into(sock, 16, FDS_PER_MESSAGE, fds)
        check_truncated(flags)
        if len(fds) == before:
            return False
    return True


def recv_into(sock: socket.socket, size: int, maxfds: int, fds: list[int]) -> tuple[bytes, int]:
    """``socket.recv_fds``, its fds appended to ``fds``: the message and its flags. A SIGINT
    meanwhile is delivered once the fds are in ``fds`` (none left without an owner)."""
    # (waited for first, where a SIGINT can be deferred: the wait itself stays interruptible)
    main = threading.current_thread() is threading.main_thread()
    if main and not _readable(sock, sock.gettimeout()):
        raise TimeoutError("timed out")
    length = max(1, min(sock.recv_into(bytearray(1), 1, _PEEK_LENGTH), size))  # (peeked)
    with sigint_deferred():
        msg, got, flags, _ = socket.recv_fds(sock, length, maxfds)
        fds.extend(got)
    return msg, flags


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Deliver a SIGINT that comes meanwhile at the end, so that a KeyboardInterrupt cannot
    fall between a system call that makes fds and the list that owns them."""
    # (elsewhere than the main thread no Python handler runs meanwhile)
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    caught: list[typing.Any] = []
    signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if caught:
        handler(*caught[0])  # (the KeyboardInterrupt, now that the fds are owned)


def take_fds(pid: int, fds: Sequence[int]) -> list[int] | None:
    """Copies of process ``pid``'s ``fds`` (``pidfd_getfd(2)``: no request, no wait for its
    threads), the caller's to close; ``None`` where the kernel refuses: before Linux 5.6,
    ``pid`` gone, or no right to trace it (another user; under Yama's ``ptrace_scope`` 1,
    a process that is not this one's descendant). A refusing process is not asked again."""
    state = STATE.connections
    if state.syscall is None:  # (looked up once: dlsym costs microseconds)
        state.syscall = getattr(ctypes.CDLL(None, use_errno=True), "syscall", False)
    if state.syscall is False or pid in state.refused or not _yama_allows(pid):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:  # (gone; or ENOSYS before Linux 5.3)
        return None
    taken: list[int] = []
    refusal = 0
    try:
        with sigint_deferred():  # (a KeyboardInterrupt comes after the loop: taken is closed)
            for fd in fds:
                got = state.syscall(PIDFD_GETFD, pidfd, fd, 0)
                if got < 0:
                    refusal = ctypes.get_errno() or errno.EIO
                    break
                taken.append(got)
    except BaseException:
        refusal = -1
        raise
    finally:
        os.close(pidfd)
        if refusal:
            for fd in taken:
                os.close(fd)
    if refusal == errno.ENOSYS:
        state.syscall = False
    elif refusal == errno.EPERM:
        remember(state.refused, pid, None, REFUSED_LIMIT)
    return None if refusal else taken


def _yama_allows(pid: int) -> bool:
    """Whether Yama's ``ptrace_scope`` lets this process trace ``pid`` (not asked where it
    does not: a refusal is logged): scope 0, root below scope 3, else a descendant."""
    state = STATE.connections
    if state.yama_scope is None:
        try:
            state.yama_scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
        except (OSError, ValueError):
            state.yama_scope = 0  # (no Yama)
    if state.yama_scope == 0 or (os.geteuid() == 0 and state.yama_scope < 3):
        return True
    if state.yama_scope > 1:
        return False
    for _ in range(64):  # (up the parents to this process: a descendant)
        parent = parent_pid(pid)
        if parent is None or parent <= 1:
            return False
        if parent == STATE.pid:
            return True
        pid = parent
    return False


def _readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether ``sock`` has something to read within ``timeout`` seconds (``None``: waits).
    (poll, not select: a process holding thousands of arrays' fds numbers sockets past 1024.)"""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


def check_truncated(flags: int) -> None:
    """Raise HandleUnavailable if the kernel dropped fds of a message (its fd table full)."""
    if flags & _MSG_CTRUNC:
        raise HandleUnavailable(
            "this process has no room for the handles it was sent: it has as many files open "
            "as its limit allows (ulimit -n). Close some, or raise the limit, and try again"
        )


def socket_pid(path: str | Path) -> int | None:
    """The pid a handle server's socket is named by (``<pid>-<random>.sock``), or ``None``."""
    pid = Path(path).name.split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def runtime_dir() -> Path:
    """This user's private directory of sockets, made 0700 at each call if missing:
    ``$XDG_RUNTIME_DIR/sharedarrays``, else ``/run/user/<uid>/sharedarrays``, else
    ``<tmp>/sharedarrays-<uid>[-n]``; PermissionDenied where none is private or safe."""
    uid = os.getuid()
    login = _login_dir(uid)
    if login is not None:
        path = login / "sharedarrays"
        _make_private(path, uid, strict=True)
        return path
    tmp = Path(tempfile.gettempdir())
    for n in range(RUNTIME_DIR_TRIES):
        path = tmp / (f"sharedarrays-{uid}-{n}" if n else f"sharedarrays-{uid}")
        if _make_private(path, uid, strict=False):
            return path
    raise PermissionDenied(
        f"{tmp / f'sharedarrays-{uid}'} and the next {RUNTIME_DIR_TRIES - 1} names after it "
        "belong to other users; set XDG_RUNTIME_DIR to a private directory of this user "
        "(mode 0700)"
    )


def _login_dir(uid: int) -> Path | None:
    """``$XDG_RUNTIME_DIR``, else a private ``/run/user/<uid>``, else ``None``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    try:
        st = os.stat(base) if base else None
    except FileNotFoundError:  # (removed, as systemd does at the last logout: as if unset)
        st = None
    except OSError:
        return Path(str(base))  # (making the directory in it says why it cannot)
    if base and st is not None:
        if st.st_uid not in (uid, 0):
            raise PermissionDenied(
                f"XDG_RUNTIME_DIR ({base}) belongs to another user (uid {st.st_uid}), who could "
                "replace the directory of this user's sockets in it; set XDG_RUNTIME_DIR to "
                "a private directory of this user (mode 0700), or unset it"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise PermissionDenied(
                f"XDG_RUNTIME_DIR ({base}) is writable by other users (mode "
                f"{stat.S_IMODE(st.st_mode):o}, no sticky bit): another user could move the "
                "directory of this user's sockets away and put one of theirs in its place; "
                f"make it private (chmod 700 {base}), or unset XDG_RUNTIME_DIR"
            )
        return Path(base)
    login = RUN_USER / str(uid)
    try:
        st = os.stat(login)
    except OSError:
        return None
    private = stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077
    return login if private else None


def _make_private(path: Path, uid: int, strict: bool) -> bool:
    """Make ``path`` 0700 if missing: False if another user's (``strict``: refused), else
    True; PermissionDenied if it is not private."""
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as e:
        raise PermissionDenied(
            f"cannot make the runtime directory {path}: {e.strerror}; set XDG_RUNTIME_DIR to "
            "a private directory of this user (mode 0700)"
        ) from None
    mine = stat.S_ISDIR(st.st_mode) and st.st_uid == uid
    if not mine and not strict:
        return False
    if not mine or st.st_mode & 0o077:
        raise PermissionDenied(
            f"{path} is not a private directory of this user (owner uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}); remove it or set XDG_RUNTIME_DIR to a private "
            "directory"
        )
    return True
