"""What travels between a pool and its workers: functions by value where a spawned worker
could not import them (:func:`by_value`), the task a worker runs (:class:`_Task`), and
arguments and results pickled on their own (:class:`_Alone`): one that cannot be loaded is
that task's error.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing import reduction
from typing import Any, TypeVar, cast

from sharedarrays.errors import TaskExited
from sharedarrays.process import STATE

__all__ = ["ByValue", "by_value"]

T = TypeVar("T")
_LOADED_MAX = 128
_MAIN_MODULES = ("__main__", "__mp_main__")


def _main_function(value: object) -> bool:
    return isinstance(value, types.FunctionType) and value.__module__ in _MAIN_MODULES


def _in_main_namespace(fn: Any, seen: dict[int, Any]) -> Any:
    """``fn`` (from cloudpickle) and the ``__main__`` functions it brings, sharing
    ``STATE.pools.main`` as their globals as a module's functions do; functions and classes
    take the newest definition, other values keep the worker's."""
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
        pools = STATE.pools
        fn = pools.loaded.get(self.blob)
        if fn is None:
            import cloudpickle

            fn = _in_main_namespace(cloudpickle.loads(self.blob), {})
            with pools.lock:
                if len(pools.loaded) >= _LOADED_MAX:
                    pools.loaded.pop(next(iter(pools.loaded)))
                pools.loaded[self.blob] = fn
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<by-value {self.name} ({len(self.blob)} bytes)>"


def _needs_value(fn: object) -> bool:
    """Whether a spawned worker cannot import ``fn`` by name: a lambda, a nested function,
    or one of a ``__main__`` that is no importable file (a notebook)."""
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
    """``fn`` wrapped to be pickled by value where a spawned worker cannot import it by name
    (a notebook's, a lambda, a nested function); else ``fn`` itself."""
    return ByValue(fn) if _needs_value(fn) else fn


class _Alone:
    """A task's arguments or result pickled on its own, so that the message carrying it
    always loads: it arrives as bytes, loaded where a failure is the task's error."""

    __slots__ = ("value", "blob")

    def __init__(self, value: Any = None, blob: bytes | None = None) -> None:
        self.value = value
        self.blob = blob

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
    """A task's exception that multiprocessing's pickler cannot write (a notebook's class),
    ``carried`` by value and raised in the parent as itself (:meth:`unwrap`)."""

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


def _args(args: Iterable[Any], kwargs: Mapping[str, Any]) -> _Alone:
    """A task's arguments, loaded by the task in the worker."""
    return _Alone((tuple(args), dict(kwargs)))


def _each(iterable: Iterable[Any], star: bool) -> Iterator[Any]:
    """The arguments of each task of a map (``star``: each item is an argument tuple)."""
    for item in iterable:
        yield (_args(item, {}),) if star else _args((item,), {})


class _Task:
    """The function a worker runs: the user's, on the arguments it loads, its result in an
    :class:`_Alone`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

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

    def __reduce__(self) -> tuple[Any, tuple[Callable[..., Any]]]:
        return _Task, (self.fn,)


def _task(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` as a worker runs it (by value where needed, result wrapped once)."""
    return cast(Callable[..., T], fn if isinstance(fn, _Task) else _Task(by_value(fn)))


def outcome(ok: bool, value: Any) -> tuple[bool, Any]:
    """A task's ``(ok, result or error)`` as the parent takes it: the result loaded (a load
    error is the task's error), the error unwrapped (:class:`_RaisedInTask`)."""
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
