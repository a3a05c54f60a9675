"""AutoRefresh: the auto-refresh thread shared by the memory map and the node-wide map."""

from __future__ import annotations

import gc
import threading

import pytest

from sharedarrays.api.widgets.refresh import MAX_INTERVAL, MIN_INTERVAL, AutoRefresh
from sharedarrays.settings import seconds

pytestmark = pytest.mark.timeout(60)


class View:
    def __init__(self, fail: bool = False) -> None:
        self.calls = threading.Semaphore(0)
        self.fail = fail
        self.closed = False

    def refresh(self) -> None:
        self.calls.release()
        if self.fail:
            raise RuntimeError("boom")


def test_refreshes_until_stopped() -> None:
    r: AutoRefresh[View] = AutoRefresh("t", lambda v: 0.01)
    v = View()
    r.start(v)
    r.start(v)  # already running: one thread
    assert r.running
    for _ in range(3):
        assert v.calls.acquire(timeout=10)
    r.stop()
    assert not r.running


def test_ends_when_the_interval_says_none_and_reports_failures() -> None:
    errors: list[str] = []
    r: AutoRefresh[View] = AutoRefresh(
        "t", lambda v: None if v.closed else 0.01, lambda v, e: errors.append(str(e))
    )
    v = View(fail=True)
    r.start(v)
    assert v.calls.acquire(timeout=10) and v.calls.acquire(timeout=10)  # a failure goes on
    v.closed = True
    thread = r._thread
    assert thread is not None
    thread.join(10)
    assert not thread.is_alive() and "boom" in errors


def test_a_collected_view_stops_its_thread() -> None:
    r: AutoRefresh[View] = AutoRefresh("t", lambda v: 0.01)
    v = View()
    r.start(v)
    assert v.calls.acquire(timeout=10)
    thread = r._thread
    assert thread is not None
    del v
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


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
    import sharedarrays as sa
    from sharedarrays.api.widgets import MemoryMap

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
    import sharedarrays as sa

    def refused(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    r: AutoRefresh[View] = AutoRefresh("t", lambda v: 0.01)
    v = View()
    monkeypatch.setattr(threading.Thread, "start", refused)
    with pytest.raises(sa.ThreadUnavailable, match="ulimit -v"):
        r.start(v)
    assert not r.running
    monkeypatch.undo()
    r.start(v)  # can start again
    assert v.calls.acquire(timeout=10)
    r.stop()
