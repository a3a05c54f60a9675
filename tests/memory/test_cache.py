"""The exporter's cache of released memory (sharedarrays/memory/cache.py) and the importers
that find their parked mappings of it again."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from typing import Any

import numpy as np
import pytest
import workers
from conftest import open_memfds

import sharedarrays as sa
from sharedarrays.memory import cache
from sharedarrays.process import STATE

N = 1 << 17  # float64: 1 MiB


def test_a_released_array_s_memory_is_the_next_one_s_and_zeros_are_zeros() -> None:
    STATE.memory.cache.trim()
    a = sa.full(N, 7.0, device="cpu", pack=False)
    address, first_id = a.address, a.allocation.id
    a.close()
    del a
    assert STATE.memory.cache.nbytes == 1 << 20
    b = sa.zeros(N, device="cpu", pack=False)
    assert b.address == address and b.allocation.reused and b.allocation.id != first_id
    assert not b.get().any()  # (the memory held 7.0: zeros fills what it reuses)
    c = sa.zeros(N, device="cpu", pack=False)  # (none cached now: fresh memory)
    assert c.address != address and not c.allocation.reused
    b.close()
    c.close()


def test_the_bound_and_trim_return_the_memory_and_its_fds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    STATE.memory.cache.trim()
    before = open_memfds()
    monkeypatch.setenv("SHAREDARRAYS_CACHE_BYTES", str(3 << 20))
    arrays = [sa.empty(N, device="cpu", pack=False) for _ in range(5)]
    del arrays
    assert STATE.memory.cache.nbytes == 3 << 20 and open_memfds() == before + 3
    assert STATE.memory.cache.trim() == 3 << 20
    assert STATE.memory.cache.nbytes == 0 and open_memfds() == before
    monkeypatch.setenv("SHAREDARRAYS_CACHE_BYTES", "0")
    a = sa.empty(N, device="cpu", pack=False)
    a.close()
    assert STATE.memory.cache.nbytes == 0 and open_memfds() == before


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_results_from_workers_reuse_memory_and_keep_their_values(method: str) -> None:
    """Workers return new arrays; the parent reads each and lets it go. After the first
    round the workers make them on memory they made before (the parent's mappings of it are
    taken again), and every value is the one its task wrote."""
    with mp.get_context(method).Pool(2) as pool:
        seen: set[int] = set()
        for rnd in range(4):
            for i, a in enumerate(
                pool.imap(workers.new_filled, [(N, 100 * rnd + i) for i in range(8)])
            ):
                np.testing.assert_array_equal(a.get()[[0, -1]], 100 * rnd + i)
                seen.add(np.asarray(a).ctypes.data)
                del a
        hits = sum(pool.apply(workers.cache_counts)[0] for _ in range(8))
    assert hits > 0
    assert len(seen) < 32  # (each a new mapping: no reuse on either side)


@pytest.mark.timeout(180)
def test_an_importer_that_said_done_is_not_asked_again() -> None:
    """A worker asks the parent for ``DONE`` once per block: the parent's mapping, asked
    once, says it unasked at the end of each later result on that block, so the workers'
    results are made on reused memory without an ``ASK`` each."""
    with mp.get_context("spawn").Pool(1, initializer=workers.count_notices) as pool:
        for rnd in range(12):
            tasks = [(N, 10 * rnd + i) for i in range(2)]
            for i, a in enumerate(pool.imap(workers.new_filled, tasks)):
                assert a.get()[-1] == 10 * rnd + i
                del a
        _, counts = pool.apply(workers.notice_counts)
        hits = pool.apply(workers.cache_counts)[0]
    # (an ASK per block made fresh, none per result made on reused memory: 24 before)
    assert hits > 0 and counts.get("ASK", 0) <= 24 - hits, (hits, counts)


@pytest.mark.timeout(180)
def test_memory_a_parent_still_holds_is_never_reused() -> None:
    """The parent keeps some results (as arrays, or only as NumPy arrays over them) while the
    workers make many more: none of the kept ones changes."""
    kept: list[tuple[int, object]] = []
    with mp.get_context("spawn").Pool(2) as pool:
        for rnd in range(15):  # (rounds: a worker reuses what the parent was done with)
            tasks = [(N, i) for i in range(8 * rnd, 8 * rnd + 8)]
            for i, a in zip(range(8 * rnd, 8 * rnd + 8), pool.imap(workers.new_filled, tasks)):
                if i % 7 == 0:
                    kept.append((i, a))
                elif i % 7 == 3:
                    kept.append((i, np.asarray(a)))  # (the view goes; the NumPy array holds it)
                del a
        for i, held in kept:
            values = held.get() if isinstance(held, sa.SharedDeviceArray) else held
            assert (np.asarray(values) == i).all(), f"result {i} was overwritten"
        assert sum(pool.apply(workers.cache_counts)[0] for _ in range(8)) > 0


@pytest.mark.timeout(180)
def test_views_returned_by_workers_let_the_argument_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers return views of the parent's array (pickled by them: in flight there until
    told they came back). Once the parent lets go of the array and the views, its memory
    goes to the cache at once, not after the in-flight bound (300 s here)."""
    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "300")
    with mp.get_context("spawn").Pool(2) as pool:
        for rnd in range(4):
            a = sa.full(N, float(rnd), device="cpu")
            alloc_id = a.allocation.id
            views = pool.map(workers.echo, [a] * 4)
            assert [float(v.get()[-1]) for v in views] == [rnd] * 4
            del a, views
            deadline = time.monotonic() + 60
            while alloc_id in STATE.memory.draining and time.monotonic() < deadline:
                time.sleep(0.05)
            assert alloc_id not in STATE.memory.draining, f"round {rnd}: held till the bound"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("end", ["with", "close", "executor"])
def test_an_ended_sa_pool_lets_the_argument_go(monkeypatch: pytest.MonkeyPatch, end: str) -> None:
    """``with sa.Pool(...)`` stops its workers before the parent lets go of the argument
    (``close``, an executor's ``shutdown``: they exit): asked as the pool ends, its idle
    workers say ``DONE`` first, so the memory goes to the cache at once, not after the
    in-flight bound (300 s here)."""
    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "300")
    for rnd in range(3):
        a = sa.full(N, float(rnd), device="cpu")
        alloc_id = a.allocation.id
        if end == "executor":
            with sa.ProcessPoolExecutor(2) as ex:
                assert list(ex.map(workers.checksum, [a] * 4)) == [rnd * N] * 4
        else:
            with sa.Pool(2) as pool:
                assert pool.map(workers.checksum, [a] * 4) == [rnd * N] * 4
                if end == "close":
                    pool.close()
                    pool.join()
        del a
        deadline = time.monotonic() + 20
        while alloc_id in STATE.memory.draining and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alloc_id not in STATE.memory.draining, f"round {rnd}: held till the bound"


@pytest.mark.timeout(180)
def test_imports_a_worker_unmapped_say_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker keeps at most ``SHAREDARRAYS_KEEP_IMPORTS`` idle mappings (2 here); one it
    unmaps says ``DONE`` then (nobody can ask it later), so once the parent lets go, all the
    arrays' memory is kept for reuse (not freed unreported after ``DONE_WAIT``)."""
    monkeypatch.setenv("SHAREDARRAYS_KEEP_IMPORTS", "2")
    # (DONEs that a loaded 2-core machine delays past 1 s must not free the memory instead)
    monkeypatch.setattr(cache, "DONE_WAIT", 60.0)
    STATE.memory.cache.trim()
    with mp.get_context("spawn").Pool(1) as pool:
        arrays = [sa.full(N, float(i), device="cpu") for i in range(8)]
        assert pool.map(workers.checksum, arrays) == [i * N for i in range(8)]
        ids = {a.allocation.id for a in arrays}
        del arrays
        deadline = time.monotonic() + 60
        kept: set[str] = set()
        while kept != ids and time.monotonic() < deadline:
            time.sleep(0.05)
            kept = {a.id for a in STATE.memory.cache.kept()} & ids
        assert len(kept) == len(ids)
    STATE.memory.cache.trim()


@pytest.mark.timeout(180)
def test_a_worker_that_keeps_the_argument_keeps_its_memory_from_reuse() -> None:
    """The views a worker returned came back, but it holds the array itself: once the
    parent lets go, the memory is not reused for the parent's next arrays meanwhile."""
    with mp.get_context("spawn").Pool(1) as pool:
        a = sa.full(N, 5.0, device="cpu")
        views = pool.map(workers.hold_and_view, [a] * 3)
        del a, views
        fresh = []
        for _ in range(20):  # (each would take the memory, were it let go)
            fresh.append(sa.full(N, 9.0, device="cpu"))
            time.sleep(0.05)
        assert pool.apply(workers.held_values) == [5.0] * 6
        assert pool.apply(workers.release_held) == 3


@pytest.mark.timeout(120)
def test_a_worker_exiting_with_results_in_flight_still_delivers_them() -> None:
    """maxtasksperchild=1: each worker exits right after returning its array, before the
    parent loads it (the keeper takes the handles at exit): every value arrives."""
    with mp.get_context("spawn").Pool(2, maxtasksperchild=1) as pool:
        results = pool.map(workers.new_filled, [(N, i) for i in range(6)])
        time.sleep(0.5)
        for i, a in enumerate(results):
            assert a.get()[-1] == i


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_cuda_results_keep_their_values_and_a_trim_returns_device_memory() -> None:
    """On the GPU: workers return new 64 MiB arrays in rounds while the parent keeps some;
    the kept ones keep their values, the workers reuse memory; then memory this process
    cached returns to the device when trimmed (``cudaMemGetInfo``)."""
    import cupy

    n = 16 << 20  # float32: 64 MiB
    kept: list[tuple[int, object]] = []
    with mp.get_context("spawn").Pool(2) as pool:
        for rnd in range(6):
            tasks = [(n, i) for i in range(8 * rnd, 8 * rnd + 8)]
            for i, a in zip(range(8 * rnd, 8 * rnd + 8), pool.imap(workers.new_filled_cuda, tasks)):
                assert float(a.array[-1]) == i
                if i % 5 == 0:
                    kept.append((i, a))
                elif i % 5 == 2:
                    kept.append((i, a.array))  # (a CuPy array over it: the view goes)
                del a
        for i, held in kept:
            values = held.array if isinstance(held, sa.SharedDeviceArray) else held
            assert bool((values == i).all()), f"result {i} was overwritten"
        assert sum(pool.apply(workers.cache_counts)[0] for _ in range(8)) > 0
    STATE.memory.cache.trim()
    arrays = [sa.empty(n, "float32", device="cuda:0", pack=False) for _ in range(4)]
    del arrays
    assert STATE.memory.cache.nbytes == 4 * (64 << 20)
    free_before = cupy.cuda.runtime.memGetInfo()[0]
    assert STATE.memory.cache.trim() == 4 * (64 << 20)
    assert cupy.cuda.runtime.memGetInfo()[0] - free_before >= 4 * (64 << 20)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["spawn-argument", "fork-argument", "fork-after-import"])
def test_memory_a_process_holds_untracked_is_never_reused(how: str) -> None:
    """A spawned Process's argument (its fds travel with it) and what a forked child inherits
    are held where nobody can ask for DONE: letting go here, and making arrays that would
    take the memory, never changes what that process reads."""
    method = how.split("-")[0]
    ctx = mp.get_context(method)
    out, go = ctx.Queue(), ctx.Event()
    with mp.get_context("spawn").Pool(1) as pool:
        if how == "fork-after-import":  # (made by a worker: the fork inherits an import)
            a = pool.apply(workers.new_filled, ((N, 3),))
        else:
            a = sa.full(N, 3.0, device="cpu", pack=False)
        child = ctx.Process(target=workers.read_twice, args=(a, out, go))
        child.start()
        assert out.get(timeout=60) == 3.0
        del a
        if how == "fork-after-import":  # (the worker's next arrays would take the memory)
            fresh = pool.map(workers.new_filled, [(N, 9)] * 8)
        else:
            fresh = [sa.full(N, 9.0, device="cpu", pack=False) for _ in range(8)]
        time.sleep(0.2)
        go.set()
        assert out.get(timeout=60) == 3.0
        child.join(60)
        assert child.exitcode == 0
        del fresh


def _new_arrays_then_read_again(out: Any, go: Any) -> None:
    """Make arrays that would take the memory just let go of, then let the process still
    holding it read again: it reads what was written before (3.0)."""
    fresh = [sa.full(N, 9.0, device="cpu", pack=False) for _ in range(8)]
    time.sleep(0.2)
    go.set()
    assert out.get(timeout=60) == 3.0
    del fresh


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["pickle-loaded-twice", "payload-bytes"])
def test_memory_of_a_payload_any_process_may_load_is_never_reused(how: str) -> None:
    """A plain pickle (loaded here by two processes, one of which closes its view first) and
    ``a.payload()``'s bytes can be loaded any number of times: letting go here, and making
    arrays that would take the memory, never changes what a process still holding it reads."""
    ctx = mp.get_context("spawn")
    out, closer, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    a = sa.full(N, 3.0, device="cpu", pack=False)
    blob = pickle.dumps(a) if how == "pickle-loaded-twice" else a.payload().to_bytes()
    procs = [ctx.Process(target=workers.load_and_read_twice, args=(blob, out, go, False))]
    if how == "pickle-loaded-twice":
        args = (blob, closer, go, True)
        procs.append(ctx.Process(target=workers.load_and_read_twice, args=args))
    for p in procs:
        p.start()
    try:
        assert out.get(timeout=60) == 3.0
        if how == "pickle-loaded-twice":  # (its DONE counts as many loads as were pickled)
            assert [closer.get(timeout=60) for _ in range(2)] == [3.0, "closed"]
            time.sleep(0.5)
        del a
        _new_arrays_then_read_again(out, go)
    finally:
        go.set()
        for p in procs:
            p.join(60)
    assert [p.exitcode for p in procs] == [0] * len(procs)


@pytest.mark.timeout(180)
def test_memory_a_forwarded_payload_holds_is_never_reused() -> None:
    """An importer forwards the array to a third process and closes its own view: letting go
    here, and making arrays that would take the memory, never changes what the third reads."""
    ctx = mp.get_context("spawn")
    to_b, to_c, tell, said, read = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    go = ctx.Event()
    b = ctx.Process(target=workers.forward_then_close, args=(to_b, to_c, tell, said, go))
    c = ctx.Process(target=workers.read_twice_from, args=(to_c, read, go))
    b.start()
    c.start()
    try:
        a = sa.full(N, 3.0, device="cpu", pack=False)
        to_b.put(a)
        assert read.get(timeout=60) == 3.0  # (the third process loaded it)
        tell.put("close")
        assert said.get(timeout=60) == "closed"
        time.sleep(0.5)  # (the forwarder's notices arrive)
        del a
        _new_arrays_then_read_again(read, go)
    finally:
        go.set()
        for p in (b, c):
            p.join(60)
    assert (b.exitcode, c.exitcode) == (0, 0)


@pytest.mark.timeout(120)
def test_an_import_taken_out_of_reuse_is_no_longer_listed_by_its_block() -> None:
    a = sa.full(N, 3.0, device="cpu", pack=False)
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(workers.listed_by_block_around_a_plain_pickle, (a,)) == (True, False)


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_cuda_memory_a_spawned_process_takes_as_argument_is_never_reused() -> None:
    """The same on a GPU: the argument's chunks travel as fds, and the parent's next arrays
    of its size never land in the memory the child still reads."""
    why = sa.list_backends()["cuda-vmm"]
    if why is not None:
        pytest.skip(f"cuda-vmm cannot be used here: {why}")
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    a = sa.full(N, 3.0, device="cuda:0", pack=False)
    child = ctx.Process(target=workers.read_twice, args=(a, out, go))
    child.start()
    assert out.get(timeout=120) == 3.0
    del a
    fresh = [sa.full(N, 9.0, device="cuda:0", pack=False) for _ in range(8)]
    sa.synchronize()
    go.set()
    assert out.get(timeout=60) == 3.0
    child.join(60)
    assert child.exitcode == 0
    del fresh
