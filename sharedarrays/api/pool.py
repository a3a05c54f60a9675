"""Process pools that work from notebooks: the standard library's, except spawn by default,
``"fork"`` refused after CUDA was initialised (:class:`ForkAfterCudaError`); functions a spawned
worker cannot import (a notebook's, a lambda) go by value; a dead worker fails the job it ran
(:class:`~sharedarrays.WorkerLost`) and the pool goes on; a task's ``sys.exit()``
(:class:`~sharedarrays.TaskExited`), or an argument or result that cannot be loaded (each is
pickled on its own), is that task's error; results waiting in the pipe do not wake the
pool's worker thread."""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import functools
import multiprocessing
import multiprocessing.context
import multiprocessing.pool
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import reduction
from typing import Any, TypeVar, cast

from sharedarrays.api.poolqueues import PoolTable, ResultQueue, TaskQueue, Workers, start_worker
from sharedarrays.errors import SharedArrayError, TaskExited, WorkerLost
from sharedarrays.process import STATE
from sharedarrays.protocol.payload import remember
from sharedarrays.transport import handles

__all__ = ["Pool", "ProcessPoolExecutor", "ForkAfterCudaError", "ExecutorBroken", "by_value"]
__all__ += ["ByValue", "DEFAULT_START_METHOD", "get_context", "cuda_initialised"]

DEFAULT_START_METHOD = "spawn"  # the start method used when none is given
T = TypeVar("T")
ContextLike = str | multiprocessing.context.BaseContext | None
_LOADED_MAX = 128
_MAIN_MODULES = ("__main__", "__mp_main__")


def _main_function(value: object) -> bool:
    return isinstance(value, types.FunctionType) and value.__module__ in _MAIN_MODULES


def _in_main_namespace(fn: Any, seen: dict[int, Any]) -> Any:
    """``fn`` (from cloudpickle) and the ``__main__`` functions it brings, sharing
    ``STATE.pools.main`` as globals like a module's; other values keep the worker's."""
    if isinstance(fn, functools.partial):
        inner = _in_main_namespace(fn.func, seen)
        return fn if inner is fn.func else functools.partial(inner, *fn.args, **fn.keywords)
    namespace = STATE.pools.main
    if not _main_function(fn) or fn.__globals__ is namespace:
        return fn
    if id(fn) in seen:
        return seen[id(fn)]
    made = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    for attr in ("__kwdefaults__", "__qualname__", "__doc__", "__module__"):
        setattr(made, attr, getattr(fn, attr))
    made.__dict__.update(fn.__dict__)
    seen[id(fn)] = made
    for name, value in fn.__globals__.items():
        if _main_function(value):
            namespace[name] = _in_main_namespace(value, seen)
        elif isinstance(value, type) and value.__module__ in _MAIN_MODULES:
            namespace[name] = value
        else:
            namespace.setdefault(name, value)
    return made


class ByValue:
    """A picklable callable carrying a function's cloudpickle ``blob`` and its ``name``."""

    __slots__ = ("blob", "name")

    def __init__(self, fn: Callable[..., Any]) -> None:
        import cloudpickle

        self.blob: bytes = cloudpickle.dumps(fn)
        self.name: str = getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = STATE.pools.loaded.get(self.blob)
        if fn is None:
            import cloudpickle

            fn = _in_main_namespace(cloudpickle.loads(self.blob), {})
            remember(STATE.pools.loaded, self.blob, fn, _LOADED_MAX)
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<by-value {self.name} ({len(self.blob)} bytes)>"


def _needs_value(fn: object) -> bool:
    """Whether a spawned worker cannot import ``fn`` (a lambda, a nested or notebook's one)."""
    if isinstance(fn, functools.partial):
        return _needs_value(fn.func)
    if isinstance(fn, ByValue):
        return False
    module = getattr(fn, "__module__", None)
    if module is None or "<" in getattr(fn, "__qualname__", ""):
        return True
    if module not in _MAIN_MODULES:
        return False
    main = sys.modules.get("__main__")  # (a module or a file the worker imports again?)
    path = getattr(main, "__file__", None)
    if getattr(getattr(main, "__spec__", None), "name", None):
        return False
    return not (isinstance(path, str) and os.path.isfile(path))


def by_value(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` wrapped to pickle by value where a spawned worker cannot import it, else ``fn``."""
    return ByValue(fn) if _needs_value(fn) else fn


@dataclass(slots=True, eq=False)
class _Alone:
    """A task's arguments or result pickled on its own (as bytes), so that the message
    carrying it always loads, and a load error is the task's."""

    value: Any = None
    blob: bytes | None = None

    def load(self) -> Any:
        return self.value if self.blob is None else reduction.ForkingPickler.loads(self.blob)

    def __reduce__(self) -> tuple[Any, tuple[None, bytes]]:
        if self.blob is not None:
            return _Alone, (None, self.blob)
        try:
            blob = bytes(reduction.ForkingPickler.dumps(self.value))
        except Exception as e:  # (a notebook's class or a lambda: by value)
            import cloudpickle

            try:
                blob = cloudpickle.dumps(self.value)
            except Exception:
                raise e from None
        return _Alone, (None, blob)


class _RaisedInTask(Exception):
    """A task's exception multiprocessing cannot pickle, ``carried`` by value (:meth:`unwrap`)."""

    def __init__(self, carried: Any, text: str) -> None:
        super().__init__(text)
        self.carried = carried

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _RaisedInTask, (self.carried, str(self))

    def unwrap(self) -> BaseException:
        """The task's own exception (with the worker's traceback as cause), else this one."""
        try:
            error: BaseException = self.carried.load()
        except Exception:
            return self
        error.__cause__ = self.__cause__
        return error


def _each(iterable: Iterable[Any], star: bool) -> Iterator[Any]:
    """The arguments of each task of a map (``star``: each item is an argument tuple)."""
    for item in iterable:
        yield (_Alone((tuple(item), {})),) if star else _Alone(((item,), {}))


@dataclass(slots=True, eq=False)
class _Task:
    """The user's function as a worker runs it: arguments loaded, the result an :class:`_Alone`."""

    fn: Callable[..., Any]

    def __call__(self, *args: Any, **kwargs: Any) -> _Alone:
        if len(args) == 1 and not kwargs and type(args[0]) is _Alone:
            args, kwargs = args[0].load()
        try:
            return _Alone(self.fn(*args, **kwargs))
        except SystemExit as e:
            fn = self.fn
            name = fn.name if type(fn) is ByValue else getattr(fn, "__qualname__", repr(fn))
            raise TaskExited(
                f"the task {name} called sys.exit({e.code!r}) in a worker; a task cannot end "
                "its worker (the pool would wait for its result forever), so this is that "
                "task's error and the worker goes on: return a value or raise an exception "
                "instead"
            ) from None
        except Exception as e:
            try:
                reduction.ForkingPickler.dumps(e)
            except Exception:
                raise _RaisedInTask(_Alone(e), f"{type(e).__qualname__}: {e}") from e
            raise


def _task(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` as a worker runs it (by value where needed, result wrapped once)."""
    return cast(Callable[..., T], fn if isinstance(fn, _Task) else _Task(by_value(fn)))


def outcome(ok: bool, value: Any) -> tuple[bool, Any]:
    """A task's ``(ok, result or error)`` in the parent: results loaded, errors unwrapped."""
    if not ok:
        return False, value.unwrap() if type(value) is _RaisedInTask else value
    try:  # (a result, or a chunk's list of them)
        if type(value) is list:
            return True, [v.load() if type(v) is _Alone else v for v in value]
        return True, value.load() if type(value) is _Alone else value
    except Exception as e:
        return False, e


def _guarded_get(recv: Callable[[], Any]) -> Any:
    """``Pool``'s result reader: a result that fails to load becomes that task's error."""
    task = recv()
    if type(task) is tuple and len(task) == 3 and type(task[2]) is tuple:
        return task[0], task[1], outcome(*task[2])
    return task


class ForkAfterCudaError(SharedArrayError, ValueError):
    """The ``fork`` start method was asked for in a process that has initialised CUDA."""


class ExecutorBroken(WorkerLost, concurrent.futures.process.BrokenProcessPool):
    """A worker of a :class:`sharedarrays.ProcessPoolExecutor` died: the executor is broken
    (as the standard library's) and every pending future failed with this error."""


def cuda_initialised() -> bool:
    """Best effort: has CUDA been initialised in this process (else: is cupy imported)?"""
    from sharedarrays.backends.cuda import driver as cuda_driver

    probe = getattr(cuda_driver, "_cuda_initialised_here", None)
    if callable(probe):  # (it never raises)
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


class Pool(multiprocessing.pool.Pool):
    """:class:`multiprocessing.pool.Pool` with the changes this module lists; ``context``: a
    start method or context (default ``"spawn"``)."""

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
            workers, cache = self._pool, self._cache  # type: ignore[has-type,attr-defined]
            self._pool = Workers(workers, cache, self._table)
        super()._repopulate_pool()  # type: ignore[misc]

    def close(self) -> None:
        """Let the workers exit once the tasks submitted are done."""
        try:
            self._ask_done()
        finally:
            super().close()

    def terminate(self) -> None:
        """Stop the workers now; let go of the pool's shared state."""
        try:
            self._ask_done()
        finally:
            super().terminate()
            self._table.close()

    def _ask_done(self) -> None:
        # idle workers that stop unasked never tell the warm loads of this process's arrays,
        # whose memory then waits for the in-flight bound (60 s) before its reuse
        if self._state == multiprocessing.pool.RUN and not self._cache:  # type: ignore[attr-defined]
            handles.ask_done_before_exit(w.pid for w in self._pool if w.is_alive())

    def join(self) -> None:
        """Wait for the workers to exit, and let go of the pool's shared state."""
        super().join()
        self._table.close()

    def _get_sentinels(self) -> list[Any]:
        # what wakes the worker handler besides a worker's exit: the pool's own notices only.
        # The standard library's adds the result pipe, where the handler spins while a
        # result waits for the result thread, taking the GIL from it: 16 new 1 MiB arrays
        # through Pool(4) take 6.5 ms a round instead of 8.0 (host, ab_trees.py --case pool)
        return [self._change_notifier._reader]  # type: ignore[attr-defined]

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
        return super().apply_async(
            _task(func), (_Alone((tuple(args), dict(kwds))),), {}, callback, error_callback
        )

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
    """:meth:`ProcessPoolExecutor.submit`'s future: the executor's, its result loaded here."""

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

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """The standard library's, asking idle workers to say ``DONE`` first (as :class:`Pool`)."""
        try:
            if not self._pending_work_items and not self._shutdown_thread:
                handles.ask_done_before_exit(self._processes or ())
        finally:
            super().shutdown(wait, cancel_futures=cancel_futures)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` in a worker (ExecutorBroken after a death)."""
        try:
            inner = super().submit(_task(fn), _Alone((args, kwargs)))
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
