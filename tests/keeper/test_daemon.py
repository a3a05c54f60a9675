"""The keeper daemon in this process (a thread): its handler table and its refusal of
another user. (tests/transport/test_keeper.py drives the real keeper process.)"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sharedarrays.keeper import daemon
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol import unix


@pytest.fixture
def keeper() -> Iterator[daemon.Keeper]:
    directory = Path(tempfile.mkdtemp(prefix="sa-k-", dir="/tmp"))
    k = daemon.Keeper(directory, idle=60.0, max_connections=8)
    thread = threading.Thread(target=k.serve_forever, daemon=True)
    thread.start()
    try:
        yield k
    finally:
        k.stop()
        thread.join(10)
        assert not thread.is_alive()
        shutil.rmtree(directory)


def _ask(k: daemon.Keeper, request: wire.Request, fds: list[int] | None = None) -> wire.Reply:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(k.path)
        socket.send_fds(s, [request.encode()], fds or [])
        msg, got, _, _ = socket.recv_fds(s, wire.MAX_MESSAGE, wire.MAX_FDS)
        for fd in got:
            os.close(fd)
        return wire.Reply.decode(msg)


def _sealed(size: int = 4096) -> int:
    fd = os.memfd_create("sharedarrays", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


def test_every_request_type_has_a_handler(keeper: daemon.Keeper) -> None:
    ops = {wire.Hello, wire.Keep, wire.Attach, wire.Fetch, wire.Release, wire.Unlink, wire.Drop}
    assert set(keeper._handlers) == ops | {wire.List, wire.Status}
    assert _ask(keeper, wire.Hello()) == wire.Reply(wire.OK, {"pid": os.getpid(), "version": 1})


def test_a_request_type_without_a_handler_is_refused(
    keeper: daemon.Keeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _ask(keeper, wire.List()) == wire.Reply(wire.OK, {"arrays": []})
    monkeypatch.delitem(keeper._handlers, wire.List)
    assert _ask(keeper, wire.List()) == wire.Reply(wire.ERROR, {"error": "unknown op 'list'"})
    assert keeper.errors == 1
    assert _ask(keeper, wire.Status()).status == wire.OK  # and it serves on


def test_keep_attach_unlink(keeper: daemon.Keeper) -> None:
    """The handlers of keep, attach and unlink, and the host backend's seal check."""
    unsealed = os.memfd_create("sharedarrays")
    os.ftruncate(unsealed, 4096)
    try:
        reply = _ask(
            keeper, wire.Keep("cd" * 16, bytes(32), "n0", [4096], {"backend": "host"}), [unsealed]
        )
    finally:
        os.close(unsealed)
    assert reply.status == wire.ERROR and "not sealed against shrinking" in reply.body["error"]
    fd = _sealed()
    keep = wire.Keep("ab" * 16, bytes(32), "n1", [4096], {"backend": "host"})
    try:
        reply = _ask(keeper, keep, [fd])
    finally:
        os.close(fd)
    assert reply.status == wire.OK and reply.body["name"] == "n1", reply
    # the connection that kept it is closed: it holds nothing, the name keeps it
    attached = _ask(keeper, wire.Attach("n1"))
    assert attached.status == wire.OK and attached.body["sizes"] == [4096]
    assert _ask(keeper, wire.Unlink("n1")) == wire.Reply(wire.OK, {})
    assert _ask(keeper, wire.Attach("n1")).status == wire.NOT_FOUND


def test_another_user_is_denied(keeper: daemon.Keeper, monkeypatch: pytest.MonkeyPatch) -> None:
    """SO_PEERCRED's uid (faked here) is checked on accept: DENIED, and the connection
    closed, before anything is read."""

    def stranger(sock: socket.socket) -> unix.Credentials:
        real = unix.peer_credentials(sock)
        return unix.Credentials(real.pid, real.uid + 1, real.gid)

    monkeypatch.setattr(daemon, "peer_credentials", stranger)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(keeper.path)
        reply = wire.Reply.decode(s.recv(1024))
        assert reply == wire.Reply(wire.DENIED, {"error": "another user"})
        assert s.recv(1024) == b""  # closed
    monkeypatch.undo()
    assert _ask(keeper, wire.Hello()).status == wire.OK


def test_a_keeper_out_of_open_files_says_so(keeper: daemon.Keeper) -> None:
    # (the kernel could not install the handles sent, MSG_CTRUNC with fewer fds than the
    # limit of a message: said as "message too long" before)
    import resource

    chunks = [_sealed() for _ in range(3)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(keeper.path)
    sock.send(wire.Hello().encode())  # (answered: the keeper has accepted the connection)
    sock.recv(wire.MAX_MESSAGE)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    fillers = [os.open("/dev/null", os.O_RDONLY)]
    while fillers[-1] < highest:  # (every free number below the highest taken)
        fillers.append(os.open("/dev/null", os.O_RDONLY))
    keep = wire.Keep("ef" * 16, bytes(32), "full", [4096] * 3, {"backend": "host"})
    try:
        # (the keeper runs in this process: room for one more fd, not three)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(fillers) + 2, hard))
        socket.send_fds(sock, [keep.encode()], chunks)
        msg, got, _, _ = socket.recv_fds(sock, wire.MAX_MESSAGE, wire.MAX_FDS)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        sock.close()
        for fd in chunks + fillers:
            os.close(fd)
    reply = wire.Reply.decode(msg)
    assert reply.status == wire.ERROR and "no room for the handles sent" in reply.body["error"]
    assert "ulimit -n" in reply.body["error"] and not got


@pytest.fixture
def idle_keeper() -> Iterator[tuple[daemon.Keeper, threading.Thread]]:
    """A keeper with ``idle=0`` (``SHAREDARRAYS_KEEPER_IDLE=0``), not yet serving: start its
    thread (it exits as soon as it holds nothing and nothing waits)."""
    directory = Path(tempfile.mkdtemp(prefix="sa-k-", dir="/tmp"))
    k = daemon.Keeper(directory, idle=0.0, max_connections=8)
    thread = threading.Thread(target=k.serve_forever, daemon=True)
    try:
        yield k, thread
    finally:
        k.stop()
        if thread.ident is None:
            k.close()  # (never served: serve_forever closes it)
        else:
            thread.join(10)
            assert not thread.is_alive()
        shutil.rmtree(directory)


@pytest.mark.timeout(60)
def test_an_idle_0_keeper_serves_what_it_accepted_and_exits_holding_nothing(
    idle_keeper: tuple[daemon.Keeper, threading.Thread],
) -> None:
    """``idle=0``: a connection made before the keeper serves is read and answered (it
    exited between accepting it and reading it before); a named array keeps the keeper
    until it is unlinked and its last holder let go; then it exits, its socket file gone."""
    k, thread = idle_keeper
    fd = _sealed()
    first = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        first.settimeout(10)
        first.connect(k.path)  # (waits to be accepted)
        keep = wire.Keep("ab" * 16, bytes(32), "idle0", [4096], {"backend": "host"})
        socket.send_fds(first, [keep.encode()], [fd])
        thread.start()
        assert wire.Reply.decode(first.recv(wire.MAX_MESSAGE)).status == wire.OK
    finally:
        os.close(fd)
        first.close()  # (the name keeps it)
    time.sleep(0.6)  # (past two rounds of the keeper's loop)
    assert thread.is_alive()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as second:
        second.settimeout(10)
        second.connect(k.path)
        second.send(wire.Attach("idle0").encode())
        msg, got, _, _ = socket.recv_fds(second, wire.MAX_MESSAGE, wire.MAX_FDS)
        for chunk in got:
            os.close(chunk)
        assert wire.Reply.decode(msg).status == wire.OK and len(got) == 1
        second.send(wire.Unlink("idle0").encode())
        assert wire.Reply.decode(second.recv(wire.MAX_MESSAGE)) == wire.Reply(wire.OK, {})
        time.sleep(0.6)
        assert thread.is_alive()  # (this connection holds the unlinked array)
    thread.join(10)  # (the last holder hung up: nothing held)
    assert not thread.is_alive()
    assert not os.path.exists(k.path)
    assert not os.path.exists(Path(k.path).with_name(daemon.ASIDE_NAME))


@pytest.mark.timeout(60)
def test_an_idle_keeper_waits_for_a_connection_that_has_not_asked_yet(
    idle_keeper: tuple[daemon.Keeper, threading.Thread],
) -> None:
    k, thread = idle_keeper
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(k.path)
        thread.start()
        time.sleep(0.6)  # (accepted, not read: past two rounds of the keeper's loop)
        assert thread.is_alive()
        s.send(wire.Hello().encode())
        assert wire.Reply.decode(s.recv(wire.MAX_MESSAGE)).status == wire.OK
        thread.join(10)  # (served, and nothing held: it goes, this connection open)
        assert not thread.is_alive()
        assert s.recv(wire.MAX_MESSAGE) == b""


def test_an_idle_keeper_does_not_exit_with_a_connection_waiting_to_be_accepted(
    idle_keeper: tuple[daemon.Keeper, threading.Thread],
) -> None:
    """The last check before exiting: the socket file is moved aside, then a connection
    that came before is found waiting; the file is put back and the keeper serves on."""
    k, _ = idle_keeper
    aside = Path(k.path).with_name(daemon.ASIDE_NAME)
    assert k._may_exit() is True  # (nothing waits: the file stays aside, close removes it)
    assert aside.exists() and not os.path.exists(k.path)
    os.rename(aside, k.path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(k.path)
        assert k._may_exit() is False
        assert os.path.exists(k.path) and not aside.exists()


@pytest.mark.timeout(60)
def test_a_keep_whose_last_fds_never_come_is_refused_in_time(
    keeper: daemon.Keeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``keep`` of 300 chunks whose sender stops after the first message of fds: refused
    after FDS_WAIT, every fd it got closed, and the keeper serves on."""
    monkeypatch.setattr(daemon, "FDS_WAIT", 0.5)
    before = len(os.listdir("/proc/self/fd"))
    fd = os.open("/dev/null", os.O_RDONLY)
    keep = wire.Keep("ab" * 16, bytes(32), "stalled", [4096] * 300, {})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10)
            s.connect(keeper.path)
            socket.send_fds(s, [keep.encode()], [fd] * wire.MAX_FDS)  # (and no more)
            reply = wire.Reply.decode(s.recv(wire.MAX_MESSAGE))
    finally:
        os.close(fd)
    assert reply.status == wire.ERROR and "did not come" in reply.body["error"]
    assert _ask(keeper, wire.Hello()).status == wire.OK and not keeper._entries
    deadline = time.monotonic() + 10  # (the keeper closes its ends of the connections)
    while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_keep_of_more_fds_than_one_message_is_kept_whole(keeper: daemon.Keeper) -> None:
    fd = os.open("/dev/null", os.O_RDONLY)
    keep = wire.Keep("cd" * 16, bytes(32), "many", [4096] * 300, {})
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(10)
            s.connect(keeper.path)
            unix.send_fds(s, keep.encode(), [fd] * 300)
            assert wire.Reply.decode(s.recv(wire.MAX_MESSAGE)).status == wire.OK
            s.send(wire.Attach("many").encode())
            msg, got, _, _ = socket.recv_fds(s, wire.MAX_MESSAGE, wire.MAX_FDS)
            complete = unix.recv_fds(s, 300, got)
            for f in got:
                os.close(f)
    finally:
        os.close(fd)
    assert wire.Reply.decode(msg).status == wire.OK and complete and len(got) == 300
