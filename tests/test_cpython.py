"""The adapter over interpreter and standard-library internals (``sharedarrays._cpython``):
one test per name, each failing when the interpreter or the standard library changes under
it (a private name gone, a count or a frame no longer what the package's checks assume)."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import subprocess
import sys
import threading
import time
from multiprocessing import context
from multiprocessing.pool import ThreadPool
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sharedarrays import _cpython
from sharedarrays._cpython import (
    ITEM_ALONE,
    LOCAL_ALONE,
    caller_frame,
    fail_pool_job,
    frame_function,
    frame_local,
    interpreter_flags,
    mark_no_spawn_in_thread,
    next_pool_job,
    refcount,
    spawning_process,
)

# ------------------------------------------------------------------------------------------
# reference counts


def _item_count(slot: tuple[Any, ...]) -> int:
    return refcount(slot[1])  # (ITEM_ALONE's shape, as in Allocation.native_view)


class _Holder:
    kept: Any = None


def _local_count(holder: _Holder) -> int:
    kept = holder.kept  # (LOCAL_ALONE's shape, as in Allocation._kept_idle)
    return refcount(kept)


@pytest.mark.parametrize("made", [object, lambda: np.arange(4.0)])
def test_item_alone_tells_an_object_only_its_tuple_holds_from_a_shared_one(made: Any) -> None:
    assert _item_count((None, made())) <= ITEM_ALONE
    other = made()
    assert _item_count((None, other)) > ITEM_ALONE  # (``other`` holds it too)
    held = [made()]
    slot = (None, held[0])
    assert _item_count(slot) > ITEM_ALONE  # (a list holds it too)
    held.clear()
    assert _item_count(slot) <= ITEM_ALONE


@pytest.mark.parametrize("made", [object, lambda: np.arange(4.0)])
def test_local_alone_tells_an_attribute_s_only_holder_from_a_shared_one(made: Any) -> None:
    holder = _Holder()
    holder.kept = made()
    assert _local_count(holder) <= LOCAL_ALONE
    other = holder.kept
    assert _local_count(holder) > LOCAL_ALONE
    del other
    assert _local_count(holder) <= LOCAL_ALONE


def test_the_counts_are_those_checked_on_this_interpreter() -> None:
    """Measured at import, never written down; but a version whose counts differ from those
    the adapter was checked with must be checked again (its notes name the versions)."""
    assert refcount is sys.getrefcount
    if sys.version_info[:2] > (3, 13) or not getattr(sys, "_is_gil_enabled", lambda: True)():
        pytest.skip("counts not yet checked on this interpreter: the two tests above are")
    assert (ITEM_ALONE, LOCAL_ALONE) == (2, 3)


# ------------------------------------------------------------------------------------------
# frames


def _who_called_me() -> tuple[str, str]:
    return frame_function(caller_frame())


def test_caller_frame_is_the_caller_s_caller() -> None:
    assert _who_called_me() == (__name__, "test_caller_frame_is_the_caller_s_caller")
    assert caller_frame(10_000) is None
    assert frame_function(None) == ("", "")


class _Recorded:
    """Pickles as a call to :func:`_record`, which records its caller's frame."""

    seen: list[tuple[str, str]] = []

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _record, ()


def _record() -> None:
    _Recorded.seen.append(frame_function(caller_frame()))


def _loads_here(blob: bytes) -> None:
    pickle.loads(blob)


def test_a_reconstructor_s_caller_is_whoever_called_the_c_unpickler() -> None:
    """The unpickler is C code without a frame: what read_by_distributed relies on."""
    _Recorded.seen.clear()
    _loads_here(pickle.dumps(_Recorded()))
    assert _Recorded.seen == [(__name__, "_loads_here")]


def test_distributed_s_unpickler_is_still_recognised() -> None:
    protocol = pytest.importorskip(
        "distributed.protocol", reason="pip install 'sharedarrays[dask]'"
    )
    from sharedarrays.api.othernode import DISTRIBUTED_LOADS

    _Recorded.seen.clear()
    protocol.pickle.loads(pickle.dumps(_Recorded()))
    protocol.deserialize(*protocol.serialize(_Recorded(), serializers=("pickle",)))
    assert _Recorded.seen == [DISTRIBUTED_LOADS, DISTRIBUTED_LOADS]


class _Out:
    """An ``out=`` that records who called its ``__array_ufunc__``."""

    seen: list[tuple[str, str]] = []

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        _Out.seen.append(frame_function(caller_frame()))
        return np.zeros(())


def test_numpy_s_mean_is_still_the_caller_of_its_reduction_into_out() -> None:
    """What ``ArrayBase.__array_ufunc__`` looks for (``_numpy_averages``)."""
    from sharedarrays.api.arraybase import _numpy_averages

    _Out.seen.clear()
    np.arange(4.0).mean(out=_Out())  # type: ignore[call-overload]
    np.arange(4.0).std(out=_Out())  # type: ignore[call-overload]
    assert [f for _, f in _Out.seen][:1] == ["_mean"]
    assert all(m in ("numpy._core._methods", "numpy.core._methods") for m, _ in _Out.seen)
    probe: list[bool] = []

    class Out:
        def __array_ufunc__(self, *args: Any, **kwargs: Any) -> Any:
            probe.append(_numpy_averages(caller_frame()))
            return np.zeros(())

    np.arange(4.0).var(out=Out())  # type: ignore[call-overload]
    np.add.reduce(np.arange(4.0), out=Out())  # type: ignore[call-overload]
    assert probe[0] and not probe[-1]


def test_array_api_compat_s_array_namespace_is_still_the_caller_with_use_compat() -> None:
    """What ``ArrayBase.__array_namespace__`` looks for (``_asking_compat``) and
    reads (the ``use_compat`` argument)."""
    compat = pytest.importorskip("array_api_compat")
    seen: list[tuple[tuple[str, str], Any]] = []

    class Probe:
        def __array_namespace__(self, *, api_version: str | None = None) -> Any:
            frame = caller_frame()
            seen.append((frame_function(frame), frame_local(frame, "use_compat")))
            return np

    compat.array_namespace(Probe(), use_compat=False)
    (module, function), use_compat = seen[0]
    assert module == "array_api_compat.common._helpers" and function == "array_namespace"
    assert use_compat is False
    assert frame_local(caller_frame(0), "no such local") is None and frame_local(None, "x") is None


# ------------------------------------------------------------------------------------------
# multiprocessing


def test_mark_no_spawn_in_thread_makes_the_record_a_plain_none() -> None:
    out: dict[str, Any] = {}

    def run() -> None:
        out["before"] = "spawning_popen" in vars(context._tls)
        out["read"] = spawning_process()
        mark_no_spawn_in_thread()
        out["after"] = vars(context._tls).get("spawning_popen", "missing")

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert out == {"before": False, "read": None, "after": None}
    assert spawning_process is context.get_spawning_popen


class _SeesSpawn:
    """Records, as it is pickled, what :func:`spawning_process` says."""

    seen: list[Any] = []

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        popen = spawning_process()
        _SeesSpawn.seen.append(popen is not None and callable(getattr(popen, "DupFd", None)))
        return int, (0,)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawning_process_is_the_popen_while_a_process_s_arguments_are_pickled(
    method: str,
) -> None:
    _SeesSpawn.seen.clear()
    pickle.dumps(_SeesSpawn())
    p = mp.get_context(method).Process(target=int, args=(_SeesSpawn(),))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert _SeesSpawn.seen == [False, True]  # (pickle.dumps alone: no Popen)
    assert spawning_process() is None


def test_interpreter_flags_reproduce_this_interpreter_s_options() -> None:
    path = Path(_cpython.__file__)
    code = (
        "import importlib.util as u; "
        f"s = u.spec_from_file_location('adapter', {str(path)!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.interpreter_flags())"
    )
    got = subprocess.run(
        [sys.executable, "-O", "-W", "error::DeprecationWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "'-O'" in got and "'-Werror::DeprecationWarning'" in got
    assert all(isinstance(f, str) for f in interpreter_flags())


# ------------------------------------------------------------------------------------------
# multiprocessing.pool


@pytest.mark.timeout(60)
def test_fail_pool_job_ends_each_kind_of_job_with_the_error() -> None:
    """A thread pool has the same jobs as a process pool: each one, its task still running,
    fails at once with the error (its callback called), and its late result is dropped."""
    release = threading.Event()
    callbacks: list[BaseException] = []

    def task(x: int) -> int:
        release.wait(30)
        return x

    with ThreadPool(3) as pool:
        jobs = [
            pool.apply_async(task, (1,), error_callback=callbacks.append),
            pool.map_async(task, [1, 2], chunksize=1),
            pool.imap(task, [1]),
            pool.imap_unordered(task, [1]),
        ]
        errors = [RuntimeError(f"lost {i}") for i in range(len(jobs))]
        for job, error in zip(jobs, errors):
            fail_pool_job(job, error)
        t0 = time.monotonic()
        for job, error in zip(jobs, errors):
            with pytest.raises(RuntimeError) as got:
                job.get(5) if hasattr(job, "get") else next(job)  # type: ignore[attr-defined]
            assert got.value is error
        assert time.monotonic() - t0 < 5 and callbacks == [errors[0]]
        release.set()
        time.sleep(0.2)  # (late results: dropped, not raised)
        assert pool._cache == {}  # type: ignore[attr-defined]
        fail_pool_job(jobs[0], RuntimeError("again"))  # (ended: left as it is)
        with pytest.raises(RuntimeError, match="lost 0"):
            jobs[0].get(1)  # type: ignore[union-attr]


def test_next_pool_job_is_above_every_job_submitted_before() -> None:
    with ThreadPool(1) as pool:
        job = pool.apply_async(int, ())
        number = next_pool_job()
        assert job._job < number < pool.apply_async(int, ())._job  # type: ignore[attr-defined]
        assert next_pool_job() > number
