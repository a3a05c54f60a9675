"""What each side of a warm handoff costs when it runs with cold caches, as in the bench.

    python benchmarks/cold_handoff.py [--device cpu|cuda:0] [--iterations 301] [--flush 64M]

In the bench's warm rounds a sharedarrays handoff runs among heavier entries (torch,
cuda.core), which leave the CPU's caches full of their own code and data: the library's
code and objects are read from memory again at every handoff, and its figure over the
floor is larger than where it runs alone (``warm_split.py``). This measures that cost
directly, without the pool: in one process the ``ForkingPickler`` dump of a warm view (the
parent's side), and in a spawned process the load of that message, ``.array`` and
``close()`` (the worker's side), each timed alone after a buffer larger than the last-level
cache was written over (``--flush``; ``0``: caches left warm), against the bench's
``bound`` entry (:class:`sharedarrays.bench.worker.LeastHandoff`) and a plain ``bytes``
argument (the floor's), in rotating order. It prints the median of each, in microseconds,
and the differences.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import pickle
import statistics
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from sharedarrays.bench.sizes import parse_size

KINDS = ("floor", "bound", "safe", "sharedarrays")


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, 5).dump(obj)
    return buf.getvalue()


def _flusher(size: int) -> Any:
    if size <= 0:
        return lambda: None
    buf = np.zeros(size, dtype=np.uint8)

    def flush() -> None:
        np.add(buf, 1, out=buf)  # read and write every line

    return flush


def _worker(messages: dict[str, bytes], device: str, iterations: int, flush: int, out: Any) -> None:
    from sharedarrays.bench import worker

    worker.init_worker(device)
    wipe = _flusher(flush)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(5):  # mapped, the native array made: warm from here on
        for kind in KINDS:
            x = pickle.loads(messages[kind])
            if kind != "floor":
                x.array  # noqa: B018
                x.close()
    for i in range(iterations):
        for kind in KINDS[i % len(KINDS) :] + KINDS[: i % len(KINDS)]:
            wipe()
            t0 = time.perf_counter_ns()
            x = pickle.loads(messages[kind])
            if kind != "floor":
                x.array  # noqa: B018
                x.close()
            times[kind].append((time.perf_counter_ns() - t0) / 1e3)
            del x
    out.put(times)


def report(side: str, times: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = med["floor"]
    print(f"{side}: median us (over the floor)")
    for k in KINDS:
        print(f"  {k:14s} {med[k]:8.2f}  ({med[k] - floor:+.2f})")
    print(f"  sharedarrays - bound: {med['sharedarrays'] - med['bound']:+.2f}")
    print(f"  sharedarrays - safe: {med['sharedarrays'] - med['safe']:+.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iterations", type=int, default=301)
    parser.add_argument("--flush", default="64M", help="bytes written between timings (0: none)")
    args = parser.parse_args()
    flush = parse_size(args.flush) if args.flush != "0" else 0

    import sharedarrays as sa
    from sharedarrays.bench import worker

    a = sa.empty(1 << 20, dtype="uint8", device=args.device)
    device = None if args.device == "cpu" else int(args.device.split(":")[1])
    from sharedarrays.api.message import allocation_bytes

    blob = bytes(len(allocation_bytes(a.allocation)))
    bound = worker.LeastHandoff(blob, a._view_tuple(), a.allocation.backend, device)
    safe = worker.SafeHandoff(
        b"safe".ljust(len(blob), b"."), a._view_tuple(), a.allocation.backend, device
    )
    objects = {"floor": blob, "bound": bound, "safe": safe, "sharedarrays": a}
    for _ in range(5):
        for obj in objects.values():
            _dumps([obj])
    wipe = _flusher(flush)
    parent: dict[str, list[float]] = {k: [] for k in KINDS}
    for i in range(args.iterations):
        for kind in KINDS[i % len(KINDS) :] + KINDS[: i % len(KINDS)]:
            obj = objects[kind]
            wipe()
            t0 = time.perf_counter_ns()
            _dumps([obj])
            parent[kind].append((time.perf_counter_ns() - t0) / 1e3)
    report(f"parent (ForkingPickler dump), flush {flush:,} bytes", parent)

    messages = {k: _dumps(o) for k, o in objects.items()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_worker, args=(messages, args.device, args.iterations, flush, queue))
    child.start()
    report(f"worker (load, .array, close), flush {flush:,} bytes", queue.get(timeout=300))
    child.join(30)
    a.close()


if __name__ == "__main__":
    main()
