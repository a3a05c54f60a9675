"""Named arrays, parking, allow_pids, readonly, and the keeper process itself (host backend)."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import closed_by_peer
from keeper_helpers import (
    keeper_memfds,
    keeper_status,
    lock_holder,
    private_keeper,
    py,
    read_json_line,
    spawn,
    stop,
    wait_gone,
)

import sharedarrays as sa
from sharedarrays import process
from sharedarrays.cli import main as cli_main
from sharedarrays.memory import registry as sa_registry
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol import unix
from sharedarrays.transport import keeper

__all__ = ["private_keeper"]  # a fixture, used by name

CREATE = (
    "import sharedarrays as sa, numpy as np; "
    "sa.from_array(np.arange({n}, dtype=np.float32), device='cpu', name={name!r})"
)


def test_named_lifecycle_across_processes(private_keeper: Path) -> None:
    # created in one process that then exits
    py(CREATE.format(n=1000, name="features"))
    kpid = lock_holder(private_keeper)
    assert kpid is not None
    (info,) = sa.list_named()
    assert info.name == "features" and info.shape == (1000,) and info.dtype == np.float32
    assert info.size >= 4000 and info.pids == () and info.device == sa.Device("cpu")
    # attached in another, which writes; the data persists in the keeper after it exits
    py("import sharedarrays as sa; a = sa.attach('features'); a.array[:] += 1")
    a = sa.attach("features")
    np.testing.assert_array_equal(a.get(), np.arange(1000, dtype=np.float32) + 1)
    assert sa.list_named()[0].pids == (os.getpid(),)
    assert keeper_memfds(kpid) == 1
    # unlinked: no longer attachable, but our mapping stays valid until we release it
    sa.unlink("features")
    with pytest.raises(sa.NameNotFound):
        sa.attach("features")
    assert a.get()[5] == 6
    assert keeper_memfds(kpid) == 1  # we still hold it
    a.close()
    del a
    gc.collect()
    sa_registry.drop_parked()
    deadline = time.monotonic() + 10
    while keeper_memfds(kpid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert keeper_memfds(kpid) == 0, "the keeper kept an unlinked array after its last holder"
    # and, holding nothing, it exits after its idle time
    wait_gone(kpid)


@pytest.mark.usefixtures("no_cache")
def test_the_last_holder_exiting_frees_an_unlinked_array(private_keeper: Path) -> None:
    a = sa.zeros(100, device="cpu", name="x")
    holder = spawn(
        "import sharedarrays as sa, sys, json; a = sa.attach('x'); "
        "print(json.dumps({'sum': float(a.get().sum())}), flush=True); sys.stdin.read()"
    )
    try:
        assert read_json_line(holder) == {"sum": 0.0}
        kpid = lock_holder(private_keeper)
        assert kpid is not None
        assert sorted(sa.list_named()[0].pids) == sorted([os.getpid(), holder.pid])
        sa.unlink("x")
        a.close()
        del a
        gc.collect()
        assert keeper_memfds(kpid) == 1  # the holder still maps it
        holder.kill()  # a crash frees it too: the kernel closes its keeper connection
        holder.wait()
        deadline = time.monotonic() + 10
        while keeper_memfds(kpid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert keeper_memfds(kpid) == 0
    finally:
        holder.kill()
        holder.wait()


def test_name_exists_and_not_found(private_keeper: Path) -> None:
    a = sa.zeros(4, device="cpu", name="dup")
    with pytest.raises(sa.NameExists) as e:
        sa.ones(8, device="cpu", name="dup")
    assert isinstance(e.value, FileExistsError) and isinstance(e.value, sa.SharedArrayError)
    with pytest.raises(sa.NameNotFound) as nf:
        sa.attach("nope")
    assert isinstance(nf.value, FileNotFoundError)
    with pytest.raises(sa.NameNotFound):
        sa.unlink("nope")
    b = sa.attach("dup")
    assert b.allocation is a.allocation  # this process maps it already: the same mapping
    sa.unlink("dup")
    # the name is free again
    c = sa.zeros(2, device="cpu", name="dup")
    assert c.allocation is not a.allocation
    sa.unlink("dup")


@pytest.mark.parametrize(
    "bad", ["", "a" * 129, "has space", "../etc", "-x", "x/y/z", "ü", "a\0b", ".hidden"]
)
def test_invalid_names(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid array name"):
        sa.zeros(2, device="cpu", name=bad)
    with pytest.raises(ValueError):
        sa.attach(bad)


def test_no_keeper_means_not_found_and_starts_nothing(private_keeper: Path) -> None:
    with pytest.raises(sa.NameNotFound, match="no keeper"):
        sa.attach("x")
    assert sa.list_named() == []
    assert lock_holder(private_keeper) is None


def test_park_lets_a_plain_pickle_load_after_the_exporter_exited(private_keeper: Path) -> None:
    code = (
        "import sharedarrays as sa, numpy as np, pickle, sys; "
        "a = sa.from_array(np.arange(12.0).reshape(3, 4), device='cpu', pack=False); "
        "a.park(); a.park(); sys.stdout.buffer.write(pickle.dumps(a[1:, ::2]))"
    )
    exporter = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert exporter.returncode == 0, exporter.stderr.decode()
    b = pickle.loads(exporter.stdout)
    np.testing.assert_array_equal(b.get(), np.arange(12.0).reshape(3, 4)[1:, ::2])
    assert b.allocation.origin.pid != os.getpid()
    (info,) = sa.list_named(parked=True)
    assert info.name is None and info.pids == (os.getpid(),)
    assert sa.list_named() == []  # parked arrays are not named
    b.unpark()
    with pytest.raises(sa.NameNotFound):
        b.unpark()
    # unparked: a second loader has nowhere to get the handles from
    code = f"import pickle; pickle.loads({exporter.stdout!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "HandleUnavailable" in r.stderr and "keeper" in r.stderr


def test_park_after_unpark_parks_again(private_keeper: Path) -> None:
    # (the keeper kept the unlinked entry while the exporter mapped it, and a second park
    # found it and did nothing: the payload did not load after the exporter exited)
    code = (
        "import sharedarrays as sa, pickle, sys; a = sa.full(1000, 3.0, device='cpu'); "
        "a.park(); a.unpark(); a.park(); sys.stdout.buffer.write(pickle.dumps(a))"
    )
    env = {**os.environ, "SHAREDARRAYS_IN_FLIGHT": "0"}  # (no flight keeps it either)
    exporter = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=60, env=env
    )
    assert exporter.returncode == 0, exporter.stderr.decode()
    b = pickle.loads(exporter.stdout)
    assert float(b.get().sum()) == 3000.0
    b.unpark()
    b.close()


def test_unpark_leaves_a_name_alone(private_keeper: Path) -> None:
    n = sa.zeros(4, name="park-named", device="cpu")
    n.park()  # (a named array is kept already: parking it changes nothing)
    # (the keeper names it as it holds it: namespace/name)
    with pytest.raises(sa.NameNotFound, match=r"is named '[^']*/park-named', not parked"):
        n.unpark()
    assert [x.name for x in sa.list_named()] == ["park-named"]
    m = sa.attach("park-named")
    m.close()
    sa.unlink("park-named")
    n.close()


def test_unparked_payload_of_a_dead_exporter_is_a_clear_error(private_keeper: Path) -> None:
    code = (
        "import sharedarrays as sa, pickle, sys; "
        "sys.stdout.buffer.write(pickle.dumps(sa.zeros(4, device='cpu', pack=False)))"
    )
    env = dict(os.environ, SHAREDARRAYS_IN_FLIGHT="0")  # no payload in flight is kept
    blob = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=60, env=env
    ).stdout
    with pytest.raises(sa.HandleUnavailable, match="no keeper holds it"):
        pickle.loads(blob)


CHILD_LOADS = (
    "import sharedarrays as sa, pickle, sys, json\n"
    "blob = bytes.fromhex(sys.stdin.readline())\n"
    "try:\n"
    "    a = pickle.loads(blob); out = {'ok': float(a.get().sum())}\n"
    "except sa.SharedArrayError as e:\n"
    "    out = {'error': type(e).__name__, 'message': str(e)}\n"
    "print(json.dumps(out), flush=True)\n"
)


def _load_in(child: subprocess.Popen[str], blob: bytes) -> dict[str, object]:
    assert child.stdin is not None
    child.stdin.write(blob.hex() + "\n")
    child.stdin.flush()
    out = read_json_line(child)
    child.wait(30)
    return out


def test_allow_pids_at_the_handle_server_and_the_keeper(private_keeper: Path) -> None:
    allowed, other = spawn(CHILD_LOADS), spawn(CHILD_LOADS)
    try:
        a = sa.full(10, 2.0, device="cpu", allow_pids=[allowed.pid])
        assert a.allocation.allow_pids == frozenset([allowed.pid])
        blob = pickle.dumps(a)
        assert _load_in(allowed, blob) == {"ok": 20.0}
        denied = _load_in(other, blob)
        assert denied["error"] == "PermissionDenied" and "allow_pids" in str(denied["message"])
    finally:
        for p in (allowed, other):
            p.kill()
            p.wait()
    # the same check at the keeper, for names
    attach = (
        "import sharedarrays as sa, sys, json\n"
        "sys.stdin.readline()\n"
        "try:\n"
        "    out = {'ok': float(sa.attach('secret').get().sum())}\n"
        "except sa.PermissionDenied as e:\n"
        "    out = {'error': str(e)}\n"
        "print(json.dumps(out), flush=True)\n"
    )
    allowed, other = spawn(attach), spawn(attach)
    try:
        b = sa.full(3, 1.0, device="cpu", name="secret", allow_pids=[allowed.pid])
        assert sa.list_named()[0].allow_pids == (allowed.pid,)
        assert _load_in(allowed, b"") == {"ok": 3.0}
        assert "allow_pids" in str(_load_in(other, b"")["error"])
        sa.unlink("secret")
        del b
    finally:
        for p in (allowed, other):
            p.kill()
            p.wait()


READONLY_CHILD = (
    "import sharedarrays as sa, pickle, sys, json\n"
    "a = pickle.loads(bytes.fromhex(sys.stdin.readline()))\n"
    "out = {'readonly': a.readonly, 'sum': float(a.get().sum())}\n"
    "try:\n"
    "    a[0] = 5\n"
    "except ValueError as e:\n"
    "    out['setitem'] = str(e)\n"
    "try:\n"
    "    a.array[0] = 5\n"
    "except ValueError as e:\n"
    "    out['native'] = str(e)\n"
    "start = format(a.allocation.address, 'x')\n"
    "out['maps'] = [l.split()[1] for l in open('/proc/self/maps') if l.startswith(start + '-')]\n"
    "out['access'] = a.allocation.access\n"
    "try:  # a hostile importer asks for write access to its mapping\n"
    "    al = a.allocation\n"
    "    al.backend.set_access(al.address, al.size, 'rw')\n"
    "    out['escalate'] = 'allowed'\n"
    "except OSError as e:\n"
    "    out['escalate'] = 'refused: ' + str(e)\n"
    "print(json.dumps(out), flush=True)\n"
)


def test_readonly_importers_get_prot_read_mappings() -> None:
    a = sa.from_array(np.arange(4.0), device="cpu", readonly=True)
    assert not a.readonly  # the creator keeps writing
    a[0] = 10
    child = spawn(READONLY_CHILD)
    try:
        out = _load_in(child, pickle.dumps(a))
    finally:
        child.kill()
        child.wait()
    assert out["readonly"] is True and out["sum"] == 16.0
    assert "read-only" in str(out["setitem"]) and "read-only" in str(out["native"])
    assert out["maps"] == ["r--s"] and out["access"] == "r"
    assert out["escalate"].startswith("refused")  # the fd itself is read-only
    assert a.get()[0] == 10  # nothing was written


def test_readonly_named_arrays(private_keeper: Path) -> None:
    a = sa.full(4, 3.0, device="cpu", name="ro", readonly=True)
    r = py(
        "import sharedarrays as sa, json; b = sa.attach('ro'); al = b.allocation\n"
        "try:\n    al.backend.set_access(al.address, al.size, 'rw'); esc = 'allowed'\n"
        "except OSError:\n    esc = 'refused'\n"
        "print(json.dumps([b.readonly, al.access, float(b.get().sum()), esc]))"
    )
    assert json.loads(r.stdout) == [True, "r", 12.0, "refused"]
    assert sa.list_named()[0].readonly
    sa.unlink("ro")
    del a


def test_restricted_arrays_are_never_packed() -> None:
    with pytest.raises(ValueError, match="pack=True"):
        sa.zeros(4, device="cpu", readonly=True, pack=True)
    assert sa.zeros(4, device="cpu", allow_pids=[1]).allocation.size >= 4096


def test_one_keeper_per_user_and_stale_sockets_are_replaced(private_keeper: Path) -> None:
    pid = keeper.ensure_running()
    assert lock_holder(private_keeper) == pid
    # a second keeper never starts beside a live one
    r = subprocess.run(
        [sys.executable, "-m", "sharedarrays", "keeper", "--foreground"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 3 and f"pid {pid}" in r.stderr
    assert keeper.ensure_running() == pid
    # killed, it leaves its socket file behind: the next keeper replaces it
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    assert (private_keeper / "keeper.sock").exists()
    new = keeper.ensure_running()
    assert new != pid and lock_holder(private_keeper) == new


def test_a_client_survives_the_keeper_exiting_while_idle(private_keeper: Path) -> None:
    first = keeper.ensure_running()
    wait_gone(first)  # idle for IDLE seconds, holding nothing
    assert not (private_keeper / "keeper.sock").exists()
    a = sa.zeros(3, device="cpu", name="again")  # our old connection is dead: reconnects
    assert lock_holder(private_keeper) not in (None, first)
    sa.unlink("again")
    del a


def test_another_users_keeper_socket_is_refused(private_keeper: Path) -> None:
    pid = keeper.ensure_running()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(str(private_keeper / "keeper.sock"))
        s.send(wire.MAGIC + b'{"op":"hello"}')
        assert json.loads(s.recv(1024)[5:])["pid"] == pid
    os.chmod(private_keeper, 0o755)
    with pytest.raises(sa.PermissionDenied, match="private directory"):
        sa.attach("x")
    os.chmod(private_keeper, 0o700)


def test_cli_ls_rm_status_keeper(private_keeper: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["status"]) == 1
    assert "no keeper" in capsys.readouterr().out
    assert cli_main(["keeper"]) == 0
    assert "keeper running, pid" in capsys.readouterr().out
    a = sa.zeros((2, 3), dtype="int16", device="cpu", name="cli-test")
    assert cli_main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "cli-test" in out and "(2, 3)" in out and "int16" in out and str(os.getpid()) in out
    assert cli_main(["ls", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["name"] == "cli-test" and row["pids"] == [os.getpid()]
    assert cli_main(["status"]) == 0
    assert "named        1" in capsys.readouterr().out
    assert cli_main(["rm", "cli-test", "missing"]) == 1
    assert "missing" in capsys.readouterr().err
    assert sa.list_named() == []
    assert cli_main(["ls", "--all"]) == 0
    assert "(unlinked)" in capsys.readouterr().out
    del a


def test_fork_child_does_not_inherit_the_keeper_connection(private_keeper: Path) -> None:
    a = sa.zeros(2, device="cpu", name="forked")
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            assert process.STATE.keeper.conn is None and not process.STATE.keeper.held
            assert [i.name for i in sa.list_named()] == ["forked"]
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sa.list_named()[0].pids == (os.getpid(),)
    sa.unlink("forked")
    del a


def test_a_release_from_a_finalizer_never_blocks_on_the_client_lock(private_keeper: Path) -> None:
    """Leases die in finalizers, in any thread, possibly while another thread holds the
    keeper client's lock and waits for that very thread (Thread.start): the release must
    not wait for the lock; it is deferred to the next request."""
    import threading

    from sharedarrays.transport import keeper

    a = sa.full(3, 1.0, device="cpu", name="fin")
    alloc_id = a.allocation.id
    done = threading.Event()
    with process.STATE.keeper.lock:
        t = threading.Thread(target=lambda: (keeper.release(alloc_id), done.set()))
        t.start()
        assert done.wait(5), "keeper.release blocked on the client lock"
        assert alloc_id in process.STATE.keeper.deferred
    t.join()
    sa.list_named()  # the next request sends it
    assert (
        alloc_id not in process.STATE.keeper.deferred and alloc_id not in process.STATE.keeper.held
    )
    sa.unlink("fin")
    del a


@pytest.mark.timeout(60)
def test_the_keeper_refuses_an_unsealed_memfd(private_keeper: Path) -> None:
    """An unsealed memfd could be shrunk by its sender after the keeper served it, killing
    every process that attached it with SIGBUS: the keeper refuses it and closes it."""
    kpid = keeper.ensure_running()
    before = keeper_memfds(kpid)
    a = sa.zeros(512, device="cpu", pack=False)
    size = a.allocation.size
    forged = os.memfd_create("sharedarrays", os.MFD_CLOEXEC)  # no seals
    os.ftruncate(forged, size)
    req = wire.Keep("ab" * 16, bytes.fromhex("cd" * 32), "unsealed", [size], {"backend": "host"})
    try:
        status, body, fds = keeper.request(req, [forged])
    finally:
        os.close(forged)
    assert fds == [] and status == wire.ERROR
    assert "not sealed against shrinking" in str(body["error"])
    assert "unsealed" not in [n.name for n in sa.list_named()]
    assert keeper_memfds(kpid) == before  # closed, not kept
    # a sealed chunk of a real array is still kept
    sa.SharedDeviceArray.park(a)
    a.unpark()
    a.close()


PLANTED = (
    "import os, pathlib\n"
    "pathlib.Path({marker!r}).write_text(f'{{__name__}} ran in pid {{os.getpid()}}')\n"
    "raise ImportError('a planted module ran')\n"
)


@pytest.mark.timeout(120)
def test_the_keeper_imports_nothing_from_the_callers_directory(
    private_keeper: Path, tmp_path: Path
) -> None:
    """Another user who can write the directory a process runs in (a shared 1777 folder)
    plants ``json.py``: the keeper that process starts must not run it, nor anything an
    empty ``PYTHONPATH`` entry (the working directory again) would find."""
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "planted-ran"
    for module in ("json", "secrets", "selectors"):
        (shared / f"{module}.py").write_text(PLANTED.format(marker=str(marker)))
    # the caller imports what it needs before it moves there (a planted module that ran
    # would say in which process)
    code = (
        "import os, secrets, sharedarrays as sa; "
        f"os.chdir({str(shared)!r}); "
        "sa.zeros(4, device='cpu', name='planted'); "
        "from sharedarrays.transport import keeper; print(keeper.running_pid())"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not marker.exists(), marker.read_text()
    assert r.returncode == 0, r.stderr
    kpid = int(r.stdout.split()[-1])
    assert lock_holder(private_keeper) == kpid
    assert os.readlink(f"/proc/{kpid}/cwd") == str(private_keeper)
    (info,) = sa.list_named(all_namespaces=True)  # (made in another directory's namespace)
    sa.unlink(info.qualified or "")


def _hello(path: Path) -> socket.socket:
    """A raw connection to the keeper at ``path`` that said hello and was answered."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(30)
    s.connect(str(path))
    s.send(wire.MAGIC + b'{"op":"hello"}')
    assert s.recv(1024)[:4] == wire.MAGIC
    return s


@pytest.mark.timeout(120)
def test_the_keeper_caps_its_connections(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past SHAREDARRAYS_KEEPER_CONNECTIONS the longest idle connection is closed, one that
    holds nothing first: a process holding an array keeps its connection and its hold."""
    monkeypatch.setenv("SHAREDARRAYS_KEEPER_CONNECTIONS", "16")
    a = sa.zeros(4, device="cpu", name="capped")
    idle = [_hello(private_keeper / "keeper.sock") for _ in range(60)]
    try:
        status = keeper_status()
        assert status["max_connections"] == 16
        assert status["connections"] == 16
        assert sa.list_named()[0].pids == (os.getpid(),)  # our hold survived
        assert cli_main(["status"]) == 0
        assert "max_connections 16" in capsys.readouterr().out
        assert sum(closed_by_peer(s) for s in idle) == 60 - 15  # ours is one of the 16
    finally:
        for s in idle:
            s.close()
    b = sa.attach("capped")
    assert b.allocation is a.allocation
    sa.unlink("capped")


@pytest.mark.timeout(120)
def test_a_keeper_out_of_fds_keeps_serving(private_keeper: Path) -> None:
    """A keeper whose fd table is full (RLIMIT_NOFILE 64 here, ~1,000 idle connections on a
    common 1024 limit) closes the longest idle connection to accept a new one: an attach
    still works, and never says that no keeper runs."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    proc = subprocess.Popen(
        [sys.executable, "-m", "sharedarrays", "keeper", "--foreground"],
        preexec_fn=limit,
        stderr=subprocess.PIPE,
        text=True,
    )
    flood: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 30
        while lock_holder(private_keeper) != proc.pid and time.monotonic() < deadline:
            time.sleep(0.05)
        a = sa.from_array(np.arange(5.0), device="cpu", name="crowded")
        for _ in range(100):  # more than it has fds for; those it cannot accept yet queue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.settimeout(30)
            s.connect(str(private_keeper / "keeper.sock"))
            s.send(wire.MAGIC + b'{"op":"hello"}')
            flood.append(s)
        keeper.disconnect()  # a new connection, behind the flood
        start = time.monotonic()
        b = sa.attach("crowded")
        took = time.monotonic() - start
        assert b.get().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert int(str(keeper_status()["connections"])) < 64
        closed = sum(closed_by_peer(s) for s in flood)
        assert closed > 0, "the keeper never ran out of fds: the test did not test"
        print(f"keeper at 64 fds, 100 idle connections, {closed} closed: attach in {took:.3f} s")
        sa.unlink("crowded")
        del a, b
    finally:
        for s in flood:
            s.close()
        keeper.disconnect()
        proc.terminate()
        proc.communicate(timeout=30)


@pytest.mark.timeout(60)
def test_a_keeper_that_does_not_answer_is_not_reported_missing(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A keeper that is overloaded or stopped (simulated: a socket that never accepts, then
    one whose listen queue is full) gives KeeperError, never NameNotFound "no keeper runs"
    nor an empty list_named()."""
    monkeypatch.setattr(keeper, "TIMEOUT", 1.0)
    private_keeper.mkdir(mode=0o700, exist_ok=True)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    silent.bind(str(private_keeper / "keeper.sock"))
    silent.listen(4)
    queued: list[socket.socket] = []
    try:
        with pytest.raises(sa.KeeperError, match="did not answer"):
            sa.attach("x")
        # (a request sent is not a request refused: a keeper stopped, then continued, does
        # it; the error must not say that trying again is safe)
        with pytest.raises(sa.KeeperError, match="may still be carried out when it resumes"):
            sa.list_named()
        assert cli_main(["status"]) == 1
        assert "the keeper runs but cannot be asked" in capsys.readouterr().out
        while True:  # fill its listen queue: connect then says EAGAIN
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            try:
                s.connect(str(private_keeper / "keeper.sock"))
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        keeper.disconnect()
        with pytest.raises(sa.KeeperError, match="did not accept"):
            sa.attach("x")
        with pytest.raises(sa.KeeperError, match="did not accept"):
            sa.unlink("x")
    finally:
        for s in queued:
            s.close()
        silent.close()
        keeper.disconnect()


def test_a_refusal_by_an_older_keeper_says_so() -> None:
    with pytest.raises(sa.KeeperError, match="predates this version of sharedarrays"):
        keeper.raise_for(wire.ERROR, {"error": "unknown op 'drop'"}, "cannot drop")
    with pytest.raises(sa.KeeperError) as info:
        keeper.raise_for(wire.ERROR, {"error": "malformed"}, "cannot drop")
    assert str(info.value) == "cannot drop: malformed"


_CLOSED_AT_EXIT = """
from sharedarrays import process
from sharedarrays.transport import keeper
keeper.ensure_running()
sock = process.STATE.keeper.conn
assert sock is not None and sock.fileno() >= 0
hooks = [h.fn for h in process.STATE.hooks.exit]
# (after the hand-over of payloads in flight, which may still tell the keeper)
assert hooks.index(keeper._close_at_exit) > hooks.index(keeper._hand_over_at_exit)
process.STATE.hooks.run_exit()
assert process.STATE.keeper.conn is None and sock.fileno() == -1, sock
print("ok")
"""


def test_the_keeper_connection_is_closed_at_exit() -> None:
    """The connection to the keeper is closed by an exit hook, after the hand-over (not left
    to the kernel, with an unclosed-socket warning at the interpreter's end)."""
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", _CLOSED_AT_EXIT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok" and "unclosed" not in done.stderr


_REFUSED_AT_EXIT = """
import pickle, sharedarrays as sa
from sharedarrays.process import STATE

def refused(alloc, count, seconds):
    raise sa.KeeperError("the keeper has no room for the handles sent")

STATE.memory.hand_over_hooks[:] = [refused]
arrays = [sa.zeros(4, device="cpu", pack=False) for _ in range(5)]
payloads = [pickle.dumps(a) for a in arrays for _ in range(2)]  # in flight at exit
"""


def test_payloads_that_cannot_be_handed_over_at_exit_are_said_once(
    private_keeper: Path,
) -> None:
    # (one stderr line per allocation: 8,014 lines from a process whose keeper ran out of
    # room; one line now, with the count of the others)
    r = subprocess.run(
        [sys.executable, "-c", _REFUSED_AT_EXIT], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if "could not be handed" in line]
    assert len(lines) == 1, r.stderr
    assert "2 payload(s) of allocation" in lines[0] and "no room for the handles" in lines[0]
    assert "(and 8 payload(s) of 4 more allocation(s), alike)" in lines[0]


def test_no_room_for_files_is_said_first_not_a_missing_keeper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a process at its open-files limit was told the exporter exited and, at the end, that
    # no keeper held the array: the keeper had it)
    def no_room(*args: object, **kwargs: object) -> None:
        raise keeper.NoRoomForFiles("this process has no room for the handles (ulimit -n)")

    monkeypatch.setattr(keeper, "request", no_room)
    gone = sa.HandleUnavailable("the handles of allocation x are no longer available")
    with pytest.raises(sa.HandleUnavailable) as info:
        keeper.fetch_handles("ab" * 16, bytes(32), gone)
    said = str(info.value)
    assert said.startswith("this process has no room") and "park()" not in said
    assert "no longer available" in said  # (what the exporter said, after)


@pytest.mark.usefixtures("no_cache")
@pytest.mark.timeout(120)
def test_a_load_while_another_thread_releases_waits_and_loads_from_the_keeper(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the release leaves the allocation registered while the keeper takes its handles; a
    # load in another thread found it there, released, and failed with ClosedArrayError)
    import threading

    from sharedarrays import importing
    from sharedarrays.process import STATE

    a = sa.from_array(np.arange(64.0), device="cpu", pack=False)
    blob = pickle.dumps(a)  # in flight: the keeper takes its handles at the release
    waiting = threading.Event()
    original = STATE.memory.wait_unregistered

    def wait_unregistered(alloc, timeout):
        waiting.set()
        return original(alloc, timeout)

    monkeypatch.setattr(STATE.memory, "wait_unregistered", wait_unregistered)
    got: list[object] = []

    def load() -> None:
        try:
            got.append(pickle.loads(blob))
        except Exception as e:
            got.append(e)

    loader = threading.Thread(target=load)

    seen: list[tuple[bool, bool]] = []  # (a hook's errors are said, not raised: kept here)

    def during_hand_over(alloc, count, seconds):  # (after the keeper's own hook)
        registered = sa_registry.lookup(alloc.id) is alloc
        loader.start()
        deadline = time.monotonic() + 60
        while not waiting.is_set() and loader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        seen.append((alloc.released and registered, waiting.is_set()))

    monkeypatch.setattr(
        STATE.memory, "hand_over_hooks", [*STATE.memory.hand_over_hooks, during_hand_over]
    )
    a.close()
    loader.join(importing.RELEASE_WAIT + 30)
    assert seen == [(True, True)], "the load did not find it released, or did not wait"
    assert len(got) == 1 and isinstance(got[0], sa.SharedDeviceArray), got
    np.testing.assert_array_equal(got[0].get(), np.arange(64.0))
    got[0].close()


@pytest.mark.timeout(120)
def test_a_list_longer_than_one_message_comes_in_pages(private_keeper: Path) -> None:
    # (a keeper holding a few hundred arrays sent a reply longer than a message: the client
    # got it cut short and list_named(), ls and top failed with a JSON error)
    from sharedarrays.protocol.keeper import LIST_PAGE, MAX_MESSAGE, OK, List

    names = [f"paged-{i:04d}-" + "x" * 80 for i in range(400)]
    arrays = [sa.zeros(1, device="cpu", name=n) for n in names]
    try:
        status, body, _ = keeper.request(List(), start=False)
        assert status == OK and isinstance(body.get("more"), str)
        assert len(json.dumps(body)) < MAX_MESSAGE and len(body["arrays"]) < len(names)
        assert sum(len(json.dumps(a, separators=(",", ":"))) for a in body["arrays"]) <= LIST_PAGE
        assert sorted(a.name for a in sa.list_named()) == names
        r = subprocess.run(
            [sys.executable, "-m", "sharedarrays", "ls"], capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr
        assert all(n in r.stdout for n in (names[0], names[-1]))
    finally:
        for n, a in zip(names, arrays):
            a.close()
            sa.unlink(n)


@pytest.mark.parametrize("idle", ["-1", "0", "nan", "inf", "1e9"])
def test_keeper_idle_out_of_range_is_a_usage_error(
    private_keeper: Path, capsys: pytest.CaptureFixture[str], idle: str
) -> None:
    with pytest.raises(SystemExit) as ended:
        cli_main(["keeper", f"--idle={idle}"])
    assert ended.value.code == 2
    assert "--idle: must be a number of seconds above 0" in capsys.readouterr().err
    assert lock_holder(private_keeper) is None  # (no keeper was started)


@pytest.mark.timeout(60)
def test_a_keeper_that_fails_as_it_starts_is_said_at_once_with_its_reason(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the caller waited for its socket for the whole time limit, then said only that no
    # keeper ran)
    monkeypatch.setenv("SHAREDARRAYS_KEEPER_IDLE", "-1")
    started = time.monotonic()
    with pytest.raises(sa.HandleUnavailable, match=r"exited as it started .*KEEPER_IDLE"):
        sa.zeros(3, device="cpu", name="never-kept")
    assert time.monotonic() - started < keeper.TIMEOUT


@pytest.mark.usefixtures("no_cache")
@pytest.mark.timeout(120)
def test_a_child_forked_during_a_release_does_not_wait_for_it(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the child inherited the allocation released and still registered, and a load there
    # waited for a release no thread of it would finish: 40 s, then ClosedArrayError)
    from forking import in_forked_child

    from sharedarrays.process import STATE

    a = sa.from_array(np.arange(64.0), device="cpu", pack=False)
    alloc_id = a.allocation.id
    blob = pickle.dumps(a)  # in flight: the keeper takes its handles at the release
    seen: list[object] = []

    def child() -> list[object]:
        started = time.monotonic()
        registered = sa_registry.lookup(alloc_id) is not None
        loaded = pickle.loads(blob)  # from the keeper, which has the handles by now
        return [registered, float(loaded.get().sum()), time.monotonic() - started]

    def during_hand_over(alloc, count, seconds):  # (after the keeper's own hook)
        seen.append(in_forked_child(child, timeout=60))

    monkeypatch.setattr(
        STATE.memory, "hand_over_hooks", [*STATE.memory.hand_over_hooks, during_hand_over]
    )
    a.close()
    assert len(seen) == 1, "the hook did not run (or failed: see stderr)"
    registered, total, took = seen[0]
    assert not registered and total == float(np.arange(64.0).sum())
    assert took < importing_wait() / 2


def importing_wait() -> float:
    from sharedarrays import importing

    return importing.RELEASE_WAIT


@pytest.mark.timeout(60)
def test_an_interrupted_request_does_not_hand_its_reply_to_the_next(
    private_keeper: Path,
) -> None:
    """A Ctrl-C while a request waits for the keeper's reply: that reply, when it comes, is
    not read as the reply of the next request (an attach of "b" was given the fds of the
    "a" asked for before: the wrong array), and the fds that came with it are closed."""
    import selectors
    import threading

    private_keeper.mkdir(mode=0o700, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(private_keeper / "keeper.sock"))
    listener.listen(4)
    interrupted = threading.Event()
    stop = threading.Event()
    r, w = os.pipe()

    def fake_keeper() -> None:  # answers request n with {"n": n} (the first: once interrupted)
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        n = 0
        while not stop.is_set():
            for key, _ in sel.select(0.1):
                sock = key.fileobj
                if sock is listener:
                    conn, _ = listener.accept()
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                assert isinstance(sock, socket.socket)
                if not sock.recv(wire.MAX_MESSAGE):
                    sel.unregister(sock)
                    sock.close()
                    continue
                n += 1
                if n == 1:
                    os.kill(os.getpid(), signal.SIGINT)
                    interrupted.wait(30)
                with contextlib.suppress(OSError):  # (the first: to a connection closed)
                    socket.send_fds(sock, [wire.Reply(wire.OK, {"n": n}).encode()], [r])
        sel.close()

    class Interrupted(Exception):  # (as KeyboardInterrupt, which would stop pytest)
        pass

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    thread = threading.Thread(target=fake_keeper, daemon=True)
    previous = signal.signal(signal.SIGINT, interrupt)
    before = len(os.listdir("/proc/self/fd"))
    try:
        thread.start()
        with pytest.raises(Interrupted):
            keeper.request(wire.Hello(), start=False)
        interrupted.set()
        _, body, fds = keeper.request(wire.Hello(), start=False)
        for fd in fds:
            os.close(fd)
        assert body == {"n": 2}, "the reply of the interrupted request was read instead"
        keeper.disconnect()
        stop.set()
        thread.join(10)
        assert len(os.listdir("/proc/self/fd")) == before, "the interrupted reply's fd leaked"
    finally:
        signal.signal(signal.SIGINT, previous)
        stop.set()
        keeper.disconnect()
        listener.close()
        os.close(r)
        os.close(w)


def test_fds_of_an_interrupted_reply_are_closed(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C handled as the keeper's reply and its fds came (recv_into hands them over,
    then raises): request closes them, as no caller gets them."""
    sa.zeros(4, device="cpu", name="x")  # (a keeper runs, and this process is connected)
    r, w = os.pipe()
    os.close(w)
    pipe = os.fstat(r).st_ino

    class Interrupted(Exception):
        pass

    def interrupted(sock: socket.socket, size: int, maxfds: int, fds: list[int]) -> object:
        fds.append(r)
        raise Interrupted

    monkeypatch.setattr(unix, "recv_into", interrupted)
    with pytest.raises(Interrupted):
        keeper.request(wire.Attach("x"), start=False)
    try:
        still = os.fstat(r).st_ino == pipe  # (its number may have been taken again since)
    except OSError:
        still = False
    assert not still, "the fd that came with the interrupted reply was left open"


def test_a_runtime_dir_with_no_room_for_the_keepers_log_is_a_shared_array_error(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full file system under the runtime directory (ENOSPC making keeper.log, as on a
    full tmpfs): naming an array raises HandleUnavailable that says so, not a raw OSError."""
    import errno

    real = os.open

    def full(path: object, *args: object, **kwargs: object) -> int:
        if str(path).endswith("keeper.log"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(sa.HandleUnavailable, match=r"cannot start the sharedarrays keeper.*df -i"):
        sa.zeros(3, device="cpu", name="never-kept")


@pytest.mark.timeout(60)
def test_a_keeper_that_fails_as_it_starts_on_a_full_file_system_says_so(
    private_keeper: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keeper that could not write its lock (ENOSPC) and so not its log either exits with
    an empty log: the error says the runtime directory's file system is full (simulated:
    a keeper that fails at start, and statvfs saying no block is left)."""
    monkeypatch.setenv("SHAREDARRAYS_KEEPER_IDLE", "-1")
    real = os.statvfs

    class Full:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_bavail, self.f_favail = 0, st.f_favail

    monkeypatch.setattr(os, "statvfs", lambda path: Full(real(path)))
    with pytest.raises(sa.HandleUnavailable, match=r"exited as it started .* is full \(no space"):
        sa.zeros(3, device="cpu", name="never-kept")


_MANY_CHUNKS = """
import pickle, sys, numpy as np, sharedarrays as sa
n = 300 * 4096  # (300 chunks: more fds than one message carries)
name = "many" if sys.argv[1] == "name" else None  # (named, or in flight at a normal exit)
a = sa.from_array(np.arange(n, dtype=np.uint8), device="cpu", chunk_bytes=4096, pack=False,
                  name=name)
assert len(a.allocation.chunk_sizes()) == 300
if name is None:
    print(pickle.dumps(a).hex())
"""


@pytest.mark.timeout(120)
def test_payloads_of_many_chunks_in_flight_at_exit_load_from_the_keeper(
    private_keeper: Path,
) -> None:
    """An array of 300 chunks in flight at a normal exit: the keeper takes its handles in
    batches (one message of 300 fds was EINVAL, of 251 refused: the payload was lost)."""
    out = py(_MANY_CHUNKS.replace("sys.argv[1]", "'send'")).stdout
    loaded = pickle.loads(bytes.fromhex(out.strip()))  # from the keeper: its exporter exited
    np.testing.assert_array_equal(loaded.get(), np.arange(300 * 4096, dtype=np.uint8))
    loaded.close()


@pytest.mark.timeout(120)
def test_a_named_array_of_many_chunks_is_kept_and_attached(private_keeper: Path) -> None:
    """A name for an array of 300 chunks (refused past 250 chunks): kept in batches, served
    in batches to a process that attaches it after its creator exited."""
    py(_MANY_CHUNKS.replace("sys.argv[1]", "'name'"))
    a = sa.attach("many")
    np.testing.assert_array_equal(a.get(), np.arange(300 * 4096, dtype=np.uint8))
    a.close()
    sa.unlink("many")


_STOPPED_KEEPER = """
import pickle, sharedarrays as sa
arrays = [sa.zeros(4096, device="cpu", pack=False) for _ in range(3)]
payloads = [pickle.dumps(a) for a in arrays]  # in flight
print("ready", flush=True)
arrays[0].close()  # its payload is handed over: the keeper does not answer
print("closed", flush=True)
"""  # (and exits with two arrays in flight)


@pytest.mark.usefixtures("no_cache")
@pytest.mark.timeout(180)
def test_a_stopped_keeper_costs_a_close_and_an_exit_one_wait_in_all(
    private_keeper: Path,
) -> None:
    """With the keeper stopped (SIGSTOP), a close that hands payloads over and then the exit
    with two arrays in flight wait TIMEOUT in all: once the keeper was late, the exit waits
    RETRY, shared by its hand-overs, and its second run of the hook does not wait again.
    (Each hand-over waited TIMEOUT, and the exit hook ran twice: 10 s + 2 x 2 x 10 s.)"""
    kpid = keeper.ensure_running()
    stop(kpid)
    try:
        child = spawn(_STOPPED_KEEPER)
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        began = time.monotonic()
        out, err = child.communicate(timeout=150)
        took = time.monotonic() - began
    finally:
        os.kill(kpid, signal.SIGCONT)
    assert child.returncode == 0 and out == "closed\n", err
    assert took < 1.5 * keeper.TIMEOUT, f"the close and the exit waited {took:.0f} s"
    said = [line for line in err.splitlines() if "could not be handed to the keeper" in line]
    assert len(said) == 2 and "did not take the handles" in said[0], err  # (close, exit)


_EXPORTER = """
import pickle, sys, numpy as np, sharedarrays as sa
a = sa.from_array(np.arange(1000.0), device="cpu", pack=False)
named = sa.from_array(np.arange(10.0), device="cpu", name="kept")
print(pickle.dumps(a).hex(), flush=True)
sys.stdin.readline()  # (the runtime directory is removed meanwhile)
b = sa.from_array(np.full(100, 3.0), device="cpu", pack=False)
print(pickle.dumps(b).hex(), flush=True)
sys.stdin.readline()
"""
_LOADER = "import pickle, sys; print(pickle.loads(bytes.fromhex(sys.stdin.read())).get().sum())"


def _keepers(base: Path) -> list[int]:
    """The keeper processes that run with ``base`` as their XDG_RUNTIME_DIR."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or ()
            if any("sharedarrays.keeper.daemon" in arg for arg in cmdline) and (
                proc.environ().get("XDG_RUNTIME_DIR") == str(base)
            ):
                found.append(proc.pid)
    return found


@pytest.mark.timeout(120)
def test_a_removed_runtime_dir_is_made_again_and_sharing_goes_on(private_keeper: Path) -> None:
    """The runtime directory removed (systemd at the last logout; a tmp cleaner) while an
    exporter and the keeper run: the exporter's handle server listens again at its path, so
    a payload pickled before loads, and it shares again; the keeper takes its lock and
    listens again at its path, so its named array is found and no second keeper starts.
    (The exporter was said to have exited; the keeper's arrays were out of reach.)"""
    exporter = spawn(_EXPORTER)
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        first = exporter.stdout.readline().strip()
        kpid = lock_holder(private_keeper)
        assert kpid is not None and first, exporter.stderr
        shutil.rmtree(private_keeper)
        deadline = time.monotonic() + 30
        while not (private_keeper / "keeper.sock").exists():
            assert time.monotonic() < deadline, "the keeper did not listen again"
            time.sleep(0.05)
        assert lock_holder(private_keeper) == kpid
        assert float(py(_LOADER, input=first).stdout) == sum(range(1000))
        exporter.stdin.write("\n")
        exporter.stdin.flush()
        second = exporter.stdout.readline().strip()
        assert float(py(_LOADER, input=second).stdout) == 300.0
        keeper.disconnect()  # (a new connection, to the socket file)
        a = sa.attach("kept")
        np.testing.assert_array_equal(a.get(), np.arange(10.0))
        a.close()
        assert [info.name for info in sa.list_named()] == ["kept"]
        assert _keepers(private_keeper.parent) == [kpid]
    finally:
        exporter.communicate(input="\n", timeout=60)


@pytest.mark.timeout(120)
def test_a_name_is_found_at_once_after_the_runtime_dir_was_removed(private_keeper: Path) -> None:
    """Asked the moment its socket was removed, before it listens again, the running keeper
    is waited for (not another started, not "no keeper runs"): the name is found."""
    exporter = spawn(_EXPORTER)
    try:
        assert exporter.stdout is not None
        assert exporter.stdout.readline().strip(), exporter.stderr
        kpid = lock_holder(private_keeper)
        keeper.disconnect()
        shutil.rmtree(private_keeper)
        a = sa.attach("kept")  # (start=False: it used to say that no keeper runs)
        np.testing.assert_array_equal(a.get(), np.arange(10.0))
        a.close()
        assert _keepers(private_keeper.parent) == [kpid]
    finally:
        exporter.communicate(input="\n\n", timeout=60)
