"""The node-wide view across processes: ``python -m sharedarrays top --json --once`` lists
each allocation with its holders and state, a killed importer disappears, ``rm`` frees a
parked allocation (the keeper's memfds go), and another user's processes are never asked."""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import pickle
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import node_workers
import numpy as np
import pytest
from keeper_helpers import keeper_memfds, private_keeper, run_cli
from users import become, other_user

import sharedarrays as sa
from sharedarrays.api import nodemap
from sharedarrays.api.widgets.render import render_node_text
from sharedarrays.process import STATE
from sharedarrays.protocol.handles import HeldAllocation, Reply, Snapshot, Status
from sharedarrays.protocol.unix import runtime_dir
from sharedarrays.transport import keeper
from sharedarrays.transport import node as transport_node

ctx = mp.get_context("spawn")
TIMEOUT = 60

# Tests that park use a runtime directory and keeper of their own (private_keeper): a keeper
# already running for this user (another version's, another test's) must not answer for them.
__all__ = ["private_keeper"]


def _top() -> dict[str, Any]:
    out = run_cli("top", "--json", "--once")
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def _row(doc: dict[str, Any], alloc_id: str) -> dict[str, Any] | None:
    return next((r for r in doc["allocations"] if r["id"] == alloc_id), None)


@contextlib.contextmanager
def _processes() -> Iterator[list[Any]]:
    procs: list[Any] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(TIMEOUT)


@pytest.mark.timeout(120)
def test_a_child_given_an_array_as_a_process_argument_is_listed() -> None:
    """A spawn child whose array arrived with its fds (no handle server asked) is still a
    holder that ``top`` lists, and is gone from the row once it ends."""
    a = sa.from_array(np.arange(1024, dtype="float64"), device="cpu", pack=False)
    ready, stop = ctx.Event(), ctx.Event()
    with _processes() as procs:
        child = ctx.Process(target=node_workers.argument_holder, args=(a, ready, stop))
        child.start()
        procs.append(child)
        assert ready.wait(TIMEOUT)
        row = _row(_top(), a.allocation.id)
        assert row is not None
        roles = {(h["pid"], h["role"]) for h in row["holders"]}
        assert roles == {(os.getpid(), "exporter"), (child.pid, "importer")}
        stop.set()
        child.join(TIMEOUT)
        row = _row(_top(), a.allocation.id)
        assert row is not None and {h["pid"] for h in row["holders"]} == {os.getpid()}
    a.close()


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("private_keeper")
def test_top_lists_holders_and_states_and_rm_frees_parked() -> None:
    stop = ctx.Event()
    stop_importer = ctx.Event()  # (a waiter killed on an Event would hang its set())
    ready = ctx.Event()
    out = ctx.Queue()
    with _processes() as procs:
        exp = ctx.Process(target=node_workers.exporter, args=(out, stop))
        exp.start()
        procs.append(exp)
        alloc_id, blob = out.get(timeout=TIMEOUT)
        imp = ctx.Process(target=node_workers.importer, args=(blob, ready, stop_importer))
        imp.start()
        procs.append(imp)
        assert ready.wait(TIMEOUT)

        row = _row(_top(), alloc_id)
        assert row is not None, "the shared allocation is not listed"
        assert row["state"] == "live" and row["backend"] == "host" and row["device"] == "cpu"
        assert row["size"] >= node_workers.NBYTES
        assert row["lost"] == row["size"] - node_workers.NBYTES
        assert row["exporter"] == {
            "pid": exp.pid,
            "command": row["exporter"]["command"],
            "alive": True,
        }
        roles = {(h["pid"], h["role"]) for h in row["holders"]}
        assert roles == {(exp.pid, "exporter"), (imp.pid, "importer")}
        assert all(h["views"] >= 1 for h in row["holders"])

        os.kill(imp.pid, signal.SIGKILL)  # a killed importer disappears
        imp.join(TIMEOUT)
        doc = _top()
        row = _row(doc, alloc_id)
        assert row is not None and {h["pid"] for h in row["holders"]} == {exp.pid}
        assert all(p["status"] != "ok" for p in doc["processes"] if p["pid"] == imp.pid)

        stop.set()
        exp.join(TIMEOUT)
        assert _row(_top(), alloc_id) is None  # closed, and nothing kept it

        park = ctx.Process(target=node_workers.parker, args=(out,))
        park.start()
        procs.append(park)
        parked_id = out.get(timeout=TIMEOUT)
        park.join(TIMEOUT)
        row = _row(_top(), parked_id)
        assert row is not None and row["state"] == "parked" and row["kept"]
        keeper_pid = keeper.running_pid()
        assert keeper_pid is not None
        assert [h["role"] for h in row["holders"]] == ["keeper"]
        assert row["holders"][0]["pid"] == keeper_pid
        before = keeper_memfds(keeper_pid)
        assert before >= 1

        rm = run_cli("rm", parked_id[:10])
        assert rm.returncode == 0, rm.stderr
        assert "keeper let go" in rm.stdout
        assert keeper_memfds(keeper_pid) == before - 1  # its memory returned
        assert _row(_top(), parked_id) is None


def _what_an_exited_process_sent(target: Any, procs: list[Any]) -> Any:
    """Run ``target(queue)`` in a new process (listed in ``procs``), take what it put on the
    queue and wait for it to exit."""
    out = ctx.Queue()
    proc = ctx.Process(target=target, args=(out,))
    proc.start()
    procs.append(proc)
    sent = out.get(timeout=TIMEOUT)
    proc.join(TIMEOUT)
    return sent


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("private_keeper")
def test_rm_frees_a_parked_allocation_whose_importer_was_killed() -> None:
    """An importer that attached a parked allocation through the keeper and was killed
    leaves nothing behind that keeps ``rm`` from freeing it."""
    ready = ctx.Event()
    with _processes() as procs:
        parked_id, blob = _what_an_exited_process_sent(node_workers.parker_with_payload, procs)
        imp = ctx.Process(target=node_workers.holder, args=(blob, ready))
        imp.start()
        procs.append(imp)
        assert ready.wait(TIMEOUT)
        row = _row(_top(), parked_id)
        assert row is not None and imp.pid in {h["pid"] for h in row["holders"]}
        os.kill(imp.pid, signal.SIGKILL)
        imp.join(TIMEOUT)
        row = _row(_top(), parked_id)
        assert row is not None and row["state"] == "parked"
        assert imp.pid not in {h["pid"] for h in row["holders"]}
        keeper_pid = keeper.running_pid()
        assert keeper_pid is not None
        before = keeper_memfds(keeper_pid)
        rm = run_cli("rm", "--yes", parked_id)
        assert rm.returncode == 0, rm.stderr
        assert "keeper let go" in rm.stdout
        assert keeper_memfds(keeper_pid) == before - 1
        assert _row(_top(), parked_id) is None


def _draining_row(importers: list[int]) -> nodemap.NodeAllocation:
    """A cuda-ipc allocation that its exporter (this process) released and ``importers``
    still map, as :func:`nodemap.node_map` would join it."""
    holders = [nodemap.Holder(os.getpid(), "exporter", "exporter", 0.0, 0)]
    holders += [nodemap.Holder(pid, "importer", "importer", 0.0, -1) for pid in importers]
    return nodemap.NodeAllocation(
        FAKE_ID, None, "cuda-ipc", "cuda:0", 2 << 20, 0, os.getpid(), "exporter", True,
        tuple(holders), False, 0, "draining", 0.0, 1.0,
    )  # fmt: skip


@pytest.mark.timeout(60)
def test_rm_of_draining_memory_names_the_importers_and_works_once_they_are_gone() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(sa.InUse) as refused:
            nodemap.free(_draining_row([sleeper.pid]))
        message = str(refused.value)
        assert f"pid {sleeper.pid} still maps" in message
        assert "Close it in those processes" in message and "exit" in message
        assert "undefined behaviour" in message
    finally:
        sleeper.kill()
        sleeper.wait(TIMEOUT)
    done = nodemap.free(_draining_row([sleeper.pid]))  # its importer is gone: not refused
    assert done and "importers are gone" in done[0]


@pytest.mark.timeout(120)
def test_rm_refuses_a_live_allocation_and_says_who_uses_it() -> None:
    a = sa.zeros(1000, device="cpu", pack=False)
    out = run_cli("rm", a.allocation.id)
    assert out.returncode == 0 or out.returncode == 1
    # this process runs no handle server until it pickles: ask through it
    import pickle

    pickle.dumps(a)
    out = run_cli("rm", a.allocation.id)
    assert out.returncode == 1
    assert "in use by views in pid" in out.stderr and str(os.getpid()) in out.stderr
    assert not a.closed and a.allocation.leases >= 1
    row = nodemap.find(nodemap.node_map(), a.allocation.id[:8])
    with pytest.raises(sa.InUse, match=str(os.getpid())):
        nodemap.free(row)
    a.close()


@pytest.mark.timeout(120)
def test_this_process_is_in_its_own_map_and_the_text_names_it() -> None:
    a = sa.zeros((512, 3), device="cpu", pack=False)
    picture = nodemap.node_map()
    row = nodemap.find(picture, a.allocation.id)
    assert row.state == "live" and row.exporter_pid == os.getpid()
    assert row.lost == row.size - 512 * 3 * 8
    text = render_node_text(picture)
    assert a.allocation.id[:12] in text and "cpu:" in text
    # (one summary per device holding allocations of this user; other tests of this process
    # may leave the current slab of another memory system, which is kept on purpose)
    summaries = {d.device: d for d in picture.devices}
    cpu_rows = [r for r in picture.allocations if r.device == "cpu"]
    assert summaries["cpu"].allocations == len(cpu_rows) >= 1
    assert summaries["cpu"].bytes == sum(r.size for r in cpu_rows) >= row.size
    assert sorted(summaries) == sorted({r.device for r in picture.allocations})
    alloc_id = a.allocation.id
    a.close()  # (kept for this process's next array of its size: shown as such)
    assert nodemap.find(nodemap.node_map(), alloc_id).state == "cached"
    assert "cached" in render_node_text(nodemap.node_map())
    STATE.memory.cache.trim()
    assert all(r.alloc_id != alloc_id for r in nodemap.node_map().allocations)


FAKE_ID = "f" * 32


@contextlib.contextmanager
def _foreign_server() -> Iterator[tuple[int, str, Any]]:
    """Another user's process listening on a socket (opened to everyone) that answers every
    request with a snapshot holding :data:`FAKE_ID`: its pid, the socket's path, and a
    function returning the magic of every request it received so far."""
    user = other_user()
    if user is None:
        pytest.skip("needs root (to create a second OS user) and useradd")
    pw = pwd.getpwnam(user)
    theirs = tempfile.mkdtemp(prefix="sa-other-")
    os.chown(theirs, pw.pw_uid, pw.pw_gid)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the other user's process
        code = 1
        try:
            os.close(read)
            become(user)
            path = os.path.join(theirs, "s.sock")
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.bind(path)
                os.chmod(path, 0o777)
                s.listen(4)
                os.write(write, b"1")
                s.settimeout(60)
                held = HeldAllocation(
                    FAKE_ID,
                    "host",
                    "cpu",
                    1 << 20,
                    1 << 20,
                    True,
                    os.getpid(),
                    0.0,
                    1,
                    False,
                    False,
                )
                body = Snapshot(os.getpid(), "other user", (held,)).encode()
                while True:
                    conn, _ = s.accept()
                    with conn, contextlib.suppress(OSError):  # (refused: closed on it)
                        request = conn.recv(4096)
                        if request:
                            os.write(write, request[:4])  # what it was asked
                        conn.send(Reply(Status.OK, 0, body).encode())
        except BaseException:
            code = 2
        finally:
            os._exit(code)
    os.close(write)
    os.set_blocking(read, False)

    def received() -> bytes:
        try:
            return os.read(read, 4096)
        except BlockingIOError:
            return b""

    try:
        os.set_blocking(read, True)
        assert os.read(read, 1) == b"1"
        os.set_blocking(read, False)
        yield pid, os.path.join(theirs, "s.sock"), received
    finally:
        os.close(read)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        shutil.rmtree(theirs, ignore_errors=True)


@pytest.mark.timeout(120)
def test_another_users_process_is_never_listed() -> None:
    """Another user's process whose socket sits among ours (hard-linked into the runtime
    directory, opened to everyone) answers with a snapshot: it is refused, never listed."""
    with _foreign_server() as (pid, path, received):
        link = runtime_dir() / f"{pid}-0ther.sock"
        os.link(path, link)
        try:
            picture = nodemap.node_map()
            assert all(r.alloc_id != FAKE_ID for r in picture.allocations)
            assert [p.status for p in picture.processes if p.pid == pid] == ["refused"]
            assert FAKE_ID not in json.dumps(_top())
            assert received() == b""  # refused before anything was sent
        finally:
            with contextlib.suppress(FileNotFoundError):
                link.unlink()


@pytest.mark.timeout(120)
def test_rm_never_reaches_another_users_process_or_keeper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rm`` of an id that another user's exporter or keeper holds is refused, and nothing
    is sent to them: their sockets (hard-linked into a runtime directory of ours, as this
    user's handle server and as this user's keeper) fail the same-user check."""
    with _foreign_server() as (pid, path, received):
        xdg = tmp_path / "xdg"
        xdg.mkdir(mode=0o711)
        ours = xdg / "sharedarrays"
        ours.mkdir(mode=0o700)
        os.link(path, ours / f"{pid}-0ther.sock")
        os.link(path, ours / "keeper.sock")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(Path(sa.__file__).parents[1])
        env["XDG_RUNTIME_DIR"] = str(xdg)
        for target in (FAKE_ID, FAKE_ID[:8]):
            out = subprocess.run(
                [sys.executable, "-m", "sharedarrays", "rm", target],
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                env=env,
            )
            assert out.returncode == 1, out.stdout
            assert "Traceback" not in out.stderr, out.stderr
            assert out.stderr.startswith("rm: "), out.stderr
        # and asked directly, the transport refuses both before sending anything
        monkeypatch.setattr(transport_node, "runtime_dir", lambda: ours)
        assert transport_node.drop_mapping(pid, FAKE_ID) is None
        assert transport_node.ask(pid, str(ours / f"{pid}-0ther.sock")).status == "refused"
        assert transport_node.ask_keeper().status == "refused"
        with pytest.raises(sa.KeeperError):
            transport_node.drop_kept(FAKE_ID)
        assert received() == b""


@contextlib.contextmanager
def _cuda_pair() -> Iterator[tuple[str, Any, Any, Any]]:
    """An exporter of a cuda-vmm array on cuda:0 and an importer using it, each in its own
    spawned process: the allocation id, both processes and the importer's stop event."""
    stop = ctx.Event()
    stop_importer = ctx.Event()
    ready = ctx.Event()
    out = ctx.Queue()
    with _processes() as procs:
        exp = ctx.Process(target=node_workers.exporter, args=(out, stop, "cuda:0", "cuda-vmm"))
        exp.start()
        procs.append(exp)
        alloc_id, blob = out.get(timeout=TIMEOUT)
        imp = ctx.Process(target=node_workers.importer, args=(blob, ready, stop_importer))
        imp.start()
        procs.append(imp)
        assert ready.wait(TIMEOUT), "the importer did not load the cuda-vmm payload"
        try:
            yield alloc_id, exp, imp, stop_importer
        finally:
            # a waiter killed on an Event would hang its set() (multiprocessing's Condition
            # waits for every sleeper to wake): only a live importer is told
            if imp.is_alive():
                stop_importer.set()
            stop.set()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_top_lists_a_cuda_vmm_exporter_and_importer_and_forgets_a_killed_importer() -> None:
    with _cuda_pair() as (alloc_id, exp, imp, _):
        row = _row(_top(), alloc_id)
        assert row is not None, "the cuda-vmm allocation is not listed"
        assert row["state"] == "live"
        assert row["backend"] == "cuda-vmm" and row["device"] == "cuda:0"
        assert row["size"] >= node_workers.NBYTES
        assert row["lost"] == row["size"] - node_workers.NBYTES
        assert row["exporter"]["pid"] == exp.pid and row["exporter"]["alive"]
        roles = {(h["pid"], h["role"]) for h in row["holders"]}
        assert roles == {(exp.pid, "exporter"), (imp.pid, "importer")}
        assert all(h["views"] >= 1 for h in row["holders"])
        doc = _top()
        assert any(d["device"] == "cuda:0" and d["bytes"] >= row["size"] for d in doc["devices"])

        os.kill(imp.pid, signal.SIGKILL)
        imp.join(TIMEOUT)
        doc = _top()
        row = _row(doc, alloc_id)
        assert row is not None and {h["pid"] for h in row["holders"]} == {exp.pid}
        assert all(p["status"] != "ok" for p in doc["processes"] if p["pid"] == imp.pid)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_nvml_cross_check_covers_exporter_and_importer_processes() -> None:
    """With nvidia-ml-py: ``top --json --once --nvml`` reports, for the exporter and the
    importer of a cuda-vmm array, the allocation's bytes under sharedarrays and a driver
    figure at least as large (NVML counts every allocation of the process's context)."""
    pytest.importorskip("pynvml", reason="nvidia-ml-py is not installed (the nvml extra)")
    why = nodemap.available()
    if why is not None:
        pytest.skip(why)
    with _cuda_pair() as (alloc_id, exp, imp, _):
        out = run_cli("top", "--json", "--once", "--nvml")
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        row = _row(doc, alloc_id)
        assert row is not None
        checks = {(c["pid"], c["device"]): c for c in doc["nvml"]}
        for pid in (exp.pid, imp.pid):
            check = checks.get((pid, "cuda:0"))
            assert check is not None, f"pid {pid} is not in the cross-check: {doc['nvml']}"
            assert check["sharedarrays"] >= row["size"]
        figures = [checks[(pid, "cuda:0")]["driver"] for pid in (exp.pid, imp.pid)]
        if all(f is None for f in figures):
            pytest.skip(f"NVML gives no per-process figure for these pids: {doc['nvml']}")
        for pid in (exp.pid, imp.pid):
            check = checks[(pid, "cuda:0")]
            assert check["driver"] is not None, f"NVML does not report pid {pid}"
            assert check["driver"] >= check["sharedarrays"]


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_nvml_cross_check_counts_this_processes_cuda_allocation() -> None:
    """On CUDA with nvidia-ml-py: the driver's figure for this process covers what
    sharedarrays holds here, and the map accounts for the allocation's bytes."""
    pytest.importorskip("pynvml")
    if nodemap.available() is not None:
        pytest.skip(str(nodemap.available()))
    # Earlier tests in this process may still hold CUDA memory (a pack slab, a kept array):
    # the allocation made here must add exactly its size to this process's figure.
    before = {(c.pid, c.device): c for c in nodemap.cross_check(nodemap.node_map())}
    held_before = getattr(before.get((os.getpid(), "cuda:0")), "sharedarrays", 0)
    a = sa.zeros(64 << 20, dtype="uint8", device="cuda:0", backend="cuda-vmm", pack=False)
    checks = {(c.pid, c.device): c for c in nodemap.cross_check(nodemap.node_map())}
    mine = checks[(os.getpid(), "cuda:0")]
    assert mine.sharedarrays - held_before == a.allocation.size
    if mine.driver is None:  # as in a container whose pids NVML does not see
        pytest.skip(f"NVML gives no per-process figure for pid {os.getpid()}")
    assert mine.driver >= mine.sharedarrays
    assert "SHAREDARRAYS" in nodemap.render_text(list(checks.values()))
    a.close()


@pytest.mark.timeout(120)
def test_the_node_widget_shows_refreshes_and_refuses_to_free_a_live_array() -> None:
    pytest.importorskip("ipywidgets")
    from sharedarrays.api.widgets.view import NodeView

    view = sa.show(scope="node")  # outside a kernel: the static view
    assert isinstance(view, NodeView)
    a = sa.zeros(4096, device="cpu", pack=False)
    widget = NodeView(interval=0.2).widget
    try:
        assert a.allocation.id[:12] in widget.html.value
        b = sa.zeros(8192, device="cpu", pack=False)
        assert b.allocation.id[:12] not in widget.html.value
        widget.refresh()
        assert b.allocation.id[:12] in widget.html.value and "live" in widget.html.value
        widget.target.value = b.allocation.id
        widget.free_button.click()
        assert "in use by views" in widget.status.value and not b.closed
        widget.auto_toggle.value = True
        assert widget.auto_refreshing
        widget.auto_toggle.value = False
        assert not widget.auto_refreshing
        b.close()
    finally:
        widget.close()
        a.close()
    with pytest.raises(ValueError, match="scope"):
        sa.show(scope="galaxy")


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("private_keeper")
def test_an_allocation_the_keeper_holds_in_flight_shows_what_is_lost_to_granularity() -> None:
    # (0 once its exporter had exited: only the exporter knew the bytes it asked for)
    with _processes() as procs:
        alloc_id, blob = _what_an_exited_process_sent(node_workers.sender, procs)
        row = _row(_top(), alloc_id)
        assert row is not None and row["kept"] and not row["exporter"]["alive"]
        assert row["size"] > node_workers.NBYTES + 8  # (rounded up to whole pages)
        assert row["lost"] == row["size"] - (node_workers.NBYTES + 8)
        a = pickle.loads(blob)  # (taken from the keeper: nothing left in flight)
        a.close()


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        (0, ValueError),
        (-1, ValueError),  # (was the socket's "Timeout value out of range")
        (float("nan"), ValueError),
        (float("inf"), ValueError),  # (was OverflowError: timestamp out of range)
        ("1", TypeError),  # (was "unsupported operand type(s) for +")
        (None, TypeError),
    ],
)
def test_node_map_refuses_a_bad_timeout_and_says_so(timeout: object, error: type) -> None:
    with pytest.raises(error, match=r"^timeout must be"):
        sa.node_map(timeout)  # type: ignore[arg-type]
