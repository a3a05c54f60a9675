"""Processes for the node-wide view's tests (tests/api/test_nodemap.py): module level, so that
spawn can import them."""

from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np

import sharedarrays as sa

NBYTES = 3 << 20
"""Bytes of each test array: not a multiple of the host granularity's larger sizes."""


def exporter(out: Any, stop: Any, device: str = "cpu", backend: str = "auto") -> None:
    """Make an array (on ``device``, with ``backend``), send its id and a payload of it,
    keep it until told to stop."""
    a = sa.from_array(
        np.arange(NBYTES // 8, dtype=np.float64), device=device, backend=backend, pack=False
    )
    a.synchronize()
    out.put((a.allocation.id, pickle.dumps(a)))
    stop.wait(120)
    a.close()


def importer(blob: bytes, ready: Any, stop: Any) -> None:
    """Load the payload, keep the view until told to stop."""
    a = pickle.loads(blob)
    assert float(a.array[3]) == 3.0
    ready.set()
    stop.wait(120)
    a.close()


def argument_holder(a: Any, ready: Any, stop: Any) -> None:
    """Given an array as a Process argument (its fds travel with it): keep it until told."""
    assert float(a.array[3]) == 3.0
    ready.set()
    stop.wait(120)
    a.close()


def parker(out: Any) -> None:
    """Make an array, park it (the keeper holds its handles), send its id and exit."""
    a = sa.zeros(NBYTES // 8, dtype=np.float64, device="cpu", pack=False)
    a.park()
    out.put(a.allocation.id)
    a.close()


def parker_with_payload(out: Any) -> None:
    """Make an array, park it, send its id and a payload of it, and exit (the keeper then
    serves the payload)."""
    a = sa.zeros(NBYTES // 8, dtype=np.float64, device="cpu", pack=False)
    a.park()
    out.put((a.allocation.id, pickle.dumps(a)))
    a.close()


def holder(blob: bytes, ready: Any) -> None:
    """Load the payload and hold it until killed."""
    a = pickle.loads(blob)
    ready.set()
    while True:
        time.sleep(60)
    a.close()  # pragma: no cover


def sender(out: Any) -> None:
    """Make an array of ``NBYTES + 8`` bytes (not a whole number of pages), send its id and
    a payload of it, and exit (the payload in flight: the keeper takes its handles)."""
    a = sa.from_array(np.arange(NBYTES // 8 + 1, dtype=np.float64), device="cpu", pack=False)
    out.put((a.allocation.id, pickle.dumps(a)))
