""":class:`concurrent.futures.ProcessPoolExecutor` with the changes
:mod:`sharedarrays.api.pool` lists."""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

from sharedarrays.api.pool import ContextLike, ExecutorBroken, get_context, initializer_of
from sharedarrays.api.pooltasks import _args, _task, by_value, outcome

__all__ = ["ProcessPoolExecutor"]

T = TypeVar("T")


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
    """:class:`concurrent.futures.ProcessPoolExecutor` with the spawn start method by
    default and notebook-defined functions shipped by value.

    Parameters
    ----------
    max_workers : int, optional
        Number of workers (default ``os.cpu_count()``).
    mp_context : str or multiprocessing context, optional
        ``"spawn"`` (the default), ``"forkserver"``, or ``"fork"`` (refused after CUDA
        was initialised in this process).
    initializer : callable, optional
        Called in each worker on start with ``initargs``.
    initargs : tuple
        Arguments of ``initializer``.
    max_tasks_per_child : int, optional
        Replace a worker after this many tasks (Python 3.11 and newer).

    Raises
    ------
    ForkAfterCudaError
        ``"fork"`` asked for after CUDA was initialised.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: ContextLike = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        max_tasks_per_child: int | None = None,
    ) -> None:
        ctx, initializer = get_context(mp_context), initializer_of(initializer)
        extra: dict[str, Any] = {}
        if max_tasks_per_child is not None:
            extra["max_tasks_per_child"] = max_tasks_per_child
        super().__init__(max_workers, ctx, initializer, initargs, **extra)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker; returns a Future.

        Raises
        ------
        ExecutorBroken
            A worker died earlier: the executor cannot run tasks any more.
        """
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
