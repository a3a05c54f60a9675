"""A spawned importer of growable arrays, driven over a Pipe (see test_growth.py)."""

from __future__ import annotations

import gc
import pickle
from typing import Any

import numpy as np


def _host(a: Any) -> np.ndarray[Any, Any]:
    native = a.array
    return np.asarray(native if isinstance(native, np.ndarray) else native.get())


def _describe(a: Any) -> tuple[tuple[int, ...], float, int, int]:
    """Shape, sum of column 0, address of element 0, chunks mapped here."""
    data = _host(a)
    col = data[:, 0] if data.ndim > 1 else data
    return tuple(a.shape), float(col.astype(np.float64).sum()), a.address, len(a.allocation.chunks)


def importer(conn: Any) -> None:
    """Answer ``(op, arg)`` messages until ``("exit", None)``; every reply is
    ``("ok", value)`` or ``("error", "TypeName: message")``."""
    views: dict[str, Any] = {}
    while True:
        op, arg = conn.recv()
        try:
            if op == "exit":
                conn.send(("ok", None))
                return
            if op == "load":  # arg: (key, payload bytes)
                key, blob = arg
                views[key] = pickle.loads(blob)
                value: Any = _describe(views[key])
            elif op == "describe":
                value = _describe(views[arg])
            elif op == "refresh":
                views[arg].refresh()
                value = _describe(views[arg])
            elif op == "resize":
                views[arg[0]].resize(arg[1])
                value = None
            elif op == "drop":
                views.pop(arg).close()
                gc.collect()
                value = None
            else:
                raise ValueError(f"unknown op {op!r}")
            conn.send(("ok", value))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


def make_growable(rows: int) -> Any:
    """A growable array made here and returned (a pool worker's result): this process keeps
    no view of it."""
    import sharedarrays as sa

    g = sa.empty((0, 4), "float64", capacity=1 << 20, device="cpu")
    g.append(np.full((rows, 4), 2.0))
    return g


def draining() -> int:
    """How many allocations released here still wait for their payloads to load."""
    from sharedarrays.memory import reap_draining

    return reap_draining()
