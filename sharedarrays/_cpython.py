"""The package's one adapter over interpreter and standard-library internals.

Where the package's correctness or speed rests on something CPython or its standard library
does not promise (reference counts of a given code shape, Python frames, multiprocessing's
record of the Process being spawned, its interpreter flags, a pool job's private
fields), the use is here and nowhere
else: each is a small named function or name, whose notes say which internal it relies
on, why there is no public way, and on which Python versions it was checked.
``tests/test_cpython.py`` has a test for each, which fails when the interpreter or the
standard library changes under it; ``tests/test_layers.py`` fails where the rest of the
package names these internals itself.

Checked on CPython 3.10, 3.11, 3.12 and 3.13 (``pyproject.toml`` asks for 3.10 or later). The
hot names (:data:`refcount`, :data:`spawning_process`) are the standard library's own
functions, bound here, not wrapped: a warm handoff calls them once per view, and a Python
frame there costs 1-2 us cold (docs/performance.md).
"""

from __future__ import annotations

import sys
from multiprocessing import context as _mp_context
from multiprocessing import util as _mp_util
from types import FrameType
from typing import Any

__all__ = [
    "ITEM_ALONE",
    "LOCAL_ALONE",
    "caller_frame",
    "fail_pool_job",
    "frame_function",
    "frame_local",
    "interpreter_flags",
    "mark_no_spawn_in_thread",
    "next_pool_job",
    "refcount",
    "spawning_process",
]

# ------------------------------------------------------------------------------------------
# reference counts: is a kept object held by anyone else?

refcount = sys.getrefcount
"""``sys.getrefcount``, for the checks "nothing but my container holds this object", compared
with :data:`ITEM_ALONE` or :data:`LOCAL_ALONE` in exactly the code shape each was measured
with. The function is public, but what it counts for a given code shape is not: how a call's
arguments and a frame's locals and stack hold references changes between versions (3.14
borrows stack references) and builds (free-threaded deferred counting), so the constants are
measured at import, never written down. No public way: a weak reference tells whether an
object is alive, not whether someone else holds it, and ``gc.get_referrers`` walks every
tracked object (milliseconds). What it serves: a kept native array is handed out again
(``Allocation.native_view``), and a kept lease counted idle (``Allocation._kept_idle``),
only where nothing else refers to it (a count that read low would hand one array to two
owners; one that read high only costs a new native array)."""


def _count_item(slot: tuple[Any, ...]) -> int:
    # the shape of Allocation.native_view: the tuple is a local (here an argument), the
    # object read from it inside the call's argument list
    return refcount(slot[1])


class _Holder:
    __slots__ = ("kept",)
    kept: object


def _count_local(holder: _Holder) -> int:
    # the shape of Allocation._kept_idle: the attribute's value in one local, passed on
    kept = holder.kept
    return refcount(kept)


def _item_alone() -> int:
    return _count_item((None, object()))


def _local_alone() -> int:
    holder = _Holder()
    holder.kept = object()
    return _count_local(holder)


ITEM_ALONE: int = _item_alone()
"""``refcount(slot[i])`` of an object that only the tuple ``slot`` holds, ``slot`` itself
held by one local of the calling function: at most this, and nothing else holds it
(2 on CPython 3.10-3.13)."""

LOCAL_ALONE: int = _local_alone()
"""``refcount(kept)`` of an object that only one attribute holds besides the calling
function's local ``kept`` (read from that attribute): at most this, and nothing else holds
it (3 on CPython 3.10-3.13)."""

# ------------------------------------------------------------------------------------------
# frames: who called?


def caller_frame(depth: int = 1) -> FrameType | None:
    """The frame ``depth`` Python frames above the function that calls this one (1: the
    frame of its caller), or ``None`` where the stack is not that deep.

    Relies on ``sys._getframe`` (CPython's; ``inspect.currentframe`` is the public name of
    the same thing, but importing :mod:`inspect` costs milliseconds at the package's
    import), and on C code having no frame: a reconstructor that the C unpickler calls sees
    the Python function that called ``pickle.loads`` as its caller. No public way: the
    standard library offers nothing else that tells a function who called it. Checked on
    CPython 3.10-3.13."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


def frame_function(frame: FrameType | None) -> tuple[str, str]:
    """The module (its ``__name__``) and the function name (the code's ``co_name``) of
    ``frame``; ``("", "")`` for ``None``.

    Relies on frames' ``f_globals`` and ``f_code`` (documented attributes, but frames
    themselves are CPython's). Checked on CPython 3.10-3.13."""
    if frame is None:
        return "", ""
    return str(frame.f_globals.get("__name__", "")), frame.f_code.co_name


def frame_local(frame: FrameType | None, name: str) -> Any:
    """The local variable ``name`` of ``frame`` (an argument, say), or ``None`` where it has
    none.

    Relies on ``f_locals`` (a snapshot dict up to 3.12, a live proxy from 3.13: ``get``
    reads either). Checked on CPython 3.10-3.13."""
    if frame is None:
        return None
    return frame.f_locals.get(name)


# ------------------------------------------------------------------------------------------
# multiprocessing: is a Process being spawned, and with which interpreter flags?

spawning_process = _mp_context.get_spawning_popen
"""``multiprocessing.context.get_spawning_popen``: the ``Popen`` of the Process this thread
is spawning (its arguments are being pickled), else ``None``. A view pickled then carries
its chunks' fds as multiprocessing's ``DupFd`` (which asks the same record). Not in
multiprocessing's documented API, and no public way: nothing public tells a reduction that
it runs for a Process's start. Checked on CPython 3.10-3.13."""


def mark_no_spawn_in_thread() -> None:
    """Make :data:`spawning_process` a plain read in this thread, where no Process was ever
    spawned from it: ``set_spawning_popen(None)``, as a spawn leaves the record.

    ``get_spawning_popen`` reads a thread-local attribute that only a spawn sets: in a
    thread that never spawned, each call raises and catches an ``AttributeError`` inside
    (10-15 us on a cold path, at every Pool task; docs/performance.md). Relies on
    ``multiprocessing.context.set_spawning_popen`` (not in the documented API; no public way
    to set the record). Checked on CPython 3.10-3.13."""
    if _mp_context.get_spawning_popen() is None:
        _mp_context.set_spawning_popen(None)


def interpreter_flags() -> list[str]:
    """The command-line options that reproduce this interpreter's settings (``-X``, ``-W``,
    ``-O``, ...) for a child Python started with :mod:`subprocess`, as multiprocessing starts
    its resource tracker.

    Relies on ``multiprocessing.util._args_from_interpreter_flags`` (``subprocess``'s,
    private). No public way: ``sys.flags``, ``sys.warnoptions`` and ``sys._xoptions`` would
    have to be turned back into options by hand, and ``sys._xoptions`` is private too.
    Checked on CPython 3.10-3.13."""
    return list(_mp_util._args_from_interpreter_flags())  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------
# multiprocessing.pool: a job whose worker died


def _no_more(i: int, obj: object) -> None:
    """A failed job's ``_set``: results that arrive after it failed are dropped."""


def fail_pool_job(job: Any, error: BaseException) -> None:
    """End ``job`` (a :class:`multiprocessing.pool.Pool`'s ``ApplyResult``, ``MapResult`` or
    ``IMapIterator``), unless it has ended, with ``error``: what ``get``, ``map`` or the
    iterator's next item raise; its error callback, if any, is called with it.

    Relies on the jobs' private fields: ``_set`` (replaced, so that late results are
    dropped), ``_success``, ``_value``, ``_error_callback``, ``_event``, ``_pool``, ``_cache``
    and ``_job``; an iterator's ``_cond``, ``_items``, ``_unsorted``, ``_index`` and
    ``_length``. No public way: a pool fails a job only with an exception its task raised,
    and a job whose worker died waits forever. Checked on CPython 3.10-3.13."""
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
    try:  # (del, not pop: the pool's cache wakes its worker thread when it empties)
        del job._cache[job._job]
    except KeyError:
        pass


def next_pool_job() -> int:
    """The number the next job submitted to any :class:`multiprocessing.pool.Pool` of this
    process gets (each call takes one: the numbers only ever grow, so every job submitted
    before the call has a smaller one).

    Relies on ``multiprocessing.pool.job_counter`` (an ``itertools.count``, not in the
    documented API), whose values are the jobs' ``_job``. No public way: a job's number is
    private too. Checked on CPython 3.10-3.13."""
    import multiprocessing.pool

    return next(multiprocessing.pool.job_counter)  # type: ignore[attr-defined,no-any-return]
