"""sa.Pool and sa.ProcessPoolExecutor: spawn by default, no fork after CUDA, functions
defined in __main__ (as in a notebook) shipped by value."""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api import pool as sa_pool

SCRIPT = textwrap.dedent(
    """
    import os
    import sharedarrays as sa

    calls = []

    def scale(args):                      # defined in __main__: not importable by a worker
        a, i, k = args
        a.array[i] *= k
        return i

    def add(x, y):
        return x + y

    def remember(x):                      # module globals persist in a worker
        calls.append(x)
        return len(calls)

    def main():
        a = sa.full((4, 1000), 1.0, device="cpu")
        with sa.Pool(2) as pool:
            assert pool._ctx.get_start_method() == "spawn"
            assert sorted(pool.map(scale, [(a, i, i + 1) for i in range(4)])) == [0, 1, 2, 3]
            assert list(pool.imap(lambda x: x * x, range(5))) == [0, 1, 4, 9, 16]
            assert sorted(pool.imap_unordered(abs, [-1, -2])) == [1, 2]
            assert pool.starmap(add, [(1, 2), (3, 4)]) == [3, 7]
            assert pool.apply_async(add, (5, 6)).get(60) == 11
            assert pool.apply(add, (1,), {"y": 1}) == 2
            assert pool.map_async(add.__call__, [], 1).get(60) == []
        with sa.Pool(1, initializer=remember, initargs=(0,)) as pool:
            counts = [pool.apply(remember, (i,)) for i in range(3)]
            assert counts == [2, 3, 4], counts  # the initializer's call, then one per task
        for i in range(4):
            assert (a.array[i] == i + 1).all()
        with sa.ProcessPoolExecutor(2) as ex:
            assert ex.submit(add, 2, y=3).result(60) == 5
            assert list(ex.map(add, [1, 2], [10, 20])) == [11, 22]
            assert list(ex.map(lambda x: -x, range(3), chunksize=2)) == [0, -1, -2]
        print("OK")

    if __name__ == "__main__":
        main()
    """
)


def test_main_functions_work_in_spawned_workers(tmp_path):
    script = tmp_path / "notebook_like.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("OK")


def test_by_value_only_where_needed():
    assert sa_pool.by_value(os.getpid) is os.getpid
    assert sa_pool.by_value(pickle.dumps) is pickle.dumps
    f = sa_pool.by_value(lambda x: x + 1)
    assert isinstance(f, sa_pool.ByValue)
    g = pickle.loads(pickle.dumps(f))
    assert g(1) == 2
    assert sa_pool.by_value(f) is f
    assert "lambda" in repr(f)


def test_nested_function_by_value():
    k = 3

    def times_k(x):
        return x * k

    f = pickle.loads(pickle.dumps(sa_pool.by_value(times_k)))
    assert f(2) == 6


def test_a_forked_child_is_not_its_parent_s_pool_worker_and_keeps_what_it_loaded():
    from forking import in_forked_child

    from sharedarrays.api.poolqueues import PoolTable, start_worker
    from sharedarrays.process import STATE

    f = pickle.loads(pickle.dumps(sa_pool.by_value(lambda x: x + 1)))
    table, saved = PoolTable(1), STATE.pools.worker
    try:
        assert f(1) == 2 and f.blob in STATE.pools.loaded
        start_worker(table)  # (as a worker does)
        child = in_forked_child(lambda: [STATE.pools.worker is None, f.blob in STATE.pools.loaded])
        assert child == [True, True] and STATE.pools.worker is not None
    finally:
        STATE.pools.worker = saved
        table.close()


def test_default_is_spawn():
    assert sa_pool.get_context().get_start_method() == "spawn"
    assert sa_pool.get_context("forkserver").get_start_method() == "forkserver"


def test_fork_refused_after_cuda_init(monkeypatch):
    monkeypatch.setattr(sa_pool, "cuda_initialised", lambda: True)
    with pytest.raises(sa_pool.ForkAfterCudaError, match="spawn"):
        sa.Pool(1, context="fork")
    with pytest.raises(sa_pool.ForkAfterCudaError):
        sa.ProcessPoolExecutor(1, mp_context="fork")
    import multiprocessing

    with pytest.raises(ValueError):
        sa_pool.get_context(multiprocessing.get_context("fork"))


def test_a_start_method_that_is_none_says_what_it_takes():
    # (an int raised AttributeError from inside: 'int' object has no attribute ...)
    for bad in (5, object(), b"spawn"):
        with pytest.raises(TypeError, match="'spawn', 'forkserver' or 'fork'"):
            sa.Pool(1, context=bad)
        with pytest.raises(TypeError, match="multiprocessing context"):
            sa.ProcessPoolExecutor(1, mp_context=bad)
    with pytest.raises(ValueError):
        sa.Pool(1, context="thread")


def test_fork_allowed_without_cuda(monkeypatch):
    monkeypatch.setattr(sa_pool, "cuda_initialised", lambda: False)
    assert sa_pool.get_context("fork").get_start_method() == "fork"


def test_cuda_initialised_counts_cupy(monkeypatch):
    from sharedarrays.backends.cuda import driver as cuda_driver

    monkeypatch.delattr(cuda_driver, "_cuda_initialised_here", raising=False)
    monkeypatch.setitem(sys.modules, "cupy", object())
    assert sa_pool.cuda_initialised()
    monkeypatch.delitem(sys.modules, "cupy")
    assert not sa_pool.cuda_initialised()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_worker_killed_mid_task_fails_the_pending_tasks_and_the_pool_goes_on(method):
    # (the standard library's Pool waits forever for the task a dead worker was running)
    import workers

    with sa.Pool(1, context=method) as pool:
        first = pool.apply_async(workers.die_on, ("die",))
        with pytest.raises(sa.WorkerLost, match=r"died \(killed by signal 9\)"):
            first.get(timeout=120)
        assert pool.apply(workers.die_on, (5,)) == 5  # a new worker took its place
        with pytest.raises(sa.WorkerLost):
            pool.map(workers.die_on, [1, "die", 3], chunksize=1)
        errors = []
        pool.apply_async(workers.die_on, ("die",), error_callback=errors.append).wait(120)
        assert len(errors) == 1 and isinstance(errors[0], sa.WorkerLost)
        for imap in (pool.imap, pool.imap_unordered):
            it = imap(workers.die_on, [1, 2, "die", 4])
            got = []
            with pytest.raises(sa.WorkerLost):
                for _ in range(5):
                    got.append(it.next(timeout=120))
            # (results that reached the parent before the death came first: at most 1, 2)
            assert got in ([], [1], [1, 2]) or sorted(got) in ([1], [1, 2])
            with pytest.raises(StopIteration):
                it.next(timeout=120)  # then the end, never a wait
        assert pool.map(workers.die_on, range(4)) == [0, 1, 2, 3]


@pytest.mark.timeout(240)
def test_results_waiting_in_the_pipe_do_not_wake_the_worker_handler(monkeypatch):
    # (the standard library's handler waits on the result pipe too, and spins while a
    # result waits there for the result thread; here only exits and notices wake it)
    import multiprocessing.pool as mp_pool
    import threading

    wakes = []
    real_wait = mp_pool.wait

    def counted(objects, timeout=None):
        ready = real_wait(objects, timeout)
        if "_handle_workers" in threading.current_thread().name:
            wakes.append(len(ready))
        return ready

    monkeypatch.setattr(mp_pool, "wait", counted)
    with sa.Pool(2) as pool:
        assert sum(pool.map(abs, range(-300, 0), chunksize=1)) == sum(range(1, 301))
        assert len(wakes) <= 3, f"the worker handler woke {len(wakes)} times for 300 results"
        pool.close()
        pool.join()


@pytest.mark.timeout(240)
def test_a_closed_pool_whose_worker_died_still_joins():
    # (the failed task leaves the pool's cache as a finished one does, waking its worker
    # thread when the cache empties: else join() after close() would wait forever)
    import threading

    import workers

    pool = sa.Pool(1)
    lost = pool.apply_async(workers.die_on, ("die",))
    pool.close()
    with pytest.raises(sa.WorkerLost):
        lost.get(timeout=120)
    joined = threading.Thread(target=pool.join, daemon=True)
    joined.start()
    joined.join(120)
    assert not joined.is_alive(), "join() did not return"


@pytest.mark.timeout(240)
def test_a_task_that_ends_its_worker_with_status_0_is_lost_too():
    import workers

    with sa.Pool(1) as pool:
        with pytest.raises(sa.WorkerLost, match=r"exit status 0\).*os\._exit\(\)"):
            pool.apply_async(workers.die_on, ("_exit",)).get(timeout=120)
        assert pool.apply(workers.die_on, (7,)) == 7


@pytest.mark.timeout(240)
@pytest.mark.parametrize("maxtasks", [None, 2])
def test_a_task_that_calls_sys_exit_fails_and_its_worker_goes_on(maxtasks):
    # (the standard library's worker ended, and its pool waited for the task forever: with
    # maxtasksperchild too, where an exit status 0 is a worker that ended as asked)
    import workers

    with sa.Pool(1, maxtasksperchild=maxtasks) as pool:
        pid = pool.apply(os.getpid)
        with pytest.raises(sa.TaskExited, match=r"die_on called sys\.exit\(3\)"):
            pool.apply_async(workers.die_on, ("exit 3",)).get(timeout=120)
        with pytest.raises(sa.TaskExited, match=r"sys\.exit\(None\)"):
            pool.map(workers.die_on, [1, "exit", 2], chunksize=1)
        assert pool.apply(workers.die_on, (7,)) == 7
        if maxtasks is None:
            assert pool.apply(os.getpid) == pid  # the same worker


@pytest.mark.timeout(240)
def test_workers_that_end_as_asked_fail_nothing():
    import workers

    with sa.Pool(2, maxtasksperchild=1) as pool:  # every worker exits (status 0) after a task
        assert pool.map(workers.die_on, range(8), chunksize=1) == list(range(8))
    pool.join()


@pytest.mark.timeout(240)
def test_an_argument_the_worker_cannot_load_is_that_tasks_error():
    # (loaded while the worker took the task, its error ended the worker: WorkerLost at
    # best, the standard library's pool hung; now the task loads its arguments)
    import workers

    big = sa.zeros(3 << 26, device="cpu", pack=False)  # 1.5 GiB of address space
    small = sa.full(4, 2.0, device="cpu")
    with sa.Pool(1, initializer=workers.limit_address_space, initargs=(1 << 30,)) as pool:
        pid = pool.apply(os.getpid)
        with pytest.raises(sa.OutOfMemory, match="ulimit -v"):
            pool.apply(workers.first_value, (big,))
        with pytest.raises(sa.OutOfMemory):
            pool.map(workers.first_value, [small, big, small])
        assert pool.map(workers.first_value, [small] * 3) == [2.0] * 3
        assert list(pool.imap(workers.first_value, [small])) == [2.0]
        assert pool.starmap(workers.first_value, [(small,)]) == [2.0]
        assert pool.apply(os.getpid) == pid  # the same worker: it did not die
    big.close()
    small.close()


@pytest.mark.timeout(240)
def test_an_argument_an_executors_worker_cannot_load_is_that_futures_error():
    # (the standard library's executor breaks: BrokenProcessPool for every future)
    import workers

    big = sa.zeros(3 << 26, device="cpu", pack=False)  # 1.5 GiB of address space
    small = sa.full(4, 2.0, device="cpu")
    with sa.ProcessPoolExecutor(
        1, initializer=workers.limit_address_space, initargs=(1 << 30,)
    ) as ex:
        with pytest.raises(sa.OutOfMemory, match="ulimit -v"):
            ex.submit(workers.first_value, big).result(timeout=120)
        assert ex.submit(workers.first_value, small).result(timeout=120) == 2.0
        with pytest.raises(sa.OutOfMemory):
            list(ex.map(workers.first_value, [small, big], timeout=120))
        assert list(ex.map(workers.first_value, [small, small], timeout=120)) == [2.0, 2.0]
    big.close()
    small.close()


@pytest.mark.timeout(240)
def test_a_task_of_an_executor_that_calls_sys_exit_is_that_futures_error():
    # (the standard library's executor raised the SystemExit in the caller: a notebook's
    # kernel or a script ended by a task)
    import workers

    with sa.ProcessPoolExecutor(1) as ex:
        pid = ex.submit(os.getpid).result(timeout=120)
        with pytest.raises(sa.TaskExited, match=r"sys\.exit\(3\)"):
            ex.submit(workers.die_on, "exit 3").result(timeout=120)
        assert ex.submit(workers.die_on, 5).result(timeout=120) == 5
        assert ex.submit(os.getpid).result(timeout=120) == pid


@pytest.mark.timeout(240)
def test_an_executor_whose_worker_died_raises_executor_broken():
    # (the standard library's BrokenProcessPool, not a SharedArrayError; still caught as one)
    import concurrent.futures.process

    import workers

    with sa.ProcessPoolExecutor(1) as ex:
        assert ex.submit(workers.die_on, 1).result(timeout=120) == 1
        with pytest.raises(sa.ExecutorBroken, match="make a new executor") as lost:
            ex.submit(workers.die_on, "die").result(timeout=120)
        assert isinstance(lost.value, sa.WorkerLost)
        assert isinstance(lost.value, concurrent.futures.process.BrokenProcessPool)
        with pytest.raises(sa.ExecutorBroken):
            ex.submit(workers.die_on, 2)
        with pytest.raises(sa.ExecutorBroken):
            list(ex.map(workers.die_on, [3], timeout=120))


@contextlib.contextmanager
def _released(path):
    """Let :func:`workers.wait_for_file` tasks waiting for ``path`` go, at the end."""
    try:
        yield
    finally:
        open(path, "w").close()


@pytest.mark.timeout(240)
def test_cancelled_executor_futures_are_done_for_wait_and_as_completed(tmp_path):
    # (they were done, but concurrent.futures.wait and as_completed were never told: they
    # waited for their timeout, or forever)
    import concurrent.futures

    import workers

    go = str(tmp_path / "go")
    with sa.ProcessPoolExecutor(1) as ex, _released(go):
        first = ex.submit(workers.wait_for_file, go, 0)
        queued = [ex.submit(workers.die_on, i) for i in range(1, 6)]
        deadline = time.monotonic() + 60
        while not first.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.running() and not first.cancel()
        cancelled = [f for f in queued if f.cancel()]
        assert cancelled  # (the executor hands a worker at most one more item than it runs)
        assert all(f.cancel() and f.cancelled() and f.done() for f in cancelled)
        done, not_done = concurrent.futures.wait(cancelled, timeout=30)
        assert (len(done), len(not_done)) == (len(cancelled), 0)
        assert set(concurrent.futures.as_completed(cancelled, timeout=30)) == set(cancelled)
        open(go, "w").close()
        assert first.result(timeout=120) == 0 and not first.running()
        rest = [f for f in queued if f not in cancelled]
        assert [f.result(timeout=120) for f in rest] == [queued.index(f) + 1 for f in rest]
    with sa.ProcessPoolExecutor(1) as ex:
        first = ex.submit(workers.wait_for_file, go + "2", 0, 5.0)
        queued = [ex.submit(workers.die_on, i) for i in range(4)]
        ex.shutdown(wait=False, cancel_futures=True)  # (its manager thread cancels them)
        done, _ = concurrent.futures.wait(queued, timeout=60)
        assert done == set(queued) and any(f.cancelled() for f in queued)
        assert first.result(timeout=120) == 0


@pytest.mark.timeout(240)
def test_only_the_job_a_dead_worker_ran_fails_and_its_other_tasks_are_not_run(tmp_path):
    # (every pending job failed, the worker's own and those queued behind it; before that,
    # the failed jobs' tasks still ran from the queue: submitted again, each ran twice)
    import workers

    a = sa.zeros(6, device="cpu")
    go = str(tmp_path / "go")
    with sa.Pool(1) as pool, _released(go):
        dying = pool.starmap_async(
            workers.die_or_add_one, [(a, -1, go), (a, 0, go), (a, 1, go)], chunksize=1
        )
        queued = [pool.apply_async(workers.add_one_at, (a, i)) for i in range(2, 5)]
        open(go, "w").close()  # (every task is in the pool's queue by now)
        with pytest.raises(sa.WorkerLost, match="while it ran a task of this job") as lost:
            dying.get(timeout=120)
        assert "its tasks no worker had taken are not run" in str(lost.value)
        assert [job.get(timeout=120) for job in queued] == [2, 3, 4]  # the others went on
        np.testing.assert_array_equal(a.get(), [0, 0, 1, 1, 1, 0])  # the job's rest not run
        assert pool.starmap(workers.add_one_at, [(a, 0), (a, 1), (a, 5)]) == [0, 1, 5]
        np.testing.assert_array_equal(a.get(), np.ones(6))  # submitted again: run once


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_workers_killed_while_they_wait_for_a_task_fail_nothing_and_the_pool_goes_on(method):
    # (an idle worker waits for a task inside the lock of the pool's task pipe: killed there,
    # the standard library's lock stayed taken and every worker, new ones too, waited for it
    # forever: map hung)
    import signal

    import workers

    with sa.Pool(2, context=method) as pool:
        assert pool.map(workers.die_on, range(4)) == [0, 1, 2, 3]
        pending = pool.apply_async(workers.die_on, (9,))
        pending.get(timeout=120)
        for worker in list(pool._pool):  # (one of them holds the lock)
            os.kill(worker.pid, signal.SIGKILL)
        assert pool.map(workers.die_on, range(8), chunksize=1) == list(range(8))
        assert pending.get(timeout=1) == 9


@pytest.mark.timeout(240)
def test_a_job_another_worker_runs_goes_on_when_a_worker_dies(tmp_path):
    import workers

    go = str(tmp_path / "go")
    with sa.Pool(2) as pool, _released(go):
        slow = pool.apply_async(workers.wait_for_file, (go, 7))
        with pytest.raises(sa.WorkerLost, match=r"killed by signal 9"):
            pool.apply_async(workers.die_on, ("die",)).get(timeout=120)
        assert not slow.ready()
        open(go, "w").close()
        assert slow.get(timeout=120) == 7


@pytest.mark.timeout(240)
def test_a_task_that_ends_its_worker_with_status_0_is_lost_with_maxtasksperchild_too():
    # (a worker that ends as asked after maxtasksperchild tasks holds no task; one whose
    # task called os._exit(0) does: the pool waited for it forever)
    import workers

    with sa.Pool(1, maxtasksperchild=2) as pool:
        with pytest.raises(sa.WorkerLost, match=r"exit status 0\)"):
            pool.apply_async(workers.die_on, ("_exit",)).get(timeout=120)
        assert pool.map(workers.die_on, range(5), chunksize=1) == list(range(5))


@pytest.mark.timeout(240)
def test_a_pool_closed_and_joined_then_terminated_ends_quietly():
    # (the standard library's pool takes its task lock once more as it ends, at terminate or
    # when collected: after join the pool's table is closed, and there is no one to exclude)
    import gc

    import workers

    with sa.Pool(1) as pool:
        assert pool.apply(workers.die_on, (1,)) == 1
        pool.close()
        pool.join()
    pool = sa.Pool(1)
    pool.close()
    pool.join()
    del pool
    gc.collect()


def _run_without_a_file(code: str) -> list[str]:
    """The lines ``python -c code`` prints (its ``__main__`` is no file a worker imports, as
    a notebook's is not): its functions go to workers by value."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr
    return r.stdout.split("\n")


_NOTEBOOK_CLASS = """
import sharedarrays as sa
class Point:  # (as a notebook cell defines it: a spawned worker has it only by value)
    def __init__(self, x):
        self.x = x
def make(i):
    return Point(i)
def call(f, v):
    return f(v)
with sa.Pool(1) as pool:
    r = pool.apply(make, (3,))
    print(type(r).__name__, r.x, isinstance(r, Point))
    print(pool.apply(call, (lambda v: v * 2, 21)))  # a lambda as an argument
with sa.ProcessPoolExecutor(1) as ex:
    print(ex.submit(make, 4).result().x)
class MyError(Exception):  # (a notebook's exception: the worker has it only by value)
    pass
def fail(i):
    raise MyError(f"task {i} failed")
for make_pool in (lambda: sa.Pool(1), lambda: sa.ProcessPoolExecutor(1)):
    with make_pool() as pool:
        try:
            if isinstance(pool, sa.Pool):
                pool.apply(fail, (1,))
            else:
                pool.submit(fail, 1).result()
        except MyError as e:
            print("caught", type(e).__name__, e, e.__cause__ is not None)
"""


@pytest.mark.timeout(240)
def test_results_and_arguments_pickle_can_only_write_by_name_travel_by_value():
    # (a worker's result of a class defined in __main__ failed: MaybeEncodingError naming
    # the pool's own wrapper; a lambda argument failed to pickle)
    assert _run_without_a_file(_NOTEBOOK_CLASS)[:5] == [
        "Point 3 True",
        "42",
        "4",
        "caught MyError task 1 failed True",  # (a MaybeEncodingError; a PicklingError)
        "caught MyError task 1 failed True",
    ]


_INITIALIZER_GLOBALS = """
import sharedarrays as sa
ARR = None
def init(a):
    global ARR
    ARR = a
def helper(i):
    return i + 1
def task(i):
    if ARR is None:
        return "ARR is None"
    ARR[i] = helper(i)
    return "ok"
def set_flag(v):
    global FLAG
    FLAG = v
def get_flag():
    return globals().get("FLAG", "unset")
a = sa.zeros(4, device="cpu")
with sa.Pool(1, initializer=init, initargs=(a,)) as pool:
    print(pool.map(task, range(4)), a.get().tolist())
    pool.apply(set_flag, ("set",))
    print(pool.apply(get_flag))
    def helper(i):  # (a cell run again: the newest definition is used)
        return -i
    print(pool.map(task, range(2)), a.get().tolist())
b = sa.zeros(2, device="cpu")
with sa.ProcessPoolExecutor(1, initializer=init, initargs=(b,)) as ex:
    print(list(ex.map(task, range(2))), b.get().tolist())
"""


@pytest.mark.timeout(240)
def test_an_initializers_globals_are_the_tasks_globals_in_a_notebook_too():
    # (functions a worker cannot import by name go by value with cloudpickle, which gave
    # each its own globals: a global the initializer set was None in every task, silently)
    assert _run_without_a_file(_INITIALIZER_GLOBALS)[:4] == [
        "['ok', 'ok', 'ok', 'ok'] [1.0, 2.0, 3.0, 4.0]",
        "set",
        "['ok', 'ok'] [0.0, -1.0, 3.0, 4.0]",
        "['ok', 'ok'] [0.0, -1.0]",  # (helper as redefined)
    ]


def test_a_scripts_functions_go_by_name_and_a_notebooks_by_value(monkeypatch):
    import types

    main = types.ModuleType("__main__")

    def f(x):
        return x

    f.__module__, f.__qualname__ = "__main__", "f"
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert isinstance(sa_pool.by_value(f), sa_pool.ByValue)  # no file: a notebook
    main.__file__ = __file__
    assert sa_pool.by_value(f) is f  # a script: imported as __mp_main__ by the worker
    assert isinstance(sa_pool.by_value(lambda x: x), sa_pool.ByValue)


def _pool_counters() -> int:
    """Open fds of sa.Pool's own shared counters in this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "sharedarrays-pool" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
    return count


@pytest.mark.timeout(240)
def test_the_pools_counter_is_let_go_on_every_path():
    import gc

    import workers

    assert _pool_counters() == 0
    with pytest.raises(ValueError):
        sa.Pool(0)
    assert _pool_counters() == 0
    with sa.Pool(1) as pool:
        assert _pool_counters() == 2  # (its fd, and the mapping's own)
        assert pool.apply(workers.die_on, (1,)) == 1
    assert _pool_counters() == 0  # terminate
    pool = sa.Pool(1)
    pool.close()
    pool.join()
    assert _pool_counters() == 0  # close, join
    pool = sa.Pool(1)
    assert pool.apply(workers.die_on, (2,)) == 2
    pool.terminate()
    del pool
    gc.collect()
    assert _pool_counters() == 0


class _Job:  # (the parts of a pool's ApplyResult that failing one reads)
    def __init__(self, cache, key):
        self._cache, self._job = cache, key
        self._event = type("E", (), {"set": lambda self: None})()
        self._error_callback, self._value, self._success = None, None, None
        cache[key] = self

    def ready(self):
        return False


class _Dead:
    exitcode = -9

    def __init__(self, pid):
        self.pid = pid


def test_a_dead_worker_fails_the_job_its_slot_names():
    from sharedarrays.api.poolqueues import PoolTable, Workers

    table = PoolTable(2)
    try:
        cache: dict = {}
        jobs = [_Job(cache, key) for key in (10, 11, 12)]
        workers = Workers([_Dead(101), _Dead(102)], cache, table)
        running = table.claim(101)
        idle = table.claim(102)
        table.cells[running] = 11 + 1  # (running a task of job 11)
        table.cells[idle] = 0
        del workers[1]  # idle (held 0): nothing fails, whatever its exit
        workers.append(object())
        assert set(cache) == {10, 11, 12}
        del workers[0]
        assert table.lost(11) and not table.lost(10) and not table.lost(12)
        workers.append(object())  # the replacement: job 11 fails, the others go on
        assert set(cache) == {10, 12}
        assert isinstance(jobs[1]._value, sa.WorkerLost)
        assert jobs[0]._value is None and jobs[2]._value is None
        assert table.reap(101) is None and table.reap(102) is None  # slots freed
        table.claim(os.getpid())
        table.claim(os.getpid())
        with pytest.raises(sa.SharedArrayError, match="make a new pool"):
            table.claim(os.getpid())  # (every slot held by a running process)
        table.reap(os.getpid())
        table.cells[table.claim(2**22 + 1)] = 0  # (a pid no process has)
        table.cells[table.claim(os.getpid())] = 0  # the dead one's slot is taken over
    finally:
        table.close()


def test_a_worker_dead_before_it_could_say_which_job_fails_every_job_pending():
    # (jobs submitted between the worker found dead and its replacement appended fail too,
    # and none of their tasks runs)
    import multiprocessing.pool

    from sharedarrays.api.poolqueues import PoolTable, Workers

    table = PoolTable(1)
    try:
        cache: dict = {}
        workers = Workers([_Dead(101)], cache, table)
        table.cells[table.claim(101)] = -1  # (a task read, its job not yet known)
        before = next(multiprocessing.pool.job_counter)
        _Job(cache, before)
        del workers[0]
        during = next(multiprocessing.pool.job_counter)  # submitted before the replacement
        late = _Job(cache, during)
        workers.append(object())  # every job in the cache fails
        assert not cache and isinstance(late._value, sa.WorkerLost)
        assert "before it could say of which job" in str(late._value)
        assert table.lost(before) and table.lost(during)
        assert not table.lost(next(multiprocessing.pool.job_counter))
    finally:
        table.close()


def test_a_worker_that_ends_with_an_error_before_its_slot_fails_every_job_pending():
    # (a spawned worker that cannot import the main module again ends as it starts, before
    # it takes a slot: it looked as if nothing was lost, and the pool started new ones for
    # ever while the jobs waited)
    import multiprocessing.pool

    from sharedarrays.api.poolqueues import PoolTable, Workers

    table = PoolTable(2)
    try:
        cache: dict = {}
        job = _Job(cache, next(multiprocessing.pool.job_counter))
        killed, failed = _Dead(101), _Dead(102)
        failed.exitcode = 1
        workers = Workers([killed, failed], cache, table)
        del workers[0]  # killed by a signal as it started: that one only, nothing fails
        workers.append(object())
        assert set(cache) == {job._job} and job._value is None
        del workers[0]  # ended with an error as it started: every new one would
        workers.append(object())
        assert not cache and isinstance(job._value, sa.WorkerLost)
        assert "as it started" in str(job._value) and "__main__" in str(job._value)
        assert table.lost(job._job)
    finally:
        table.close()


_NO_MAIN_GUARD = """
import sharedarrays as sa

def inc(x):
    return x + 1

with sa.Pool(1) as pool:  # (no if __name__ == "__main__": each worker makes one, and ends)
    pool.map(inc, range(3))
"""


@pytest.mark.timeout(240)
def test_an_executor_whose_workers_cannot_import_the_main_module_says_so(tmp_path):
    # (the error named kills, crashes and os._exit(), never the missing __main__ guard that
    # ended every worker as it started)
    script = tmp_path / "unguarded.py"
    script.write_text(
        _NO_MAIN_GUARD.replace("sa.Pool(1) as pool", "sa.ProcessPoolExecutor(1) as pool").replace(
            "pool.map(inc, range(3))", "list(pool.map(inc, range(3)))"
        )
    )
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=200, cwd=tmp_path
    )
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("sharedarrays.api.pool.ExecutorBroken: ")
    assert 'if __name__ == "__main__":' in last and "as it started" in last


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["file", "stdin"])
def test_a_pool_whose_workers_cannot_import_the_main_module_fails_never_hangs(tmp_path, how):
    # (a script without the __main__ guard, or read from standard input with python -:
    # every spawned worker ended as it imported the main module again, and the map waited
    # for ever while the pool started new ones)
    script = tmp_path / "unguarded.py"
    script.write_text(_NO_MAIN_GUARD)
    command = [sys.executable, str(script) if how == "file" else "-"]
    r = subprocess.run(
        command,
        input=_NO_MAIN_GUARD if how == "stdin" else None,
        capture_output=True,
        text=True,
        timeout=200,
        cwd=tmp_path,
    )
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("sharedarrays.errors.WorkerLost: ") and "as it started" in last


def test_a_task_of_a_failed_job_is_not_run_by_the_worker_that_takes_it():
    import multiprocessing

    from sharedarrays.api import poolqueues
    from sharedarrays.api.poolqueues import PoolTable, TaskQueue
    from sharedarrays.process import STATE

    table = PoolTable(1)
    queue = TaskQueue(ctx=multiprocessing.get_context("spawn"), table=table)
    saved = STATE.pools.worker
    try:
        poolqueues.start_worker(table)  # (as a worker does)
        cell = STATE.pools.worker[1]
        table.lose(5, 4242, -9)
        queue.put((5, 0, abs, (-1,), {}))
        queue.put((6, 0, abs, (-2,), {}))
        queue.put(None)
        job, _, func, args, kwds = queue.get()
        assert (job, func, args) == (5, poolqueues.not_run, (4242, -9))
        assert table.cells[cell] == 5 + 1  # (what the worker holds: a task of job 5)
        with pytest.raises(sa.WorkerLost, match=r"not run.*pid 4242\) died \(killed by signal 9"):
            func(*args, **kwds)
        assert queue.get() == (6, 0, abs, (-2,), {})
        assert table.cells[cell] == 6 + 1  # (until its result is written)
        assert queue.get() is None and table.cells[cell] == 0
    finally:
        STATE.pools.worker = saved
        queue.close()
        table.close()


def test_a_task_message_cut_by_a_dead_reader_is_dropped_and_said(monkeypatch):
    # (a reader killed as it read leaves the rest of its message first in the pipe: read as
    # a size, it made the next reader wait for bytes that never come, or unpickle garbage)
    import pickle
    import struct

    from sharedarrays.api import poolqueues

    def message(obj):
        body = pickle.dumps(obj, protocol=5)
        return struct.pack("!i", len(body)) + body

    monkeypatch.setattr(poolqueues, "MESSAGE_STALL", 0.2)
    r, w = os.pipe()
    try:
        os.write(w, message((1, 0, abs, (-1,), {})) + message(None))
        assert pickle.loads(poolqueues.read_message(r))[0] == 1  # whole messages read
        assert pickle.loads(poolqueues.read_message(r)) is None
        cut = message((2, 0, abs, (-2,), {}))
        os.write(w, cut[4:] + message((3, 0, abs, (-3,), {})))  # its size read by the dead
        with pytest.raises(poolqueues.PipeCut):
            poolqueues.read_message(r)
        os.write(w, message(None))  # the pipe was emptied: the next reader starts at one
        assert pickle.loads(poolqueues.read_message(r)) is None
        os.write(w, struct.pack("!i", 1000) + b"\x80" * 10)  # a size whose bytes never come
        with pytest.raises(poolqueues.PipeCut):
            poolqueues.read_message(r)
        os.write(w, struct.pack("!i", 3) + b"abc")  # not a pickle
        with pytest.raises(poolqueues.PipeCut):
            poolqueues.read_message(r)
        os.close(w)
        w = -1
        with pytest.raises(EOFError) as closed:
            poolqueues.read_message(r)  # the writer closed: the end, not a cut
        assert type(closed.value) is EOFError
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@pytest.mark.timeout(240)
def test_a_worker_killed_as_it_reads_a_task_fails_the_jobs_never_loses_one():
    # (the slot said a task was taken only after the message was read: killed between the
    # two, the worker looked idle, nothing failed, and the job waited for ever)
    import workers

    with sa.Pool(1, initializer=workers.die_after_reading_a_task) as pool:
        job = pool.apply_async(workers.die_on, (1,))
        with pytest.raises(sa.WorkerLost, match="as it took a task"):
            job.get(timeout=120)


@pytest.mark.timeout(240)
def test_an_initializer_that_ends_its_worker_fails_the_jobs_pending():
    # (each worker died in the initializer, looked idle, and the pool started new ones for
    # ever while the job waited)
    import workers

    with sa.Pool(1, initializer=workers.die_in_initializer) as pool:
        job = pool.map_async(workers.die_on, range(4))
        with pytest.raises(sa.WorkerLost, match=r"exit status 3\) as the pool's initializer ran"):
            job.get(timeout=120)


_UNLOADABLE = """
import sharedarrays as sa
def ok(x):
    return x + 1
if __name__ == "__main__":
    def bad(x):  # (not at the top level: a spawned worker cannot find it)
        return x
    with sa.Pool(2) as pool:
        try:
            pool.map(bad, range(40))
        except sa.TaskNotLoaded as e:
            print("bad:", type(e).__name__, "bad" in str(e))
        late = pool.map_async(ok, range(8))
        print("ok:", late.get(timeout=60))
"""


@pytest.mark.timeout(240)
def test_a_function_the_worker_cannot_find_is_that_jobs_error(tmp_path):
    # (the worker died loading the task, and each one that took a task of that job failed
    # every job pending, later ones too; the error did not say why)
    script = tmp_path / "unloadable.py"
    script.write_text(_UNLOADABLE)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["bad: TaskNotLoaded True", "ok: [1, 2, 3, 4, 5, 6, 7, 8]"]


@pytest.mark.timeout(120)
def test_an_ended_pool_leaves_its_workers_nothing_to_hand_to_the_keeper(no_cache: None) -> None:
    """A worker's results loaded here again (warm) are told to it at the pool's end: it
    counts them in flight, and would hand its memory to the keeper at its exit."""
    import workers

    from sharedarrays.transport.node import ask_keeper

    pool = sa.Pool(2)
    pids = [w.pid for w in pool._pool]  # type: ignore[attr-defined]
    results = pool.map(workers.small_made_here, range(1, 9), chunksize=1)
    assert [float(r.get()[0]) for r in results] == [float(n) for n in range(1, 9)]
    pool.close()
    pool.join()
    kept = [a for a in ask_keeper().arrays if a.get("creator") in pids]
    assert kept == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end", ["pool first", "array first", "stdlib pool first"])
def test_an_array_loaded_warm_by_workers_is_not_handed_to_the_keeper(
    no_cache: None, end: str
) -> None:
    """This process's array, loaded again (warm: not told) by the workers for each task, is
    asked of them before a release hands memory to the keeper, and told by them as they exit
    (a standard library pool closed): nothing is left in flight."""
    import multiprocessing

    import workers

    from sharedarrays.transport.node import ask_keeper

    x = sa.from_array(np.arange(1 << 20, dtype=np.float64), device="cpu")  # (no slab's)
    alloc_id = x.allocation.id
    stdlib = end == "stdlib pool first"
    pool = multiprocessing.get_context("spawn").Pool(2) if stdlib else sa.Pool(2)
    try:
        assert pool.map(workers.checksum, [x] * 8, chunksize=1) == [float(x.sum())] * 8
        if end != "array first":
            pool.close()
            pool.join()
        del x
        kept = [a for a in ask_keeper().arrays if a.get("id") == alloc_id]
        assert kept == []
    finally:
        pool.terminate()
        pool.join()


_EXIT_AFTER_A_POOL = """
import os, sys
import numpy as np
import sharedarrays as sa
import workers

if __name__ == "__main__":
    x = sa.from_array(np.arange(1 << 20, dtype=np.float64), device="cpu")
    with sa.Pool(2) as pool:
        assert pool.map(workers.checksum, [x] * 8, chunksize=1) == [float(x.sum())] * 8
    print(x.allocation.id)
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cache", ["0", str(1 << 30)])
def test_an_exit_after_a_pool_hands_the_keeper_nothing(tmp_path: Path, cache: str) -> None:
    """A script that passed its array to a pool's workers (each loaded it warm after the
    first time) and exits with the array open: the pool's end asked the workers, nothing is
    in flight, and the keeper gets nothing (memory kept for reuse, or not)."""
    from sharedarrays.transport.node import ask_keeper

    script = tmp_path / "exit_after_a_pool.py"
    script.write_text(_EXIT_AFTER_A_POOL)
    env = {**os.environ, "SHAREDARRAYS_CACHE_BYTES": cache}
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=200, env=env
    )
    assert r.returncode == 0, r.stderr
    alloc_id = r.stdout.split()[-1]
    assert [a for a in ask_keeper().arrays if a.get("id") == alloc_id] == []
