"""Every multiprocessing pattern users rely on, with every start method and memory system.

The matrix: start methods (spawn, fork, forkserver) x patterns (an argument written in
place; a result returned through ``map``, ``imap_unordered``, ``apply_async`` with a
callback and ``ProcessPoolExecutor.map``; a ``Queue`` and a ``Pipe`` whose producer exits
before the consumer reads; a view of the parent's array returned; a process passing the
parent's array and one of its own on to a process of its own) x memory systems (``host`` and the
``host-pointer`` double of exporter-owned memory here; the GPU run adds cuda-vmm, cuda-ipc
and cuda-pool through ``tests/test_conformance.py``). Each case checks the values, that
writes are seen both ways where the memory is shared, and that this process's fds return to
their baseline. Every case has a time limit, so a hang fails.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pattern_workers as pw
import pytest
from conftest import fd_targets, open_fds
from keeper_helpers import private_keeper  # noqa: F401 - fixture

import sharedarrays as sa
from sharedarrays.api.pool import cuda_initialised
from sharedarrays.memory import cache
from sharedarrays.memory.cache import empty_cache
from sharedarrays.memory.registry import (
    draining_allocations,
    drop_parked,
    lookup,
    reap_draining,
)
from sharedarrays.protocol import keeper as wire
from sharedarrays.transport import client, keeper
from sharedarrays.transport import handles as transport

METHODS = ["spawn", "fork", "forkserver"]
BACKENDS = [
    "host",
    "host-pointer",
    pytest.param("cuda-vmm", marks=pytest.mark.gpu),
    pytest.param("cuda-ipc", marks=pytest.mark.gpu),
    pytest.param("cuda-pool", marks=pytest.mark.gpu),
]
pytestmark = pytest.mark.timeout(240)


IN_FLIGHT = 15
"""The bound on payloads in flight in these tests (seconds): long enough for every load
here, short enough that what a case kept for payloads it cannot know were loaded (a forked
child loads its parent's payloads from the mapping it inherited, asking nobody) is
returned before the fd check gives up."""


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's fds back to their baseline afterwards. (No private keeper: the
    forkserver, started once, would give its children a runtime directory gone since.)"""
    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", str(IN_FLIGHT))
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()  # (started once per process, and kept: not a leak)
    forkserver.ensure_running()
    transport.server_address()  # (this process's handle server, started once)
    keeper.disconnect()  # (the one connection a process keeps to the keeper: counted apart)
    # (and the connections it keeps to other processes' handle servers: a cache of at most
    # MAX_CLIENT_CONNECTIONS, whose entries an earlier case's processes left, and which a
    # failed send to one since gone closes: counted apart too)
    client.close_connections()
    drop_parked()
    empty_cache()  # (memory kept for reuse is held, not leaked: emptied before and after)
    before, targets = open_fds(), fd_targets()
    yield
    # A leak is an fd open now to something that was not open before, or more fds than
    # before. Fewer is no leak: the pipes of an earlier case's pool may still have been
    # closing when the baseline was taken (pools and their threads close their pipes a
    # moment after they end).
    deadline = time.monotonic() + IN_FLIGHT + 30
    while True:
        gc.collect()
        drop_parked()
        empty_cache()
        keeper.disconnect()  # (the one connection a process keeps to the keeper)
        client.close_connections()
        after, new = open_fds(), fd_targets() - targets
        if (after <= before and not new) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not new, f"file descriptors leaked: {new}"
    assert after <= before, f"file descriptors leaked: {after} open, {before} before"


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    """The memory system under test (a CUDA one is skipped, with the reason, where the
    device lacks it); CUDA is initialised here, before the fd baseline."""
    name = str(request.param)
    if name.startswith("cuda"):
        why = sa.list_backends()[name]
        if why is not None:
            pytest.skip(f"{name} cannot be used here: {why}")
        sa.zeros(1, device="cuda:0", backend=name, pack=False).close()
    return name


def _context(method: str, backend: str) -> Any:
    """The start method's context; ``None`` where CUDA refuses it (fork after CUDA was
    initialised, asserted here: the pattern is the refusal), also for host memory once a
    CUDA case ran in this process (``-m "gpu or not gpu"`` on a GPU machine)."""
    if method == "fork" and (backend.startswith("cuda") or cuda_initialised()):
        with pytest.raises(sa.ForkAfterCudaError):
            sa.Pool(1, context="fork")
        return None
    return mp.get_context(method)


def _keeper_holds() -> int:
    try:
        _, body, _ = keeper.request(wire.Status(), start=False)
    except sa.HandleUnavailable:
        return 0
    return int(body["arrays"])


def _values(arrays: list[sa.SharedDeviceArray]) -> list[int]:
    return [int(a.get()[0]) for a in arrays]


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("method", METHODS)
def test_results_made_in_workers(method: str, backend: str, clean: None) -> None:
    if _context(method, backend) is None:
        return
    tasks = [(backend, i) for i in range(6)]
    with sa.Pool(2, context=method) as pool:
        got = pool.map(pw.make, tasks)
        assert _values(got) == list(range(6))
        assert sorted(_values(list(pool.imap_unordered(pw.make, tasks)))) == list(range(6))
        seen: list[sa.SharedDeviceArray] = []
        pool.apply_async(pw.make, ((backend, 9),), callback=seen.append).get(60)
        assert _values(seen) == [9]
        got[0].array[5] = 123  # the parent's writes reach the memory a worker made
        assert pool.apply(pw.first, (got[0][5:],)) == 123
    with sa.ProcessPoolExecutor(2, mp_context=method) as ex:
        assert _values(list(ex.map(pw.make, tasks))) == list(range(6))
    assert all(a.allocation.origin.pid != 0 for a in got)
    del got, seen


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("method", METHODS)
def test_arguments_written_in_place_and_views_returned(
    method: str, backend: str, clean: None
) -> None:
    if _context(method, backend) is None:
        return
    a = sa.zeros(pw.N, dtype="int64", device=pw.device_of(backend), backend=backend)
    with sa.Pool(2, context=method) as pool:
        views = pool.map(pw.write_and_view, [a, a, a])
    assert [v.shape for v in views] == [(2,)] * 3
    assert (a.get()[1:3] == 7).all()  # the workers' writes, seen here
    a.array[1] = 8  # and this process's, seen through the views the workers returned
    assert [int(v.get()[0]) for v in views] == [8, 8, 8]
    del views, a


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("channel", ["queue", "pipe"])
def test_producer_exits_before_the_consumer_reads(
    method: str, backend: str, channel: str, clean: None
) -> None:
    ctx = _context(method, backend)
    if ctx is None:
        return
    if channel == "queue":
        q = ctx.Queue()
        out, read = q, q.get
    else:
        receiver, sender = ctx.Pipe(duplex=False)
        out, read = sender, receiver.recv
    p = ctx.Process(target=pw.produce, args=(out, backend, 5))
    p.start()
    if backend in ("host", "cuda-vmm"):  # exporter-owned memory's producer waits at exit
        p.join(60)
        assert p.exitcode == 0
    a = read()
    assert int(a.get()[0]) == 5 and int(a.get().sum()) == 5 * pw.N
    a.array[0] = 6
    assert int(a.get()[0]) == 6
    del a
    gc.collect()
    drop_parked()  # (host-pointer: the producer is told this process closed it)
    p.join(60)
    assert p.exitcode == 0
    if channel == "queue":
        q.close()
        q.join_thread()
    else:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("method", METHODS)
def test_a_process_passes_arrays_on(method: str, backend: str, clean: None) -> None:
    ctx = _context(method, backend)
    if ctx is None:
        return
    a = sa.zeros(pw.N, dtype="int64", device=pw.device_of(backend), backend=backend)
    q = ctx.Queue()
    p = ctx.Process(target=pw.pass_on, args=(a, method, q))
    p.start()
    exitcode, b = q.get(timeout=120)
    assert exitcode == 0
    assert int(a.get()[0]) == 42  # written by the grandchild
    assert int(b.get()[0]) == 43 and int(b.get()[1:].sum()) == 0  # made by the child
    del b
    gc.collect()
    drop_parked()  # (exporter-owned memory: the child waits at exit until this closed it)
    p.join(60)
    assert p.exitcode == 0
    q.close()
    q.join_thread()
    del a


@pytest.mark.timeout(120)
def test_fork_after_use_never_aliases_memory() -> None:
    """Regression: fork children inherited the parent's slab and handed out its free space.
    (No fd check: this process's current slab stays mapped while it has room.)"""
    before = sa.full(3, -1, dtype="int64", device="cpu")  # the parent's slab is in use
    with sa.Pool(4, context="fork") as pool:
        got = pool.map(pw.make_small, range(16))
    assert _values(got) == list(range(16))
    after = [sa.full(4, 100 + i, dtype="int64", device="cpu") for i in range(8)]
    assert _values(got) == list(range(16))  # nothing the parent made since overwrote them
    assert _values(after) == [100 + i for i in range(8)] and int(before.get()[0]) == -1
    regions = {(a.allocation.id, a.offset) for a in got + after + [before]}
    assert len(regions) == len(got) + len(after) + 1
    del got, after, before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS)
def test_a_result_that_cannot_load_is_an_error_and_the_pool_goes_on(method: str) -> None:
    """Regression: the standard library's result thread died and ``map`` hung forever."""
    with sa.Pool(2, context=method) as pool:
        for _ in range(2):
            with pytest.raises(sa.HandleUnavailable, match="gone"):
                pool.map(pw.unloadable, range(4))
        with pytest.raises(sa.HandleUnavailable):
            list(pool.imap_unordered(pw.unloadable, range(2)))
        errors: list[BaseException] = []
        r = pool.apply_async(pw.unloadable, error_callback=errors.append)
        with pytest.raises(sa.HandleUnavailable):
            r.get(60)
        assert [type(e) for e in errors] == [sa.HandleUnavailable]
        assert pool.map(pw.first, [sa.full(3, 4, device="cpu")] * 2) == [4, 4]  # still works
    with sa.ProcessPoolExecutor(2, mp_context=method) as ex:
        with pytest.raises(sa.HandleUnavailable):
            list(ex.map(pw.unloadable, range(3)))
        with pytest.raises(sa.HandleUnavailable):
            ex.submit(pw.unloadable).result(60)
        assert ex.submit(pw.first, sa.full(3, 5, device="cpu")).result(60) == 5


@pytest.mark.timeout(120)
def test_a_payload_never_loaded_of_cached_memory_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
    private_keeper: Path,  # noqa: F811
    clean: None,
) -> None:
    """Memory its exporter keeps for reuse waits for a payload in flight in the exporter
    (nothing goes to the keeper) for the payload's bound, then is let go."""
    from multiprocessing.reduction import ForkingPickler

    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "5")  # (1 s could pass before the check)
    a = sa.zeros(pw.N, device="cpu", pack=False)
    alloc_id = a.allocation.id
    ForkingPickler.dumps(a)  # never loaded (multiprocessing's: a plain pickle is not cached)
    del a
    gc.collect()
    assert [x.id for x in draining_allocations()] == [alloc_id] and _keeper_holds() == 0
    deadline = time.monotonic() + 60
    while draining_allocations() and time.monotonic() < deadline:
        reap_draining()  # (what the handle server's housekeeping does every few seconds)
        time.sleep(0.05)
    assert draining_allocations() == [] and _keeper_holds() == 0


@pytest.mark.usefixtures("no_cache")
def test_a_payload_never_loaded_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch,
    private_keeper: Path,  # noqa: F811
    clean: None,
) -> None:
    """The keeper keeps a payload in flight for its bound, then lets the memory go."""
    import pickle

    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "5")  # (1 s passed before the check on a
    a = sa.zeros(pw.N, device="cpu", pack=False)  # loaded 2-core host)
    pickle.dumps(a)  # never loaded
    del a
    gc.collect()
    assert _keeper_holds() == 1  # handed over when the last view went
    deadline = time.monotonic() + 60
    while _keeper_holds() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _keeper_holds() == 0


@pytest.mark.timeout(120)
def test_arrays_returned_to_their_exporter_are_not_left_in_flight(
    private_keeper: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that returns the parent's array (``return a``) counts that payload in
    flight; the parent says it came back (asking the worker for ``DONE``), so the memory goes
    to the parent's cache at once, and when the cache is emptied the worker's release hands
    nothing to the keeper. (One task: the parent's own payload is fetched, so it keeps
    nothing in flight either, and no keeper starts at all.)"""
    import workers

    # (a DONE that a loaded 2-core machine delays past 1 s must not free the memory instead)
    monkeypatch.setattr(cache, "DONE_WAIT", 60.0)
    a = sa.zeros(pw.N, dtype="int64", device="cpu")
    alloc_id = a.allocation.id
    with sa.Pool(1, context="spawn") as pool:
        back = pool.apply(workers.add_one, (a,))
        assert int(back.get()[0]) == 1 and back.allocation is a.allocation
        del a, back
        deadline = time.monotonic() + 60  # (not the in-flight bound: told at once)
        # (released once the pool's result thread has let go of the result too)
        while (lookup(alloc_id) or draining_allocations()) and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        assert not draining_allocations() and empty_cache() > 0
        # the worker drops it when told the memory was freed
        while alloc_id in pool.apply(workers.mapped_ids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alloc_id not in pool.apply(workers.mapped_ids)
    assert keeper.running_pid() is None  # nothing was handed over


STDLIB_TRIES = {"host": 3, "cuda-vmm": 20}
"""Fresh pools per case: 20 on the GPU (where a hang and a broken executor were once seen
with the standard library's pools), 3 on the host (the same logic, in CI's time)."""


@pytest.mark.parametrize(
    "backend", ["host", pytest.param("cuda-vmm", marks=pytest.mark.gpu)], indirect=True
)
@pytest.mark.parametrize("kind", ["pool", "executor"])
@pytest.mark.timeout(600)
def test_stdlib_pools_return_new_arrays_every_time(kind: str, backend: str) -> None:
    """The standard library's own pools (not ``sa.Pool``), each try a fresh pool whose
    workers return new arrays: every try gives the right values, none hangs or breaks."""
    import json
    import subprocess
    import sys

    tries = STDLIB_TRIES[backend]
    run = subprocess.run(
        [sys.executable, pw.__file__, kind, backend, str(tries)],
        capture_output=True,
        text=True,
        timeout=60 + 25 * tries,
        check=False,
    )
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    outcomes = [x["outcome"] for x in lines if "try" in x]
    assert outcomes == ["ok"] * tries, (outcomes, run.stderr[-2000:])
    assert run.returncode == 0 and lines[-1] == {"done": tries}, run.stderr[-2000:]
