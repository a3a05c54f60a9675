"""The report: the issue's targets checked against a run's results, the method x size table
and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sharedarrays.bench.sizes import size_label

__all__ = ["TARGETS", "evaluate_targets", "format_table", "plot"]

TARGETS = {
    "warm_overhead_ms": 0.05,
    "warm_vs_torch": 3.0,
    "cold_overhead_ms": 0.5,
    "copy_ratio": 1000.0,
    "bandwidth_ratio": 0.97,
    "many_memory_ratio": 1.25,
    "many_arrays_per_s": 20000.0,
}
"""The issue's targets (ratios within one run on the H200)."""


def _median(data: dict[str, Any], method: str, task: str, size: int) -> float | None:
    case = data.get("results", {}).get(method, {}).get(task, {}).get(str(size))
    return None if case is None else float(case["median_ms"])


def _sizes(data: dict[str, Any]) -> list[int]:
    return [int(s) for s in data["config"]["sizes"]]


def evaluate_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the issue's targets against one run's results.

    Every comparison uses the ``handoff`` task at each size; the floor is the ``floor``
    method, measured in the same pool as sharedarrays. Returns one row per target with
    ``status`` ``PASS``, ``MISS`` or ``n/a`` (not measured in this run) and the numbers.
    """
    rows: list[dict[str, Any]] = []
    sizes = _sizes(data)

    def row(name: str, ok: bool | None, measured: str) -> None:
        status = "n/a" if ok is None else ("PASS" if ok else "MISS")
        rows.append({"target": name, "status": status, "measured": measured})

    def per_size(method: str, other: str) -> list[tuple[int, float, float]]:
        out = []
        for s in sizes:
            a, b = _median(data, method, "handoff", s), _median(data, other, "handoff", s)
            if a is not None and b is not None:
                out.append((s, a, b))
        return out

    def over_floor(name: str, kind: str, limit: float) -> None:
        """The row of a target on ``sharedarrays-<kind>`` minus the floor, at its worst size."""
        measured = per_size(f"sharedarrays-{kind}", "floor")
        worst = max(measured, key=lambda r: r[1] - r[2]) if measured else None
        row(
            name,
            None if worst is None else worst[1] - worst[2] <= limit,
            "not measured"
            if worst is None
            else f"worst {worst[1] - worst[2]:+.3f} ms at {size_label(worst[0])} "
            f"({kind} {worst[1]:.3f}, floor {worst[2]:.3f})",
        )

    over_floor(
        f"warm overhead over floor <= {TARGETS['warm_overhead_ms']} ms at every size",
        "warm",
        TARGETS["warm_overhead_ms"],
    )
    pairs = (data.get("steps") or {}).get("pairs")
    limit_us = TARGETS["warm_overhead_ms"] * 1e3
    row(
        f"warm overhead over floor <= {TARGETS['warm_overhead_ms']} ms, interleaved pairs",
        None if not pairs else pairs["warm_minus_floor_us"] <= limit_us,
        "not measured"
        if not pairs
        else f"{pairs['warm_minus_floor_us']:+.1f} us at 1M, median of {pairs['pairs']} pairs "
        f"(control: {pairs['control_minus_floor_us']:+.1f} us)",
    )
    vs_torch = per_size("torch-warm", "sharedarrays-warm")
    low = min(vs_torch, key=lambda r: r[1] / r[2]) if vs_torch else None
    row(
        f"warm >= {TARGETS['warm_vs_torch']:g}x faster than torch warm",
        None if low is None else low[1] / low[2] >= TARGETS["warm_vs_torch"],
        "torch not measured"
        if low is None
        else f"lowest {low[1] / low[2]:.2f}x at {size_label(low[0])} "
        f"(torch {low[1]:.3f} ms, sharedarrays {low[2]:.3f} ms)",
    )
    over_floor(
        f"cold <= floor + {TARGETS['cold_overhead_ms']} ms at every size",
        "cold",
        TARGETS["cold_overhead_ms"],
    )
    gib = 1 << 30
    copy, sa_cold = (_median(data, m, "handoff", gib) for m in ("copy", "sharedarrays-cold"))
    sa_warm = _median(data, "sharedarrays-warm", "handoff", gib)
    row(
        f"1 GiB handoff >= {TARGETS['copy_ratio']:g}x faster than copy",
        None if copy is None or sa_cold is None else copy / sa_cold >= TARGETS["copy_ratio"],
        "1G not measured for both"
        if copy is None or sa_cold is None
        else f"cold {copy / sa_cold:,.0f}x (copy {copy:.1f} ms, cold {sa_cold:.3f} ms)"
        + (f"; warm {copy / sa_warm:,.0f}x" if sa_warm else ""),
    )
    bw = data.get("bandwidth")
    row(
        f"consumer bandwidth >= {TARGETS['bandwidth_ratio']}x plain",
        None if bw is None else bw["ratio"] >= TARGETS["bandwidth_ratio"],
        "not measured"
        if bw is None
        else f"{bw['ratio']:.3f}x ({bw['shared_GBps']:.0f} vs {bw['plain_GBps']:.0f} GB/s)",
    )
    many = data.get("many")
    row(
        f"{many['count'] if many else 10000} x {size_label(many['bytes_each']) if many else '4K'}: "
        f"memory <= {TARGETS['many_memory_ratio']}x payload",
        None if many is None else many["memory_ratio"] <= TARGETS["many_memory_ratio"],
        "not measured"
        if many is None
        else f"{many['memory_ratio']:.2f}x ({many['allocations']} allocations)",
    )
    row(
        f"small arrays: >= {TARGETS['many_arrays_per_s']:,.0f} arrays/s",
        None if many is None else many["arrays_per_s"] >= TARGETS["many_arrays_per_s"],
        "not measured"
        if many is None
        else f"{many['arrays_per_s']:,.0f}/s warm (first handoff "
        f"{many['first_arrays_per_s']:,.0f}/s)",
    )
    return rows


def format_table(data: dict[str, Any]) -> str:
    """The method x size table (median ms and ratio to the floor), per task, and targets."""
    sizes = _sizes(data)
    lines: list[str] = []
    meta = data["meta"]
    where = meta.get("gpu", {}).get("name") or f"{meta['machine']} ({meta['cpus']} CPUs)"
    lines.append(f"sharedarrays bench, {meta['date_utc']}, {meta['hostname']}, {where}")
    for task in data["config"]["tasks"]:
        lines.append("")
        lines.append(f"{task}: median ms (x floor)")
        head = f"{'method':<19}" + "".join(f"{size_label(s):>20}" for s in sizes)
        lines.append(head)
        for method in data["results"]:
            cells: list[str] = []
            for s in sizes:
                m = _median(data, method, task, s)
                f = _median(data, "floor", task, s)
                if m is None:
                    cells.append(f"{'-':>20}")
                elif f:
                    cells.append(f"{m:>11.3f} ({m / f:>5.1f}x)")
                else:
                    cells.append(f"{m:>20.3f}")
            lines.append(f"{method:<19}" + "".join(cells))
    if data.get("scaling"):
        lines.append("")
        lines.append("fan-out (handoff to every worker at once): median ms for all tasks")
    for w, row in data.get("scaling", {}).items():
        for method, by_size in row.items():
            text = ", ".join(
                f"{size_label(int(s))} {c['median_ms']:.3f}" for s, c in by_size.items()
            )
            lines.append(f"  {w:>2} workers  {method:<18} {text}")
    if data.get("skipped"):
        lines.append("")
        for what, why in data["skipped"].items():
            lines.append(f"skipped {what}: {why}")
    if data.get("targets"):
        lines.append("")
        lines.append("targets")
        for t in data["targets"]:
            lines.append(f"  {t['status']:<5} {t['target']}: {t['measured']}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str) -> None:
    """Time against size, log-log, one line per method, a panel per task (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(data["config"]["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for method, result in data["results"].items():
            cases = sorted(result.get(task, {}).values(), key=lambda c: c["size"])
            if not cases:
                continue
            xs = [c["size"] for c in cases]
            line = ax.plot(xs, [c["median_ms"] for c in cases], marker="o", label=method)[0]
            ax.fill_between(
                xs,
                [c["p10_ms"] for c in cases],
                [c["p90_ms"] for c in cases],
                color=line.get_color(),
                alpha=0.15,
                linewidth=0,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("array size (bytes)")
        ax.set_ylabel("median ms per task (p10-p90 shaded)")
        ax.set_title(task)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = data["meta"]
    where = meta.get("gpu", {}).get("name") or f"{meta['machine']} host"
    fig.suptitle(f"sharedarrays bench: spawn Pool handoff, {where}, {meta['date_utc']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
