"""Where the time of a warm handoff goes: one process tree, each step timed on its own.

Run on the GPU machine: ``python benchmarks/profile_handoff.py [--device cuda:0|cpu]``.
Prints the median of each measurement in microseconds.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import sharedarrays as sa

REPEATS = 301


def median_us(fn: Callable[[], Any], repeats: int = REPEATS) -> float:
    for _ in range(20):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def noop(_: object = None) -> None:
    return None


_kept: list[Any] = []


def keep(a: Any) -> None:
    """Hold the view past the task (its teardown is not part of the handoff)."""
    _kept.append(a)
    if len(_kept) > 100:
        _kept.clear()


def touch_close(a: Any) -> int:
    n = len(a.array.shape)
    a.close()
    return n


def touch(a: Any) -> int:
    return len(a.array.shape)


def load_in_task(payload: bytes) -> float:
    """Load, touch and drop inside the task, timed there (seconds)."""
    t = time.perf_counter()
    a = sa.load(payload)
    a.array  # noqa: B018
    del a
    return time.perf_counter() - t


def loads_timed(blob: bytes) -> tuple[float, int]:
    """Unpickle (and touch) a pickled list of arrays inside the task: seconds, count."""
    t = time.perf_counter()
    arrays = pickle.loads(blob)
    for x in arrays:
        x.array  # noqa: B018
    return time.perf_counter() - t, len(arrays)


def cold_steps(payloads: list[bytes]) -> dict[str, float]:
    """In the worker: time the parts of a first import, one fresh allocation per payload."""
    from sharedarrays.backends import get_backend
    from sharedarrays.backends.device import CPU, Device
    from sharedarrays.memory.allocation import Allocation
    from sharedarrays.protocol.payload import Payload
    from sharedarrays.transport import client

    steps: dict[str, list[float]] = {
        "decode": [],
        "fetch fds": [],
        "import+map+access": [],
        "release": [],
    }
    for blob in payloads:
        t0 = time.perf_counter()
        p = Payload.from_bytes(blob)
        device = CPU if p.backend == "host" else Device("cuda", p.device)
        backend = get_backend(device, p.backend)
        t1 = time.perf_counter()
        sizes, fds, _ = client.fetch_handles(p.server, p.pid, p.alloc_id, p.secret)
        t2 = time.perf_counter()
        alloc = Allocation.import_(backend, p.alloc_id, p.secret, sizes, fds, p.pid)
        t3 = time.perf_counter()
        alloc.release()
        t4 = time.perf_counter()
        for name, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            steps[name].append(dt)
    return {f"worker cold: {k}": statistics.median(v) * 1e6 for k, v in steps.items()}


def interleaved(
    pool: Any, fn: Callable[[Any], Any], arg: Any, n: int = 1001
) -> tuple[float, float, float]:
    """The floor and ``fn(arg)`` measured alternately: medians of floor, task, task - floor."""
    floors, tasks = [], []
    for _ in range(n):
        t = time.perf_counter()
        pool.apply(noop, (1,))
        t1 = time.perf_counter()
        pool.apply(fn, (arg,))
        t2 = time.perf_counter()
        floors.append(t1 - t)
        tasks.append(t2 - t1)
    diffs = [w - f for w, f in zip(tasks, floors)]
    return tuple(statistics.median(x) * 1e6 for x in (floors, tasks, diffs))  # type: ignore[return-value]


def load_steps(blob: bytes, payload: bytes, sync: bytes | None) -> dict[str, float]:
    """In the worker: time the parts of loading a payload of an array already mapped here."""
    from sharedarrays.api.array import SharedDeviceArray
    from sharedarrays.memory.allocation import lookup
    from sharedarrays.protocol.payload import Payload

    p = Payload.from_bytes(payload)
    alloc = lookup(p.alloc_id)
    assert alloc is not None, "map it first"
    out = {
        "worker: pickle.loads (whole load)": median_us(lambda: pickle.loads(blob)),
        "worker: Payload.from_bytes": median_us(lambda: Payload.from_bytes(payload)),
        "worker: new view (lease)": median_us(
            lambda: SharedDeviceArray(alloc, p.dtype, p.shape, p.strides, p.offset)
        ),
        "worker: view + .array": median_us(
            lambda: SharedDeviceArray(alloc, p.dtype, p.shape, p.strides, p.offset).array
        ),
    }
    if sync is not None:
        out["worker: import_sync"] = median_us(lambda: alloc.backend.import_sync(sync))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    a = sa.zeros(1 << 18, "float32", device=args.device)
    print(f"device {a.device}, backend {a.backend}")
    rows: dict[str, float] = {}
    rows["parent: pickle.dumps(a)"] = median_us(lambda: pickle.dumps(a))
    with sa.no_sync():
        rows["parent: pickle.dumps(a), no_sync"] = median_us(lambda: pickle.dumps(a))
    rows["parent: export_sync"] = median_us(lambda: a.allocation.backend.export_sync())
    in_thread: list[float] = []
    t = threading.Thread(target=lambda: in_thread.append(median_us(lambda: pickle.dumps(a))))
    t.start()
    t.join()
    rows["parent: pickle.dumps(a) from another thread"] = in_thread[0]
    rows["parent: pickle.loads in the exporter"] = median_us(lambda: pickle.loads(pickle.dumps(a)))
    with mp.get_context("spawn").Pool(1) as pool:
        pool.apply(touch, (a,))  # map it in the worker (then it stays parked)
        rows["pool: floor (empty task)"] = median_us(lambda: pool.apply(noop, (1,)), 201)
        rows["pool: warm handoff"] = median_us(lambda: pool.apply(touch, (a,)), 201)
        with sa.no_sync():
            rows["pool: warm handoff, no_sync"] = median_us(lambda: pool.apply(touch, (a,)), 201)
        f, w, d = interleaved(pool, touch, a)
        rows["pool (interleaved): floor"] = f
        rows["pool (interleaved): warm handoff"] = w
        rows["pool (interleaved): warm - floor, per pair"] = d
        # a ladder, each rung adding one thing (1,001 pairs each):
        same_size = bytes(len(pickle.dumps(a)))  # what the Pool moves, without sharedarrays
        ladder: list[tuple[str, Callable[[Any], Any], Any]] = [
            ("bytes of a pickled array's size (control)", noop, same_size),
            ("array received and kept (no .array, no teardown)", keep, a),
            ("array received, dropped after the task", noop, a),
            ("+ .array in the task", touch, a),
            ("+ close in the task (as the bench)", touch_close, a),
        ]
        for name, fn, arg in ladder:
            rows[f"pool (pairs): {name} - floor"] = interleaved(pool, fn, arg)[2]
        with sa.no_sync():
            rows["pool (pairs): as the bench, no_sync - floor"] = interleaved(pool, touch_close, a)[
                2
            ]
        c = sa.zeros(1 << 18, "float32", device="cpu", pack=False)
        pool.apply(touch, (c,))
        rows["pool (pairs): a host array as the bench, same pool - floor"] = interleaved(
            pool, touch_close, c
        )[2]
        smalls = [sa.full(512, float(i), "float64", device=args.device) for i in range(10_000)]
        t = time.perf_counter()
        small_blob = pickle.dumps(smalls)
        rows["10k x 4 KiB: pickle.dumps in the parent (total)"] = (time.perf_counter() - t) * 1e6
        secs, _ = pool.apply(loads_timed, (small_blob,))
        rows["10k x 4 KiB: pickle.loads + .array in the worker (first)"] = secs * 1e6
        secs, _ = pool.apply(loads_timed, (pickle.dumps(smalls),))
        rows["10k x 4 KiB: pickle.loads + .array in the worker (again)"] = secs * 1e6
        blob = pickle.dumps(a)
        rows["pool: send the payload bytes only"] = median_us(
            lambda: pool.apply(noop, (blob,)), 201
        )
        payload = a.payload().to_bytes()
        rows["pool: payload bytes, sa.load in the task (no sync)"] = median_us(
            lambda: pool.apply(load_in_task, (payload,)), 201
        )
        inside = [pool.apply(load_in_task, (a.payload().to_bytes(),)) for _ in range(201)]
        rows["worker: load + .array + drop, timed inside"] = statistics.median(inside) * 1e6
        rows.update(pool.apply(load_steps, (blob, payload, a.__reduce__()[1][2])))
        fresh = [sa.empty(1 << 18, "float32", device=args.device, pack=False) for _ in range(51)]
        rows.update(pool.apply(cold_steps, ([x.payload().to_bytes() for x in fresh],)))
        c = sa.zeros(1 << 18, "float32", device="cpu", pack=False)
        pool.apply(touch, (c,))
        rows["pool: warm handoff of a host array, same pool"] = median_us(
            lambda: pool.apply(touch, (c,)), 201
        )
    width = max(map(len, rows))
    for name, us in rows.items():
        print(f"{name:<{width}}  {us:9.1f} us")


if __name__ == "__main__":
    main()
