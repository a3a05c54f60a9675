"""Where the time of a cold handoff goes (a new array, first import in the worker).

Run on the GPU machine: ``python benchmarks/profile_cold.py [--device cuda:0|cpu]
[--sizes 1M,1G,32G] [--pairs 41]``. Prints medians in microseconds.

Each pair is an empty task (the floor) and then a cold handoff, timed alternately in the same
one-worker spawn Pool, so that the drift of the Pool's round trip cancels in the per-pair
difference. Between pairs the teardown of the previous array (the parent's close, the
worker's release of its mapping, the notices between them) is waited for, so that it does not
run during the next timed handoff. Also timed, inside the processes:

* the parent's first pickling of the new array;
* the worker's first ``pickle.loads`` of it (the payload bytes sent as plain bytes);
* the exporter's handle server answering the request (its thread, wall time);
* the same handoff without waiting for the teardown (as ``python -m sharedarrays bench``
  times it), to show what an overlapping teardown adds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
from typing import Any

import sharedarrays as sa
from sharedarrays.bench.sizes import parse_size, size_label
from sharedarrays.transport import notices
from sharedarrays.transport.server import HandleServer


def noop(_: object = None) -> None:
    return None


def touch_close(a: Any) -> int:
    n = len(a.array.shape)
    a.close()
    return n


def loads_timed(blob: bytes) -> float:
    t = time.perf_counter()
    a = pickle.loads(blob)
    a.array  # noqa: B018
    dt = time.perf_counter() - t
    a.close()
    return dt


def settle(_: object = None) -> int:
    """In the worker: release parked mappings and wait until their notices are sent."""
    from sharedarrays.memory.allocation import drop_parked

    drop_parked()
    deadline = time.monotonic() + 5
    while notices.pending_notices() and time.monotonic() < deadline:
        time.sleep(0.0002)
    return 0


def warm_up(_: object = None) -> int:
    import cupy  # noqa: F401  (in the worker: CUDA started before the timing)

    return 0


def _settle_parent(pool: Any) -> None:
    pool.apply(settle)
    deadline = time.monotonic() + 5
    while notices.pending_notices() and time.monotonic() < deadline:
        time.sleep(0.0002)
    time.sleep(0.002)


def _pair(pool: Any, size: int, device: str | None) -> tuple[float, float]:
    """An empty task, then the cold handoff of a new array (closed here after): seconds."""
    a = sa.empty(size // 4, "float32", device=device, pack=False)
    t = time.perf_counter()
    pool.apply(noop, (1,))
    t1 = time.perf_counter()
    pool.apply(touch_close, (a,))
    t2 = time.perf_counter()
    a.close()
    return t1 - t, t2 - t1


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None)
    parser.add_argument("--sizes", default="1M,64M,1G,8G,32G")
    parser.add_argument("--pairs", type=int, default=41)
    args = parser.parse_args()
    device = args.device
    probe = sa.empty(1, "float32", device=device)
    print(f"device {probe.device}, backend {probe.backend}")
    is_cuda = probe.device.is_cuda
    probe.close()

    served: list[float] = []
    answer = HandleServer._answer

    def timed_answer(self: Any, conn: Any, peer: Any, request: bytes) -> None:
        t = time.perf_counter()
        try:
            answer(self, conn, peer, request)
        finally:
            served.append(time.perf_counter() - t)

    HandleServer._answer = timed_answer  # type: ignore[method-assign]

    with mp.get_context("spawn").Pool(1) as pool:
        if is_cuda:
            pool.apply(warm_up)
        for size in [parse_size(s) for s in args.sizes.split(",")]:
            floors, colds, pickles, inside, cold_loose, floors_loose = [], [], [], [], [], []
            served.clear()
            for i in range(args.pairs + 2):
                floor, cold = _pair(pool, size, device)
                _settle_parent(pool)
                b = sa.empty(size // 4, "float32", device=device, pack=False)
                t3 = time.perf_counter()
                blob = pickle.dumps(b)
                t4 = time.perf_counter()
                inside_s = pool.apply(loads_timed, (blob,))
                b.close()
                _settle_parent(pool)
                floor_loose, cold_loose_s = _pair(pool, size, device)
                pool.apply(settle)  # as the bench: no wait for the parent's notices
                if i < 2:
                    continue
                floors.append(floor)
                colds.append(cold)
                pickles.append(t4 - t3)
                inside.append(inside_s)
                floors_loose.append(floor_loose)
                cold_loose.append(cold_loose_s)
            diffs = [c - f for c, f in zip(colds, floors)]
            loose = [c - f for c, f in zip(cold_loose, floors_loose)]
            rows = {
                "floor": med(floors),
                "cold handoff": med(colds),
                "cold - floor, per pair (settled)": med(diffs),
                "cold - floor, per pair (teardown not waited for)": med(loose),
                "parent: first pickle.dumps of a new array": med(pickles),
                "worker: first pickle.loads + .array": med(inside),
                "exporter: handle server answering": med(served) if served else float("nan"),
            }
            print(f"\n{size_label(size)} ({args.pairs} pairs)")
            width = max(map(len, rows))
            for name, us in rows.items():
                print(f"  {name:<{width}}  {us:9.1f} us")


if __name__ == "__main__":
    main()
