"""Payloads in flight and served processes (memory/inflight.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sharedarrays.memory.inflight import InFlight, in_flight_seconds


def test_payloads_count_until_loaded_or_handed_over() -> None:
    f = InFlight()
    assert f.in_flight() == (0, 0.0)
    f.note_sent()
    f.note_sent()
    count, left = f.in_flight()
    assert count == 2 and 0 < left <= in_flight_seconds()
    f.note_loaded()
    assert f.in_flight()[0] == 1
    f.handed_over()
    assert f.in_flight() == (0, 0.0)


def test_the_bound_ends_a_payload_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAREDARRAYS_IN_FLIGHT", "0")
    f = InFlight()
    f.note_sent()
    assert f.in_flight() == (0, 0.0)


def test_served_processes_holders_and_returned_payloads() -> None:
    f = InFlight()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=30)
    f.record_served(os.getppid(), "/srv/a", chunks=3, holder=True)
    f.record_served(gone.pid, None, chunks=5, holder=True)
    assert [s.pid for s in f.served()] == [os.getppid(), gone.pid]
    assert f.served_servers() == ["/srv/a"]
    assert f.holders() == (os.getppid(),)  # one that exited is forgotten
    assert f.mapping_past(2) == [os.getppid()] and f.mapping_past(3) == []
    f.note_returned("/srv/b")  # (not served yet: its TOOK may come after its payloads)
    f.note_returned("/srv/a")
    assert f.returned("/srv/a") == 1 and f.returned("/srv/b") == 1
    assert f.take_returned("/srv/b") == 1 and f.returned("/srv/b") == 0
    f.closed_by(os.getppid())
    assert f.holders() == ()


def test_a_load_counted_nowhere_never_hides_the_next_payload_in_flight() -> None:
    """More loads than payloads sent (a payload loaded twice) leave the count at zero, not
    below: the next payload pickled is in flight."""
    f = InFlight()
    f.note_sent()
    f.note_loaded(3)
    assert f.in_flight() == (0, 0.0)
    f.note_sent()
    assert f.in_flight()[0] == 1


def test_a_payload_loaded_back_by_its_exporter_leaves_the_next_one_in_flight() -> None:
    """``a.payload()`` (counted nowhere) loaded in its own process, then ``a`` pickled: that
    pickle is in flight (it was not, when the load counted one back below zero)."""
    import pickle

    import sharedarrays as sa

    a = sa.zeros(4, device="cpu", pack=False)
    sa.load(a.payload().to_bytes()).close()
    assert a.allocation.in_flight()[0] == 0
    pickle.dumps(a)
    assert a.allocation.in_flight()[0] == 1


def test_a_renamed_block_keeps_no_warm_loads_of_its_old_array() -> None:
    """An importer's block reused by its exporter under a new id: the old array's warm loads,
    told under the new id, would count the new array's payloads in flight as loaded."""
    f = InFlight()
    f.note_returned("/srv/a")
    f.note_returned("/srv/a")
    f.note_block_renamed()
    assert f.returned_from() == [] and f.take_returned("/srv/a") == 0
