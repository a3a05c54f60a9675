"""The :class:`Run` that goes through every group of methods and part, saving the results as
it goes: the method x size table here, the warm and cold rounds in :mod:`harness.overhead`,
the other parts in :mod:`harness.parts`, what they share in :mod:`harness.pools`."""

from __future__ import annotations

import contextlib
import platform
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.pool import Pool
from typing import Any

from harness.config import COPY_MAX_BYTES, TASK_TIMEOUT
from harness.environment import utc_now
from harness.methods import (
    Method,
    copy_method,
    cuda_core_methods,
    floor_method,
    sa_methods,
    shm_methods,
    torch_methods,
)
from harness.overhead import Overhead
from harness.parts import Parts
from harness.pools import (
    MethodFailed,
    families_of,
    family_of,
    log,
    spawn_pool,
    stats,
    time_case,
)
from harness.report import evaluate_targets
from harness.sizes import size_label
from harness.worker import (
    raise_fd_limit,
    task_cleanup,
)

__all__ = ["Run", "stats"]


class Run(Overhead, Parts):
    """One benchmark run: results so far, written to JSON after every step."""

    # method x size ----------------------------------------------------------------------
    def run_methods(self, group: str, methods: list[Method], pool: Pool) -> None:
        """Time each method at each size and task kind in one pool (and the pool's floor)."""
        small = min(self.cfg.sizes)
        self.data["pool_floor"][group] = time_case(pool, floor_method(), small, False, self.cfg)
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
                        case = time_case(pool, m, size, task == "read", self.cfg)
                        case["size"] = size
                        out[task][str(size)] = case
                        log(
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
                raise MethodFailed from e
            finally:
                self.peers.free_device_memory()
            self.data["results"][m.name] = out
            log(f"  {m.name} done in {time.perf_counter() - t_method:.1f} s")
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
        wanted = [m for m in self.cfg.methods if family_of(m) in families_of(name)]
        if not wanted:
            return
        log(f"[{name}] {', '.join(wanted)}")
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
                    with spawn_pool(self.cfg, 1, mr, preload) as pool:
                        self.run_methods(label, methods, pool)
                        pool.apply_async(task_cleanup, (None,)).get(TASK_TIMEOUT)
                    methods = []
                except MethodFailed:
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
        log(
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
        if "results" not in cfg.skip:
            self.results()
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
