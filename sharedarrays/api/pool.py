"""Process pools that work from notebooks and never fork after CUDA was initialised.

:class:`Pool` and :class:`ProcessPoolExecutor` are the standard library's, with two changes:

* **spawn by default.** A process forked after CUDA was initialised cannot use CUDA, so the
  default start method is ``"spawn"``; ``"forkserver"`` may be asked for, and ``"fork"`` is
  refused with :class:`ForkAfterCudaError` when CUDA was initialised in this process.
* **Functions defined in a notebook work.** A spawned worker cannot import a function from
  a notebook's ``__main__`` (nor ``python -c``'s), nor a lambda or a nested function. Such
  functions are shipped by value with cloudpickle, wrapped in a small picklable callable;
  functions importable by name (a script's too, as the worker imports the script) are sent
  by name as usual. In a worker the by-value functions of the parent's ``__main__`` share
  one namespace, as a module's functions do, so a global that the initializer or a task
  sets is seen by the next task; an exception of a class defined in a notebook comes back
  as itself (:class:`~sharedarrays.api.pooltasks._RaisedInTask`).

Shared arrays in the arguments and results are passed without copying, as everywhere.

* **A worker that dies is an error, never a hung pool.** The standard library's pool starts
  a new worker when one dies (killed, out of memory, a crash) but waits forever for the
  task it was running, and a worker killed while it waits for a task (inside the lock of
  the pool's task pipe) leaves every other worker waiting forever. Here the locks of both
  pipes are ones the kernel releases at a worker's exit, the pool's table says which job
  the dead worker was running (:mod:`sharedarrays.api.poolqueues`), that job fails with
  :class:`~sharedarrays.WorkerLost`, and the pool goes on with a new worker and its other
  jobs (:class:`_Workers`).
* **A task that calls ``sys.exit()`` fails with** :class:`~sharedarrays.TaskExited` **and
  its worker goes on.** The standard library's pool loses the worker and waits for the task
  forever; its executor raises the ``SystemExit`` where the caller waits, ending the
  caller's program.
* **An argument that cannot be loaded is that task's error, never a dead worker.** The
  standard library's workers (``Pool``'s and the executor's) load a task's arguments as
  they take the task, and an error there ends the worker. Here they are pickled on their
  own in the parent (:func:`~sharedarrays.api.pooltasks._args`) and loaded by the task
  itself in the worker.
* **A result that cannot be loaded is that task's error, never a hung pool.** The standard
  library unpickles results in one thread of the pool (``Pool``) or of the executor's
  manager; an exception there ends that thread and the pool waits forever (``Pool``) or
  breaks (``ProcessPoolExecutor``). Here each result is pickled on its own in the worker
  (:class:`~sharedarrays.api.pooltasks._Alone`) and loaded in the parent where its
  caller's result is set, so the error (say, :class:`~sharedarrays.HandleUnavailable`) is
  raised where the caller waits for that result (``map``, ``apply``, ``AsyncResult.get``,
  ``Future.result``, the ``error_callback``), and the pool goes on working.

What travels to the workers and back is :mod:`sharedarrays.api.pooltasks`; the executor is
:mod:`sharedarrays.api.poolexecutor`.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import functools
import multiprocessing
import multiprocessing.context
import multiprocessing.pool
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from sharedarrays._cpython import fail_pool_job, next_pool_job
from sharedarrays.api.poolqueues import (
    STARTING,
    PoolTable,
    ResultQueue,
    TaskQueue,
    died_of,
    start_worker,
    started,
)
from sharedarrays.api.pooltasks import _args, _each, _guarded_get, _task, by_value
from sharedarrays.errors import SharedArrayError, WorkerLost

__all__ = [
    "Pool",
    "ForkAfterCudaError",
    "ExecutorBroken",
    "DEFAULT_START_METHOD",
    "get_context",
    "cuda_initialised",
    "by_value",
]

DEFAULT_START_METHOD = "spawn"
"""The start method used when none is given."""

T = TypeVar("T")
ContextLike = str | multiprocessing.context.BaseContext | None


class ForkAfterCudaError(SharedArrayError, ValueError):
    """The ``fork`` start method was asked for in a process that has initialised CUDA."""


class ExecutorBroken(WorkerLost, concurrent.futures.process.BrokenProcessPool):
    """A worker of a :class:`sharedarrays.ProcessPoolExecutor` died (killed, the kernel's
    out-of-memory killer, a crash, ``os._exit()``): the executor is broken, as the standard
    library's is, and every future pending then failed with this error. Make a new executor
    and submit them again (:class:`sharedarrays.Pool` replaces a dead worker and goes on).

    It is a :class:`~sharedarrays.WorkerLost` and the standard library's
    ``BrokenProcessPool``: either ``except`` catches it."""


def cuda_initialised() -> bool:
    """Best effort: has CUDA been initialised in this process?

    Asks the CUDA backend where it can tell; otherwise counts an imported ``cupy`` as
    initialised.
    """
    from sharedarrays.backends.cuda import driver as cuda_driver

    probe = getattr(cuda_driver, "_cuda_initialised_here", None)
    if callable(probe):
        try:
            return bool(probe())
        except Exception:
            pass
    return "cupy" in sys.modules


def get_context(method: ContextLike = None) -> multiprocessing.context.BaseContext:
    """The multiprocessing context for ``method`` (default :data:`DEFAULT_START_METHOD`).

    Raises
    ------
    ForkAfterCudaError
        ``"fork"`` while CUDA is initialised in this process.
    ValueError
        A start method this platform does not have.
    TypeError
        Neither a name nor a multiprocessing context.
    """
    if method is None:
        ctx: multiprocessing.context.BaseContext = multiprocessing.get_context(DEFAULT_START_METHOD)
    elif isinstance(method, str):
        ctx = multiprocessing.get_context(method)
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


# --------------------------------------------------------------------------------------------
def _start_worker(
    table: PoolTable, initializer: Callable[..., object] | None, initargs: tuple[Any, ...]
) -> None:
    """A :class:`Pool` worker's initializer: claims its slot in the pool's table
    (:func:`~sharedarrays.api.poolqueues.start_worker`), then calls the user's."""
    start_worker(table)
    if initializer is not None:
        initializer(*initargs)
    started()  # (a death before this fails the jobs pending: see _Workers)


class _Workers(list):  # type: ignore[type-arg]
    """A pool's list of its worker processes (``Pool._pool``) that fails the job a worker
    was running when it died.

    The standard library's worker handler thread forgets an exited worker with ``del
    pool[i]`` (``Pool._join_exited_workers``), then appends a new one; a task the worker was
    running is lost, and whoever waits for it would wait forever. Here the deletion of a
    worker asks the pool's table what it held
    (:meth:`~sharedarrays.api.poolqueues.PoolTable.reap`): nothing (it waited for a task or
    ended as asked; or it was killed as it started, before it took a slot: nothing is
    lost), or a task of one job, which fails with :class:`~sharedarrays.WorkerLost` when the
    next worker is appended (after, so that a caller woken by the error finds a worker to
    give the next task to). Where the table cannot tell (a task read, its job not yet
    known), every job of ``cache`` (the pool's jobs) fails. So does every job when a worker
    ends with an error before it took a slot (a spawned worker that cannot import the main
    module again: a pool made outside ``if __name__ == "__main__":``, a script read from
    standard input), or in the pool's initializer: each new worker would end the same way,
    and the jobs would wait forever. The tasks of a failed job that no worker has taken yet
    are not run (the table names the job), so that submitting it again runs them once. Only
    the cache is kept, not the pool: the handler thread holds this list until the pool ends.
    """

    def __init__(self, workers: Iterable[Any], cache: Mapping[int, Any], table: PoolTable) -> None:
        super().__init__(workers)
        self.cache = cache
        self.table = table
        self.failed: list[tuple[Any, WorkerLost]] = []  # (jobs to fail once replaced)
        self.lost_all: WorkerLost | None = None  # (every job to fail once replaced)
        self.lost_by = (0, 0)  # (the pid and exit code of the worker that made lost_all)

    def __delitem__(self, index: Any) -> None:
        if isinstance(index, int):
            worker = self[index]
            held = self.table.reap(worker.pid)
            # held: 0 nothing, whatever its exit (it waited for a task, or ended as asked,
            # after maxtasksperchild tasks or at close); None: no slot (it died before it
            # took one, as it started: an error there, exit status 1, ends every new worker
            # the same way; a signal, that one only); STARTING: in the pool's initializer;
            # else a task (a task's os._exit(0) too)
            if held or (held is None and worker.exitcode > 0):
                self._lost(worker.pid, worker.exitcode, held)
        super().__delitem__(index)

    def _lost(self, pid: int, code: int, held: int | None) -> None:
        why = died_of(code)
        after = (
            "; its standard error may say why (a task that called os._exit(), a crash; the "
            "kernel's log names the out-of-memory killer's victims): submit it again once "
            "that is mended"
        )
        if held is not None and held > 0:
            job = self.cache.get(held - 1)
            self.table.lose(held - 1, pid, code)  # (before the new worker starts: it could
            if job is not None:  # take one)
                self.failed.append(
                    (
                        job,
                        WorkerLost(
                            f"a worker of this Pool (pid {pid}) died ({why}) while it ran a "
                            "task of this job, so the job failed with this error (its tasks "
                            "no worker had taken are not run; those other workers were "
                            "running finish, their results dropped), and a new worker took "
                            "its place; the pool's other jobs go on" + after
                        ),
                    )
                )
            return
        if held is None:
            what = (
                "as it started, before the pool's initializer ran, so every job pending "
                "then failed with this error, and a new worker took its place: each one that "
                "ends so fails the jobs pending then. Its standard error says why. A spawned "
                "or forkserver worker first imports the main module again: make the pool "
                'only under if __name__ == "__main__": (the main module must not make one '
                "as it is imported), run the script from a file (python - reads it from "
                "standard input, which cannot be imported again), and make the pool again"
            )
        elif held == STARTING:
            what = (
                "as the pool's initializer ran (it raised, or ended the process), so every "
                "job pending then failed with this error, and a new worker took its place: "
                "each one the initializer ends fails the jobs pending then; mend the "
                "initializer, and make the pool again"
            )
        else:
            what = (
                "as it took a task, before it could say of which job, so every job pending "
                "then failed with this error (their tasks no worker had taken are not run; "
                "those other workers were running finish, their results dropped), and a new "
                "worker took its place" + after
            )
        self.lost_all = WorkerLost(f"a worker of this Pool (pid {pid}) died ({why}) {what}")
        self.lost_by = (pid, code)
        # the tasks of every job submitted until now that no worker has taken yet are not
        # run (set now, before the new worker starts, which could take one first)
        self.table.lose_below(next_pool_job(), pid, code)

    def append(self, worker: Any) -> None:
        super().append(worker)
        failed, self.failed = self.failed, []
        lost, self.lost_all = self.lost_all, None
        if lost is not None:
            # (again: the jobs submitted since the worker was found dead fail too, so their
            # tasks must not run either; a task skipped whose job is not in the list below
            # fails its job itself, with the error the worker sends back)
            self.table.lose_below(next_pool_job(), *self.lost_by)
            failed = [(job, lost) for job in list(self.cache.values())]
        for job, error in failed:
            fail_pool_job(job, error)


class Pool(multiprocessing.pool.Pool):
    """:class:`multiprocessing.pool.Pool` with the spawn start method by default and
    notebook-defined functions shipped by value.

    Parameters
    ----------
    processes : int, optional
        Number of workers (default ``os.cpu_count()``).
    initializer : callable, optional
        Called in each worker on start with ``initargs``.
    initargs : tuple
        Arguments of ``initializer``.
    maxtasksperchild : int, optional
        Replace a worker after this many tasks.
    context : str or multiprocessing context, optional
        ``"spawn"`` (the default), ``"forkserver"``, or ``"fork"`` (refused after CUDA
        was initialised in this process).

    Raises
    ------
    ForkAfterCudaError
        ``"fork"`` asked for after CUDA was initialised.

    Examples
    --------
    >>> import sharedarrays as sa
    >>> def square(x):  # defined in a notebook cell
    ...     return x * x
    >>> with sa.Pool(2) as pool:  # doctest: +SKIP
    ...     pool.map(square, range(4))
    [0, 1, 4, 9]
    """

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        context: ContextLike = None,
    ) -> None:
        self.__dict__["_state"] = "CLOSE"  # lets Pool.__del__ pass if get_context raises
        ctx = get_context(context)
        if initializer is not None:
            if not callable(initializer):
                raise TypeError("initializer must be a callable")
            initializer = by_value(initializer)
        if processes is None:
            processes = os.cpu_count() or 1
        if type(processes) is int and processes > 0:  # (else the standard library's error)
            self._table = PoolTable(processes)
        else:
            self._table = PoolTable(0)
        try:
            super().__init__(
                processes,
                _start_worker,
                (self._table, initializer, tuple(initargs)),
                maxtasksperchild,
                ctx,
            )
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
        """Stop the workers now (as the standard library's), and let go of the pool's
        shared state."""
        super().terminate()
        self._table.close()

    def join(self) -> None:
        """Wait for the workers to exit (after :meth:`close` or :meth:`terminate`), and let
        go of the pool's shared state."""
        super().join()
        self._table.close()

    def _setup_queues(self) -> None:
        # (the standard library's, with queues whose locks a dead worker does not hold)
        ctx = self._ctx  # type: ignore[attr-defined]
        self._inqueue = TaskQueue(ctx=ctx, table=self._table)
        self._outqueue = ResultQueue(ctx=ctx, table=self._table)
        self._quick_put = self._inqueue._writer.send  # type: ignore[attr-defined]
        self._quick_get = functools.partial(
            _guarded_get,
            self._outqueue._reader.recv,  # type: ignore[attr-defined]
        )

    def apply(
        self,
        func: Callable[..., T],
        args: Iterable[Any] = (),
        kwds: Mapping[str, Any] = {},
    ) -> T:
        """Call ``func(*args, **kwds)`` in a worker and wait for the result."""
        return self.apply_async(func, args, kwds).get()  # (as the standard library's)

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

    def map(
        self, func: Callable[[Any], T], iterable: Iterable[Any], chunksize: int | None = None
    ) -> list[T]:
        """``[func(x) for x in iterable]``, computed by the workers."""
        return super().map(_task(func), list(_each(iterable, False)), chunksize)

    def map_async(
        self,
        func: Callable[[Any], T],
        iterable: Iterable[Any],
        chunksize: int | None = None,
        callback: Callable[[list[T]], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> multiprocessing.pool.MapResult[T]:
        """Like :meth:`map`, returning an ``AsyncResult``."""
        return super().map_async(
            _task(func),
            list(_each(iterable, False)),
            chunksize,
            callback,
            error_callback,
        )

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

    def starmap(
        self,
        func: Callable[..., T],
        iterable: Iterable[Iterable[Any]],
        chunksize: int | None = None,
    ) -> list[T]:
        """``[func(*args) for args in iterable]``, computed by the workers."""
        return super().starmap(_task(func), list(_each(iterable, True)), chunksize)

    def starmap_async(
        self,
        func: Callable[..., T],
        iterable: Iterable[Iterable[Any]],
        chunksize: int | None = None,
        callback: Callable[[list[T]], object] | None = None,
        error_callback: Callable[[BaseException], object] | None = None,
    ) -> multiprocessing.pool.AsyncResult[list[T]]:
        """Like :meth:`starmap`, returning an ``AsyncResult``."""
        return super().starmap_async(
            _task(func),
            list(_each(iterable, True)),
            chunksize,
            callback,
            error_callback,
        )
