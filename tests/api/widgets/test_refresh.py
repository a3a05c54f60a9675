"""A map's auto-refresh thread (the memory map's and the node-wide map's): it refreshes until
stopped, goes on after a failed refresh, and one that cannot start is ThreadUnavailable; the
interval's bounds."""

from __future__ import annotations

import threading

import pytest

import sharedarrays as sa
from sharedarrays.api.widgets import MemoryMap
from sharedarrays.api.widgets.model import MAX_INTERVAL, MIN_INTERVAL
from sharedarrays.settings import seconds

pytestmark = pytest.mark.timeout(60)


def _counted(fail: bool = False) -> tuple[sa.SharedDeviceArray, MemoryMap, threading.Semaphore]:
    """An array, its map refreshing every MIN_INTERVAL, and a semaphore released per read."""
    a = sa.zeros(10, device="cpu")
    m = MemoryMap(a, interval=MIN_INTERVAL)
    calls, read = threading.Semaphore(0), m._read

    def counted() -> object:
        calls.release()
        if fail:
            raise RuntimeError("boom")
        return read()

    m._read = counted  # type: ignore[method-assign]
    return a, m, calls


def test_refreshes_until_stopped() -> None:
    a, m, calls = _counted()
    m.start()
    thread = m._thread
    m.start()  # already running: one thread
    assert m.auto_refreshing and m._thread is thread and thread is not None
    for _ in range(3):
        assert calls.acquire(timeout=10)
    m.stop()
    assert not m.auto_refreshing and not thread.is_alive()
    a.close()


def test_a_failed_refresh_does_not_end_it() -> None:
    a, m, calls = _counted(fail=True)
    m.start()
    assert calls.acquire(timeout=10) and calls.acquire(timeout=10)  # a failure goes on
    assert m.auto_refreshing
    m.stop()
    a.close()


@pytest.mark.parametrize(
    ("interval", "error"),
    [
        (0, ValueError),  # (refreshed without pause: a core's worth of the kernel's CPU)
        (-1, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        (0.1, ValueError),  # (below what the widget's "every (s)" allows)
        ("2", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_a_bad_interval_is_refused_before_any_thread_runs(interval: object, error: type) -> None:
    a = sa.zeros(10, device="cpu")
    with pytest.raises(error, match="interval"):
        sa.show(interval=interval)  # type: ignore[arg-type]
    with pytest.raises(error, match="interval"):
        a.show(interval=interval)  # type: ignore[arg-type]
    with pytest.raises(error, match="interval"):
        sa.show(scope="node", interval=interval)  # type: ignore[arg-type]
    m = MemoryMap(a)
    if interval is not None:  # (start(None) keeps the interval it has)
        with pytest.raises(error, match="interval"):
            m.start(interval)  # type: ignore[arg-type]
    assert not m.auto_refreshing
    a.close()


def test_seconds_takes_numpy_numbers() -> None:
    import numpy as np

    assert seconds(np.float32(0.5), "interval", MIN_INTERVAL, MAX_INTERVAL) == 0.5
    assert seconds(np.int64(3), "interval", MIN_INTERVAL, MAX_INTERVAL) == 3.0


def test_a_thread_that_cannot_start_is_thread_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    a, m, calls = _counted()
    monkeypatch.setattr(threading.Thread, "start", refused)
    with pytest.raises(sa.ThreadUnavailable, match="ulimit -v"):
        m.start()
    assert not m.auto_refreshing
    monkeypatch.undo()
    m.start()  # can start again
    assert calls.acquire(timeout=10)
    m.stop()
    a.close()
