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

from sharedarrays.bench.config import COPY_MAX_BYTES, TASK_TIMEOUT, Config
from sharedarrays.bench.environment import environment, utc_now
from sharedarrays.bench.methods import (
    FLOOR_ARG,
    Method,
    Peers,
    copy_method,
    cuda_core_methods,
    drop_everywhere,
    floor_method,
    sa_methods,
    shm_methods,
    torch_methods,
)
from sharedarrays.bench.report import evaluate_targets
from sharedarrays.bench.sizes import size_label
from sharedarrays.bench.worker import (
    init_worker,
    raise_fd_limit,
    task_bandwidth,
    task_cleanup,
    task_floor,
    task_many,
    task_sharedarrays,
    task_steps,
)

__all__ = ["Run", "stats"]


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


def _interleaved(
    pool: Pool, args: tuple[Any, ...], pairs: int, task: Callable[..., Any] = task_sharedarrays
) -> float:
    """Median over ``pairs`` of (``task(*args)`` - an empty task), the two timed back to back
    in the same pool, so that the drift of the pool's round trip cancels (us)."""
    diffs = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        pool.apply_async(task_floor, (FLOOR_ARG, False)).get(TASK_TIMEOUT)
        t1 = time.perf_counter()
        pool.apply_async(task, args).get(TASK_TIMEOUT)
        diffs.append((time.perf_counter() - t1) - (t1 - t0))
    return statistics.median(diffs) * 1e6


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

    # many small arrays ------------------------------------------------------------------
    def many(self) -> None:
        """``many_count`` arrays of ``many_bytes`` handed off in one task (a list)."""
        import sharedarrays as sa

        count, nbytes = self.cfg.many_count, self.cfg.many_bytes
        _log(f"[many] {count} arrays of {size_label(nbytes)} in one task")
        packed = True
        arrays: list[Any] = []
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
            create_s = time.perf_counter() - t
            sizes: dict[str, int] = {}
            for a in arrays:
                sizes[a.allocation.id] = a.allocation.size
            memory = sum(sizes.values())
            payload = count * nbytes
            pickled = len(pickle.dumps(arrays))
            samples: list[float] = []
            first = 0.0
            with _pool(self.cfg) as pool:
                started = time.perf_counter()
                for i in range(self.cfg.repeats + 1):
                    t0 = time.perf_counter()
                    got = pool.apply_async(task_many, (arrays,)).get(TASK_TIMEOUT * 2)
                    dt = time.perf_counter() - t0
                    if got != count:
                        raise RuntimeError(f"the worker saw {got} arrays, not {count}")
                    if i == 0:
                        first = dt
                    else:
                        samples.append(dt)
                        if time.perf_counter() - started > self.cfg.case_seconds and i >= 3:
                            break
                pool.apply_async(task_cleanup, (None,)).get(TASK_TIMEOUT)
        except Exception as e:
            self.skip("many", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        finally:
            for a in arrays:
                a.close()
            arrays.clear()
            self.peers.free_device_memory()
        warm = stats(samples)
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
            "first_ms": first * 1e3,
            "first_arrays_per_s": count / first,
            "warm": warm,
            "arrays_per_s": count / (warm["median_ms"] / 1e3),
        }
        self.data["many"] = out
        _log(
            f"  {len(sizes)} allocations, {memory / 2**20:.1f} MiB for "
            f"{payload / 2**20:.1f} MiB of payload (x{out['memory_ratio']:.2f}); first handoff "
            f"{first * 1e3:.1f} ms ({out['first_arrays_per_s']:,.0f}/s), then median "
            f"{warm['median_ms']:.1f} ms ({out['arrays_per_s']:,.0f} arrays/s)"
        )
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
            blob, sync = a.__reduce__()[1]
            with _pool(self.cfg) as pool:
                pool.apply_async(task_sharedarrays, (a, False)).get(TASK_TIMEOUT)
                worker = pool.apply_async(task_steps, (blob, sync, repeats)).get(TASK_TIMEOUT)
                same_size = b"x" * len(multiprocessing.reduction.ForkingPickler.dumps(a))
                pairs = {
                    "warm_minus_floor_us": _interleaved(pool, (a, False), self.cfg.pairs),
                    "control_minus_floor_us": _interleaved(
                        pool, (same_size, False), self.cfg.pairs, task_floor
                    ),
                    "pairs": self.cfg.pairs,
                }
            a.close()
        except Exception as e:
            self.skip("steps", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        sides: dict[str, dict[str, float]] = {
            "parent_us": {k: statistics.median(v) * 1e6 for k, v in parent.items()},
            "worker_us": worker,
        }
        self.data["steps"] = {**sides, "payload_bytes": len(blob), "pairs": pairs}
        for side, values in sides.items():
            text = ", ".join(f"{k} {v:.1f}" for k, v in values.items())
            _log(f"  {side[:-3]} (median us): {text}")
        _log(
            f"  interleaved pairs ({pairs['pairs']}, 1 MiB): warm handoff - floor "
            f"{pairs['warm_minus_floor_us']:+.1f} us; control (bytes of the pickled array's "
            f"size, no array) - floor {pairs['control_minus_floor_us']:+.1f} us"
        )
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
        self.group("base", lambda: [floor_method(), *sa_methods(cfg)])
        if cfg.is_cuda:
            self.group("sa.ipc", lambda: sa_methods(cfg, "cuda-ipc", "sa.ipc"))
            self.group("sa.pool", lambda: sa_methods(cfg, "cuda-pool", "sa.pool"))
            self.group("torch", lambda: torch_methods(self.peers), preload="torch")
            self.group(
                "cuda.core",
                lambda: cuda_core_methods(self.peers),
                memory_resource=lambda: self.peers.memory_resource()[0],
                cleanup=self.peers.close_memory_resource,
            )
        else:
            self.group("shm", shm_methods)
        if "bandwidth" not in cfg.skip:
            self.bandwidth()
        if "many" not in cfg.skip:
            self.many()
        if "steps" not in cfg.skip:
            self.steps()
        if "scaling" not in cfg.skip:
            self.scaling()
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
