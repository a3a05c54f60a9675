"""Handoff by pickle: every start method, every multiprocessing channel, plain pickle."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import workers
from keeper_helpers import takes_refused

import sharedarrays as sa
from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.cache import empty_cache
from sharedarrays.memory.registry import lookup
from sharedarrays.process import STATE
from sharedarrays.protocol.handles import Kind
from sharedarrays.transport.handles import server_address

METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]


@pytest.fixture(scope="module", params=METHODS)
def pool(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    with mp.get_context(request.param).Pool(2) as p:
        yield p


def test_pool_workers_write_their_slices(pool) -> None:  # type: ignore[no-untyped-def]
    a = sa.full((4, 1000), 3.0, device="cpu", pack=False)
    sums = pool.map(workers.double_slice, [(a, i) for i in range(4)])
    assert sums == [7000.0] * 4
    np.testing.assert_array_equal(a.get(), 7.0)


def test_views_with_offsets_and_strides_reach_workers(pool) -> None:  # type: ignore[no-untyped-def]
    ref = np.arange(60, dtype=np.int32).reshape(6, 10)
    a = sa.from_array(ref, device="cpu", pack=False)
    views = [a[1:5, ::3], a[::-2, 7], a[2, 1:9:2], a[..., None, ::-1]]
    assert pool.map(workers.checksum, views) == [
        float(ref[1:5, ::3].sum()),
        float(ref[::-2, 7].sum()),
        float(ref[2, 1:9:2].sum()),
        float(ref.sum()),
    ]
    back = pool.map(workers.add_one, [a[1:5, ::3]])[0]
    assert back.allocation is a.allocation  # it came home: the same mapping, no new one
    ref[1:5, ::3] += 1
    np.testing.assert_array_equal(a.get(), ref)


@pytest.mark.parametrize("method", METHODS)
def test_queue(method: str) -> None:
    ctx = mp.get_context(method)
    q, done = ctx.Queue(), ctx.Queue()
    a = sa.zeros((10, 10), device="cpu", pack=False)
    p = ctx.Process(target=workers.queue_consumer, args=(q, done))
    p.start()
    q.put(a[2:])
    assert done.get(timeout=60) == 400.0
    p.join(60)
    assert p.exitcode == 0
    assert a.get()[2:].sum() == 400 and a.get()[:2].sum() == 0


@pytest.mark.parametrize("method", METHODS)
def test_pipe(method: str) -> None:
    ctx = mp.get_context(method)
    parent, child = ctx.Pipe()
    a = sa.full(8, 2, "int64", device="cpu", pack=False)
    p = ctx.Process(target=workers.pipe_consumer, args=(child,))
    p.start()
    parent.send(a)
    assert parent.recv() == a.allocation.id
    p.join(60)
    assert a.get().tolist() == [6] * 8


@pytest.mark.parametrize("method", METHODS)
def test_process_arguments(method: str) -> None:
    ctx = mp.get_context(method)
    q = ctx.Queue()
    a = sa.zeros((3, 4), "int16", device="cpu", pack=False)
    p = ctx.Process(target=workers.process_arg_consumer, args=(a, q))
    p.start()
    origin_pid, alloc_id = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and alloc_id == a.allocation.id
    np.testing.assert_array_equal(a.get(), np.arange(12).reshape(3, 4))
    if method != "fork":  # at spawn the fds travelled with the arguments (DupFd), no fetch
        assert origin_pid == os.getpid()
        assert a.allocation.served == ()


@pytest.mark.parametrize("method", METHODS)
def test_process_pool_executor(method: str) -> None:
    a = sa.zeros(100, "float32", device="cpu", pack=False)
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as ex:
        results = list(ex.map(workers.fill_value, [a[:50], a[50:]], [1.0, 2.0]))
    assert {r[1] for r in results} == {a.allocation.id}
    assert a.get()[:50].sum() == 50 and a.get()[50:].sum() == 100


def test_load_in_exporter_is_the_same_memory() -> None:
    a = sa.zeros(5, device="cpu", pack=False)
    b = pickle.loads(pickle.dumps(a[1:]))
    assert b.allocation is a.allocation and b.address == a.address + 8
    b[0] = 9
    assert a.array[1] == 9


def _served_soon(alloc: Allocation, count: int) -> int:
    """How many times ``alloc`` was served, once ``count`` or 10 s later (a worker that
    took the fds itself says so in a notice, which the server may handle after its result)."""
    deadline = time.monotonic() + 10
    while len(alloc.served) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(alloc.served)


def test_one_mapping_per_allocation_in_an_importer() -> None:
    a = sa.zeros(5, device="cpu", pack=False)
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as p:
        same, live = p.apply(workers.import_twice, (pickle.dumps(a[1:]),))
        assert same and live == 1
        fetched = _served_soon(a.allocation, 1)
        assert fetched == 1
        # the worker still maps it (parked, no live view): later handoffs fetch nothing
        p.apply(workers.checksum, (a[2:],))
        p.apply(workers.checksum, (a,))
        assert len(a.allocation.served) == fetched


@pytest.mark.usefixtures("no_cache")
def test_warm_handoffs_are_parked_and_dropped_when_the_exporter_releases() -> None:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as p:
        a = sa.zeros(5, device="cpu", pack=False)
        alloc_id = a.allocation.id
        for _ in range(5):
            p.apply(workers.increment, (a,))
        assert _served_soon(a.allocation, 1) == 1  # one cold import, then warm
        assert p.apply(workers.parked_ids) == [alloc_id]
        np.testing.assert_array_equal(a.get(), 5)
        a.close()
        del a
        deadline = time.time() + 10
        while p.apply(workers.parked_ids) and time.time() < deadline:
            time.sleep(0.05)
        assert p.apply(workers.parked_ids) == []  # the exporter told the worker
        assert p.apply(workers.mapped_ids) == []


@pytest.mark.timeout(120)
def test_results_the_keeper_relayed_are_not_kept_parked(no_cache: None) -> None:
    # (the worker drops each result before it is loaded: with no cache to keep it, the keeper
    # takes its handles until the parent loads it; nobody can load it again after, so the
    # parent's last view unmaps it at once instead of parking memory nothing else frees)
    from sharedarrays.memory import parked_allocations

    with mp.get_context("spawn").Pool(2) as pool:
        for blob in pool.imap_unordered(workers.made_here_pickled, [4] * 8):
            got = pickle.loads(blob)
            assert got.get().tolist() == [4.0] * 4
            alloc_id, relayed = got.allocation.id, got.allocation in STATE.keeper.kept
            got.close()
            del got
            gc.collect()  # (the load's own reference cycles)
            assert relayed  # (what the test is about: the keeper held it)
            assert alloc_id not in {a.id for a in parked_allocations()}
            assert lookup(alloc_id) is None  # unmapped here


def test_parking_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAREDARRAYS_KEEP_IMPORTS", "2")  # spawned workers inherit it
    arrays = [sa.zeros(3, device="cpu", pack=False) for _ in range(4)]
    with mp.get_context("spawn").Pool(1) as p:
        for x in arrays:
            p.apply(workers.checksum, (x,))
        assert p.apply(workers.parked_ids) == [x.allocation.id for x in arrays[2:]]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_warm_handoff_takes_the_lease_the_parked_import_keeps(device: str) -> None:
    """The first handoff parks the import with a lease of its own; every later one hands the
    view that lease (no lease made or ended) and leaves the import parked again after the
    view's close, with no lease counted for it."""
    a = sa.from_array(np.arange(8.0), device=device, pack=False)
    with mp.get_context("spawn").Pool(1) as p:
        first = p.apply(workers.takes_the_kept_lease, (a,))
        later = [p.apply(workers.takes_the_kept_lease, (a,)) for _ in range(3)]
    kept = first[1]
    assert kept != 0 and first[0] != kept and first[2:] == (True, 0)
    assert later == [(kept, kept, True, 0)] * 3


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_parked_import_keeps_its_native_base_for_the_next_handoff(device: str) -> None:
    """A warm handoff makes no native memory object: the importer keeps the allocation's
    native base while it is parked (no view lease left), and the next `.array` uses it."""
    a = sa.from_array(np.arange(8.0), device=device, pack=False)
    with mp.get_context("spawn").Pool(1) as p:
        first = p.apply(workers.reuses_native_base, (a,))
        second = p.apply(workers.reuses_native_base, (a,))
    assert first == (False, True, 0)
    assert second == (True, True, 0)


def test_releasing_a_parked_import_waits_for_its_native_arrays() -> None:
    """Released while parked (an eviction, a drop), an import whose native array lives on is
    no longer parked but stays mapped for it, and is released when it goes."""
    a = sa.from_array(np.arange(8.0) + 5, device="cpu", pack=False)
    with mp.get_context("spawn").Pool(1) as p:
        got = p.apply(workers.evicted_while_a_native_lives, (a,))
    assert got["parked"] is True and got["released"] is False
    assert got["after"] == (False, False, 1)  # kept by the native array's base alone
    assert got["value"] == 5.0
    assert got["end"] == (False, True, 0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_plain_pickle_through_a_file_to_a_fresh_interpreter(tmp_path: Path, device: str) -> None:
    a = sa.from_array(np.arange(12.0).reshape(3, 4), device=device, pack=False)
    path = tmp_path / "a.pkl"
    with open(path, "wb") as f:
        pickle.dump(a[1:, ::-1], f)
    code = (
        "import pickle, sys\n"
        f"b = pickle.load(open({str(path)!r}, 'rb'))\n"
        "assert b.shape == (2, 4), b.shape\n"
        "print(b.device, b.get().tolist()); b[...] = -1\n"
        "if b.device.is_cuda:\n"
        "    import cupy; cupy.cuda.get_current_stream().synchronize()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    want = np.arange(12.0).reshape(3, 4)[1:, ::-1].tolist()
    assert out.stdout.strip() == f"{a.device} {want}"
    np.testing.assert_array_equal(a.get()[1:], -1)
    np.testing.assert_array_equal(a.get()[0], [0, 1, 2, 3])


@pytest.mark.timeout(120)
def test_an_array_closed_after_its_taker_answered_stays_from_the_keeper(
    monkeypatch: pytest.MonkeyPatch, no_cache: None
) -> None:
    """A worker that takes the fds says TOOK before it answers, but the exporter may read it
    after the answer: its handle server reads what it was sent before a hand-over. (Memory
    kept for reuse waits for its importers' DONE instead: not handed over.)"""
    if why := takes_refused():
        pytest.skip(why)
    a = sa.from_array(np.arange(1000.0), device="cpu", pack=False)
    server_address()  # (starts the handle server)
    server = STATE.server.server
    assert server is not None
    took = server._handlers[Kind.TOOK]
    read: list[int] = []

    def read_late(*args: object) -> None:  # (a busy exporter: read a while after)
        time.sleep(0.5)
        read.append(1)
        took(*args)  # type: ignore[arg-type]

    monkeypatch.setitem(server._handlers, Kind.TOOK, read_late)
    with mp.get_context("spawn").Pool(1) as p:
        assert p.apply(workers.checksum, (a,)) == np.arange(1000.0).sum()
    alloc = a.allocation
    a.close()
    assert read  # (the worker took the fds)
    assert not alloc.flight.was_handed_over  # (else the keeper holds it up to 60 s)
    assert alloc.released and lookup(alloc.id) is None


def test_a_handle_server_that_does_not_settle_is_not_waited_for_again(
    monkeypatch: pytest.MonkeyPatch, no_cache: None
) -> None:
    """Hand-overs (an exit with many arrays in flight) wait for one unanswered SETTLE only."""
    from sharedarrays.transport import handles

    server_address()
    server = STATE.server.server
    assert server is not None
    monkeypatch.setattr(server, "silent", set())
    asked: list[str] = []

    def unanswered(paths: list[str], timeout: float, asker: str = "") -> list[str]:
        asked.extend(paths)
        return paths

    monkeypatch.setattr(handles, "settle", unanswered)
    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "0.5")  # (what the keeper gets, briefly)
    for _ in range(3):
        a = sa.zeros(16, device="cpu", pack=False)
        pickle.dumps(a)  # (in flight: its release hands it over)
        a.close()
    assert asked == [server.path]


@pytest.mark.timeout(60)
def test_stopped_importers_delay_a_hand_over_by_the_settle_bound_in_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four served processes that do not answer TELL (stopped: they never accept) cost a
    hand-over one SETTLE_TIMEOUT in all, not one each, and are not asked again."""
    import socket

    from sharedarrays.transport import handles

    server_address()
    server = STATE.server.server
    assert server is not None
    monkeypatch.setattr(server, "silent", set())
    stopped = []
    for i in range(4):  # (listening, never accepting: as a SIGSTOPped process's server)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.bind(str(tmp_path / f"{os.getpid()}-0000000{i}.sock"))
        sock.listen()
        stopped.append(sock)
    paths = [s.getsockname() for s in stopped]
    began = time.monotonic()
    handles.gather_loads(paths)
    took = time.monotonic() - began
    assert server.silent == set(paths)
    assert took < 3 * handles.SETTLE_TIMEOUT  # (one each would be at least 4)
    began = time.monotonic()
    handles.gather_loads(paths)
    assert time.monotonic() - began < handles.SETTLE_TIMEOUT  # (not asked again)
    for sock in stopped:
        sock.close()


def test_exporter_exits_first_and_the_importer_keeps_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (no payload of ours kept in flight: the pool worker's TOOK or LOADED may come after its
    # result, and the memory would go to the keeper, where the stale payload would find it)
    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "0")
    path, ready, go = tmp_path / "a.pkl", tmp_path / "ready", tmp_path / "go"
    code = f"import workers; workers.exporter_main({str(path)!r}, {str(ready)!r}, {str(go)!r})"
    exporter = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.time() + 60
        while not ready.exists():
            assert exporter.poll() is None and time.time() < deadline, "exporter failed"
            time.sleep(0.01)
        with open(path, "rb") as f:
            a = pickle.load(f)
        go.touch()
        assert exporter.wait(60) == 0
        assert not os.path.exists(f"/proc/{exporter.pid}")
        # the exporter is gone: our mapping still holds the data, and writes still work
        np.testing.assert_array_equal(a.get(), np.arange(1000))
        a[...] = 7
        assert a.get().sum() == 7000
        # ...and a second process can still import it, from us
        blob = pickle.dumps(a[10:20])
        with mp.get_context("spawn").Pool(1) as p:
            assert p.apply(workers.checksum, (pickle.loads(blob),)) == 70.0
        # but the original payload names a dead exporter: a clear error
        with open(path, "rb") as f:
            stale = f.read()
        a.close()
        import gc

        gc.collect()
        with pytest.raises(sa.HandleUnavailable, match=f"pid {exporter.pid}"):
            pickle.loads(stale)
    finally:
        exporter.kill()
        exporter.wait()


def test_payload_of_a_closed_array_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "0")  # no payload in flight is kept
    a = sa.zeros(4, device="cpu", pack=False)
    blob = pickle.dumps(a)
    alloc_id = a.allocation.id
    a.close()
    import gc

    gc.collect()
    assert lookup(alloc_id) is None
    code = f"import pickle; pickle.loads({blob!r})"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "HandleUnavailable" in out.stderr
    assert "Keep that process" in out.stderr


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_fd_counts_return_to_baseline_after_200_round_trips(method: str) -> None:
    from conftest import open_fds

    from sharedarrays.transport import keeper

    keeper.ensure_running()  # (a worker that starts it holds the launch's pipes meanwhile)
    with mp.get_context(method).Pool(1) as p:
        first = sa.zeros(1, device="cpu", pack=False)
        p.apply(workers.add_one, (first,))  # both handle servers start
        first_id = first.allocation.id
        del first
        gc.collect()
        deadline = time.time() + 30  # the worker drops it when told the memory was freed
        while first_id in p.apply(workers.mapped_ids) and time.time() < deadline:
            empty_cache()  # (the parent keeps it for reuse once the worker said DONE)
            time.sleep(0.05)
        worker_before = p.apply(workers.num_fds)

        before = open_fds()
        for i in range(200):
            a = sa.full(64, float(i), device="cpu", pack=False)
            back = p.apply(workers.add_one, (a,))
            assert back.allocation is a.allocation and a.array[0] == i + 1
            del a, back
        # release notices travel off-thread: give them a moment to land (memory kept for
        # reuse holds its fds: emptied, as the next allocation would find it held, not leaked)
        deadline = time.time() + 10
        while time.time() < deadline:
            empty_cache()
            after, worker_after = open_fds(), p.apply(workers.num_fds)
            if after <= before and worker_after <= worker_before:
                break
            time.sleep(0.05)
    # (fewer is no leak: a kept connection or cached memory of an earlier test may go meanwhile)
    assert after <= before, f"exporter leaked {after - before} fds"
    assert worker_after <= worker_before, f"worker leaked {worker_after - worker_before} fds"


def test_a_list_of_small_arrays_imports_each_slab_once() -> None:
    arrays = [sa.full(512, float(i), device="cpu") for i in range(1500)]
    slabs = {a.allocation.id for a in arrays}
    with mp.get_context("spawn").Pool(1) as p:
        worker = p.apply(os.getpid)
        assert p.apply(workers.checksum_list, (arrays,)) == float(sum(range(1500)))
        assert sorted(p.apply(workers.mapped_ids)) == sorted(slabs)
    allocations = {x.allocation.id: x.allocation for x in arrays}.values()
    # (the first slab may be older than this test and have been served to others before)
    served = sum(1 for a in allocations for s in a.served if s.pid == worker)
    assert served == len(slabs)
