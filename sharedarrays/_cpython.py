"""The package's one adapter over what CPython and its standard library do not promise: each
use a named function, tested in ``tests/test_cpython.py`` on CPython 3.10-3.13."""

from __future__ import annotations

import contextlib
import sys
from multiprocessing import context as _mp_context
from multiprocessing import util as _mp_util
from types import FrameType, SimpleNamespace
from typing import Any

refcount = sys.getrefcount
"""Compared with :data:`ITEM_ALONE` or :data:`LOCAL_ALONE` only in the code shape each was
measured with at import (bound, not wrapped: the warm handoff calls it once per view)."""


def _count_item(slot: tuple[Any, ...]) -> int:
    # Allocation.native_view's shape: the item read from a local tuple in the call
    return refcount(slot[1])


def _count_local(holder: Any) -> int:
    # Allocation._kept_idle's shape: the attribute's value in one local, passed on
    kept = holder.kept
    return refcount(kept)


ITEM_ALONE: int = _count_item((None, object()))
"""``refcount(slot[i])`` of an object only the local tuple ``slot`` holds (2 on 3.10-3.13)."""

LOCAL_ALONE: int = _count_local(SimpleNamespace(kept=object()))
"""``refcount(kept)`` of an object only one attribute and the local ``kept`` hold (3)."""


def caller_frame(depth: int = 1) -> FrameType | None:
    """The frame ``depth`` Python frames above this one's caller (C has none), or ``None``."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


def frame_function(frame: FrameType | None) -> tuple[str, str]:
    """The module ``__name__`` and code name of ``frame``; ``("", "")`` for ``None``."""
    if frame is None:
        return "", ""
    return str(frame.f_globals.get("__name__", "")), frame.f_code.co_name


def frame_local(frame: FrameType | None, name: str) -> Any:
    """The local ``name`` of ``frame``, or ``None`` (``f_locals``: from 3.13, a proxy)."""
    return None if frame is None else frame.f_locals.get(name)


spawning_process = _mp_context.get_spawning_popen
"""``multiprocessing.context.get_spawning_popen``: the ``Popen`` of the Process this thread
is spawning, else ``None`` (a view pickled then carries its chunks' fds)."""


def mark_no_spawn_in_thread() -> None:
    """Make :data:`spawning_process` a plain read in this thread (else each call raises and
    catches an ``AttributeError`` inside)."""
    if _mp_context.get_spawning_popen() is None:
        _mp_context.set_spawning_popen(None)


def interpreter_flags() -> list[str]:
    """The options (``-X``, ``-W``, ``-O``, ...) that give a child Python this one's settings."""
    return list(_mp_util._args_from_interpreter_flags())  # type: ignore[attr-defined]


def _no_more(i: int, obj: object) -> None:
    """A failed job's ``_set``: results that arrive after it failed are dropped."""


def fail_pool_job(job: Any, error: BaseException) -> None:
    """End a pool's ``job`` (``ApplyResult``, ``MapResult``, ``IMapIterator``) with ``error``
    unless it has ended, calling its error callback; late results are dropped."""
    import multiprocessing.pool

    if isinstance(job, multiprocessing.pool.IMapIterator):
        it: Any = job  # (its fields are not in the standard library's stubs)
        with it._cond:
            it._set = _no_more  # (its late results would move its count past its end)
            it._items.append((False, error))
            it._unsorted.clear()
            it._index = it._length = 0  # after the error: the end
            it._cond.notify_all()
    else:
        if job.ready():
            return
        job._set = _no_more
        job._success, job._value = False, error
        if job._error_callback is not None:
            try:
                job._error_callback(error)
            except Exception as e:  # (as the pool's result thread would lose it: said)
                print(f"sharedarrays: a Pool error_callback raised {e!r}", file=sys.stderr)
        job._event.set()
        job._pool = None
    with contextlib.suppress(KeyError):  # (del: the pool's cache wakes its worker when empty)
        del job._cache[job._job]


def next_pool_job() -> int:
    """Take the next pool job number: every job submitted before has a smaller one."""
    import multiprocessing.pool

    return next(multiprocessing.pool.job_counter)  # type: ignore[attr-defined,no-any-return]
