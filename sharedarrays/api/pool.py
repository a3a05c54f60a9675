"""Process pools that work from notebooks and never fork after CUDA was initialised.

:class:`Pool` and :class:`ProcessPoolExecutor` are the standard library's, except: spawn by
default and ``"fork"`` refused after CUDA was initialised here (:class:`ForkAfterCudaError`);
functions a spawned worker cannot import (a notebook's, a lambda) shipped by value; a worker
that dies fails the job it ran (:class:`~sharedarrays.WorkerLost`) and the pool goes on
(:mod:`~sharedarrays.api.poolqueues`); a task's ``sys.exit()`` is its error
(:class:`~sharedarrays.TaskExited`), and so is an argument or result that cannot be loaded
(:mod:`~sharedarrays.api.pooltasks`).
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import contextlib
import functools
import multiprocessing
import multiprocessing.context
import multiprocessing.pool
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from sharedarrays._cpython import fail_pool_job, next_pool_job
from sharedarrays.api.poolqueues import (
    STARTING,
    PoolTable,
    ResultQueue,
    TaskQueue,
    died_of,
    start_worker,
)
from sharedarrays.api.pooltasks import _args, _each, _guarded_get, _task, by_value, outcome
from sharedarrays.errors import SharedArrayError, WorkerLost

__all__ = ["Pool", "ProcessPoolExecutor", "ForkAfterCudaError", "ExecutorBroken", "by_value"]
__all__ += ["DEFAULT_START_METHOD", "get_context", "cuda_initialised"]

DEFAULT_START_METHOD = "spawn"
"""The start method used when none is given."""

T = TypeVar("T")
ContextLike = str | multiprocessing.context.BaseContext | None


class ForkAfterCudaError(SharedArrayError, ValueError):
    """The ``fork`` start method was asked for in a process that has initialised CUDA."""


class ExecutorBroken(WorkerLost, concurrent.futures.process.BrokenProcessPool):
    """A worker of a :class:`sharedarrays.ProcessPoolExecutor` died: the executor is broken
    (as the standard library's) and every pending future failed with this error."""


def cuda_initialised() -> bool:
    """Best effort: has CUDA been initialised in this process (else: is cupy imported)?"""
    from sharedarrays.backends.cuda import driver as cuda_driver

    probe = getattr(cuda_driver, "_cuda_initialised_here", None)
    with contextlib.suppress(Exception):
        if callable(probe):
            return bool(probe())
    return "cupy" in sys.modules


def get_context(method: ContextLike = None) -> multiprocessing.context.BaseContext:
    """The multiprocessing context for ``method`` (default :data:`DEFAULT_START_METHOD`):
    :class:`ForkAfterCudaError` for ``"fork"`` while CUDA is initialised here, ValueError or
    TypeError for an unknown start method."""
    if method is None or isinstance(method, str):
        ctx = multiprocessing.get_context(DEFAULT_START_METHOD if method is None else method)
    elif isinstance(method, multiprocessing.context.BaseContext):
        ctx = method
    else:
        raise TypeError(
            f"a start method is 'spawn', 'forkserver' or 'fork', or a multiprocessing context "
            f"(multiprocessing.get_context(...)), not {type(method).__name__}"
        )
    if ctx.get_start_method() == "fork" and cuda_initialised():
        raise ForkAfterCudaError(
            "the 'fork' start method cannot be used after CUDA was initialised in this "
            "process (a forked child cannot use CUDA); use 'spawn' (the default) or "
            "'forkserver'"
        )
    return ctx


def _initializer(initializer: Callable[..., object] | None) -> Callable[..., object] | None:
    """A pool's ``initializer`` as its workers get it (by value where needed)."""
    if initializer is not None and not callable(initializer):
        raise TypeError("initializer must be a callable")
    return None if initializer is None else by_value(initializer)


class _Workers(list):  # type: ignore[type-arg]
    """A pool's list of its workers (``Pool._pool``) that fails the job a dead worker ran.

    The standard library's handler thread forgets a dead worker with ``del pool[i]`` and
    appends a new one: here the deletion asks the table what the worker held, and that job
    (or, where the table cannot tell, every pending job) fails once the next one is appended.
    """

    def __init__(self, workers: Iterable[Any], cache: Mapping[int, Any], table: PoolTable) -> None:
        super().__init__(workers)
        self.cache = cache
        self.table = table
        self.failed: list[tuple[Any, WorkerLost]] = []  # (jobs to fail once replaced)
        self.lost_all: tuple[WorkerLost, int, int] | None = None  # (every job: pid, code)

    def __delitem__(self, index: Any) -> None:
        if isinstance(index, int):
            worker = self[index]
            held = self.table.reap(worker.pid)
            # (None: no slot yet; an error then ends every new worker the same way)
            if held or (held is None and worker.exitcode > 0):
                self._lost(worker.pid, worker.exitcode, held)
        super().__delitem__(index)

    def _lost(self, pid: int, code: int, held: int | None) -> None:
        died = f"a worker of this Pool (pid {pid}) died ({died_of(code)})"
        others = (
            "(its tasks no worker had taken are not run; those other workers were running "
            "finish, their results dropped), and a new worker took its place"
        )
        again = (
            "; its standard error may say why (a task that called os._exit(), a crash; the "
            "kernel's log names the out-of-memory killer's victims): submit it again once "
            "that is mended"
        )
        if held is not None and held > 0:
            job = self.cache.get(held - 1)
            self.table.lose(held - 1, pid, code)  # (before the new worker can take a task)
            if job is not None:
                why = f"{died} while it ran a task of this job, so the job failed with this error"
                lost = WorkerLost(f"{why} {others}; the pool's other jobs go on{again}")
                self.failed.append((job, lost))
            return
        every = "so every job pending then failed with this error"
        if held is None:
            what = (
                f"as it started, before the pool's initializer ran, {every}, and a new worker "
                "took its place: each one that ends so fails the jobs pending then. Its "
                "standard error says why. A spawned or forkserver worker first imports the "
                'main module again: make the pool only under if __name__ == "__main__": (the '
                "main module must not make one as it is imported), run the script from a file "
                "(python - reads it from standard input, which cannot be imported again), and "
                "make the pool again"
            )
        elif held == STARTING:
            what = (
                f"as the pool's initializer ran (it raised, or ended the process), {every}, "
                "and a new worker took its place: each one the initializer ends fails the jobs "
                "pending then; mend the initializer, and make the pool again"
            )
        else:
            what = f"as it took a task, before it could say of which job, {every} {others}{again}"
        self.lost_all = WorkerLost(f"{died} {what}"), pid, code
        # untaken tasks of every job so far are not run (set before the new worker starts)
        self.table.lose(next_pool_job(), pid, code, below=True)

    def append(self, worker: Any) -> None:
        super().append(worker)
        failed, self.failed = self.failed, []
        if self.lost_all is not None:
            (lost, pid, code), self.lost_all = self.lost_all, None
            self.table.lose(next_pool_job(), pid, code, below=True)  # (jobs submitted since, too)
            failed = [(job, lost) for job in list(self.cache.values())]
        for job, error in failed:
            fail_pool_job(job, error)


class Pool(multiprocessing.pool.Pool):
    """:class:`multiprocessing.pool.Pool` with the changes this module lists; ``context``: a
    start method or context, ``"spawn"`` by default (:class:`ForkAfterCudaError` for
    ``"fork"`` after CUDA was initialised here)."""

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        context: ContextLike = None,
    ) -> None:
        self.__dict__["_state"] = "CLOSE"  # lets Pool.__del__ pass if get_context raises
        ctx, initializer = get_context(context), _initializer(initializer)
        if processes is None:
            processes = os.cpu_count() or 1
        # (a bad number of processes: the standard library's error)
        self._table = PoolTable(processes if type(processes) is int and processes > 0 else 0)
        try:
            args = (self._table, initializer, tuple(initargs))
            super().__init__(processes, start_worker, args, maxtasksperchild, ctx)
        except BaseException:
            self._table.close()
            raise

    def _repopulate_pool(self) -> None:
        if type(self._pool) is list:  # type: ignore[has-type]  # (the first call, in __init__)
            self._pool = _Workers(
                self._pool,  # type: ignore[has-type]
                self._cache,  # type: ignore[attr-defined]
                self._table,
            )
        super()._repopulate_pool()  # type: ignore[misc]

    def terminate(self) -> None:
        """Stop the workers now; let go of the pool's shared state."""
        super().terminate()
        self._table.close()

    def join(self) -> None:
        """Wait for the workers to exit, and let go of the pool's shared state."""
        super().join()
        self._table.close()

    def _setup_queues(self) -> None:
        # (the standard library's, with queues whose locks a dead worker does not hold)
        ctx = self._ctx  # type: ignore[attr-defined]
        self._inqueue = TaskQueue(ctx=ctx, table=self._table)
        self._outqueue = ResultQueue(ctx=ctx, table=self._table)
        self._quick_put = self._inqueue._writer.send  # type: ignore[attr-defined]
        recv = self._outqueue._reader.recv  # type: ignore[attr-defined]
        self._quick_get = functools.partial(_guarded_get, recv)

    def apply_async(
        self,
        func: Callable[..., T],
        args: Iterable[Any] = (),
        kwds: Mapping[str, Any] = {},
        callback: Callable[[T], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> multiprocessing.pool.AsyncResult[T]:
        """Like :meth:`apply`, returning an ``AsyncResult``."""
        return super().apply_async(_task(func), (_args(args, kwds),), {}, callback, error_callback)

    def _map_async(self, func: Callable[..., T], iterable: Iterable[Any], *rest: Any) -> Any:
        # (map, map_async, starmap, starmap_async: the standard library's, on these tasks)
        star = rest[0] is multiprocessing.pool.starmapstar  # type: ignore[attr-defined]
        tasks = list(_each(iterable, star))
        return super()._map_async(_task(func), tasks, *rest)  # type: ignore[misc]

    def imap(
        self, func: Callable[[Any], T], iterable: Iterable[Any], chunksize: int | None = 1
    ) -> multiprocessing.pool.IMapIterator[T]:
        """Like :meth:`map`, yielding results in order as they come."""
        return super().imap(_task(func), _each(iterable, False), chunksize)

    def imap_unordered(
        self, func: Callable[[Any], T], iterable: Iterable[Any], chunksize: int | None = 1
    ) -> multiprocessing.pool.IMapIterator[T]:
        """Like :meth:`imap`, in completion order."""
        return super().imap_unordered(_task(func), _each(iterable, False), chunksize)


def _broken(error: BaseException) -> BaseException:
    """The executor's ``BrokenProcessPool`` as an :class:`ExecutorBroken`."""
    if type(error) is not concurrent.futures.process.BrokenProcessPool:
        return error
    made = ExecutorBroken(
        f"{error} A worker of this ProcessPoolExecutor died (killed, out of memory, a "
        "crash, os._exit(), or an error as it started: a spawned or forkserver worker "
        "imports the main module again, so make the executor only under if __name__ == "
        '"__main__": in a script saved as a file; its standard error may say why), so the '
        "executor is broken and every future pending then failed: make a new executor and "
        "submit them again (sharedarrays.Pool replaces a dead worker and goes on)"
    )
    made.__cause__ = error
    return made


class _ResultFuture(Future[Any]):
    """What :meth:`ProcessPoolExecutor.submit` returns: it follows the executor's future,
    loading the result here (a load error is its error)."""

    def __init__(self, inner: Future[Any]) -> None:
        super().__init__()
        self._inner: Future[Any] | None = inner
        inner.add_done_callback(self._follow)

    def _follow(self, inner: Future[Any]) -> None:
        self._inner = None  # no cycle: the result goes with the last reference to this
        if inner.cancelled():  # (as the executor does for its own: then waiters told)
            super().cancel()
            self.set_running_or_notify_cancel()
            return
        error = inner.exception()
        ok, value = outcome(error is None, inner.result() if error is None else error)
        if ok:
            self.set_result(value)
        else:
            self.set_exception(_broken(value))

    def cancel(self) -> bool:
        inner = self._inner
        if inner is not None:
            inner.cancel()  # (cancelled, it calls _follow before it returns)
        return self.cancelled()

    def running(self) -> bool:
        inner = self._inner
        return inner is not None and inner.running()


class ProcessPoolExecutor(concurrent.futures.ProcessPoolExecutor):
    """:class:`concurrent.futures.ProcessPoolExecutor` with the changes this module lists;
    ``mp_context``: as :class:`Pool`'s ``context``."""

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: ContextLike = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        max_tasks_per_child: int | None = None,
    ) -> None:
        ctx, initializer = get_context(mp_context), _initializer(initializer)
        # (max_tasks_per_child: Python 3.11 and newer)
        extra = {} if max_tasks_per_child is None else {"max_tasks_per_child": max_tasks_per_child}
        super().__init__(max_workers, ctx, initializer, initargs, **extra)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; returns a Future
        (:class:`ExecutorBroken` where a worker died earlier)."""
        try:
            inner = super().submit(_task(fn), _args(args, kwargs))
        except concurrent.futures.process.BrokenProcessPool as e:
            raise _broken(e) from e
        return _ResultFuture(inner)

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        **kwargs: Any,
    ) -> Iterator[T]:
        """Like the built-in ``map(fn, *iterables)``, computed by the workers."""
        return super().map(by_value(fn), *iterables, timeout=timeout, chunksize=chunksize, **kwargs)
