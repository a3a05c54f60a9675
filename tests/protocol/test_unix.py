"""The Unix-socket helper: peer credentials, same-user checks, fds in batches, fds taken."""

from __future__ import annotations

import fcntl
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import sharedarrays as sa
from sharedarrays.protocol import unix


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        yield a, b


def test_peer_credentials_name_this_process(pair: tuple[socket.socket, socket.socket]) -> None:
    assert unix.peer_credentials(pair[0]) == unix.Credentials(os.getpid(), os.getuid(), os.getgid())
    assert unix.check_same_user(pair[1], "the peer") == unix.peer_credentials(pair[1])


def test_another_uid_is_refused(
    pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    other = unix.Credentials(4242, os.getuid() + 1, 0)
    monkeypatch.setattr(unix, "peer_credentials", lambda sock: other)
    with pytest.raises(
        sa.PermissionDenied, match=rf"the peer runs as another user \(uid {other.uid}\)"
    ):
        unix.check_same_user(pair[0], "the peer")


@pytest.mark.parametrize("count", [0, 1, 250, 251, 600])
def test_fds_go_in_batches_and_all_arrive(
    pair: tuple[socket.socket, socket.socket], count: int
) -> None:
    """More fds than one SCM_RIGHTS message takes (SCM_MAX_FD is 253): the first 250 ride
    on the message, the rest on messages of their own, and all arrive in order."""
    one, two = os.memfd_create("one"), os.memfd_create("two")
    os.ftruncate(two, 2)
    sent = [two if i % 2 else one for i in range(count)]
    got: list[int] = []
    try:
        done = threading.Thread(target=unix.send_fds, args=(pair[0], b"header", sent))
        done.start()
        msg, got, flags, _ = socket.recv_fds(pair[1], 64, unix.FDS_PER_MESSAGE)
        unix.check_truncated(flags)
        assert msg == b"header" and len(got) == min(count, unix.FDS_PER_MESSAGE)
        assert unix.recv_fds(pair[1], count, got)
        done.join(10)
        assert [os.fstat(fd).st_size for fd in got] == [i % 2 * 2 for i in range(count)]
    finally:
        for fd in [*got, one, two]:
            os.close(fd)


def test_fds_arrive_on_a_socket_numbered_past_1024() -> None:
    """A process with thousands of arrays holds their fds: a socket numbered past select()'s
    1024 still receives (on the main thread, where a SIGINT is held off meanwhile)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the hard fd limit is {hard}: no fd past 1024 here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1100), hard))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        high = socket.socket(fileno=fcntl.fcntl(b.fileno(), fcntl.F_DUPFD, 1050))
        r, w = os.pipe()
        socket.send_fds(a, [b"x"], [r])
        got: list[int] = []
        assert high.fileno() >= 1050
        assert unix.recv_into(high, 16, 4, got)[0] == b"x" and len(got) == 1
        os.close(got[0])
        high.close()
        os.close(r)
        os.close(w)
    finally:
        a.close()
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_sender_that_stops_early_is_noticed(pair: tuple[socket.socket, socket.socket]) -> None:
    r, w = os.pipe()
    got: list[int] = []
    try:
        socket.send_fds(pair[0], [b"header"], [r])
        pair[0].send(b"+")  # a batch without fds: the sender stopped
        _, got, _, _ = socket.recv_fds(pair[1], 64, unix.FDS_PER_MESSAGE)
        assert unix.recv_fds(pair[1], 5, got) is False
        assert len(got) == 1
    finally:
        for fd in [*got, r, w]:
            os.close(fd)


def test_truncated_fds_are_refused() -> None:
    unix.check_truncated(0)
    unix.check_truncated(socket.MSG_TRUNC)  # (the message, not its fds: the caller's check)
    with pytest.raises(sa.HandleUnavailable, match="ulimit -n"):
        unix.check_truncated(socket.MSG_CTRUNC)


def test_connect_to_nothing_says_so(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(FileNotFoundError):
        unix.connect_unix(os.path.join(tmp_path, "none.sock"), 0.0, 1.0)


def test_connect_to_a_full_queue_times_out_at_the_deadline(tmp_path: os.PathLike[str]) -> None:
    """A listener that accepts nothing and whose queue is full: EAGAIN, tried again until the
    deadline, then TimeoutError."""
    import time

    path = os.path.join(tmp_path, "full.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(path)
        listener.listen(0)
        queued = []
        try:
            start = time.monotonic()
            with pytest.raises(TimeoutError):
                for _ in range(64):  # fills the queue, then waits at the deadline
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    s.setblocking(False)
                    try:
                        s.connect(path)
                    except BlockingIOError:
                        s.close()
                        unix.connect_unix(path, time.monotonic() + 0.3, 1.0)
                    queued.append(s)
            assert 0.25 < time.monotonic() - start < 10
        finally:
            for s in queued:
                s.close()


def test_a_removed_runtime_dir_is_made_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removed while processes run: made again; and where ``$XDG_RUNTIME_DIR`` itself was
    removed (systemd removes ``/run/user/<uid>`` at the last logout), as if it were unset
    (making the directory in it had failed with PermissionDenied)."""
    uid = os.getuid()
    base = tmp_path / "xdg"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(unix, "RUN_USER", tmp_path / "run")
    assert unix.runtime_dir() == base / "sharedarrays"
    shutil.rmtree(base / "sharedarrays")
    assert unix.runtime_dir() == base / "sharedarrays"
    assert os.lstat(base / "sharedarrays").st_mode & 0o777 == 0o700
    shutil.rmtree(base)
    assert unix.runtime_dir() == tmp_path / f"sharedarrays-{uid}"


@pytest.mark.timeout(60)
def test_take_fds_copies_a_child_s_fds_and_refuses_what_is_not_there() -> None:
    from keeper_helpers import takes_refused

    if why := takes_refused():
        pytest.skip(why)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys; fd = os.memfd_create('x'); print(fd, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        fd = int(child.stdout.readline())
        before = sorted(os.listdir("/proc/self/fd"))
        (taken,) = unix.take_fds(child.pid, [fd]) or [-1]
        try:  # (the child's memfd itself, close-on-exec as pidfd_getfd makes it)
            assert os.readlink(f"/proc/self/fd/{taken}").startswith("/memfd:x")
            assert os.get_inheritable(taken) is False
        finally:
            os.close(taken)
        assert unix.take_fds(child.pid, [fd, 1000]) is None  # (all or none)
        assert sorted(os.listdir("/proc/self/fd")) == before
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
        child.stdout.close()  # type: ignore[union-attr]
    assert unix.take_fds(child.pid, [fd]) is None  # (gone)


@pytest.mark.timeout(60)
def test_take_fds_asks_yama_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Yama would refuse (and log) the take, it is not tried: at scope 1 only this
    process's descendants, at 2 only root, at 3 nobody; at 0 anyone of the user."""
    from sharedarrays.process import STATE

    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        for scope, root, mine, parent in [
            (0, False, True, True),
            (1, False, True, False),
            (1, True, True, True),
            (2, False, False, False),
            (2, True, True, True),
            (3, True, False, False),
        ]:
            monkeypatch.setattr(STATE.connections, "yama_scope", scope)
            monkeypatch.setattr(os, "geteuid", lambda root=root: 0 if root else 1000)
            assert unix._yama_allows(child.pid) is mine, (scope, root)
            assert unix._yama_allows(os.getppid()) is parent, (scope, root)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
