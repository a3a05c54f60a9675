"""Cross-process ordering (``sharedarrays.backends.cuda.sync``) on the CPU: the ``no_sync``
switch, token parsing, process start times, one record per message (the fence's lifetime).
The GPU side (events ordering a consumer after a producer, one record per message, the ring)
is in ``backends/test_cuda_vmm.py``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sharedarrays.backends.cuda import sync
from sharedarrays.errors import PayloadError
from sharedarrays.process import start_time
from sharedarrays.protocol.token import OrderingToken, encode

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def child_env() -> dict[str, str]:
    """The environment for a fresh interpreter that must import sharedarrays from here."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def test_no_sync_switch() -> None:
    assert not sync._no_sync.get()
    with sync.no_sync():
        assert sync._no_sync.get()
        assert sync.export_sync(object()) is None  # type: ignore[arg-type]
        seen: list[bool] = []
        t = threading.Thread(target=lambda: seen.append(not sync._no_sync.get()))
        t.start()
        t.join()
        assert seen == [True]  # the switch is local to this thread
        with sync.no_sync():
            pass
        assert sync._no_sync.get()
    assert not sync._no_sync.get()


def test_sync_token_checks() -> None:
    with pytest.raises(PayloadError, match="sync token"):
        sync._event_for(None, b"short")
    # A token whose exporter has exited needs no wait (and touches no driver).
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(proc.stdout)
    token = encode(OrderingToken(dead, 12345, bytes(64), 0))
    assert sync._event_for(None, token) is None
    # A token naming this process but no event of it is malformed.
    mine = encode(OrderingToken(os.getpid(), 0, b"\x01" * 64, 0))
    with pytest.raises(PayloadError, match="never exported"):
        sync._event_for(None, mine)


def test_process_start_time() -> None:
    assert start_time(os.getpid()) == sync._my_start_time() > 0
    assert start_time(2**31 + 7) is None


# --------------------------------------------------------------------------------------------
# one record per message: the fence lives as long as the pickling that holds it


@pytest.fixture(autouse=True)
def _default_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # (the fake devices' indices name no CUDA device: where CuPy is imported, its stream
    # lookup would ask for them)
    monkeypatch.setattr(sync, "current_stream", lambda index: 0)


class _Recorder:
    """A fake CUDA device for :func:`sync.export_fence`: its ``stream_token`` counts the
    queries, each a new token (or none: ``idle``)."""

    def __init__(self, index: int = 9, idle: bool = False) -> None:
        self.device = SimpleNamespace(index=index)
        self.records = 0
        self.idle = idle

    def stream_token(self, stream: int) -> bytes | None:
        self.records += 1
        return None if self.idle else b"token-%d" % self.records


_recorder = _Recorder()


class _Item:
    """Stands for an array: its reducer passes the message's fence as ordering argument."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _loaded, (self.i, sync.export_fence(_recorder))  # type: ignore[arg-type]


def _loaded(i: int, token: bytes | None) -> tuple[int, bytes | None]:
    return i, token


def _tokens(loaded: list[tuple[int, bytes | None]]) -> set[bytes | None]:
    return {token for _, token in loaded}


def _fence(device: _Recorder) -> sync.Fence:
    fence = sync.export_fence(device)  # type: ignore[arg-type]
    assert fence is not None
    return fence


@pytest.mark.parametrize("dumps", ["pickle", "ForkingPickler"])
def test_one_record_per_message(dumps: str) -> None:
    from multiprocessing.reduction import ForkingPickler

    dump = pickle.dumps if dumps == "pickle" else lambda obj: bytes(ForkingPickler.dumps(obj))
    before = _recorder.records
    items = [_Item(i) for i in range(1000)]
    first = dump(items)
    assert _recorder.records == before + 1  # one record for the 1,000 items of the message
    loaded = pickle.loads(first)
    assert [i for i, _ in loaded] == list(range(1000))
    assert _tokens(loaded) == {b"token-%d" % (before + 1)}
    assert len({id(token) for _, token in loaded}) == 1  # pickled once, then memo references
    assert first.count(b"token-%d" % (before + 1)) == 1  # written once into the message
    second = pickle.loads(dump(items))
    assert _recorder.records == before + 2  # the next message records anew
    assert _tokens(second) == {b"token-%d" % (before + 2)}


def test_the_fence_dies_with_its_pickler() -> None:
    fence = _fence(_recorder)
    assert _fence(_recorder) is fence  # alive: shared
    other = _Recorder(index=10)
    assert _fence(other) is not fence  # one per device (and stream)
    seen: list[sync.Fence] = []
    t = threading.Thread(target=lambda: seen.append(_fence(_recorder)))
    t.start()
    t.join()
    assert seen[0] is not fence  # one per thread
    ref = weakref.ref(fence)
    token = fence.token
    seen.clear()
    del fence
    assert ref() is None  # only held weakly here
    assert _fence(_recorder).token != token


def test_an_idle_stream_pickles_as_no_token() -> None:
    idle = _Recorder(index=11, idle=True)
    fence = _fence(idle)
    assert fence.token is None and pickle.loads(pickle.dumps(fence)) is None
    assert _fence(idle) is fence and idle.records == 1  # asked once
    del fence
    busy = _fence(_Recorder(index=12))
    assert pickle.loads(pickle.dumps(busy)) == busy.token and type(busy.token) is bytes


def test_a_queue_message_records_once() -> None:
    import multiprocessing

    queue = multiprocessing.get_context("spawn").Queue()
    try:
        before = _recorder.records
        queue.put([_Item(i) for i in range(100)])  # pickled by the queue's feeder thread
        got = queue.get(timeout=30)
        assert _recorder.records == before + 1 and len(_tokens(got)) == 1
        queue.put([_Item(i) for i in range(100)])
        again = queue.get(timeout=30)
        assert _recorder.records == before + 2 and _tokens(again) != _tokens(got)
    finally:
        queue.close()
        queue.join_thread()


def test_no_fence_inside_no_sync() -> None:
    with sync.no_sync():
        assert sync.export_fence(object()) is None  # type: ignore[arg-type]


def test_a_forked_child_keeps_the_backends_facts_and_drops_their_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``STATE.backends.reset_in_child``: registrations, kinds, backend objects and reasons
    stay; CUDA's events, the loaded CANN runtimes and the locks are the child's own; a
    parent that had initialised CUDA marks the child."""
    from forking import in_forked_child

    from sharedarrays.backends.cuda import driver
    from sharedarrays.process import STATE

    state = STATE.backends
    monkeypatch.setattr(state, "rings", {0: "a ring"})
    monkeypatch.setattr(state, "waited", {(0, 0): b"token"})
    monkeypatch.setattr(state, "acl", {"": "runtime"})
    monkeypatch.setattr(state, "cuda_forked", False)
    monkeypatch.setattr(driver, "_cuda_initialised_here", lambda: True)  # (the fork hook asks)
    lock = state.lock

    def child() -> list[object]:
        s = STATE.backends
        kept = bool(s.registrations) and bool(s.kinds) and "host" in s.registrations
        return [kept, s.rings, s.waited, s.acl, s.cuda_forked, s.cuda_parent_had, s.lock is lock]

    assert in_forked_child(child) == [True, {}, {}, {}, True, False, False]
    assert state.rings == {0: "a ring"}  # (the parent keeps its own)
