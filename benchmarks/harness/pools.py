"""What the parts of a run share: spawn pools, timed cases, medians, and :class:`RunBase`
(the results so far, the peers, one worker for every peer)."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import multiprocessing.reduction
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

from harness.config import ROUND_FAMILIES, TASK_TIMEOUT, Config
from harness.environment import environment
from harness.methods import (
    FLOOR_ARG,
    Method,
    Peers,
    drop_everywhere,
)
from harness.worker import (
    init_worker,
    task_floor,
)

__all__ = [
    "stats",
    "log",
    "time_case",
    "spawn_pool",
    "free_bytes",
    "family_of",
    "families_of",
    "RunBase",
    "MethodFailed",
]


def stats(samples_s: Sequence[float]) -> dict[str, Any]:
    """Median, p10 and p90 (milliseconds) and the samples themselves."""
    ms = [s * 1e3 for s in samples_s]
    ordered = sorted(ms)

    def pct(q: float) -> float:
        if len(ordered) == 1:
            return ordered[0]
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {
        "median_ms": statistics.median(ms),
        "p10_ms": pct(0.10),
        "p90_ms": pct(0.90),
        "repeats": len(ms),
        "samples_ms": ms,
    }


def log(msg: str) -> None:
    print(msg, flush=True)


def time_case(
    pool: Pool, method: Method, size: int, read: bool, cfg: Config, workers: int = 1
) -> dict[str, Any]:
    """Warm up, then time ``repeats`` handoffs of one method at one size."""
    samples: list[float] = []
    box: list[Any] = [] if method.cold else method.new(size)
    started = time.perf_counter()
    warmup = cfg.warmup
    i = 0
    try:
        while len(samples) < cfg.repeats:
            if method.cold:
                box = method.new(size)
            if workers == 1:
                t0 = time.perf_counter()
                pool.apply_async(method.task, (method.send(box), read)).get(TASK_TIMEOUT)
                dt = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                arg = method.send(box)
                pool.starmap_async(method.task, [(arg, read)] * workers, chunksize=1).get(
                    TASK_TIMEOUT
                )
                dt = time.perf_counter() - t0
            if method.cold:
                method.free(box)
                if method.after_cold is not None:
                    if workers == 1:
                        method.after_cold(pool)
                    else:
                        drop_everywhere(pool, workers)
            if i == 1 and dt > cfg.case_seconds / 5:
                warmup = min(warmup, 1)  # slow cases (the copy path) warm up once
            if i >= warmup:
                samples.append(dt)
                if time.perf_counter() - started > cfg.case_seconds and len(samples) >= 3:
                    break
            i += 1
    finally:
        if box:
            method.free(box)
    return stats(samples)


@contextlib.contextmanager
def spawn_pool(
    cfg: Config,
    workers: int = 1,
    memory_resource: Any = None,
    preload: str | None = None,
    sa_pool: bool = False,
) -> Iterator[Pool]:
    """A spawn Pool whose workers have started (CUDA and ``preload`` initialised): the
    standard library's, or ``sa.Pool`` where ``sa_pool``."""
    initargs = (cfg.device, memory_resource, preload)
    if sa_pool:
        import sharedarrays as sa

        pool: Pool = sa.Pool(workers, init_worker, initargs, context="spawn")
    else:
        pool = multiprocessing.get_context("spawn").Pool(workers, init_worker, initargs)
    try:
        pool.starmap_async(task_floor, [(FLOOR_ARG, False)] * workers, chunksize=1).get(
            TASK_TIMEOUT * 2
        )
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


def free_bytes(cfg: Config) -> int | None:
    """Free device memory (CUDA) or available host memory, in bytes; None if unknown."""
    try:
        if cfg.is_cuda:
            import cupy

            with cupy.cuda.Device(cfg.index):
                return int(cupy.cuda.runtime.memGetInfo()[0])
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except Exception:
        return None
    return None


class RunBase:
    """A benchmark run's state: its options, the peers, the results so far (written to JSON
    after every step), and what the parts share."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.peers = Peers(cfg)
        self.data: dict[str, Any] = {
            "meta": environment(cfg.is_cuda, cfg.index),
            "config": asdict(cfg),
            "tasks": {
                "handoff": "receive the object and materialise the native array; no kernel",
                "read": "handoff plus a full sum of the array, synchronised",
            },
            "skipped": {},
            "notes": [],
            "pool_floor": {},
            "results": {},
        }

    # bookkeeping ------------------------------------------------------------------------
    def skip(self, what: str, why: str) -> None:
        self.data["skipped"][what] = why
        log(f"  skipped {what}: {why}")

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        log(f"  note: {text}")

    def save(self) -> None:
        if self.cfg.json_path:
            path = Path(self.cfg.json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(path)

    # one worker for every peer -------------------------------------------------------------
    def peers_missing(self, families: Sequence[str]) -> dict[str, str]:
        """Why each of the peers ``torch`` and ``cuda.core`` among ``families`` cannot run."""
        missing: dict[str, str] = {}
        for family in ("torch", "cuda.core"):
            if family in families:
                why = self.peers.why_not(family)
                if why is not None:
                    missing[family] = why
        return missing

    @contextlib.contextmanager
    def peer_pool(self, families: Sequence[str]) -> Iterator[Pool]:
        """One spawn worker for every method of a part (the issue's like-for-like rule): it
        has started CUDA and CuPy, torch wherever torch can run here (and torch's reductions
        are registered in this process), and holds cuda.core's memory resource where
        cuda.core is among ``families``."""
        preload = None
        if self.cfg.is_cuda and self.peers.why_not("torch") is None:
            preload = "torch"
        mr = None
        if "cuda.core" in families and self.peers.why_not("cuda.core") is None:
            mr = self.peers.memory_resource()[0]
        with spawn_pool(self.cfg, 1, mr, preload) as pool:
            yield pool

    def round_families(self) -> list[str]:
        """The families of the warm and cold rounds that ``--methods`` chose."""
        chosen = {family_of(m) for m in self.cfg.methods}
        return [f for f in ROUND_FAMILIES["cuda" if self.cfg.is_cuda else "cpu"] if f in chosen]


class MethodFailed(Exception):
    """A method failed mid-group; its pool may be unusable, so the rest get a fresh one."""


def family_of(method: str) -> str:
    return method if method in ("floor", "copy") else method.rsplit("-", 1)[0]


def families_of(group: str) -> tuple[str, ...]:
    return {"base": ("floor", "sharedarrays")}.get(group, (group,))
