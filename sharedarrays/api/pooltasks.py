"""What travels between a pool and its workers: functions shipped by value where a spawned
worker could not import them (:func:`by_value`), the task a worker runs (:class:`_Task`),
and arguments and results pickled on their own (:class:`_Alone`), so that one that cannot
be loaded is that task's error.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing import reduction
from typing import Any, TypeVar, cast

from sharedarrays.errors import TaskExited

__all__ = ["ByValue", "by_value"]

T = TypeVar("T")

_loaded: dict[bytes, Callable[..., Any]] = {}
_loaded_lock = threading.Lock()
_LOADED_MAX = 128


_MAIN_MODULES = ("__main__", "__mp_main__")

_main_namespace: dict[str, Any] = {}
"""In a worker: the one namespace of the functions of the parent's ``__main__``."""


def _in_main_namespace(fn: Any, seen: dict[int, Any] | None = None) -> Any:
    """``fn`` (loaded from cloudpickle) and the ``__main__`` functions it brings, with
    :data:`_main_namespace` as their globals, as a module's functions share theirs
    (cloudpickle gives each its own). Functions and classes take the newest definition;
    other values keep the worker's."""
    if isinstance(fn, functools.partial):
        inner = _in_main_namespace(fn.func, seen)
        return fn if inner is fn.func else functools.partial(inner, *fn.args, **fn.keywords)
    if not isinstance(fn, types.FunctionType) or fn.__module__ not in _MAIN_MODULES:
        return fn
    namespace = _main_namespace
    if fn.__globals__ is namespace:
        return fn
    seen = {} if seen is None else seen
    made = seen.get(id(fn))
    if made is not None:
        return made
    made = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    made.__kwdefaults__ = fn.__kwdefaults__
    made.__qualname__ = fn.__qualname__
    made.__doc__ = fn.__doc__
    made.__dict__.update(fn.__dict__)
    made.__module__ = fn.__module__
    seen[id(fn)] = made
    for name, value in fn.__globals__.items():
        if isinstance(value, types.FunctionType) and value.__module__ in _MAIN_MODULES:
            namespace[name] = _in_main_namespace(value, seen)
        elif isinstance(value, type) and value.__module__ in _MAIN_MODULES:
            namespace[name] = value
        else:
            namespace.setdefault(name, value)
    return made


def _load(blob: bytes) -> Callable[..., Any]:
    fn = _loaded.get(blob)
    if fn is None:
        import cloudpickle

        fn = _in_main_namespace(cloudpickle.loads(blob))
        with _loaded_lock:
            if len(_loaded) >= _LOADED_MAX:
                _loaded.pop(next(iter(_loaded)))
            _loaded[blob] = fn
    return fn


class ByValue:
    """A picklable callable carrying a function's cloudpickle ``blob`` and its ``name``."""

    __slots__ = ("blob", "name")

    def __init__(self, fn: Callable[..., Any]) -> None:
        import cloudpickle

        self.blob: bytes = cloudpickle.dumps(fn)
        self.name: str = getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _load(self.blob)(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[bytes, str]]:
        return _rebuild, (self.blob, self.name)

    def __repr__(self) -> str:
        return f"<by-value {self.name} ({len(self.blob)} bytes)>"


def _rebuild(blob: bytes, name: str) -> ByValue:
    obj = ByValue.__new__(ByValue)
    obj.blob = blob
    obj.name = name
    return obj


def _needs_value(fn: object) -> bool:
    """Whether a spawned worker could not import ``fn`` by name: a lambda, a nested
    function, or one of a ``__main__`` that is no importable file (a notebook)."""
    if isinstance(fn, ByValue):
        return False
    if isinstance(fn, functools.partial):
        return _needs_value(fn.func)
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module is None or "<" in qualname:
        return True
    return module in _MAIN_MODULES and not _main_is_importable()


def _main_is_importable() -> bool:
    """Whether a spawned worker imports this process's ``__main__`` (a module or a file)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


def by_value(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` wrapped to be pickled by value when a spawned worker could not import it by
    name (defined in ``__main__`` or a notebook, a lambda, a nested function); otherwise
    ``fn`` itself."""
    if _needs_value(fn):
        return ByValue(fn)
    return fn


class _Pending:
    """A value as it reaches the other process: bytes, loaded where a failure is the task's
    error."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def load(self) -> Any:
        return reduction.ForkingPickler.loads(self.blob)


class _Alone:
    """A task's arguments or result pickled on its own, arriving as a :class:`_Pending`, so
    that the message carrying it always loads."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        try:
            blob = bytes(reduction.ForkingPickler.dumps(self.value))
        except Exception as e:  # (a notebook's class or a lambda: by value)
            import cloudpickle

            try:
                blob = cloudpickle.dumps(self.value)
            except Exception:
                raise e from None
        return _Pending, (blob,)


class _RaisedInTask(Exception):
    """A task's exception that multiprocessing's pickler cannot write (a notebook's class),
    sent by value and raised in the parent as itself (:meth:`unwrap`)."""

    def __init__(self, error: BaseException, text: str | None = None) -> None:
        super().__init__(text or f"{type(error).__qualname__}: {error}")
        self.carried: Any = _Alone(error)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _raised_again, (self.carried, str(self))

    def unwrap(self) -> BaseException:
        """The task's own exception (with the worker's traceback as cause), else this one."""
        try:
            error = self.carried.load() if type(self.carried) is _Pending else self.carried.value
        except Exception:
            return self
        if not isinstance(error, BaseException):
            return self
        error.__cause__ = self.__cause__
        return error


def _raised_again(carried: Any, text: str) -> _RaisedInTask:
    made = _RaisedInTask.__new__(_RaisedInTask)
    Exception.__init__(made, text)
    made.carried = carried
    return made


def _load_pending(value: Any) -> Any:
    """A result (or a chunk's list of them) with its pending parts loaded."""
    if isinstance(value, _Pending):
        return value.load()
    if type(value) is list and any(isinstance(v, _Pending) for v in value):
        return [_load_pending(v) for v in value]
    return value


def _args(args: Iterable[Any], kwargs: Mapping[str, Any]) -> _Alone:
    """A task's arguments, loaded by the task in the worker."""
    return _Alone((tuple(args), dict(kwargs)))


def _each(iterable: Iterable[Any], star: bool) -> Iterator[Any]:
    """The arguments of each task of a map (``star``: each item is an argument tuple)."""
    for item in iterable:
        yield (_args(item, {}),) if star else _args((item,), {})


class _Task:
    """The function a worker runs: the user's, on the arguments it loads, its result
    wrapped in :class:`_Alone`."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> _Alone:
        if len(args) == 1 and not kwargs:
            sent = args[0]
            if type(sent) is _Pending:
                args, kwargs = sent.load()
            elif type(sent) is _Alone:  # (called without pickling)
                args, kwargs = sent.value
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
                raise _RaisedInTask(e) from e
            raise

    def __reduce__(self) -> tuple[Any, tuple[Callable[..., Any]]]:
        return _Task, (self.fn,)


def _task(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` as a worker runs it (by value where needed, result wrapped once)."""
    return cast(Callable[..., T], fn if isinstance(fn, _Task) else _Task(by_value(fn)))


def _guarded_get(recv: Callable[[], Any]) -> Any:
    """``Pool``'s result reader: a result that fails to load becomes that task's error."""
    task = recv()
    if type(task) is tuple and len(task) == 3 and type(task[2]) is tuple:
        job, i, (ok, value) = task
        if ok:
            try:
                return job, i, (True, _load_pending(value))
            except Exception as e:
                return job, i, (False, e)
        if type(value) is _RaisedInTask:
            return job, i, (False, value.unwrap())
    return task
