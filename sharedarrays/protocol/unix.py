"""Unix sockets of this user: where they live, who is at the other end, fds across them.

One helper for the handle servers, their clients, the keeper and its clients:

* :func:`runtime_dir`: the private directory (mode 0700) every socket of this user lives in;
* :func:`peer_credentials`: the pid, uid and gid of the process at the other end
  (``SO_PEERCRED``), and :func:`check_same_user`, which refuses another user's;
* :func:`connect_unix`: a ``SOCK_SEQPACKET`` connection with a deadline for a listener whose
  queue is full;
* :func:`send_fds` / :func:`recv_fds`: file descriptors by ``SCM_RIGHTS`` in batches of
  :data:`FDS_PER_MESSAGE`, with the kernel's truncation reported (:func:`check_truncated`);
  :func:`recv_into` takes one message and its fds so that a Ctrl-C cannot lose them.

Nothing here knows what the messages mean.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sharedarrays.errors import HandleUnavailable, PermissionDenied

__all__ = [
    "FDS_PER_MESSAGE",
    "MAX_PATH",
    "BACKOFF",
    "Credentials",
    "runtime_dir",
    "peer_credentials",
    "check_same_user",
    "connect_unix",
    "send_fds",
    "recv_fds",
    "recv_into",
    "check_truncated",
]

SCM_MAX_FD = 253
"""Most file descriptors the kernel passes in one ``SCM_RIGHTS`` message."""
FDS_PER_MESSAGE = 250
"""File descriptors sent per message (below :data:`SCM_MAX_FD`)."""
MAX_PATH = 107
"""Longest Unix socket path in bytes (``sun_path`` less its terminating NUL)."""
BACKOFF = 0.05
"""Seconds between tries to connect to a listener whose queue of connections is full."""
RUN_USER = Path("/run/user")
"""Where systemd makes each logged-in user's private runtime directory (``<uid>``)."""
RUNTIME_DIR_TRIES = 100
"""Names the fallback runtime directory under the temporary directory may take
(``sharedarrays-<uid>``, then ``-1``, ``-2``, ...) while other users hold the earlier ones."""
_CRED = struct.Struct("3i")


@dataclass(frozen=True)
class Credentials:
    """The process at the other end of a Unix socket, as the kernel saw it at connect."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> Credentials:
    """The credentials of ``sock``'s peer (``SO_PEERCRED``).

    Raises
    ------
    OSError
        ``sock`` is not a connected Unix socket.
    """
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return Credentials(pid, uid, gid)


def check_same_user(sock: socket.socket, what: str) -> Credentials:
    """The credentials of ``sock``'s peer, refused when it runs as another user.

    Raises
    ------
    PermissionDenied
        ``what`` (say, ``"the keeper /run/user/1000/sharedarrays/keeper.sock"``) runs as
        another user.
    OSError
        ``SO_PEERCRED`` failed.
    """
    peer = peer_credentials(sock)
    if peer.uid != os.getuid():
        raise PermissionDenied(f"{what} runs as another user (uid {peer.uid})")
    return peer


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


def send_fds(sock: socket.socket, message: bytes, fds: Sequence[int]) -> None:
    """Send ``message`` with ``fds``: the first :data:`FDS_PER_MESSAGE` beside it, the rest in
    messages of their own (``b"+"``), as many as they need; :func:`recv_fds` takes them."""
    fds = list(fds)
    socket.send_fds(sock, [message], fds[:FDS_PER_MESSAGE])
    for i in range(FDS_PER_MESSAGE, len(fds), FDS_PER_MESSAGE):
        socket.send_fds(sock, [b"+"], fds[i : i + FDS_PER_MESSAGE])


def recv_fds(
    sock: socket.socket, count: int, fds: list[int], deadline: float | None = None
) -> bool:
    """Receive the fds :func:`send_fds` sent after its first message, appending them to
    ``fds`` (which holds those of the first message) until it holds ``count``; whether they
    all came (``False``: the sender stopped first). ``fds`` stays the caller's, also when
    this raises: it closes them.

    With a ``deadline`` (``time.monotonic()``) they must all have come by then, however the
    sender spaces its messages (each within the socket's timeout would otherwise keep the
    receiver waiting as long as the sender likes); ``sock``'s timeout is left at what
    remained.

    Raises
    ------
    TimeoutError
        A message did not come within the socket's timeout, or not all by ``deadline``.
    HandleUnavailable
        This process has no room for them (:func:`check_truncated`).
    OSError
        Receiving failed.
    """
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
    """``socket.recv_fds(sock, size, maxfds)``, its fds appended to ``fds`` (the caller's to
    close, also when this raises); returns the message and its flags.

    In the main thread a SIGINT (Ctrl-C, a notebook's interrupt) that comes while the message
    is taken is handed to its handler only once the fds are in ``fds``: raised between the
    receive and the append, the ``KeyboardInterrupt`` would leave the fds open with no owner
    (memory the exporter can never free). The wait for the message stays interruptible: the
    handler is held back only once the message is there.

    The message is received into a buffer of its own length (:func:`_message_length`), at
    most ``size`` bytes (a longer one is truncated, ``MSG_TRUNC`` in the flags): a buffer of
    ``size`` for every message would cost a large one its allocation each time.

    Raises
    ------
    TimeoutError
        No message within the socket's timeout.
    OSError
        Receiving failed.
    """
    if threading.current_thread() is not threading.main_thread() or not callable(
        signal.getsignal(signal.SIGINT)
    ):  # (no Python handler can run here between the receive and the append)
        msg, got, flags, _ = socket.recv_fds(sock, _message_length(sock, size), maxfds)
        fds.extend(got)
        return msg, flags
    if not select.select([sock], [], [], sock.gettimeout())[0]:
        raise TimeoutError("timed out")
    length = _message_length(sock, size)
    caught: list[typing.Any] = []
    handler = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    try:
        msg, got, flags, _ = socket.recv_fds(sock, length, maxfds)
        fds.extend(got)
    finally:
        signal.signal(signal.SIGINT, handler)
    if caught and callable(handler):
        handler(*caught[0])  # (the KeyboardInterrupt, now that the fds are owned)
    return msg, flags


def _message_length(sock: socket.socket, size: int) -> int:
    """The length of the next message on ``sock`` (``SOCK_SEQPACKET``), at most ``size``
    (at least 1: a peer's end of file is read as an empty message), taken without reading
    it (``MSG_PEEK | MSG_TRUNC``: Linux gives a packet's whole length; its fds stay
    queued). Waits as a receive does (the socket's timeout)."""
    return max(1, min(sock.recv_into(bytearray(1), 1, _PEEK_LENGTH), size))


_PEEK_LENGTH = int(socket.MSG_PEEK | socket.MSG_TRUNC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)  # (a plain int: IntFlag's & makes a flag object)


def check_truncated(flags: int) -> None:
    """Raise if the kernel dropped file descriptors of a message (``MSG_CTRUNC``: this
    process's fd table was full, ``RLIMIT_NOFILE``).

    Raises
    ------
    HandleUnavailable
        Some fds were dropped.
    """
    if flags & _MSG_CTRUNC:
        raise HandleUnavailable(
            "this process has no room for the handles it was sent: it has as many files open "
            "as its limit allows (ulimit -n). Close some, or raise the limit, and try again"
        )


def runtime_dir() -> Path:
    """The private directory of this user's sockets, created with mode 0700 if missing.

    Made again when it was removed (a tmp cleaner; systemd, at a user's last logout, removes
    ``/run/user/<uid>`` while tmux or nohup processes live on): each call checks. The first
    of these, the same in every process of the user:

    * ``$XDG_RUNTIME_DIR/sharedarrays`` when that is set and exists;
    * ``/run/user/<uid>/sharedarrays`` when ``/run/user/<uid>`` is this user's and closed to
      others (systemd makes it at login);
    * ``<tmp>/sharedarrays-<uid>``; where another user made that name first (``/tmp`` is
      open to everyone), ``<tmp>/sharedarrays-<uid>-1``, then ``-2``, ... up to
      :data:`RUNTIME_DIR_TRIES` names: the first that is this user's or can be made.

    Raises
    ------
    PermissionDenied
        The directory cannot be made, is this user's but open to others, or (for
        ``$XDG_RUNTIME_DIR``) belongs to another user or is a symlink; ``$XDG_RUNTIME_DIR``
        itself belongs to another user (not root), or others may write in it without its
        sticky bit (they could move the directory away and put theirs in its place); or every
        fallback name belongs to another user.
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
    """``$XDG_RUNTIME_DIR`` when set and there, else ``/run/user/<uid>`` when it is
    ``uid``'s and closed to others, else ``None``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    st: os.stat_result | None = None
    if base:
        try:
            st = os.stat(base)
        except FileNotFoundError:  # (removed, as systemd does at the last logout: as if unset)
            pass
        except OSError:
            return Path(base)  # (making the directory in it says why it cannot)
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
