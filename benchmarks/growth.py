"""Append throughput of a growable array (issue 8), and an importer catching up.

    python benchmarks/growth.py                       # host, 4 KiB rows up to 64 MiB
    python benchmarks/growth.py --device cuda --row 2M --to 8G

Appends one row at a time to ``sa.empty((0, ...), capacity=<to>)`` until the array holds
``--to`` bytes, and prints: the median time per append in each eighth of the run (so a
size-dependent cost would show), the overall rate, the chunks mapped, and whether the first
element's address ever changed (it must not: nothing is copied). Then a spawned importer
loads the first payload, the array grows by as much again (past the capacity, the slow
path), and the importer's ``refresh()`` is timed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _importer(conn: Any) -> None:
    sys.path.insert(0, str(ROOT))
    a = pickle.loads(conn.recv())
    conn.send(a.shape)
    conn.recv()
    t = time.perf_counter()
    a.refresh()
    conn.send((a.shape, time.perf_counter() - t))


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    import numpy as np

    import sharedarrays as sa
    from sharedarrays.cli import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--row", default="4K", help="bytes per appended row (default 4K)")
    ap.add_argument("--to", default="64M", help="grow until this many bytes (default 64M)")
    args = ap.parse_args(argv)
    row, to = parse_size(args.row), parse_size(args.to)
    n = max(to // row, 1)
    a = sa.empty((0, row // 4), "float32", device=args.device, capacity=n * row)
    backend = a.allocation.backend
    values = backend.to_native(np.ones(row // 4, "float32"))
    a.append(values)
    first = a.address
    moved = False
    times = []
    sync = backend.synchronize
    sync()
    start = time.perf_counter()
    for _ in range(n - 1):
        t = time.perf_counter()
        a.append(values)
        times.append(time.perf_counter() - t)
        moved |= a.address != first
    sync()
    total = time.perf_counter() - start
    print(f"{a.backend} {a.device}: {n} appends of {row} B to {a.nbytes / 2**20:.0f} MiB")
    eighth = max(len(times) // 8, 1)
    bands = [
        f"{statistics.median(times[i : i + eighth]) * 1e6:.1f}"
        for i in range(0, len(times), eighth)
    ][:8]
    print(f"median us per append, by eighth of the run: {' '.join(bands)}")
    print(
        f"{(n - 1) / total:,.0f} appends/s, {(n - 1) * row / total / 1e6:,.1f} MB/s; "
        f"{len(a.allocation.chunks)} chunks; first element moved: {moved}"
    )

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_importer, args=(child,))
    proc.start()
    conn.send(pickle.dumps(a))
    conn.recv()
    t = time.perf_counter()
    a.resize(2 * n)  # past the capacity: the allocation moves (no copy)
    print(
        f"resize {n} -> {2 * n} rows past the capacity (move): {(time.perf_counter() - t) * 1e3:.2f} ms"
    )
    conn.send(None)
    shape, took = conn.recv()
    print(f"importer refresh() to {shape}: {took * 1e3:.2f} ms")
    proc.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
