"""Functions that spawned worker processes run (they must be importable by name)."""

from __future__ import annotations

import gc
import os
import pickle
import sys
from typing import Any

import numpy as np


def double_slice(args: tuple[Any, int]) -> float:
    a, i = args
    a.array[i] = a.array[i] * 2 + 1
    return float(a.array[i].sum())


def add_one(a: Any) -> Any:
    a.array[...] += 1
    return a


def fill_value(a: Any, value: float) -> tuple[int, str]:
    a.array[...] = value
    return os.getpid(), a.allocation.id


def checksum(a: Any) -> float:
    return float(np.asarray(a.array, dtype=np.float64).sum())


def echo(a: Any) -> Any:
    return a


def num_fds(_: object = None) -> int:
    import psutil

    gc.collect()
    return psutil.Process().num_fds()


def queue_consumer(q: Any, done: Any) -> None:
    a = q.get()
    a.array[...] = 5
    done.put(float(a.array.sum()))


def pipe_consumer(conn: Any) -> None:
    a = conn.recv()
    a.array[...] *= 3
    conn.send(a.allocation.id)
    conn.close()


def process_arg_consumer(a: Any, q: Any) -> None:
    a.array[...] = np.arange(a.size).reshape(a.shape)
    q.put((a.allocation.origin.pid, a.allocation.id))


def import_twice(blob: bytes) -> tuple[bool, int]:
    """Load one payload twice in a fresh process: one mapping, same address."""
    x = pickle.loads(blob)
    y = pickle.loads(blob)
    import sharedarrays.allocation as al

    return x.allocation is y.allocation and x.address == y.address, len(al.live_allocations())


def exporter_main(path: str, ready: str, go: str) -> None:
    """Run as a script: create an array, write its payload to ``path``, wait, exit."""
    import time

    import sharedarrays as sa

    a = sa.from_array(np.arange(1000, dtype=np.int64), device="cpu")
    with open(path, "wb") as f:
        pickle.dump(a, f)
    open(ready, "w").close()
    deadline = time.time() + 60
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.01)
    sys.exit(0)


_held: list[Any] = []


def hold(a: Any) -> str:
    """Keep a view alive in this worker (so later tasks find the allocation mapped)."""
    _held.append(a)
    return a.allocation.id


def release_held(_: object = None) -> int:
    n = len(_held)
    _held.clear()
    gc.collect()
    return n


def parked_ids(_: object = None) -> list[str]:
    from sharedarrays.allocation import parked_allocations

    gc.collect()
    return [a.id for a in parked_allocations()]


def mapped_ids(_: object = None) -> list[str]:
    from sharedarrays.allocation import live_allocations

    gc.collect()
    return [a.id for a in live_allocations()]


def increment(a: Any) -> None:
    a.array[...] += 1


def fd_targets(_: object = None) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return sorted(out)
