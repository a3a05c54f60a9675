"""The handle server's handler table, and its refusal of another user."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import sharedarrays as sa
from sharedarrays import process
from sharedarrays.protocol import unix
from sharedarrays.protocol.handles import Kind, Reply, Request, Status
from sharedarrays.transport import client
from sharedarrays.transport import handles as transport
from sharedarrays.transport import server as handle_server


def _ask(path: str, data: bytes) -> Reply:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(data)
        msg, fds, _, _ = socket.recv_fds(s, 1 << 16, unix.FDS_PER_MESSAGE)
        for fd in fds:
            os.close(fd)
        return Reply.decode(msg)


def test_every_kind_has_a_handler() -> None:
    transport.server_address()
    assert process.STATE.server.server is not None
    assert set(process.STATE.server.server._handlers) == set(Kind)


def test_a_kind_without_a_handler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    a = sa.zeros(16, device="cpu", pack=False)
    path = transport.server_address()
    assert process.STATE.server.server is not None
    request = Request(Kind.CLOSED, a.allocation.id, bytes(32))  # (a wrong secret: no effect)
    assert _ask(path, request.encode()).status == Status.GONE  # handled
    monkeypatch.delitem(process.STATE.server.server._handlers, Kind.CLOSED)
    assert _ask(path, request.encode()).status == Status.BAD_REQUEST
    fetch = Request(Kind.FETCH, a.allocation.id, a.allocation.secret).encode()
    sizes = json.dumps(a.allocation.chunk_sizes()).encode()
    assert _ask(path, fetch) == Reply(Status.OK, len(a.allocation.chunk_sizes()), sizes)


@pytest.mark.parametrize(
    "data",
    [b"SAZ9" + bytes(48), b"SAR1" + bytes(48), b"", b"SAH1", b"SAH1" + bytes(48 + 200)],
    ids=["unknown-magic", "a-reply", "empty", "truncated", "oversized"],
)
def test_malformed_requests_are_answered_bad_request(data: bytes) -> None:
    path = transport.server_address()
    if not data:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(data)  # an empty message reads as a hang-up: the server closes
            assert s.recv(64) == b""
        return
    assert _ask(path, data) == Reply(Status.BAD_REQUEST)


def test_another_user_is_answered_bad_uid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server checks SO_PEERCRED's uid (faked here) before it reads the request, and
    the client turns the refusal into PermissionDenied."""
    a = sa.zeros(16, device="cpu", pack=False)
    path = transport.server_address()
    client.close_connections()

    def stranger(sock: socket.socket) -> unix.Credentials:
        real = unix.peer_credentials(sock)
        return unix.Credentials(real.pid, real.uid + 1, real.gid)

    monkeypatch.setattr(handle_server, "peer_credentials", stranger)
    request = Request(Kind.FETCH, a.allocation.id, a.allocation.secret).encode()
    assert _ask(path, request) == Reply(Status.BAD_UID)
    with pytest.raises(sa.PermissionDenied, match="another user"):
        client.fetch_handles(path, os.getpid(), a.allocation.id, a.allocation.secret)
    assert a.allocation.served == ()


def test_a_client_refuses_a_server_of_another_user(monkeypatch: pytest.MonkeyPatch) -> None:
    a = sa.zeros(16, device="cpu", pack=False)
    path = transport.server_address()
    client.close_connections()
    other = unix.Credentials(1, os.getuid() + 1, 0)
    monkeypatch.setattr(unix, "peer_credentials", lambda sock: other)
    with pytest.raises(sa.PermissionDenied, match="runs as another user"):
        client.fetch_handles(path, os.getpid(), a.allocation.id, a.allocation.secret)
    assert len(process.STATE.connections.by_server) == 0


def test_kept_connections_to_servers_that_hung_up_are_closed() -> None:
    client.close_connections()
    ends = []
    for n in range(client.TIDY_CONNECTIONS - 1):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.keep_connection(f"/gone/{n}", ours)
        ends.append(theirs)
    ends[0].close()  # (its server's process exited)
    ends[2].close()
    kept = client.TIDY_CONNECTIONS - 1
    assert len(process.STATE.connections.by_server) == kept  # (below the tidy mark: no poll)
    fresh, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.keep_connection("/new", fresh)
    assert len(process.STATE.connections.by_server) == kept + 1
    last, another = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.keep_connection("/newer", last)  # (at the tidy mark: the two hung up are closed)
    assert len(process.STATE.connections.by_server) == kept + 2 - 2
    client.close_connections()
    for end in (ends[1], other, another):
        end.close()


@pytest.mark.timeout(120)
def test_connections_to_ended_pool_workers_do_not_pile_up() -> None:
    # (each worker that returns an array has a handle server of its own; after its pool
    # ends, the parent's connection to it is closed when the next one is kept)
    import multiprocessing as mp

    import workers

    def sockets() -> int:
        fds = os.listdir("/proc/self/fd")
        return sum(_link(f"/proc/self/fd/{fd}").startswith("socket:") for fd in fds)

    client.close_connections()
    counts = []
    for n in range(1, 7):
        with mp.get_context("fork").Pool(1) as pool:
            got = pool.apply(workers.made_here, (n,))
        pool.join()
        assert got.get().tolist() == [float(n)] * n
        got.close()
        deadline = time.monotonic() + 10  # (the notifier tells the ended server: let it)
        while client.pending_notices() and time.monotonic() < deadline:
            time.sleep(0.01)
        counts.append((len(process.STATE.connections.by_server), sockets()))
    # (a connection to an ended worker's server is closed by the next notice to it, or
    # when TIDY_CONNECTIONS are kept and the next is kept: never more, however many pools;
    # other sockets this process opens on first use may come in any round)
    tidy = client.TIDY_CONNECTIONS
    assert all(kept <= tidy for kept, _ in counts), counts
    assert counts[-1][1] <= counts[0][1] + 2, counts  # (piling up: one more per pool)


def test_done_is_counted_and_not_answered() -> None:
    """DONE (a block's importer closed its last view) is a notice: the server counts it and
    sends nothing back, so that the importer's notifier never waits on a busy exporter."""
    a = sa.empty(1 << 16, "uint8", device="cpu", pack=False)
    alloc = a.allocation
    assert alloc.block is not None
    alloc.flight.note_sent()  # (a payload of it in flight, as a pickle for a Pool makes)
    assert not alloc.flight.all_done()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(transport.server_address())
        s.send(Request(Kind.DONE, alloc.id, alloc.secret, 1).encode())
        deadline = time.monotonic() + 10
        while not alloc.flight.all_done() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alloc.flight.all_done()
        s.setblocking(False)
        with pytest.raises(BlockingIOError):  # (an answer would have come before the count)
            s.recv(1 << 10)
    a.close()


def test_took_is_recorded_as_served_or_answered_released_when_too_late(
    tmp_path: os.PathLike[str],
) -> None:
    """TOOK (an importer took the chunk fds itself) records it as served, with no answer;
    for an allocation released and gone before the TOOK came, the server tells the importer
    RELEASED, as it tells those it served when it releases."""
    a = sa.empty(1 << 16, "uint8", device="cpu", pack=False)
    alloc = a.allocation
    path = os.path.join(tmp_path, "importer.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as importer:
        importer.bind(path)
        importer.listen()
        importer.settimeout(10)
        server = transport.server_address()
        client.send_notice(server, Kind.TOOK, alloc.id, alloc.secret, 1, path)
        deadline = time.monotonic() + 10
        while path not in alloc.served_servers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert path in alloc.served_servers() and alloc.served[-1].pid == os.getpid()
        gone_id = os.urandom(16).hex()
        client.send_notice(server, Kind.TOOK, gone_id, bytes(32), 1, path)
        conn, _ = importer.accept()
        with conn:
            conn.settimeout(10)
            told = Request.decode(conn.recv(1 << 10))
        assert (told.kind, told.alloc_id) == (Kind.RELEASED, gone_id)
    a.close()


def test_tell_sends_the_askers_warm_loads_once(tmp_path: os.PathLike[str]) -> None:
    """TELL (an exporter about to hand memory to the keeper) gets ``LOADED`` for the loads
    here of its payloads that were not told, before the answer; only for its own server."""
    a = sa.empty(1 << 16, "uint8", device="cpu", pack=False)
    alloc = a.allocation
    path = os.path.join(tmp_path, f"{os.getpid()}-0123abcd.sock")  # (the asker: this pid)
    for _ in range(3):
        alloc.flight.note_returned(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as asker:
        asker.bind(path)
        asker.listen()
        asker.settimeout(10)
        server = transport.server_address()
        other = os.path.join(tmp_path, f"{os.getpid() + 1}-0123abcd.sock")
        for reply_to, status in ((other, Status.BAD_REQUEST), (path, Status.OK)):
            request = Request(Kind.TELL, "0" * 32, bytes(32), reply_to=reply_to)
            assert _ask(server, request.encode()).status == status
        conn, _ = asker.accept()
        with conn:
            conn.settimeout(10)
            told = Request.decode(conn.recv(1 << 10))
            assert (told.kind, told.alloc_id, told.count) == (Kind.LOADED, alloc.id, 3)
            assert _ask(server, request.encode()).status == Status.OK  # (told once)
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(1 << 10)
    a.close()


def test_tell_loads_leaves_what_a_forked_child_did_not_adopt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A forked child keeps its parent's record of a CUDA or growable allocation (not adopted:
    still the parent's pid); its warm loads are the parent's to tell, not the child's too."""
    a = sa.empty(1 << 16, "uint8", device="cpu", pack=False)
    alloc = a.allocation
    alloc.flight.note_returned("/srv/exporter")
    sent: list[tuple[str, str, int]] = []
    monkeypatch.setattr(
        client, "send_notice", lambda path, kind, i, s, n, r: sent.append((path, i, n))
    )
    pid, alloc.pid = alloc.pid, os.getpid() + 1  # (inherited, not adopted)
    try:
        handle_server.tell_loads()
    finally:
        alloc.pid = pid
    assert sent == [] and alloc.flight.returned("/srv/exporter") == 1
    handle_server.tell_loads()  # (its own: told)
    assert sent == [("/srv/exporter", alloc.id, 1)]
    a.close()


@pytest.mark.timeout(60)
def test_settle_gives_up_on_a_full_accept_queue_at_once(tmp_path: os.PathLike[str]) -> None:
    """A server whose accept queue is full (a stopped process's) is silent at once: the
    others asked with it still get the whole bound to answer."""
    from sharedarrays.transport import node

    full = os.path.join(tmp_path, f"{os.getpid()}-0000000f.sock")
    queued = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stopped:
        stopped.bind(full)
        stopped.listen(0)
        while True:  # (fill its queue)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            queued.append(s)
            try:
                s.connect(full)
            except BlockingIOError:
                break
        own = transport.server_address()
        try:
            assert node.settle([full, own], 2.0) == [full]
        finally:
            for s in queued:
                s.close()


@pytest.mark.timeout(60)
def test_a_notice_sent_while_loading_never_waits_for_a_stopped_server(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``send_notice`` (a load's TOOK) to a server that reads nothing: once a connection's
    buffer is full it goes on a new one, then is dropped; it never waits NOTICE_TIMEOUT."""
    monkeypatch.setattr(client, "NOTICE_TIMEOUT", 10.0)
    path = os.path.join(tmp_path, "stopped.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as stopped:
        stopped.bind(path)
        stopped.listen(4)  # (never accepts, never reads)
        start = time.monotonic()
        for _ in range(2000):  # (more than one connection's buffer holds)
            client.send_notice(path, Kind.TOOK, "00" * 16, bytes(32), 1, "")
        took = time.monotonic() - start
        client.close_connections()
    assert took < client.NOTICE_TIMEOUT, f"2,000 notices took {took:.1f} s"


def test_loaded_notices_are_read_a_bounded_number_at_a_time() -> None:
    """One wake-up reads the notice that woke the server and at most ``READ_AHEAD`` more
    from that connection: the rest wait for the next round, behind the other connections."""
    transport.server_address()
    server = process.STATE.server.server
    assert server is not None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        notice = Request(Kind.LOADED, "00" * 16, bytes(32), 1)
        for _ in range(100):
            theirs.send(notice.encode())
        server._loaded(ours, unix.peer_credentials(ours), notice)  # (as if one was read)
        ours.setblocking(False)
        left = 0
        with pytest.raises(BlockingIOError):
            while ours.recv(1 << 10):
                left += 1
        assert left > 0, "every notice queued was read in one wake-up"
        assert left == 100 - handle_server.READ_AHEAD
    finally:
        ours.close()
        theirs.close()


FLOODER = """
import signal, socket, sys
signal.alarm(60)  # (killed by the test long before)
sock = socket.socket(fileno=int(sys.argv[1]))
sock.setblocking(True)  # (waits while the server's queue is full)
notice = bytes.fromhex(sys.argv[2])
for _ in range(1000):
    sock.send(notice)
print("flooding", flush=True)
while True:
    sock.send(notice)
"""


@pytest.mark.timeout(120)
def test_a_flood_of_loaded_notices_on_one_connection_does_not_stall_loads() -> None:
    """Eight processes send LOADED notices (no id, no secret) without end on one connection
    to this process's handle server; a FETCH on another connection is still answered (the
    server read the notices as long as they came, and answered nothing else)."""
    a = sa.zeros(16, device="cpu", pack=False)
    path = transport.server_address()
    notice = Request(Kind.LOADED, "00" * 16, bytes(32), 1).encode()
    flood = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    flood.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)  # (many queued at once)
    flooders: list[subprocess.Popen[str]] = []
    try:
        flood.settimeout(10)
        flood.connect(path)
        for _ in range(8):
            flooders.append(
                subprocess.Popen(
                    [sys.executable, "-I", "-c", FLOODER, str(flood.fileno()), notice.hex()],
                    pass_fds=[flood.fileno()],
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in flooders:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "flooding\n"  # (each would end in 60 s)
        fetch = Request(Kind.FETCH, a.allocation.id, a.allocation.secret).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(20)  # (unbounded reading: no answer while the flood lasts, 60 s)
            s.connect(path)
            s.send(fetch)
            msg, fds, _, _ = socket.recv_fds(s, 1 << 16, unix.FDS_PER_MESSAGE)
            for fd in fds:
                os.close(fd)
        assert Reply.decode(msg).status == Status.OK
        assert all(proc.poll() is None for proc in flooders)  # (flooding all along)
    finally:
        for proc in flooders:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()
        flood.close()


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # (the listing's own fd, closed by now)
        return ""
