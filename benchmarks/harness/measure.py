"""Running and measuring: spawn pools, timed cases, and the :class:`Run` that goes through
every group of methods and part, saving the results as it goes."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import multiprocessing.reduction
import pickle
import platform
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

from harness.config import COPY_MAX_BYTES, ROUND_FAMILIES, TASK_TIMEOUT, Config
from harness.environment import environment, utc_now
from harness.methods import (
    FLOOR_ARG,
    Method,
    Peers,
    bound_method,
    control_method,
    copy_method,
    cuda_core_methods,
    drop_everywhere,
    family_methods,
    floor_method,
    sa_methods,
    safe_cold_method,
    safe_method,
    shm_methods,
    torch_methods,
)
from harness.report import evaluate_targets
from harness.rounds import FLOOR, over_floor, run_rounds
from harness.sizes import size_label
from harness.worker import (
    init_worker,
    raise_fd_limit,
    task_bandwidth,
    task_cleanup,
    task_cold_bound,
    task_floor,
    task_many,
    task_many_torch,
    task_sharedarrays,
    task_steps,
)

__all__ = ["Run", "stats"]

SETTLE = (FLOOR_ARG, False)
"""The arguments of the floor task that ends every timed call of the interleaved rounds
(:meth:`Run._rounds`): the call ends when the worker is idle again."""

BOUND_REPEATS = 21
"""New arrays whose cold load's two fixed steps are timed alone (:meth:`Run.cold_bound`)."""


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


def _log(msg: str) -> None:
    print(msg, flush=True)


def _time_case(
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
def _pool(
    cfg: Config, workers: int = 1, memory_resource: Any = None, preload: str | None = None
) -> Iterator[Pool]:
    """A spawn Pool whose workers have started (CUDA and ``preload`` initialised)."""
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(
        workers, initializer=init_worker, initargs=(cfg.device, memory_resource, preload)
    )
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


ROUND_LIMITS: dict[str, tuple[int, str]] = {
    "cuda.core": (
        4 << 30,
        "cuda.core's worker crashed at the first 8 GiB buffer in runs 1 and 2 "
        "(docs/performance.md, cuda.core failure); measured up to 4G only",
    ),
}
"""Families the warm and cold rounds run only up to a size, and why."""


class _RoundFailed(Exception):
    """One method failed inside the rounds; its pool may be unusable."""

    def __init__(self, family: str, why: str) -> None:
        super().__init__(f"{family}: {why}")
        self.family = family
        self.why = why


def _free_bytes(cfg: Config) -> int | None:
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


class Run:
    """One benchmark run: results so far, written to JSON after every step."""

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
        _log(f"  skipped {what}: {why}")

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        _log(f"  note: {text}")

    def save(self) -> None:
        if self.cfg.json_path:
            path = Path(self.cfg.json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(path)

    # method x size ----------------------------------------------------------------------
    def run_methods(self, group: str, methods: list[Method], pool: Pool) -> None:
        """Time each method at each size and task kind in one pool (and the pool's floor)."""
        small = min(self.cfg.sizes)
        self.data["pool_floor"][group] = _time_case(pool, floor_method(), small, False, self.cfg)
        for m in methods:
            if m.name not in self.cfg.methods:
                continue
            out: dict[str, Any] = {"group": group}
            t_method = time.perf_counter()
            try:
                for task in self.cfg.tasks:
                    out[task] = {}
                    for size in self.cfg.sizes:
                        if m.max_size is not None and size > m.max_size:
                            continue
                        case = _time_case(pool, m, size, task == "read", self.cfg)
                        case["size"] = size
                        out[task][str(size)] = case
                        _log(
                            f"  {m.name:<18} {task:<8} {size_label(size):>5}  "
                            f"median {case['median_ms']:9.3f} ms  "
                            f"(p10 {case['p10_ms']:.3f}, p90 {case['p90_ms']:.3f}, "
                            f"n={case['repeats']})"
                        )
            except Exception as e:
                self.skip(m.name, f"failed: {type(e).__name__}: {e}")
                self.data.setdefault("errors", {})[m.name] = traceback.format_exc()
                if any(out.get(t) for t in self.cfg.tasks):
                    self.data["results"][m.name] = out  # keep what was measured
                raise _MethodFailed from e
            finally:
                self.peers.free_device_memory()
            self.data["results"][m.name] = out
            _log(f"  {m.name} done in {time.perf_counter() - t_method:.1f} s")
            self.save()
        if any(m.max_size is not None and max(self.cfg.sizes) > m.max_size for m in methods):
            names = [m.name for m in methods if m.max_size is not None]
            self.note(f"{', '.join(names)} measured up to {size_label(COPY_MAX_BYTES)} only")

    def group(
        self,
        name: str,
        make: Callable[[], list[Method]],
        memory_resource: Callable[[], Any] | None = None,
        cleanup: Callable[[], None] | None = None,
        preload: str | None = None,
    ) -> None:
        """Run a group of methods in a fresh one-worker pool; skip the group if it fails."""
        wanted = [m for m in self.cfg.methods if _family(m) in _families(name)]
        if not wanted:
            return
        _log(f"[{name}] {', '.join(wanted)}")
        try:
            methods = make()
        except Exception as e:
            for m in wanted:
                self.skip(m, f"not available: {type(e).__name__}: {e}")
            self.save()
            return
        try:
            mr = memory_resource() if memory_resource is not None else None
            attempt = 0
            while methods:
                # a failed method may leave its pool unusable: the rest get a fresh one
                label = name if attempt == 0 else f"{name}#{attempt}"
                try:
                    with _pool(self.cfg, 1, mr, preload) as pool:
                        self.run_methods(label, methods, pool)
                        pool.apply_async(task_cleanup, (None,)).get(TASK_TIMEOUT)
                    methods = []
                except _MethodFailed:
                    done = set(self.data["results"]) | set(self.data["skipped"])
                    methods = [m for m in methods if m.name not in done]
                    attempt += 1
        except Exception as e:
            for m in wanted:
                if m not in self.data["results"] and m not in self.data["skipped"]:
                    self.skip(m, f"failed: {type(e).__name__}: {e}")
        finally:
            if cleanup is not None:
                with contextlib.suppress(Exception):
                    cleanup()
            self.peers.free_device_memory()
            self.save()

    # bandwidth --------------------------------------------------------------------------
    def bandwidth(self) -> None:
        """Copy-kernel bandwidth in the worker: shared arrays against plain ones."""
        import sharedarrays as sa

        nbytes = self.cfg.bandwidth_bytes
        _log(f"[bandwidth] copyto of {size_label(nbytes)} in the worker")
        try:
            x = sa.empty(nbytes // 4, "float32", device=self.cfg.device)
            y = sa.empty(nbytes // 4, "float32", device=self.cfg.device)
            with _pool(self.cfg) as pool:
                got = pool.apply_async(task_bandwidth, (x, y, self.cfg.bandwidth_repeats)).get(
                    TASK_TIMEOUT * 2
                )
            x.close()
            y.close()
        except Exception as e:
            self.skip("bandwidth", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        finally:
            self.peers.free_device_memory()
        shared = statistics.median(got["shared_ms"])
        plain = statistics.median(got["plain_ms"])
        out = {
            "bytes": nbytes,
            "kernel": "cupy.copyto(y, x)" if self.cfg.is_cuda else "numpy.copyto(y, x)",
            "timer": "CUDA events" if self.cfg.is_cuda else "time.perf_counter",
            "shared_ms": got["shared_ms"],
            "plain_ms": got["plain_ms"],
            "shared_median_ms": shared,
            "plain_median_ms": plain,
            "shared_GBps": 2 * nbytes / (shared / 1e3) / 1e9,
            "plain_GBps": 2 * nbytes / (plain / 1e3) / 1e9,
            "ratio": plain / shared,
        }
        self.data["bandwidth"] = out
        _log(
            f"  shared {out['shared_GBps']:.1f} GB/s, plain {out['plain_GBps']:.1f} GB/s "
            f"(read+write), ratio {out['ratio']:.3f}"
        )
        self.save()

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
        with _pool(self.cfg, 1, mr, preload) as pool:
            yield pool

    def round_families(self) -> list[str]:
        """The families of the warm and cold rounds that ``--methods`` chose."""
        chosen = {_family(m) for m in self.cfg.methods}
        return [f for f in ROUND_FAMILIES["cuda" if self.cfg.is_cuda else "cpu"] if f in chosen]

    # warm and cold: interleaved rounds over the floor ------------------------------------------
    def overhead(self, kind: str) -> None:
        """The ``warm`` or ``cold`` part: each method's overhead over the floor, as the median
        of per-round differences over interleaved rounds, at each of its sizes."""
        cold = kind == "cold"
        sizes = self.cfg.cold_sizes if cold else self.cfg.warm_sizes
        families = self.round_families()
        part: dict[str, Any] = {"rounds": self.cfg.rounds, "families": families, "sizes": {}}
        self.data.setdefault("overhead", {})[kind] = part
        _log(
            f"[{kind}] over the floor, {self.cfg.rounds} interleaved rounds (balanced order) "
            f"of floor, {', '.join(families)}"
        )
        excluded = self.peers_missing(families)
        if not self.cfg.is_cuda:  # the host has no torch or cuda.core methods: say why
            for family in ("torch", "cuda.core"):
                excluded[family] = self.peers.why_not(family) or "no CUDA device"
        for family, why in excluded.items():
            self.skip(f"{kind} {family}", why)
        pending = list(sizes)
        while pending:
            try:
                with self.peer_pool([f for f in families if f not in excluded]) as pool:
                    while pending:
                        size = pending[0]
                        got = self.overhead_size(pool, kind, size, families, excluded)
                        part["sizes"][str(size)] = got
                        pending.pop(0)
                        self.save()
                    pool.apply_async(task_cleanup, (None,)).get(TASK_TIMEOUT)
            except _RoundFailed as e:
                # its pool may be unusable: the size again, without it, in a fresh pool
                excluded[e.family] = e.why
                self.skip(f"{kind} {e.family}", e.why)
                self.data.setdefault("errors", {})[f"{kind} {e.family}"] = traceback.format_exc()
            except Exception as e:
                why = f"failed: {type(e).__name__}: {e}"
                for size in pending:
                    part["sizes"][str(size)] = {"size": size, "failed": why}
                self.skip(f"{kind} {', '.join(size_label(s) for s in pending)}", why)
                self.data.setdefault("errors", {})[kind] = traceback.format_exc()
                pending = []
            finally:
                self.peers.free_device_memory()
        self.save()

    def overhead_size(
        self, pool: Pool, kind: str, size: int, families: Sequence[str], excluded: dict[str, str]
    ) -> dict[str, Any]:
        """The rounds of one size: floor and every method once per round, in a balanced order."""
        cold = kind == "cold"
        label = size_label(size)
        out: dict[str, Any] = {"size": size, "methods": {}, "not_measured": {}}
        entries: dict[str, Method] = {FLOOR: floor_method()}
        for family in [*families, *(f for f in excluded if f not in families)]:
            limit = ROUND_LIMITS.get(family)
            if family in excluded:
                out["not_measured"][family] = excluded[family]
            elif limit is not None and size > limit[0]:
                out["not_measured"][family] = limit[1]
            else:
                try:
                    warm, cold_method = family_methods(self.cfg, self.peers, family)
                except Exception as e:
                    out["not_measured"][family] = f"not available: {type(e).__name__}: {e}"
                    continue
                entries[family] = cold_method if cold else warm
        if cold and "sharedarrays" in entries:
            entries["safe"] = safe_cold_method(self.cfg)
        free = _free_bytes(self.cfg) if cold else None
        if free is not None and size * 1.1 > free:
            why = f"needs {label} at a time, {free / 2**30:.1f} GiB free"
            for family in list(entries)[1:]:
                out["not_measured"][family] = why
            self.note(f"cold {label} not run: {why}")
            return out
        boxes: dict[str, list[Any]] = {}
        per_slot = False
        try:
            for name in list(entries)[1:]:
                try:  # warm: the one object; cold: a probe (e.g. a size a backend refuses)
                    box = entries[name].new(size)
                    if cold:
                        entries[name].free(box)
                    else:
                        boxes[name] = box
                except Exception as e:
                    out["not_measured"][name] = f"could not make {label}: {type(e).__name__}: {e}"
                    del entries[name]
            if not cold and "sharedarrays" in boxes:
                dumps = multiprocessing.reduction.ForkingPickler.dumps
                nbytes = len(dumps(boxes["sharedarrays"][0]))
                entries["control"] = control_method(nbytes)
                boxes["control"] = entries["control"].new(size)
                out["control_bytes"] = nbytes
                entries["bound"] = bound_method(self.cfg, boxes["sharedarrays"][0])
                boxes["bound"] = entries["bound"].new(size)
                entries["safe"] = safe_method(self.cfg, boxes["sharedarrays"][0])
                boxes["safe"] = entries["safe"].new(size)
            for name, m in entries.items():
                if name not in boxes and not m.cold:
                    boxes[name] = m.new(size)
            if cold:
                # the round's new objects all at once where they fit, else each before its slot
                per_slot = free is not None and (len(entries) - 1) * size * 1.1 > free
                out["objects"] = "made before each slot" if per_slot else "made before the round"
            samples = self._rounds(pool, entries, boxes, size, per_slot)
        finally:
            for name, box in boxes.items():
                if box:
                    with contextlib.suppress(Exception):
                        entries[name].free(box)
        over = over_floor(samples)
        out["rounds"] = len(samples[FLOOR])
        out["order"] = list(entries)
        out["floor_median_ms"] = statistics.median(samples[FLOOR]) * 1e3
        out["methods"] = over
        for name, row in over.items():
            figure = f"{row['median_us'] / 1e3:+.3f} ms" if cold else f"{row['median_us']:+.1f} us"
            low, high = row["ci95_us"]
            _log(
                f"  {kind} {label:>4} {name:<13} over the floor {figure} "
                f"(95% interval {low:+.0f} to {high:+.0f}, "
                f"p10 {row['p10_us']:+.0f}, p90 {row['p90_us']:+.0f} us; "
                f"{row['method_median_ms']:.3f} ms; {row['rounds']} rounds)"
            )
        for name, why in out["not_measured"].items():
            _log(f"  {kind} {label:>4} {name:<13} not measured: {why}")
        if cold and "sharedarrays" in over:
            out["bound"] = self.cold_bound(pool, size)
        return out

    def cold_bound(self, pool: Pool, size: int) -> dict[str, Any]:
        """What bounds sharedarrays' cold handoff of ``size``: the handle request to the
        exporter and the mapping, each timed alone in the worker (:func:`task_cold_bound`),
        over ``BOUND_REPEATS`` new arrays; medians in ms."""
        import sharedarrays as sa
        from sharedarrays.api.message import allocation_bytes

        steps: dict[str, list[float]] = {"fetch": [], "map": []}
        try:
            for _ in range(BOUND_REPEATS):
                a = sa.empty(size // 4, "float32", device=self.cfg.device)
                try:
                    got = pool.apply_async(task_cold_bound, (allocation_bytes(a.allocation),)).get(
                        TASK_TIMEOUT
                    )
                finally:
                    a.close()
                for k, v in got.items():
                    steps[k].append(v)
        except Exception as e:
            return {"failed": f"{type(e).__name__}: {e}"}
        out: dict[str, Any] = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in steps.items()}
        out["repeats"] = BOUND_REPEATS
        out["bound_ms"] = out["fetch_ms"] + out["map_ms"]
        _log(
            f"  cold {size_label(size):>4} bound, alone in the worker: handle request "
            f"{out['fetch_ms']:.3f} ms + mapping {out['map_ms']:.3f} ms = "
            f"{out['bound_ms']:.3f} ms (median of {BOUND_REPEATS})"
        )
        return out

    def _rounds(
        self,
        pool: Pool,
        entries: dict[str, Method],
        boxes: dict[str, list[Any]],
        size: int,
        per_slot: bool,
    ) -> dict[str, list[float]]:
        """:func:`run_rounds` on the Pool: cold methods get a new object every round."""
        cold = [name for name, m in entries.items() if m.cold]

        def time_one(name: str) -> float:
            # The entry's task, then a settling floor task (``SETTLE``), timed together: a
            # task's work left behind in the worker after its result (torch unmaps a
            # tensor's memory when its task returns) delays the settling task, and so is
            # charged to the entry that left it, not to whichever entry comes next.
            m = entries[name]
            try:
                if per_slot and m.cold:
                    boxes[name] = m.new(size)
                t0 = time.perf_counter()
                pool.apply_async(m.task, (m.send(boxes[name]), False)).get(TASK_TIMEOUT)
                pool.apply_async(task_floor, SETTLE).get(TASK_TIMEOUT)
                dt = time.perf_counter() - t0
                if per_slot and m.cold:
                    m.free(boxes.pop(name))
                return dt
            except Exception as e:
                if name == FLOOR:
                    raise
                raise _RoundFailed(name, f"failed: {type(e).__name__}: {e}") from e

        def before_round(index: int) -> None:
            if not per_slot:
                for name in cold:
                    try:
                        boxes[name] = entries[name].new(size)
                    except Exception as e:
                        raise _RoundFailed(name, f"failed: {type(e).__name__}: {e}") from e

        def after_round(index: int) -> None:
            drops: list[Callable[[Pool], None]] = []
            for name in cold:
                box = boxes.pop(name, None)
                if box:
                    entries[name].free(box)
                drop = entries[name].after_cold
                if drop is not None:
                    drops.append(drop)
            if drops:  # once: every cold import of the round is dropped in the worker
                drops[0](pool)

        def lead_in() -> None:
            # an untimed floor task (its time dropped): every round's first entry follows
            # it, not the last entry of the round before (whose traces in the caches it
            # would meet in one round of n more than any other entry)
            time_one(FLOOR)

        return run_rounds(
            list(entries),
            self.cfg.rounds,
            time_one,
            warmup=self.cfg.warmup,
            before_round=before_round if cold else None,
            after_round=after_round if cold else None,
            lead_in=lead_in,
            max_seconds=self.cfg.round_seconds,
        )

    # many small arrays ------------------------------------------------------------------
    def many(self) -> None:
        """``many_count`` arrays of ``many_bytes`` handed off in one task (a list), for
        sharedarrays and (on CUDA, where it runs) torch, alternated in one worker."""
        import sharedarrays as sa

        count, nbytes = self.cfg.many_count, self.cfg.many_bytes
        chosen = {_family(m) for m in self.cfg.methods}
        families = ["sharedarrays", *(["torch"] if "torch" in chosen else [])]
        missing = self.peers_missing(families)
        if not self.cfg.is_cuda:  # the host has no torch methods: say why, once
            missing["torch"] = self.peers.why_not("torch") or "no CUDA device"
        for family, why in missing.items():
            self.skip(f"many {family}", why)
        _log(f"[many] {count} arrays of {size_label(nbytes)} in one task")
        packed = True
        lists: dict[str, list[Any]] = {}
        tasks: dict[str, Callable[[list[Any]], int]] = {}
        try:
            t = time.perf_counter()
            try:
                empty: Callable[..., Any] = sa.empty  # pack= is new: not in every version
                arrays = [
                    empty(nbytes // 4, "float32", device=self.cfg.device, pack=True)
                    for _ in range(count)
                ]
            except TypeError:
                packed = False
                if self.cfg.is_cuda:
                    count = min(count, 1000)
                self.note(
                    f"sa.empty(pack=True) is not accepted yet: {count} arrays, one allocation each"
                )
                arrays = [
                    sa.empty(nbytes // 4, "float32", device=self.cfg.device) for _ in range(count)
                ]
            lists["sharedarrays"], tasks["sharedarrays"] = arrays, task_many
            create_s = time.perf_counter() - t
            sizes: dict[str, int] = {}
            for a in arrays:
                sizes[a.allocation.id] = a.allocation.size
            memory = sum(sizes.values())
            payload = count * nbytes
            pickled = len(pickle.dumps(arrays))
            if "torch" in families and "torch" not in missing:
                torch = self.peers.torch()
                lists["torch"] = [
                    torch.empty(nbytes // 4, dtype=torch.float32, device=self.cfg.device)
                    for _ in range(count)
                ]
                tasks["torch"] = task_many_torch
            first: dict[str, float] = {}

            def time_one(name: str) -> float:
                t0 = time.perf_counter()
                got = pool.apply_async(tasks[name], (lists[name],)).get(TASK_TIMEOUT * 2)
                dt = time.perf_counter() - t0
                if got != count:
                    raise RuntimeError(f"the worker saw {got} {name} arrays, not {count}")
                return dt

            with self.peer_pool(list(lists)) as pool:
                for name in lists:  # the first handoff (a cold import), apart
                    first[name] = time_one(name)
                samples = run_rounds(
                    list(lists), self.cfg.repeats, time_one, max_seconds=self.cfg.case_seconds
                )
                pool.apply_async(task_cleanup, (None,)).get(TASK_TIMEOUT)
        except Exception as e:
            self.skip("many", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        finally:
            for a in lists.get("sharedarrays", []):
                a.close()
            lists.clear()
            self.peers.free_device_memory()
        methods: dict[str, Any] = {}
        for name, values in samples.items():
            warm = stats(values)
            methods[name] = {
                "first_ms": first[name] * 1e3,
                "first_arrays_per_s": count / first[name],
                "warm": warm,
                "arrays_per_s": count / (warm["median_ms"] / 1e3),
            }
        out = {
            "count": count,
            "bytes_each": nbytes,
            "packed": packed,
            "allocations": len(sizes),
            "memory_bytes": memory,
            "payload_bytes": payload,
            "memory_ratio": memory / payload,
            "pickle_bytes": pickled,
            "create_s": create_s,
            **methods["sharedarrays"],
            "order": "alternated in one worker, balanced, one handoff of each per round",
            "methods": methods,
            "not_measured": missing,
        }
        if "torch" in methods:
            out["ratio_vs_torch"] = (
                methods["sharedarrays"]["arrays_per_s"] / (methods["torch"]["arrays_per_s"])
            )
        self.data["many"] = out
        _log(
            f"  sharedarrays: {len(sizes)} allocations, {memory / 2**20:.1f} MiB for "
            f"{payload / 2**20:.1f} MiB of payload (x{out['memory_ratio']:.2f})"
        )
        for name, row in methods.items():
            _log(
                f"  {name:<13} first handoff {row['first_ms']:.1f} ms "
                f"({row['first_arrays_per_s']:,.0f}/s), then median "
                f"{row['warm']['median_ms']:.1f} ms ({row['arrays_per_s']:,.0f} arrays/s)"
            )
        if "ratio_vs_torch" in out:
            _log(f"  sharedarrays / torch, same run: {out['ratio_vs_torch']:.2f}x")
        self.save()

    # steps ------------------------------------------------------------------------------
    def steps(self) -> None:
        """Time the pieces of a warm sharedarrays handoff: pickling here, loading there."""
        import sharedarrays as sa

        _log("[steps] where a warm sharedarrays handoff spends its time")
        repeats = 200
        try:
            a = sa.empty(1 << 18, "float32", device=self.cfg.device)
            dumps = multiprocessing.reduction.ForkingPickler.dumps
            parent: dict[str, list[float]] = {"pickle_floor_arg": [], "pickle_array": []}
            for _ in range(repeats):
                t0 = time.perf_counter()
                dumps((task_floor, (FLOOR_ARG, False)))
                t1 = time.perf_counter()
                dumps((task_sharedarrays, (a, False)))
                parent["pickle_floor_arg"].append(t1 - t0)
                parent["pickle_array"].append(time.perf_counter() - t1)
            part, view = a.__reduce__()[1]  # the allocation's part, the view's fields
            blob, sync = part.blob, getattr(part.fence, "token", None)
            with _pool(self.cfg) as pool:
                pool.apply_async(task_sharedarrays, (a, False)).get(TASK_TIMEOUT)
                worker = pool.apply_async(task_steps, (blob, view, sync, repeats)).get(TASK_TIMEOUT)
            a.close()
        except Exception as e:
            self.skip("steps", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        sides: dict[str, dict[str, float]] = {
            "parent_us": {k: statistics.median(v) * 1e6 for k, v in parent.items()},
            "worker_us": worker,
        }
        self.data["steps"] = {**sides, "payload_bytes": len(blob)}
        for side, values in sides.items():
            text = ", ".join(f"{k} {v:.1f}" for k, v in values.items())
            _log(f"  {side[:-3]} (median us): {text}")
        self.save()

    # fan-out ----------------------------------------------------------------------------
    def scaling(self) -> None:
        """One array handed to 1, 4, 16 workers at once: floor, warm and cold."""
        sizes = sorted({min(self.cfg.sizes), max(self.cfg.sizes)})
        out: dict[str, Any] = {}
        self.data["scaling"] = out
        methods = [floor_method(), *sa_methods(self.cfg)]
        for w in self.cfg.workers:
            _log(f"[scaling] {w} worker{'s' if w != 1 else ''}")
            row: dict[str, Any] = {}
            out[str(w)] = row
            try:
                with _pool(self.cfg, w) as pool:
                    for m in methods:
                        row[m.name] = {}
                        for size in sizes:
                            case = _time_case(pool, m, size, False, self.cfg, workers=w)
                            case["size"] = size
                            case["per_task_ms"] = case["median_ms"] / w
                            row[m.name][str(size)] = case
                            _log(
                                f"  {m.name:<18} {size_label(size):>5}  median "
                                f"{case['median_ms']:8.3f} ms for {w} tasks "
                                f"({case['per_task_ms']:.3f} ms per task)"
                            )
            except Exception as e:
                self.skip(f"scaling-{w}", f"failed: {type(e).__name__}: {e}")
            finally:
                self.peers.free_device_memory()
            self.save()

    # everything -------------------------------------------------------------------------
    def table_groups(self) -> None:
        """The method x size table's groups but the copy path (which runs last)."""
        cfg = self.cfg
        self.group("base", lambda: [floor_method(), *sa_methods(cfg)])
        if not cfg.is_cuda:
            self.group("shm", shm_methods)
            return
        self.group("sa.ipc", lambda: sa_methods(cfg, "cuda-ipc", "sa.ipc"))
        self.group("sa.pool", lambda: sa_methods(cfg, "cuda-pool", "sa.pool"))
        self.group("torch", lambda: torch_methods(self.peers), preload="torch")
        self.group(
            "cuda.core",
            lambda: cuda_core_methods(self.peers),
            memory_resource=lambda: self.peers.memory_resource()[0],
            cleanup=self.peers.close_memory_resource,
        )

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        raise_fd_limit()
        # cuda.core warns when the *default* start method is fork; every pool here is spawn
        warnings.filterwarnings("ignore", message="multiprocessing start method is 'fork'")
        where = self.data["meta"].get("gpu", {}).get("name", platform.machine())
        _log(
            f"sharedarrays bench on {cfg.device} ({where}): "
            f"sizes {', '.join(size_label(s) for s in cfg.sizes)}, {cfg.repeats} repeats after "
            f"{cfg.warmup} warm-up, tasks {', '.join(cfg.tasks)}"
        )
        table = "table" not in cfg.skip
        if table:
            self.table_groups()
        for kind in ("warm", "cold"):
            if kind not in cfg.skip:
                self.overhead(kind)
        if "many" not in cfg.skip:
            self.many()
        if "bandwidth" not in cfg.skip:
            self.bandwidth()
        if "steps" not in cfg.skip:
            self.steps()
        if "scaling" not in cfg.skip:
            self.scaling()
        if table:
            self.group("copy", lambda: [copy_method(cfg, self.peers)])
        self.data["targets"] = evaluate_targets(self.data)
        self.data["meta"]["finished_utc"] = utc_now()
        self.save()
        return self.data


class _MethodFailed(Exception):
    """A method failed mid-group; its pool may be unusable, so the rest get a fresh one."""


def _family(method: str) -> str:
    return method if method in ("floor", "copy") else method.rsplit("-", 1)[0]


def _families(group: str) -> tuple[str, ...]:
    return {"base": ("floor", "sharedarrays")}.get(group, (group,))
