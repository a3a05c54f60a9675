"""How much of a handoff of many small arrays is Python's cyclic garbage collector.

    python benchmarks/many_gc.py [--device cuda:0] [--count 10000] [--rounds 15] [--torch]

The bench's ``many`` part, with the collector watched (``gc.callbacks``) in both processes:
a one-worker spawn Pool (which imports torch too with ``--torch``, as the bench's worker
does) is handed the same list of ``count`` packed 4 KiB arrays ``rounds`` times after the
first (cold) handoff. Each round prints the round trip, the worker's task time, and the time
the collector ran in the worker and in the parent during the round, with the generations of
the collections.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import time
from typing import Any

_gc: dict[str, Any] = {"t": 0.0, "spent": 0.0, "gens": []}


def _watch(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc["t"] = time.perf_counter()
    else:
        _gc["spent"] += time.perf_counter() - _gc["t"]
        _gc["gens"].append(info["generation"])


def _taken() -> tuple[float, list[int]]:
    spent, gens = _gc["spent"], _gc["gens"]
    _gc["spent"], _gc["gens"] = 0.0, []
    return spent, gens


def _counts(gens: list[int]) -> str:
    """Collections by generation, e.g. ``65/5/1``."""
    return "/".join(str(gens.count(g)) for g in range(3))


def _init(device: str, torch: bool) -> None:
    import sharedarrays  # noqa: F401

    if device.startswith("cuda"):
        import cupy

        cupy.zeros(1)
    if torch:
        import torch as _torch

        if device.startswith("cuda"):
            _torch.zeros(1, device=device)
    gc.callbacks.append(_watch)
    _taken()


def task(arrays: list[Any]) -> tuple[float, float, list[int]]:
    t0 = time.perf_counter()
    natives = [a.array for a in arrays]
    del natives
    for a in arrays:
        a.close()
    t1 = time.perf_counter()
    spent, gens = _taken()  # (the collections while the message was loaded, too)
    return t1 - t0, spent, gens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--torch", action="store_true")
    args = parser.parse_args()

    import sharedarrays as sa

    if args.torch:
        import torch  # noqa: F401
    arrays = [sa.empty(1024, "float32", device=args.device, pack=True) for _ in range(args.count)]
    gc.callbacks.append(_watch)
    trips: list[float] = []
    with mp.get_context("spawn").Pool(
        1, initializer=_init, initargs=(args.device, args.torch)
    ) as pool:
        for r in range(args.rounds + 1):
            _taken()
            t = time.perf_counter()
            body, wgc, wgens = pool.apply_async(task, (arrays,)).get(300)
            trip = time.perf_counter() - t
            pgc, pgens = _taken()
            label = "first" if r == 0 else f"round {r}"
            print(
                f"{label:<9} trip {trip * 1e3:7.1f} ms  worker task {body * 1e3:6.1f} ms  "
                f"gc: worker {wgc * 1e3:6.1f} ms {_counts(wgens)}  "
                f"parent {pgc * 1e3:6.1f} ms {_counts(pgens)}"
            )
            if r:
                trips.append(trip)
    print(f"median warm trip {statistics.median(trips) * 1e3:.1f} ms")
    for a in arrays:
        a.close()


if __name__ == "__main__":
    main()
