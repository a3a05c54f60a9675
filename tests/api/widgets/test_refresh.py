"""AutoRefresh: the auto-refresh thread shared by the memory map and the node-wide map."""

from __future__ import annotations

import gc
import threading

import pytest

from sharedarrays.api.widgets.refresh import AutoRefresh

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
