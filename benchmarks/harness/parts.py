"""The ``many``, ``bandwidth``, ``steps`` and ``scaling`` parts of a run."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import multiprocessing.reduction
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

from harness.config import RESULTS_SIZES, RESULTS_TASKS, RESULTS_WORKERS, TASK_TIMEOUT
from harness.methods import (
    FLOOR_ARG,
    floor_method,
    sa_methods,
)
from harness.pools import (
    RunBase,
    family_of,
    log,
    spawn_pool,
    stats,
    time_case,
)
from harness.rounds import run_rounds
from harness.sizes import size_label
from harness.worker import (
    task_bandwidth,
    task_cleanup,
    task_floor,
    task_many,
    task_many_torch,
    task_result,
    task_result_torch,
    task_sharedarrays,
    task_steps,
)

__all__ = ["Parts"]


class Parts(RunBase):
    """The many, bandwidth, steps and scaling parts of a :class:`~harness.measure.Run`."""

    # bandwidth --------------------------------------------------------------------------
    def bandwidth(self) -> None:
        """Copy-kernel bandwidth in the worker: shared arrays against plain ones."""
        import sharedarrays as sa

        nbytes = self.cfg.bandwidth_bytes
        log(f"[bandwidth] copyto of {size_label(nbytes)} in the worker")
        try:
            x = sa.empty(nbytes // 4, "float32", device=self.cfg.device)
            y = sa.empty(nbytes // 4, "float32", device=self.cfg.device)
            with spawn_pool(self.cfg) as pool:
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
        log(
            f"  shared {out['shared_GBps']:.1f} GB/s, plain {out['plain_GBps']:.1f} GB/s "
            f"(read+write), ratio {out['ratio']:.3f}"
        )
        self.save()

    # many small arrays ------------------------------------------------------------------
    def many(self) -> None:
        """``many_count`` arrays of ``many_bytes`` handed off in one task (a list), for
        sharedarrays and (on CUDA, where it runs) torch, alternated in one worker."""
        count, nbytes = self.cfg.many_count, self.cfg.many_bytes
        chosen = {family_of(m) for m in self.cfg.methods}
        families = ["sharedarrays", *(["torch"] if "torch" in chosen else [])]
        missing = self.peers_missing(families)
        if not self.cfg.is_cuda:  # the host has no torch methods: say why, once
            missing["torch"] = self.peers.why_not("torch") or "no CUDA device"
        for family, why in missing.items():
            self.skip(f"many {family}", why)
        log(f"[many] {count} arrays of {size_label(nbytes)} in one task")
        lists: dict[str, list[Any]] = {}
        tasks: dict[str, Callable[[list[Any]], int]] = {}
        try:
            t = time.perf_counter()
            arrays, packed = self.many_arrays(count, nbytes)
            count = len(arrays)
            lists["sharedarrays"], tasks["sharedarrays"] = arrays, task_many
            create_s = time.perf_counter() - t
            sizes: dict[str, int] = {}
            for a in arrays:
                sizes[a.allocation.id] = a.allocation.size
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
        out = _many_result(count, nbytes, packed, sizes, pickled, create_s, first, samples)
        out["not_measured"] = missing
        self.data["many"] = out
        _log_many(out)
        self.save()

    # results: new arrays returned by workers ----------------------------------------------
    def results(self) -> None:
        """:data:`RESULTS_WORKERS` spawn workers return :data:`RESULTS_TASKS` new arrays of
        each size per round, which the parent reads (a sum where the memory is) and lets go:
        sharedarrays through ``sa.Pool`` and through the standard Pool, and
        torch.multiprocessing (CUDA) through the standard Pool, alternated in balanced rounds
        (both orders)."""
        families = ["sharedarrays", "sharedarrays, std Pool"]
        # (on the host, torch's CPU tensors: torch.multiprocessing shares them in shm files)
        why_not = self.peers.why_not("torch") if self.cfg.is_cuda else _no_torch()
        if why_not is None:
            families.append("torch")
        else:
            self.skip("results torch", why_not)
        tasks = {name: task_result for name in families} | {"torch": task_result_torch}
        n = RESULTS_TASKS
        out: dict[str, Any] = {"tasks": n, "workers": RESULTS_WORKERS, "sizes": {}}
        log(f"[results] {RESULTS_WORKERS} workers return {n} new arrays per round")
        preload = "torch" if "torch" in families else None
        try:
            with contextlib.ExitStack() as stack:
                # sharedarrays through sa.Pool; the standard Pool (torch.multiprocessing's)
                # for torch, and for sharedarrays in a second row
                std = stack.enter_context(spawn_pool(self.cfg, RESULTS_WORKERS, None, preload))
                pools = {name: std for name in families}
                pools["sharedarrays"] = stack.enter_context(
                    spawn_pool(self.cfg, RESULTS_WORKERS, None, preload, sa_pool=True)
                )
                for nbytes in RESULTS_SIZES["cuda" if self.cfg.is_cuda else "cpu"]:
                    expected = sum(range(n)) * (nbytes // 4)

                    def time_one(
                        name: str, nbytes: int = nbytes, expected: int = expected
                    ) -> float:
                        t0 = time.perf_counter()
                        total = 0.0
                        specs = [(nbytes, float(i)) for i in range(n)]
                        for got in pools[name].imap_unordered(tasks[name], specs):
                            total += float(got.sum()) if name == "torch" else _sum(got)
                            del got
                        dt = time.perf_counter() - t0
                        if total != expected:
                            raise RuntimeError(f"{name}: the results summed to {total}")
                        return dt

                    samples = run_rounds(
                        families,
                        self.cfg.repeats,
                        time_one,
                        warmup=self.cfg.warmup,
                        max_seconds=self.cfg.case_seconds,
                    )
                    row = {name: stats(values) for name, values in samples.items()}
                    if "torch" in row:
                        row["torch_over_sharedarrays"] = (
                            row["torch"]["median_ms"] / row["sharedarrays"]["median_ms"]
                        )
                    out["sizes"][str(nbytes)] = row
                    log(
                        f"  {size_label(nbytes):>5}: "
                        + ", ".join(
                            f"{k} {v['median_ms']:.2f} ms"
                            for k, v in row.items()
                            if k != "torch_over_sharedarrays"
                        )
                        + (
                            f" (torch / sharedarrays {row['torch_over_sharedarrays']:.2f}x)"
                            if "torch" in row
                            else ""
                        )
                    )
        except Exception as e:
            self.skip("results", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        finally:
            self.peers.free_device_memory()
        self.data["returned"] = out  # ("results" is the method x size table's)
        self.save()

    def many_arrays(self, count: int, nbytes: int) -> tuple[list[Any], bool]:
        """``count`` shared arrays of ``nbytes`` (packed, where this version packs), and
        whether they are packed."""
        import sharedarrays as sa

        try:
            empty: Callable[..., Any] = sa.empty  # pack= is new: not in every version
            arrays = [
                empty(nbytes // 4, "float32", device=self.cfg.device, pack=True)
                for _ in range(count)
            ]
            return arrays, True
        except TypeError:
            if self.cfg.is_cuda:
                count = min(count, 1000)
            self.note(
                f"sa.empty(pack=True) is not accepted yet: {count} arrays, one allocation each"
            )
            arrays = [
                sa.empty(nbytes // 4, "float32", device=self.cfg.device) for _ in range(count)
            ]
            return arrays, False

    # steps ------------------------------------------------------------------------------
    def steps(self) -> None:
        """Time the pieces of a warm sharedarrays handoff: pickling here, loading there."""
        import sharedarrays as sa

        log("[steps] where a warm sharedarrays handoff spends its time")
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
            with spawn_pool(self.cfg) as pool:
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
            log(f"  {side[:-3]} (median us): {text}")
        self.save()

    # fan-out ----------------------------------------------------------------------------
    def scaling(self) -> None:
        """One array handed to 1, 4, 16 workers at once: floor, warm and cold."""
        sizes = sorted({min(self.cfg.sizes), max(self.cfg.sizes)})
        out: dict[str, Any] = {}
        self.data["scaling"] = out
        methods = [floor_method(), *sa_methods(self.cfg)]
        for w in self.cfg.workers:
            log(f"[scaling] {w} worker{'s' if w != 1 else ''}")
            row: dict[str, Any] = {}
            out[str(w)] = row
            try:
                with spawn_pool(self.cfg, w) as pool:
                    for m in methods:
                        row[m.name] = {}
                        for size in sizes:
                            case = time_case(pool, m, size, False, self.cfg, workers=w)
                            case["size"] = size
                            case["per_task_ms"] = case["median_ms"] / w
                            row[m.name][str(size)] = case
                            log(
                                f"  {m.name:<18} {size_label(size):>5}  median "
                                f"{case['median_ms']:8.3f} ms for {w} tasks "
                                f"({case['per_task_ms']:.3f} ms per task)"
                            )
            except Exception as e:
                self.skip(f"scaling-{w}", f"failed: {type(e).__name__}: {e}")
            finally:
                self.peers.free_device_memory()
            self.save()


def _many_result(
    count: int,
    nbytes: int,
    packed: bool,
    sizes: dict[str, int],
    pickled: int,
    create_s: float,
    first: dict[str, float],
    samples: dict[str, list[float]],
) -> dict[str, Any]:
    """The ``many`` part's figures: each method's first and warm handoffs, the memory."""
    methods: dict[str, Any] = {}
    for name, values in samples.items():
        warm = stats(values)
        methods[name] = {
            "first_ms": first[name] * 1e3,
            "first_arrays_per_s": count / first[name],
            "warm": warm,
            "arrays_per_s": count / (warm["median_ms"] / 1e3),
        }
    memory, payload = sum(sizes.values()), count * nbytes
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
    }
    if "torch" in methods:
        out["ratio_vs_torch"] = (
            methods["sharedarrays"]["arrays_per_s"] / (methods["torch"]["arrays_per_s"])
        )
    return out


def _log_many(out: dict[str, Any]) -> None:
    log(
        f"  sharedarrays: {out['allocations']} allocations, {out['memory_bytes'] / 2**20:.1f} "
        f"MiB for {out['payload_bytes'] / 2**20:.1f} MiB of payload (x{out['memory_ratio']:.2f})"
    )
    for name, row in out["methods"].items():
        log(
            f"  {name:<13} first handoff {row['first_ms']:.1f} ms "
            f"({row['first_arrays_per_s']:,.0f}/s), then median "
            f"{row['warm']['median_ms']:.1f} ms ({row['arrays_per_s']:,.0f} arrays/s)"
        )
    if "ratio_vs_torch" in out:
        log(f"  sharedarrays / torch, same run: {out['ratio_vs_torch']:.2f}x")


def _sum(a: Any) -> float:
    """The sum of a shared array where its memory is (CuPy on a GPU, NumPy on the host)."""
    return float(a.array.sum())


def _no_torch() -> str | None:
    """Why torch (CPU) cannot be the results part's peer on the host, or None."""
    try:
        importlib.import_module("torch.multiprocessing")  # (registers its reductions)
    except ImportError as e:
        return f"torch is not installed: {e}"
    return None
