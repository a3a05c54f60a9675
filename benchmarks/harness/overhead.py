"""The ``warm`` and ``cold`` parts: each method's overhead over the floor, as the median of
per-round differences over interleaved rounds (:mod:`harness.rounds`), with the rounds'
``bound`` and ``safe`` entries (:mod:`harness.handoffs`) and the cold bound's two steps."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.reduction
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.pool import Pool
from typing import Any

from harness.config import TASK_TIMEOUT
from harness.methods import (
    FLOOR_ARG,
    Method,
    bound_method,
    control_method,
    family_methods,
    floor_method,
    safe_cold_method,
    safe_method,
)
from harness.pools import (
    RunBase,
    free_bytes,
    log,
)
from harness.rounds import FLOOR, over_floor, run_rounds
from harness.sizes import size_label
from harness.worker import (
    handoff_part,
    task_cleanup,
    task_cold_bound,
    task_floor,
)

__all__ = ["Overhead", "ROUND_LIMITS"]

SETTLE = (FLOOR_ARG, False)
"""The arguments of the floor task that ends every timed call of the interleaved rounds
(:meth:`Run._rounds`): the call ends when the worker is idle again."""

BOUND_REPEATS = 21
"""New arrays whose cold load's two fixed steps are timed alone (:meth:`Run.cold_bound`)."""


ROUND_LIMITS: dict[str, tuple[int, str]] = {
    "cuda.core": (
        4 << 30,
        "cuda.core's worker crashed at the first 8 GiB buffer in runs 1 and 2 "
        "(docs/performance.md, known limits of the peers); measured up to 4G only",
    ),
}
"""Families the warm and cold rounds run only up to a size, and why."""


class _RoundFailed(Exception):
    """One method failed inside the rounds; its pool may be unusable."""

    def __init__(self, family: str, why: str) -> None:
        super().__init__(f"{family}: {why}")
        self.family = family
        self.why = why


class Overhead(RunBase):
    """The warm and cold parts of a :class:`~harness.measure.Run`."""

    # warm and cold: interleaved rounds over the floor ------------------------------------------
    def overhead(self, kind: str) -> None:
        """The ``warm`` or ``cold`` part: each method's overhead over the floor, as the median
        of per-round differences over interleaved rounds, at each of its sizes."""
        cold = kind == "cold"
        sizes = self.cfg.cold_sizes if cold else self.cfg.warm_sizes
        families = self.round_families()
        # (a cold round's array is one the worker never saw: memory this process keeps for
        # reuse, which the worker may map already, is not used; the results part measures it)
        setting = os.environ.get("SHAREDARRAYS_CACHE_BYTES")
        if cold:
            os.environ["SHAREDARRAYS_CACHE_BYTES"] = "0"
        try:
            self._overhead(kind, sizes, families)
        finally:
            if cold and setting is None:
                del os.environ["SHAREDARRAYS_CACHE_BYTES"]
            elif cold:
                os.environ["SHAREDARRAYS_CACHE_BYTES"] = setting

    def _overhead(self, kind: str, sizes: list[int], families: list[str]) -> None:
        part: dict[str, Any] = {"rounds": self.cfg.rounds, "families": families, "sizes": {}}
        self.data.setdefault("overhead", {})[kind] = part
        log(
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

    def round_entries(
        self,
        cold: bool,
        size: int,
        families: Sequence[str],
        excluded: dict[str, str],
        not_measured: dict[str, str],
    ) -> dict[str, Method]:
        """The floor and each family's warm or cold method at ``size`` (and the cold rounds'
        ``safe`` entry); why each other family is not measured goes into ``not_measured``."""
        entries: dict[str, Method] = {FLOOR: floor_method()}
        for family in [*families, *(f for f in excluded if f not in families)]:
            limit = ROUND_LIMITS.get(family)
            if family in excluded:
                not_measured[family] = excluded[family]
            elif limit is not None and size > limit[0]:
                not_measured[family] = limit[1]
            else:
                try:
                    warm, cold_method = family_methods(self.cfg, self.peers, family)
                except Exception as e:
                    not_measured[family] = f"not available: {type(e).__name__}: {e}"
                    continue
                entries[family] = cold_method if cold else warm
        if cold and "sharedarrays" in entries:
            entries["safe"] = safe_cold_method(self.cfg)
        return entries

    def overhead_size(
        self, pool: Pool, kind: str, size: int, families: Sequence[str], excluded: dict[str, str]
    ) -> dict[str, Any]:
        """The rounds of one size: floor and every method once per round, in a balanced order."""
        cold = kind == "cold"
        label = size_label(size)
        out: dict[str, Any] = {"size": size, "methods": {}, "not_measured": {}}
        entries = self.round_entries(cold, size, families, excluded, out["not_measured"])
        free = free_bytes(self.cfg) if cold else None
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
        _log_size(kind, label, over, out["not_measured"])
        if cold and "sharedarrays" in over:
            out["bound"] = self.cold_bound(pool, size)
        return out

    def cold_bound(self, pool: Pool, size: int) -> dict[str, Any]:
        """What bounds sharedarrays' cold handoff of ``size``: the handle request to the
        exporter and the mapping, each timed alone in the worker (:func:`task_cold_bound`),
        over ``BOUND_REPEATS`` new arrays; medians in ms."""
        import sharedarrays as sa

        allocation_bytes = handoff_part("allocation_bytes")

        steps: dict[str, list[float]] = {
            "fetch": [],
            "map": [],
            "driver": [],
            "driver_teardown": [],
        }
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
        out: dict[str, Any] = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in steps.items() if v}
        out["repeats"] = BOUND_REPEATS
        out["bound_ms"] = out["fetch_ms"] + out["map_ms"]
        driver = (
            f"; the driver's own import + map + access of the same chunks {out['driver_ms']:.3f} "
            f"ms, and {out['driver_teardown_ms']:.3f} ms to undo them"
            if "driver_ms" in out
            else ""
        )
        log(
            f"  cold {size_label(size):>4} bound, alone in the worker: handle request "
            f"{out['fetch_ms']:.3f} ms + mapping {out['map_ms']:.3f} ms = "
            f"{out['bound_ms']:.3f} ms (median of {BOUND_REPEATS}){driver}"
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


def _log_size(
    kind: str, label: str, over: dict[str, dict[str, Any]], not_measured: dict[str, str]
) -> None:
    """Print one size's figures over the floor, and why each other entry was not measured."""
    cold = kind == "cold"
    for name, row in over.items():
        figure = f"{row['median_us'] / 1e3:+.3f} ms" if cold else f"{row['median_us']:+.1f} us"
        low, high = row["ci95_us"]
        log(
            f"  {kind} {label:>4} {name:<13} over the floor {figure} "
            f"(95% interval {low:+.0f} to {high:+.0f}, "
            f"p10 {row['p10_us']:+.0f}, p90 {row['p90_us']:+.0f} us; "
            f"{row['method_median_ms']:.3f} ms; {row['rounds']} rounds)"
        )
    for name, why in not_measured.items():
        log(f"  {kind} {label:>4} {name:<13} not measured: {why}")
