"""The handle server's handler table, and its refusal of another user."""

from __future__ import annotations

import json
import os
import socket

import pytest

import sharedarrays as sa
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
    assert transport._server is not None
    assert set(transport._server._handlers) == set(Kind)


def test_a_kind_without_a_handler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    a = sa.zeros(16, device="cpu", pack=False)
    path = transport.server_address()
    assert transport._server is not None
    request = Request(Kind.CLOSED, a.allocation.id, bytes(32))  # (a wrong secret: no effect)
    assert _ask(path, request.encode()).status == Status.GONE  # handled
    monkeypatch.delitem(transport._server._handlers, Kind.CLOSED)
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
    assert client.kept_connections() == 0


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
    assert client.kept_connections() == kept  # (below the tidy mark: no poll)
    fresh, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.keep_connection("/new", fresh)
    assert client.kept_connections() == kept + 1
    last, another = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.keep_connection("/newer", last)  # (at the tidy mark: the two hung up are closed)
    assert client.kept_connections() == kept + 2 - 2
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
        counts.append((client.kept_connections(), sockets()))
    # (a connection to each ended worker's server until TIDY_CONNECTIONS are kept; then
    # those are closed when the next is kept: never more, however many pools)
    tidy = client.TIDY_CONNECTIONS
    assert [kept for kept, _ in counts] == [1, 2, 3, 4, 1, 2][: len(counts)], counts
    # (and the sockets: the tidy in the fifth round closed four, opened one; other
    # sockets this process opens on first use may come in any round)
    assert tidy == 4 and counts[4][1] <= counts[3][1] - 2, counts


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:  # (the listing's own fd, closed by now)
        return ""
