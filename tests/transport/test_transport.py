from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import closed_by_peer
from users import become, other_user

import sharedarrays as sa
from sharedarrays import process
from sharedarrays.memory import empty_cache
from sharedarrays.memory import registry as sa_registry
from sharedarrays.protocol import unix
from sharedarrays.protocol.handles import Kind, Request, Status
from sharedarrays.protocol.payload import MAGIC, TAG_BYTES, _tag
from sharedarrays.transport import client
from sharedarrays.transport import handles as transport
from sharedarrays.transport import server as handle_server


def test_runtime_dir_is_private() -> None:
    d = unix.runtime_dir()
    st_ = os.lstat(d)
    assert stat.S_ISDIR(st_.st_mode) and st_.st_uid == os.getuid()
    assert st_.st_mode & 0o777 == 0o700
    server = Path(transport.server_address())
    assert server.parent == d and stat.S_ISSOCK(os.lstat(server).st_mode)


def test_runtime_dir_open_to_others_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    (tmp_path / "sharedarrays").mkdir(mode=0o777)
    os.chmod(tmp_path / "sharedarrays", 0o777)
    with pytest.raises(sa.PermissionDenied, match="private directory"):
        unix.runtime_dir()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722])
def test_an_xdg_runtime_dir_others_may_write_in_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int
) -> None:
    # (another user could move this user's sharedarrays directory away and put theirs in its
    # place: every later process of this user refused, the keeper out of reach)
    base = tmp_path / "run"
    base.mkdir()
    os.chmod(base, mode)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    with pytest.raises(sa.PermissionDenied, match=r"writable by other users.*chmod 700"):
        unix.runtime_dir()
    assert not (base / "sharedarrays").exists()
    os.chmod(base, mode | stat.S_ISVTX)  # (sticky, as /tmp: others cannot move it)
    assert unix.runtime_dir() == base / "sharedarrays"
    os.chmod(base, 0o711)
    assert unix.runtime_dir() == base / "sharedarrays"


def test_an_xdg_runtime_dir_of_another_user_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_stat = os.stat
    base = tmp_path / "run"
    base.mkdir(mode=0o700)

    def stat_(path: object, *args: object, **kwargs: object) -> os.stat_result:
        st_ = real_stat(path, *args, **kwargs)  # type: ignore[arg-type]
        if str(path) == str(base):  # (as if another user (not root) owned it)
            fields = list(st_)
            fields[stat.ST_UID] = os.getuid() + 4242
            return os.stat_result(fields)
        return st_

    monkeypatch.setattr(unix.os, "stat", stat_)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    with pytest.raises(sa.PermissionDenied, match=r"belongs to another user \(uid"):
        unix.runtime_dir()


def test_sizes_that_are_not_positive_ints_are_an_inconsistent_reply() -> None:
    # (2097152.0 == 2097152 passed the importer's check, and ctypes raised ArgumentError)
    from sharedarrays.protocol.handles import Handles

    for body in (b"[2097152.0]", b"[true]", b"[0]", b"[-4096]", b'["4096"]', b"[[4096]]"):
        with pytest.raises(sa.PayloadError, match="inconsistent"):
            Handles.decode(body)
    assert Handles.decode(b"[4096, 8192]").sizes == [4096, 8192]


def test_recv_into_takes_a_message_of_any_length_up_to_its_size_with_its_fds() -> None:
    # (the buffer is the message's own length, peeked: a long one comes whole, one over
    # ``size`` is cut and says so, an end of file is an empty message)
    import socket as socket_

    left, right = socket_.socketpair(socket_.AF_UNIX, socket_.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        long = os.urandom(200_000)
        socket_.send_fds(left, [long], [r, w])
        fds: list[int] = []
        msg, flags = unix.recv_into(right, 1 << 20, 4, fds)
        assert msg == long and not flags & socket_.MSG_TRUNC and len(fds) == 2
        for fd in fds:
            os.close(fd)
        left.send(b"x" * 64)
        msg, flags = unix.recv_into(right, 16, 4, [])
        assert msg == b"x" * 16 and flags & socket_.MSG_TRUNC
        left.send(b"next")
        msg, flags = unix.recv_into(right, 16, 4, [])
        assert msg == b"next" and not flags & socket_.MSG_TRUNC
        left.close()
        assert unix.recv_into(right, 16, 4, [])[0] == b""
    finally:
        for fd in (r, w):
            os.close(fd)
        left.close()
        right.close()


def test_a_ctrl_c_as_fds_arrive_leaves_them_owned(monkeypatch: pytest.MonkeyPatch) -> None:
    # (a SIGINT handled between socket.recv_fds returning and its fds being stored raised
    # KeyboardInterrupt there: the fds had no owner, their memory stayed pinned)
    import signal
    import socket as socket_

    left, right = socket_.socketpair(socket_.AF_UNIX, socket_.SOCK_SEQPACKET)
    r, w = os.pipe()
    real = socket_.recv_fds

    def interrupted(*args: object) -> object:
        got = real(*args)  # type: ignore[arg-type]
        os.kill(os.getpid(), signal.SIGINT)  # (handled at the next bytecode)
        for _ in range(1000):  # (lets the eval loop see it here, where it would have)
            pass
        return got

    class Interrupted(Exception):  # (as KeyboardInterrupt, which would stop pytest)
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        socket_.send_fds(left, [b"reply"], [r, w])
        monkeypatch.setattr(unix.socket, "recv_fds", interrupted)
        fds: list[int] = []
        with pytest.raises(Interrupted):
            unix.recv_into(right, 64, 4, fds)
        assert len(fds) == 2  # owned by the caller, who closes them
        for fd in fds:
            os.close(fd)
        assert signal.getsignal(signal.SIGINT) is interrupt
        monkeypatch.setattr(unix.socket, "recv_fds", real)
        socket_.send_fds(left, [b"again"], [r])
        fds = []
        assert unix.recv_into(right, 64, 4, fds)[0] == b"again" and len(fds) == 1
        os.close(fds[0])
    finally:
        signal.signal(signal.SIGINT, previous)
        for fd in (r, w):
            os.close(fd)
        left.close()
        right.close()


def test_wrong_secret_is_refused(fd_baseline: None) -> None:
    a = sa.zeros(16, device="cpu", pack=False)
    server = transport.server_address()
    with pytest.raises(sa.PermissionDenied, match="secret"):
        client.fetch_handles(server, os.getpid(), a.allocation.id, b"\0" * 32)


def test_unknown_allocation_is_unavailable(fd_baseline: None) -> None:
    server = transport.server_address()
    with pytest.raises(sa.HandleUnavailable, match="no longer available"):
        client.fetch_handles(server, os.getpid(), "ab" * 16, b"\0" * 32)


def test_dead_server_is_unavailable(tmp_path: Path, fd_baseline: None) -> None:
    with pytest.raises(sa.HandleUnavailable, match="has exited"):
        client.fetch_handles(str(tmp_path / "gone.sock"), 12345, "ab" * 16, b"\0" * 32)


def test_fetch_returns_working_fds(fd_baseline: None) -> None:
    a = sa.from_array(np.arange(10.0), device="cpu", pack=False)
    sizes, fds, exports = client.fetch_handles(
        transport.server_address(), os.getpid(), a.allocation.id, a.allocation.secret
    )
    try:
        assert sizes == a.allocation.chunk_sizes() and len(fds) == 1 and exports == ()
        assert os.fstat(fds[0]).st_size == sizes[0]
        assert os.fstat(fds[0]).st_ino == os.fstat(a.allocation.chunks[0].fd).st_ino
    finally:
        for fd in fds:
            os.close(fd)
    assert a.allocation.served[-1].pid == os.getpid()


def _fetch_and_close(a: sa.SharedDeviceArray) -> None:
    _, fds, _ = client.fetch_handles(
        transport.server_address(), os.getpid(), a.allocation.id, a.allocation.secret
    )
    for fd in fds:
        os.close(fd)


def test_requests_to_one_server_reuse_one_connection(fd_baseline: None) -> None:
    a, b = (sa.zeros(16, device="cpu", pack=False) for _ in range(2))
    server = transport.server_address()
    client.close_connections()
    _fetch_and_close(a)
    kept = process.STATE.connections.by_server[server]
    _fetch_and_close(b)
    _fetch_and_close(a)
    assert process.STATE.connections.by_server[server] is kept  # no new connect per request
    assert process.STATE.server.server is not None
    deadline = time.monotonic() + 10  # the server thread files the connection after replying
    while len(process.STATE.server.server.conns) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(process.STATE.server.server.conns) == 1
    assert transport.open_connections() == 2  # this process at both ends
    client.close_connections()
    assert server not in process.STATE.connections.by_server


def test_notices_to_one_server_reuse_one_connection(fd_baseline: None) -> None:
    """A notice per result returned from a worker: each goes on the connection kept to that
    server, not a new one (and a fetch may take that connection next)."""
    a = sa.zeros(16, device="cpu", pack=False)
    server = transport.server_address()
    client.close_connections()

    def notify() -> socket.socket:
        client.start_notifier()
        client.queue_notice([server], Kind.DONE, a.allocation.id, a.allocation.secret, count=0)
        deadline = time.monotonic() + 10
        while client.pending_notices() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.pending_notices() == 0
        return process.STATE.connections.by_server[server]

    try:
        kept = notify()
        assert notify() is kept and notify() is kept  # no new connect per notice
        _fetch_and_close(a)  # a request takes the same connection
        assert process.STATE.connections.by_server[server] is kept
    finally:
        client.close_connections()
        a.close()


def test_a_kept_connection_the_server_dropped_is_replaced(
    monkeypatch: pytest.MonkeyPatch, fd_baseline: None
) -> None:
    a = sa.zeros(16, device="cpu", pack=False)
    server = transport.server_address()
    client.close_connections()
    _fetch_and_close(a)
    kept = process.STATE.connections.by_server[server]
    monkeypatch.setattr(handle_server, "MAX_CONNECTIONS", 1)
    other = client._connect(server, "gone")  # the server closes the longest idle: ours
    try:
        other.sendall(b"?")  # a malformed request: answered, so the eviction has happened
        assert other.recv(64)[:4] == b"SAR1"
        _fetch_and_close(a)  # sent on the dead connection first, then once more anew
        assert process.STATE.connections.by_server[server] is not kept
    finally:
        other.close()
        client.close_connections()


@pytest.mark.skipif(sys.platform != "linux", reason="fork")
def test_a_forked_child_does_not_use_its_parents_connections(tmp_path: Path) -> None:
    a = sa.zeros(16, device="cpu", pack=False, allow_pids=[os.getpid()])
    _fetch_and_close(a)  # the parent now keeps a connection, authenticated as its pid
    blob = pickle.dumps(a)
    server = transport.server_address()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports by exit status
        code = 3
        try:
            try:
                client._fetch(server, 1, a.allocation.id, a.allocation.secret, None, None)
                code = 1  # served as the parent
            except sa.PermissionDenied:
                code = 0  # asked on a connection of its own
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert pickle.loads(blob).allocation is a.allocation


def test_a_payload_whose_secret_was_swapped_is_refused_by_the_exporter(tmp_path: Path) -> None:
    a = sa.zeros(8, device="cpu", pack=False)
    blob = pickle.dumps(a)
    start = blob.index(MAGIC)
    length = int.from_bytes(blob[start - 4 : start], "little")
    payload = blob[start : start + length]
    doc = json.loads(payload[len(MAGIC) + TAG_BYTES :])
    doc["secret"] = "11" * 32
    body = json.dumps(doc, separators=(",", ":")).encode()
    forged = MAGIC + _tag(body, bytes.fromhex(doc["secret"])) + body
    path = tmp_path / "forged.bin"
    path.write_bytes(forged)
    code = f"import sharedarrays as sa; sa.load(open({str(path)!r}, 'rb').read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "PermissionDenied" in out.stderr and "secret" in out.stderr


@contextlib.contextmanager
def _server_opened_to_others(open_socket: bool) -> Iterator[str]:
    """This process's handle server path; with ``open_socket`` its directory and socket are
    opened to every user for the block, so that only the SO_PEERCRED check stands."""
    server = transport.server_address()
    directory = os.path.dirname(server)
    # (the run's private XDG_RUNTIME_DIR above it, tests/conftest.py, is opened likewise)
    dirs = [d for d in (directory, os.environ.get("XDG_RUNTIME_DIR")) if d]
    if open_socket:
        for d in dirs:
            os.chmod(d, 0o711)
        os.chmod(server, 0o777)
    try:
        yield server
    finally:
        for d in dirs:
            os.chmod(d, 0o700)
        os.chmod(server, 0o600)


_RAW_CLIENT = """
import socket, struct, sys
path, alloc_id, secret = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect(path)
except PermissionError:
    print("EACCES"); sys.exit(0)
s.sendall(struct.pack("4s16s32s", b"SAH1", bytes.fromhex(alloc_id), secret))
msg, fds, _, _ = socket.recv_fds(s, 4096, 10)
print("STATUS", msg[4], "FDS", len(fds))
"""


@pytest.mark.parametrize("open_socket", [False, True], ids=["private-dir", "socket-opened"])
def test_another_user_is_denied(open_socket: bool) -> None:
    """A second OS user holding the right secret gets no fds: the 0700 directory stops it,
    and where the socket is reachable, the SO_PEERCRED uid check does."""
    user = other_user()
    python = "/usr/bin/python3"
    if user is None or not os.access(python, os.X_OK):
        pytest.skip("needs root (to create a second OS user), useradd and /usr/bin/python3")
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    with _server_opened_to_others(open_socket) as server:
        out = subprocess.run(
            [python, "-c", _RAW_CLIENT, server, a.allocation.id, a.allocation.secret.hex()],
            user=user,
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
    assert out.returncode == 0, out.stderr
    if open_socket:
        assert out.stdout.split() == ["STATUS", str(Status.BAD_UID), "FDS", "0"]
    else:
        assert out.stdout.strip() == "EACCES"
    assert a.allocation.served == ()


def test_stale_socket_files_are_removed() -> None:
    d = unix.runtime_dir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    stale = d / f"{dead}-deadbeef.sock"
    stale.touch()
    handle_server._remove_stale_sockets(d)
    assert not stale.exists()


@pytest.mark.parametrize("take", ["0", "1"], ids=["asked", "taken"])
@pytest.mark.parametrize("open_socket", [False, True], ids=["private-dir", "socket-opened"])
def test_another_user_loading_a_payload_gets_permission_denied(
    open_socket: bool, take: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole load path as a second OS user: a forked child drops to that user, forgets
    the parent's mappings and loads the payload (also trying to take the fds itself: the
    kernel refuses another user)."""
    monkeypatch.setenv("SHAREDARRAYS_TAKE_FDS", take)
    user = other_user()
    if user is None:
        pytest.skip("needs root (to create a second OS user) and useradd")
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    blob = pickle.dumps(a)
    with _server_opened_to_others(open_socket):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 3
            try:
                become(user)
                from sharedarrays.process import STATE

                STATE.memory.registry.clear()
                os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp()  # (its own: it gets as far
                try:  # as asking, or taking, before it is refused)
                    pickle.loads(blob)
                    code = 1
                except sa.PermissionDenied:  # (the take refused: by the kernel, or Yama's
                    tried = take == "1" and unix._yama_allows(os.getppid())  # scope first)
                    code = 4 if tried and os.getppid() not in STATE.connections.refused else 0
                except BaseException:
                    code = 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert a.allocation.served == ()


def test_exporter_of_exporter_owned_memory_waits_then_names_its_holders(tmp_path: Path) -> None:
    """SHAREDARRAYS_EXIT_WAIT bounds the wait; stderr then says who still held what, once."""
    import gc
    import time

    from conformance_workers import start_exporter  # (registers host-pointer here)

    path, go = tmp_path / "payload", tmp_path / "go"
    exporter, a = start_exporter(path, "cpu", "host-pointer", go, exit_wait=1)
    try:
        go.touch()
        start = time.monotonic()
        _, err = exporter.communicate(timeout=60)
        waited = time.monotonic() - start
        assert exporter.returncode == 0
        assert 0.9 <= waited < 30, waited
        assert "still hold" in err and f"by pid {os.getpid()}" in err and "host-pointer" in err
        # (said once, after one wait: the exit hooks run twice in a main process)
        assert err.count("still hold") == 1, err
        assert a.get().sum() == float(np.arange(4096, dtype=np.float32).sum())  # (a memfd)
    finally:
        if exporter.poll() is None:
            exporter.kill()
            exporter.communicate()
    a.close()
    del a
    gc.collect()


def test_a_pointer_backends_handle_comes_only_from_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The payload never carries the portable handle: the server sends it after the uid,
    secret and allow_pids checks, and records the importer as a holder."""
    import pointer_backend  # noqa: F401 - registers host-pointer here

    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "0")  # the payloads below are never loaded

    a = sa.from_array(np.arange(10.0), device="cpu", backend="host-pointer", pack=False)
    export = a.allocation.exports()[0]
    assert export not in pickle.dumps(a) and export.hex().encode() not in pickle.dumps(a)
    server = transport.server_address()
    sizes, fds, exports = client.fetch_handles(
        server, os.getpid(), a.allocation.id, a.allocation.secret
    )
    try:
        assert sizes == a.allocation.chunk_sizes() and exports == (export,) and len(fds) == 1
    finally:
        for fd in fds:
            os.close(fd)
    with pytest.raises(sa.PermissionDenied):
        client.fetch_handles(server, os.getpid(), a.allocation.id, b"\0" * 32)


_SEND_CLOSED = """
import socket, sys
from sharedarrays.protocol.handles import Kind, Reply, Request
path, alloc_id, secret = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
    s.connect(path)
    s.sendall(Request(Kind.CLOSED, alloc_id, secret).encode())
    print(Reply.decode(s.recv(64)).status)
"""


def _first_message_length(path: str) -> int:
    """Listen at ``path`` (bound under another name until it listens), accept one connection
    and return the length of its first message (``-1``: none came in 20 s)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(f"{path}.new")
        os.chmod(f"{path}.new", 0o777)
        listener.listen(1)
        os.rename(f"{path}.new", path)
        listener.settimeout(20)
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(20)
                return len(conn.recv(1024))
        except OSError:
            return -1


@pytest.mark.timeout(60)
def test_a_release_notice_goes_to_no_socket_of_another_user() -> None:
    """A notice carries the allocation's secret: the notifier sends it only where the peer
    runs as this user, whatever path an importer named as its own server (here a socket
    another OS user listens on), and to a socket of this user as before."""
    from concurrent.futures import ThreadPoolExecutor

    from forking import in_forked_child

    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    alloc = a.allocation

    def sent_to(path: str, user: str | None) -> int:
        def listen() -> int:
            if user is not None:
                become(user)
            return _first_message_length(path)

        with ThreadPoolExecutor(1) as pool:
            listening = pool.submit(in_forked_child, listen)
            deadline = time.monotonic() + 20
            while not os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.01)
            client.start_notifier()
            client.queue_notice([path], Kind.RELEASED, alloc.id, alloc.secret)
            return int(listening.result(40))

    shared = Path(tempfile.mkdtemp(prefix="sa-notice-"))
    try:
        os.chmod(shared, 0o777)
        assert sent_to(str(shared / "mine.sock"), None) > 0  # this user's: told, as before
        user = other_user()
        if user is None:
            pytest.skip("needs root (to create a second OS user) and useradd")
        assert sent_to(str(shared / "theirs.sock"), user) in (0, -1)  # nothing sent
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        a.close()


def test_closed_notices_count_only_for_their_sender_with_the_secret() -> None:
    """SAC1 ("I closed it"): the server believes it only with the allocation's secret, and
    only for the process that sends it (SO_PEERCRED), so nobody can free memory that
    another importer still uses."""
    import pointer_backend  # noqa: F401 - registers host-pointer here

    from sharedarrays.memory.registry import draining_allocations

    a = sa.from_array(np.arange(10.0), device="cpu", backend="host-pointer", pack=False)
    alloc = a.allocation
    server = transport.server_address()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alloc.record_served(other.pid, None, 1)  # as if that process had imported it
        assert alloc.holders == (other.pid,)

        def send(secret: bytes) -> str:
            out = subprocess.run(
                [sys.executable, "-c", _SEND_CLOSED, server, alloc.id, secret.hex()],
                capture_output=True, text=True, check=True, timeout=60,
            )  # fmt: skip
            return out.stdout.strip()

        del a
        assert alloc in draining_allocations()  # kept for the holder
        assert send(b"\0" * 32) != "0"  # wrong secret: refused, nothing changes
        assert send(alloc.secret) == "0"  # right secret, but from a process that holds nothing
        assert alloc.holders == (other.pid,) and alloc in draining_allocations()
    finally:
        other.kill()
        other.wait()
    alloc.closed_by(None)  # the holder exited: the housekeeping's call frees it
    assert alloc not in draining_allocations() and alloc.chunk_fds() == []


# ---------------------------------------------------------------------------------------------
# the handle server under pressure, and what a load may raise

EXPORTER = """
import json, os, pickle, resource, sys
import numpy as np
import sharedarrays as sa
from sharedarrays.transport import handles as transport
a = sa.from_array(np.arange(1000.0), device="cpu", pack=False)
blob = pickle.dumps(a)
spare = int(sys.argv[1])
if spare:  # room for ``spare`` more fds: the handle server runs out first
    n = len(os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + spare, hard))
print(json.dumps({"blob": blob.hex(), "server": transport.server_address(),
                  "id": a.allocation.id, "secret": a.allocation.secret.hex()}), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _exporter(spare_fds: int = 0) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """A child process sharing ``np.arange(1000.0)``: itself and what it printed (the
    payload ``blob`` in hex, its ``server``, the allocation ``id`` and ``secret``)."""
    from keeper_helpers import close_pipes, read_json_line, spawn

    child = spawn(EXPORTER.replace("sys.argv[1]", str(spare_fds)))
    try:
        yield child, {k: str(v) for k, v in read_json_line(child).items()}
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait(30)
        close_pipes(child)


def _raw(server: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    sock.connect(server)
    return sock


@pytest.mark.timeout(120)
def test_a_handle_server_out_of_fds_keeps_serving() -> None:
    """EMFILE on accept (the exporter's fd table full) closes the longest idle connection
    and goes on; it used to end the server thread, and every later load waited 10 s."""
    with _exporter(spare_fds=8) as (_, out):
        flood = [_raw(out["server"]) for _ in range(40)]  # more than the exporter has fds for
        try:
            start = time.monotonic()
            b = pickle.loads(bytes.fromhex(out["blob"]))
            took = time.monotonic() - start
            assert b.get().sum() == np.arange(1000.0).sum()
            for s in flood:
                s.setblocking(False)
            closed = sum(1 for s in flood if closed_by_peer(s))
        finally:
            for s in flood:
                s.close()
        assert closed > 0, "the server never ran out of fds: the test did not test"
        assert took < 5, f"a load took {took:.1f} s"
        b.close()
        del b
        gc.collect()
        sa_registry.drop_parked()
        ms = took * 1000
        print(f"EMFILE: 40 idle connections, {closed} closed by the server, load in {ms:.1f} ms")


@pytest.mark.timeout(180)
def test_importers_that_never_read_their_replies_do_not_stall_the_server() -> None:
    """Five connections queue requests and never read the replies: the server drops each
    when its socket buffer is full instead of waiting 10 s on it, and a load goes through."""
    import threading

    with _exporter() as (_, out):
        request = Request(Kind.FETCH, out["id"], bytes.fromhex(out["secret"])).encode()
        sent = [0] * 5
        floods = [_raw(out["server"]) for _ in range(5)]

        def flood(i: int) -> None:
            sock = floods[i]
            sock.settimeout(15)
            try:
                for _ in range(1000):
                    sock.send(request)
                    sent[i] += 1
            except OSError:
                pass  # dropped by the server (EPIPE), or it stopped reading (15 s)

        threads = [threading.Thread(target=flood, args=(i,)) for i in range(5)]
        try:
            for t in threads:
                t.start()
            time.sleep(0.5)  # the floods are queued
            start = time.monotonic()
            b = pickle.loads(bytes.fromhex(out["blob"]))
            took = time.monotonic() - start
            assert b.get().sum() == np.arange(1000.0).sum()
        finally:
            for t in threads:
                t.join(30)
            for s in floods:
                s.setblocking(False)
            dropped = sum(1 for s in floods if closed_by_peer(s))
            for s in floods:
                s.close()
        assert took < 5, f"a load waited {took:.1f} s behind importers that never read"
        assert dropped == 5, f"{5 - dropped} flooding connections kept ({sent} sent)"
        b.close()
        del b
        gc.collect()
        sa_registry.drop_parked()
        ms = took * 1000
        print(f"slow readers: {sent} requests sent, {dropped} of 5 dropped, load in {ms:.1f} ms")


def _dead_pid() -> int:
    """A pid no process has now (one that just exited)."""
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(p.stdout)


def test_a_live_server_whose_pid_means_nothing_here_keeps_its_socket(tmp_path: Path) -> None:
    """A process in another pid namespace (a container sharing the runtime directory) has a
    pid that does not run here: its socket survives the cleanup while it listens; a socket
    nothing listens on any more is removed."""
    directory = tmp_path / "rt"
    directory.mkdir(mode=0o700)
    pid = _dead_pid()
    live = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    live.bind(str(directory / f"{pid}-11111111.sock"))
    live.listen(1)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dead.bind(str(directory / f"{pid}-22222222.sock"))
    dead.listen(1)
    dead.close()  # its process died: the file stays
    (directory / f"{pid}-33333333.sock").touch()
    try:
        handle_server._remove_stale_sockets(directory)
        left = sorted(p.name for p in directory.iterdir())
        assert left == [f"{pid}-11111111.sock"]
    finally:
        live.close()


def _forged(blob: bytes, **fields: object) -> bytes:
    """``blob``'s payload with ``fields`` changed, sealed again with its own secret (what a
    process holding the payload can do)."""
    start = blob.index(MAGIC)
    length = int.from_bytes(blob[start - 4 : start], "little")
    doc = json.loads(blob[start + len(MAGIC) + TAG_BYTES : start + length])
    doc.update(fields)
    body = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + _tag(body, bytes.fromhex(doc["secret"])) + body


@pytest.mark.parametrize("kind", ["file", "through-a-file", "symlink-loop", "datagram"])
def test_a_forged_server_path_is_a_shared_array_error(tmp_path: Path, kind: str) -> None:
    """Whatever a payload names as its server, a load fails with a SharedArrayError that
    says what is wrong, never a raw OSError (ENOTDIR, ELOOP, EPROTOTYPE...)."""
    a = sa.zeros(8, device="cpu", pack=False)
    regular = tmp_path / "file"
    regular.write_text("not a socket")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(str(tmp_path / "dgram"))
    server = {
        "file": regular,
        "through-a-file": regular / "x.sock",
        "symlink-loop": loop,
        "datagram": tmp_path / "dgram",
    }[kind]
    blob = _forged(pickle.dumps(a), id=os.urandom(16).hex(), server=str(server))
    try:
        with pytest.raises(sa.SharedArrayError) as e:
            sa.load(blob)
        assert not isinstance(e.value, (sa.PayloadError, sa.PermissionDenied)), e.value
    finally:
        dgram.close()
    print(f"{kind}: {type(e.value).__name__}: {e.value}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("taken", [False, True])
def test_loads_from_a_stopped_exporter_fail_as_handle_unavailable(
    monkeypatch: pytest.MonkeyPatch, taken: bool
) -> None:
    """100 loads at once from an exporter stopped with SIGSTOP: its listen queue (64) fills,
    and connect says EAGAIN to the rest. Each is retried until the timeout; every load
    fails with HandleUnavailable, none with a raw BlockingIOError. Where the loader may
    take the fds out of the exporter (its child here), all load: nothing is asked."""
    from concurrent.futures import ThreadPoolExecutor

    from keeper_helpers import stop, takes_refused

    if taken and (why := takes_refused()):
        pytest.skip(why)
    monkeypatch.setenv("SHAREDARRAYS_TAKE_FDS", "1" if taken else "0")
    monkeypatch.setattr(client, "TIMEOUT", 2.0)
    with _exporter() as (child, out):
        blob = bytes.fromhex(out["blob"])
        stop(child.pid)  # (every thread: kill alone left its server answering now and then)

        def load(_: int) -> str:
            try:
                pickle.loads(blob)
            except Exception as e:
                return type(e).__name__
            return "loaded"

        start = time.monotonic()
        with ThreadPoolExecutor(100) as pool:
            outcomes = list(pool.map(load, range(100)))
        took = time.monotonic() - start
        os.kill(child.pid, signal.SIGCONT)
    counts = {k: outcomes.count(k) for k in set(outcomes)}
    print(f"stopped exporter: 100 concurrent loads in {took:.1f} s: {counts}")
    assert counts == {"loaded" if taken else "HandleUnavailable": 100}, counts


def _squat(path: Path, user: str) -> None:
    """Make ``path`` a private directory of ``user`` (what that user could do first)."""
    pw = pwd.getpwnam(user)
    path.mkdir(mode=0o700)
    os.chown(path, pw.pw_uid, pw.pw_gid)


def test_the_runtime_dir_passes_over_names_another_user_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = other_user()
    if user is None:
        pytest.skip("needs root (to create a second OS user) and useradd")
    uid = os.getuid()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(unix, "RUN_USER", tmp_path / "run")
    _squat(tmp / f"sharedarrays-{uid}", user)
    assert unix.runtime_dir() == tmp / f"sharedarrays-{uid}-1"
    assert unix.runtime_dir() == tmp / f"sharedarrays-{uid}-1"  # found again
    st_ = os.lstat(tmp / f"sharedarrays-{uid}-1")
    assert st_.st_uid == uid and st_.st_mode & 0o777 == 0o700
    # every name taken: a clear error saying what to do
    monkeypatch.setattr(unix, "RUNTIME_DIR_TRIES", 3)
    os.rmdir(tmp / f"sharedarrays-{uid}-1")
    _squat(tmp / f"sharedarrays-{uid}-1", user)
    _squat(tmp / f"sharedarrays-{uid}-2", user)
    with pytest.raises(sa.PermissionDenied, match="XDG_RUNTIME_DIR"):
        unix.runtime_dir()
    # systemd's /run/user/<uid>, when it is ours, comes first
    (tmp_path / "run" / str(uid)).mkdir(parents=True, mode=0o700)
    assert unix.runtime_dir() == tmp_path / "run" / str(uid) / "sharedarrays"


SQUATTED_EXPORTER = """
import json, pickle, sys
import numpy as np
import sharedarrays as sa
from sharedarrays.transport import handles as transport, keeper
a = sa.from_array(np.arange(10.0), device="cpu", name="squatted")
b = sa.from_array(np.arange(20.0), device="cpu", pack=False)
print(json.dumps({"blob": pickle.dumps(b).hex(), "server": transport.server_address(),
                  "keeper": keeper.running_pid()}), flush=True)
sys.stdin.read()
"""

SQUATTED_IMPORTER = """
import json, pickle, sys
import sharedarrays as sa
a = sa.attach("squatted")
b = pickle.loads(bytes.fromhex(sys.stdin.read()))
print(json.dumps([float(a.get().sum()), float(b.get().sum())]))
sa.unlink("squatted")
"""


@pytest.mark.timeout(120)
def test_a_squatted_runtime_dir_does_not_stop_sharing() -> None:
    """Another user made ``<tmp>/sharedarrays-<uid>`` first: processes of this user still
    share arrays by pickle and by name, all through the next name."""
    from keeper_helpers import close_pipes, lock_holder, read_json_line, wait_gone

    user = other_user()
    if user is None:
        pytest.skip("needs root (to create a second OS user) and useradd")
    uid = os.getuid()
    tmp = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))  # short: socket paths <= 107 bytes
    os.chmod(tmp, 0o1777)
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
    env.update(TMPDIR=str(tmp), SHAREDARRAYS_KEEPER_IDLE="2")
    expected = tmp / f"sharedarrays-{uid}-1"
    exporter = None
    try:
        _squat(tmp / f"sharedarrays-{uid}", user)
        exporter = subprocess.Popen(
            [sys.executable, "-c", SQUATTED_EXPORTER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )  # fmt: skip
        out = read_json_line(exporter)
        assert Path(str(out["server"])).parent == expected
        assert lock_holder(expected) == out["keeper"]
        r = subprocess.run(
            [sys.executable, "-c", SQUATTED_IMPORTER],
            input=str(out["blob"]), capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout) == [45.0, 190.0]
    finally:
        if exporter is not None:
            exporter.kill()
            exporter.wait(30)
            close_pipes(exporter)
        kpid = lock_holder(expected)
        if kpid is not None:
            os.kill(kpid, signal.SIGTERM)
            wait_gone(kpid)
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_handle_server_that_cannot_start_is_a_shared_array_error(tmp_path: Path) -> None:
    """A runtime directory too deep for a Unix socket path (107 bytes): pickling says so with
    a SharedArrayError, not a raw OSError."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir(mode=0o700)
    code = (
        "import pickle, sharedarrays as sa\n"
        "try:\n"
        "    pickle.dumps(sa.zeros(4, device='cpu', pack=False))\n"
        "except sa.SharedArrayError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    env = dict(os.environ, XDG_RUNTIME_DIR=str(deep))
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("HandleUnavailable") and "XDG_RUNTIME_DIR" in r.stdout, r.stdout


@pytest.mark.timeout(60)
def test_a_server_that_drips_its_handles_is_given_up_on_in_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fd_baseline: None
) -> None:
    """A same-user server (say, named by a forged payload) that says 1000 fds will come and
    sends one at a time, each within the client's timeout: the fetch gives up within
    TIMEOUT for the whole reply (each message's timeout alone kept it waiting 1000 times as
    long), with HandleUnavailable, and closes the fds it got."""
    import threading

    from sharedarrays.protocol.handles import Reply

    monkeypatch.setattr(client, "TIMEOUT", 1.0)
    path = str(tmp_path / "drip.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    r, w = os.pipe()
    n = 1000

    def drip() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            header = Reply(Status.OK, n, json.dumps([4096] * n).encode()).encode()
            with contextlib.suppress(OSError):  # (until the client hangs up)
                socket.send_fds(conn, [header], [r])
                for _ in range(n - 1):
                    time.sleep(0.1)
                    socket.send_fds(conn, [b"+"], [r])

    thread = threading.Thread(target=drip, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with pytest.raises(sa.HandleUnavailable, match="did not answer"):
            client.fetch_handles(path, 1, "00" * 16, bytes(32))
        took = time.monotonic() - start
        thread.join(30)
        assert not thread.is_alive(), "the client kept the connection open"
    finally:
        listener.close()
        os.close(r)
        os.close(w)
    assert took < 30, f"the fetch waited {took:.0f} s for a server that drips its handles"


def test_a_handle_server_with_no_room_in_the_runtime_dir_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ENOSPC binding the server's socket (a full tmpfs): the error says to free room there,
    not that socket paths are limited to 107 bytes."""
    import errno

    def full() -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(process.STATE.server, "server", None)
    monkeypatch.setattr(transport, "HandleServer", full)
    with pytest.raises(sa.HandleUnavailable, match=r"No space left on device\. Free space"):
        transport.server_address()


def test_a_connection_kept_after_a_reply_of_many_fds_has_the_full_timeout() -> None:
    """A reply of more fds than one message carries sets the socket's timeout to what is
    left of the reply's deadline; the connection kept for the next request gets the full
    TIMEOUT back (the next request on it would have had a fraction of a second)."""
    a = sa.zeros(300 * 4096, dtype="uint8", device="cpu", chunk_bytes=4096, pack=False)
    alloc = a.allocation
    assert len(alloc.chunk_sizes()) > unix.FDS_PER_MESSAGE
    server = transport.server_address()
    client.close_connections()
    sizes, fds, _ = client.fetch_handles(server, os.getpid(), alloc.id, alloc.secret)
    for fd in fds:
        os.close(fd)
    assert len(fds) == len(sizes) == len(alloc.chunk_sizes())
    kept = client.take_connection(server)
    assert kept is not None
    try:
        assert kept.gettimeout() == client.TIMEOUT
    finally:
        kept.close()
    a.close()
    empty_cache()  # (its 300 chunk fds: not kept for reuse past this test)
