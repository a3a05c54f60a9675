"""The ``dask`` part of the bench: a same-node Dask transfer of a shared array against Dask's
default path for a native array (NumPy on the host, CuPy on a GPU), in one run.

One sample: ``client.scatter`` the array to the one worker of a ``distributed.LocalCluster``
(worker processes, TCP, on this node), then a task there touches one element and returns it,
and the client waits for that small result. A shared array travels as its payload (a few
hundred bytes, :mod:`sharedarrays.api.dask`); a native array travels as its data (Dask's
own serializers: its bytes through the TCP comm, and for CuPy a copy to the host and back).
The array is made before the sample and its scattered key released after it; the ratio is
Dask's median over sharedarrays'.

A size is skipped (with the reason) when the native path would not fit: it holds the array,
its frames and the worker's copy at once, so a size needs :data:`MEMORY_FACTOR` times its
bytes of free memory (host memory, and GPU memory on a GPU). The whole part is skipped with
the reason where distributed is not installed.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from harness.config import Config
from harness.sizes import size_label

__all__ = ["MEMORY_FACTOR", "METHODS", "measure", "format_dask", "touch"]

METHODS = ("sharedarrays", "dask")
"""``sharedarrays``: a shared array (its payload travels); ``dask``: a native array."""

MEMORY_FACTOR = 4
"""Free bytes a size needs, in multiples of the size: the native array in the client, its
frames, the worker's copy, and the shared array (host memory; GPU memory on a GPU)."""


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def touch(v: Any) -> float:
    """The task: one element of what the worker received (a shared array's native view,
    a NumPy or a CuPy array), as a float (on a GPU that waits for the copy)."""
    native = getattr(v, "array", v)
    return float(native.reshape(-1)[-1])


def _free_bytes(cfg: Config) -> int:
    """Free memory for one size: host memory, and the smaller with GPU memory on a GPU."""
    free = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if cfg.is_cuda:
        import cupy

        with cupy.cuda.Device(cfg.index):
            gpu_free, _ = cupy.cuda.runtime.memGetInfo()
        free = min(free, int(gpu_free)) if free else int(gpu_free)
    return free


def _arrays(cfg: Config, size: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """Makers of the two arrays of ``size`` bytes (float64 ones; the native one a NumPy or
    a CuPy array, the shared one on the run's device)."""
    import sharedarrays as sa

    n = max(size // 8, 1)

    def native() -> Any:
        if cfg.is_cuda:
            import cupy

            with cupy.cuda.Device(cfg.index):
                return cupy.ones(n)
        return np.ones(n)

    def shared() -> Any:
        # pack=False: a small array packed into a slab would share the slab's lifetime
        a = sa.ones(n, device=cfg.device, pack=False, progress=False)
        a.synchronize()
        return a

    return shared, native


def _sample(client: Any, worker: str, value: Any) -> float:
    """Seconds for one scatter plus a touching task's result."""
    t0 = time.perf_counter()
    fut = client.scatter(value, workers=[worker], hash=False)
    got = client.submit(touch, fut, workers=[worker], pure=False).result()
    elapsed = time.perf_counter() - t0
    if got != 1.0:
        raise RuntimeError(f"the worker read {got!r} instead of 1.0")
    client.cancel([fut])
    del fut
    return elapsed


def _case(client: Any, worker: str, make: Callable[[], Any], cfg: Config) -> dict[str, Any]:
    """Warm-up samples, then timed ones (at least 3, and ``cfg.repeats`` unless they take
    longer than ``cfg.case_seconds``)."""
    value = make()
    try:
        for _ in range(min(cfg.warmup, 1) if cfg.quick else cfg.warmup):
            _sample(client, worker, value)
        samples: list[float] = []
        spent = 0.0
        while len(samples) < cfg.repeats and (len(samples) < 3 or spent < cfg.case_seconds):
            samples.append(_sample(client, worker, value))
            spent += samples[-1]
    finally:
        close = getattr(value, "close", None)
        if close is not None:
            close()
    ms = sorted(s * 1e3 for s in samples)
    return {
        "median_ms": statistics.median(ms),
        "p10_ms": ms[len(ms) // 10],
        "p90_ms": ms[min(len(ms) - 1, (9 * len(ms)) // 10)],
        "repeats": len(ms),
        "samples_ms": ms,
    }


def measure(cfg: Config) -> dict[str, Any]:
    """Run the ``dask`` part on ``cfg.device`` with ``cfg.dask_sizes``.

    Returns
    -------
    dict
        ``{"transfer": what one sample does, "sizes": [...], "results": {method: {size:
        case}}, "ratios": {size: dask / sharedarrays}, "skipped": {what: why}}``; with only
        ``skipped["dask"]`` when distributed is missing or the cluster fails.
    """
    part: dict[str, Any] = {
        "transfer": "client.scatter to one worker process on this node (TCP), then a task "
        "that touches one element; native: " + ("CuPy" if cfg.is_cuda else "NumPy"),
        "sizes": list(cfg.dask_sizes),
        "results": {m: {} for m in METHODS},
        "ratios": {},
        "skipped": {},
    }
    try:
        import distributed

        import sharedarrays.api.dask as sadask
    except ImportError as e:
        part["skipped"]["dask"] = f"pip install 'sharedarrays[dask]' ({e})"
        return part
    sadask.register()
    _log(f"dask part on {cfg.device}: {', '.join(size_label(s) for s in cfg.dask_sizes)}")
    try:
        with (
            distributed.LocalCluster(
                n_workers=1,
                processes=True,
                threads_per_worker=1,
                dashboard_address=None,
                worker_dashboard_address=None,
                memory_limit=0,  # no spilling or pausing: the bench holds large arrays
            ) as cluster,
            distributed.Client(cluster) as client,
        ):
            (worker,) = client.scheduler_info()["workers"]
            for size in cfg.dask_sizes:
                label = size_label(size)
                free = _free_bytes(cfg)
                if free and MEMORY_FACTOR * size > free:
                    part["skipped"][label] = (
                        f"needs {MEMORY_FACTOR} x {label} of free memory; "
                        f"{free / 2**30:.1f} GiB free"
                    )
                    _log(f"  skipped {label}: {part['skipped'][label]}")
                    continue
                shared, native = _arrays(cfg, size)
                for method, make in zip(METHODS, (shared, native)):
                    case = _case(client, worker, make, cfg)
                    part["results"][method][str(size)] = case
                    _log(f"  {method:>12} {label:>6}: {case['median_ms']:.3f} ms")
                sa_ms = part["results"]["sharedarrays"][str(size)]["median_ms"]
                dask_ms = part["results"]["dask"][str(size)]["median_ms"]
                part["ratios"][str(size)] = dask_ms / sa_ms
    except Exception as e:  # a failed cluster must not lose the rest of the bench
        part["skipped"]["dask"] = f"failed: {type(e).__name__}: {e}"
        _log(f"  skipped dask: {part['skipped']['dask']}")
    return part


def format_dask(part: dict[str, Any]) -> str:
    """The ``dask`` part as a text table: median ms per method and size, and the ratio."""
    lines = [f"dask: {part['transfer']}: median ms (p10-p90)"]
    lines.append(f"{'size':>8} {'sharedarrays':>24} {'dask':>26} {'dask / sa':>10}")
    for size in part["sizes"]:
        key = str(size)
        cells = []
        for method in METHODS:
            case = part["results"][method].get(key)
            cells.append(
                f"{case['median_ms']:.3f} ({case['p10_ms']:.2f}-{case['p90_ms']:.2f})"
                if case
                else "-"
            )
        ratio = part["ratios"].get(key)
        lines.append(
            f"{size_label(size):>8} {cells[0]:>24} {cells[1]:>26} "
            f"{(f'{ratio:.1f}x' if ratio else '-'):>10}"
        )
    lines.extend(f"skipped {what}: {why}" for what, why in part["skipped"].items())
    return "\n".join(lines)
