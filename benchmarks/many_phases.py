"""Unprofiled phases of a warm load of many small arrays in a spawn worker.

    python benchmarks/many_phases.py [cpu|cuda:0] [count]

The parent makes ``count`` (10,000) packed arrays of 4 KiB and pickles the list (median of 7
``pickle.dumps``); a one-worker spawn Pool loads the message once (maps the slabs), then 15
times more, timing apart: ``pickle.loads``, ``.array`` of each, closing each, and dropping
the natives and views. Prints the medians in ms. Run it with ``PYTHONPATH`` pointing at two
versions of the package, alternately, to compare them (cProfile inflates Python time; these
are plain wall times).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import statistics
import sys
import time
from typing import Any


def phases(blob: bytes, device: str) -> dict[str, float]:
    if device.startswith("cuda"):
        import cupy

        cupy.zeros(1)
    out: dict[str, list[float]] = {"loads": [], "array": [], "close": [], "drop": []}
    first = pickle.loads(blob)
    for a in first:
        a.close()
    del first
    for _ in range(15):
        t0 = time.perf_counter()
        views: Any = pickle.loads(blob)
        t1 = time.perf_counter()
        natives = [a.array for a in views]
        t2 = time.perf_counter()
        del natives
        t3 = time.perf_counter()
        for a in views:
            a.close()
        t4 = time.perf_counter()
        del views
        t5 = time.perf_counter()
        out["loads"].append(t1 - t0)
        out["array"].append(t2 - t1)
        out["close"].append(t4 - t3)
        out["drop"].append(t5 - t4 + t3 - t2)
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def main() -> None:
    import sharedarrays as sa

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    arrays = [sa.empty(1024, "float32", device=device, pack=True) for _ in range(count)]
    dumps = []
    for _ in range(7):
        t = time.perf_counter()
        blob = pickle.dumps(arrays)
        dumps.append(time.perf_counter() - t)
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.apply(phases, (blob, device))
    total = sum(got.values())
    print(
        f"{count} x 4 KiB on {device}: dumps {statistics.median(dumps) * 1e3:.1f} ms; "
        + ", ".join(f"{k} {v:.1f} ms" for k, v in got.items())
        + f" (worker {total:.1f} ms, {total * 1e3 / count:.2f} us per array)"
    )


if __name__ == "__main__":
    main()
