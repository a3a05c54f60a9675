"""The benchmark harness (``benchmarks/bench.py``, ``benchmarks/harness/``) runs end to end on
the host backend (no timing assertions). It is not part of the package: the tests import it
by path."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
SCRIPT = BENCHMARKS / "bench.py"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))  # (spawned workers get the same sys.path)

from harness import config, report, rounds, sizes  # noqa: E402

REPEATS = 21
ROUNDS = 7


@pytest.mark.timeout(180)
def test_bench_cpu_quick(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--device",
            "cpu",
            "--quick",
            "--repeats",
            str(REPEATS),
            "--rounds",
            str(ROUNDS),
            "--warm-sizes",
            "1M,4M",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["config"]["device"] == "cpu"
    # the only skips on the host are the CUDA peers', each with its reason
    assert data["skipped"], "the torch and cuda.core rows must say why they did not run"
    for what, why in data["skipped"].items():
        assert what.split()[-1] in ("torch", "cuda.core"), (what, why)
        assert "need a CUDA device" in why
    for method in config.HOST_METHODS:
        result = data["results"][method]
        for task in config.TASKS:
            cases = result[task]
            assert len(cases) == len(data["config"]["sizes"]), (method, task)
            for case in cases.values():
                assert case["repeats"] >= REPEATS
                assert len(case["samples_ms"]) == case["repeats"]
                assert case["median_ms"] > 0
                assert case["p10_ms"] <= case["median_ms"] <= case["p90_ms"]
    for kind, sizes_, methods in [
        ("warm", ["1M", "4M"], {"sharedarrays", "shm", "control", "bound", "safe"}),
        ("cold", ["1M"], {"sharedarrays", "shm", "safe"}),
    ]:
        part = data["overhead"][kind]
        assert [sizes.size_label(int(s)) for s in part["sizes"]] == sizes_
        for case in part["sizes"].values():
            assert set(case["methods"]) == methods, (kind, case)
            assert case["order"][0] == "floor" and case["rounds"] == ROUNDS
            for row in case["methods"].values():
                assert len(row["diffs_us"]) == ROUNDS
                assert row["p10_us"] <= row["median_us"] <= row["p90_us"]
            assert "need a CUDA device" in case["not_measured"]["torch"]
    many = data["many"]
    assert many["count"] > 0 and many["arrays_per_s"] > 0
    assert set(many["methods"]) == {"sharedarrays"}
    assert "need a CUDA device" in many["not_measured"]["torch"]
    assert data["bandwidth"]["ratio"] > 0
    assert set(data["scaling"]) == {"1", "4"}
    targets = {t["target"]: t for t in data["targets"]}
    warm_row = targets["warm over the floor <= +40 us at 1M"]
    assert warm_row["status"] in ("PASS", "MISS", "BOUND")
    assert "; bound, same rounds (a pickle hook with the fence): " in warm_row["measured"]
    assert targets["cold over the floor <= +0.35 ms at 1M"]["status"] in ("PASS", "MISS", "BOUND")
    bound = data["overhead"]["cold"]["sizes"][str(1 << 20)]["bound"]
    assert bound["fetch_ms"] > 0 and bound["map_ms"] > 0
    assert bound["bound_ms"] == bound["fetch_ms"] + bound["map_ms"]
    torch_row = targets["warm over the floor >= 4x below torch at 1M"]
    assert torch_row["status"] == "n/a"
    assert torch_row["measured"].startswith("not measured: torch: ")
    gib_row = targets["cold over the floor <= +0.5 ms at 1G"]
    assert gib_row["measured"] == "not measured: 1G is not among the cold sizes of this run"
    for key in ("date_utc", "hostname", "python", "versions"):
        assert key in data["meta"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "handoff: median ms (x floor)" in proc.stdout
    assert "sharedarrays-warm" in proc.stdout and "targets" in proc.stdout
    # the log names each figure (what a reader of benchmarks/ab.sh's logs looks for)
    assert re.search(r"warm +1M sharedarrays +over the floor [+-]", proc.stdout)
    assert re.search(r"cold +1M sharedarrays +over the floor [+-]", proc.stdout)
    assert re.search(r"sharedarrays .*arrays/s", proc.stdout)


def _case(us: float) -> dict[str, Any]:
    return {"median_us": us, "p10_us": us, "p90_us": us, "rounds": 301}


def _partial_run() -> dict[str, Any]:
    """A run's results as the JSON holds them: warm at 1M only, cold at 1M and 1G, no torch
    in the cold part, many with torch, no bandwidth part."""
    mib, gib = 1 << 20, 1 << 30
    return {
        "meta": {"date_utc": "d", "hostname": "h", "machine": "x86_64", "cpus": 1},
        "config": {"sizes": [mib], "tasks": ["handoff"], "skip": ["bandwidth"]},
        "skipped": {"cold torch": "not available: ModuleNotFoundError: torch"},
        "results": {},
        "overhead": {
            "warm": {
                "rounds": 301,
                "sizes": {
                    str(mib): {
                        "methods": {"sharedarrays": _case(35.0), "torch": _case(150.0)},
                        "not_measured": {},
                    }
                },
            },
            "cold": {
                "rounds": 301,
                "sizes": {
                    str(mib): {
                        "methods": {"sharedarrays": _case(340.0)},
                        "not_measured": {"torch": "not available: ModuleNotFoundError: torch"},
                    },
                    str(gib): {"methods": {"sharedarrays": _case(650.0)}, "not_measured": {}},
                },
            },
        },
        "many": {
            "count": 10000,
            "bytes_each": 4096,
            "memory_ratio": 1.02,
            "allocations": 20,
            "arrays_per_s": 50000.0,
            "methods": {
                "sharedarrays": {"arrays_per_s": 50000.0},
                "torch": {"arrays_per_s": 26000.0},
            },
            "not_measured": {},
        },
    }


def _targets(data: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {t["target"]: (t["status"], t["measured"]) for t in report.evaluate_targets(data)}


def test_targets_pass_miss_and_not_measured() -> None:
    data = _partial_run()
    got = _targets(data)
    assert got["warm over the floor <= +40 us at 1M"] == ("PASS", "+35.0 us")
    # 35 * 4 = 140 <= 150: PASS; the figure names both
    status, measured = got["warm over the floor >= 4x below torch at 1M"]
    assert status == "PASS" and measured.startswith("4.29x") and "+150.0" in measured
    assert got["warm over the floor <= +40 us at 1G"] == (
        "n/a",
        "not measured: 1G is not among the warm sizes of this run",
    )
    assert got["cold over the floor <= +0.35 ms at 1M"] == ("PASS", "+0.340 ms")
    assert got["cold over the floor <= +0.5 ms at 1G"] == ("MISS", "+0.650 ms")
    assert got["cold over the floor <= +1.5 ms at 32G"][0] == "n/a"
    status, measured = got["10,000 x 4K in one task >= 2x torch, same run"]
    assert status == "MISS" and measured.startswith("1.92x")  # 50,000 < 2 x 26,000
    assert got["consumer bandwidth >= 0.97x plain"] == (
        "n/a",
        "not measured: the bandwidth part was skipped (--skip bandwidth)",
    )
    assert got["10,000 x 4K: memory <= 1.25x payload"] == ("PASS", "1.02x (20 allocations)")

    # each figure moves its row across its limit
    warm = data["overhead"]["warm"]["sizes"][str(1 << 20)]["methods"]
    warm["sharedarrays"]["median_us"] = 40.5
    got = _targets(data)
    assert got["warm over the floor <= +40 us at 1M"][0] == "MISS"
    assert got["warm over the floor >= 4x below torch at 1M"][0] == "MISS"  # 162 > 150
    warm["sharedarrays"]["median_us"] = -3.0  # at the floor: below torch by any factor
    assert _targets(data)["warm over the floor >= 4x below torch at 1M"][0] == "PASS"
    warm["torch"]["median_us"] = -5.0
    assert _targets(data)["warm over the floor >= 4x below torch at 1M"][0] == "MISS"
    data["many"]["methods"]["torch"]["arrays_per_s"] = 25000.0
    assert _targets(data)["10,000 x 4K in one task >= 2x torch, same run"][0] == "PASS"

    # a peer that did not run says why
    del data["many"]["methods"]["torch"]
    data["many"]["not_measured"]["torch"] = "torch rows need a CUDA device"
    assert _targets(data)["10,000 x 4K in one task >= 2x torch, same run"] == (
        "n/a",
        "not measured: torch: torch rows need a CUDA device",
    )
    del warm["torch"]
    data["overhead"]["warm"]["sizes"][str(1 << 20)]["not_measured"]["torch"] = "failed: X"
    assert _targets(data)["warm over the floor >= 4x below torch at 1M"] == (
        "n/a",
        "not measured: torch: failed: X",
    )
    data["config"]["skip"].append("cold")
    assert _targets(data)["cold over the floor <= +0.35 ms at 1M"] == (
        "n/a",
        "not measured: the cold part was skipped (--skip cold)",
    )
    assert {r["status"] for r in report.evaluate_targets({"config": {}})} == {"n/a"}


def test_warm_targets_show_the_medians_intervals() -> None:
    """Where a run has the 95% intervals of the medians, the warm rows show them: the
    overhead's, and the ratio's range with both medians in their intervals."""
    data = _partial_run()
    warm = data["overhead"]["warm"]["sizes"][str(1 << 20)]["methods"]
    warm["sharedarrays"]["ci95_us"] = [30.0, 50.0]
    warm["torch"]["ci95_us"] = [120.0, 180.0]
    got = _targets(data)
    assert got["warm over the floor <= +40 us at 1M"] == (
        "PASS",
        "+35.0 us (95% interval +30.0 to +50.0)",
    )
    status, measured = got["warm over the floor >= 4x below torch at 1M"]
    assert status == "PASS" and measured.startswith("4.29x, 2.40x to 6.00x (")
    warm["sharedarrays"]["ci95_us"] = [-2.0, 50.0]  # (a ratio past the floor: no range)
    assert _targets(data)["warm over the floor >= 4x below torch at 1M"][1].startswith("4.29x (")
    data["targets"] = report.evaluate_targets(data)
    assert "+35.0 us  (95% interval -2.0 to +50.0; p10" in report.format_table(data)


def test_a_warm_goal_the_least_handoff_exceeds_in_the_same_rounds_is_bound() -> None:
    """A warm miss names the ``bound`` entry of the same rounds (one pickle hook with the
    fence); where that alone exceeds the goal, the row is BOUND, not MISS."""
    data = _partial_run()
    warm = data["overhead"]["warm"]["sizes"][str(1 << 20)]["methods"]
    warm["sharedarrays"]["median_us"] = 60.0
    warm["bound"] = _case(25.0)
    status, measured = _targets(data)["warm over the floor <= +40 us at 1M"]
    assert status == "MISS"  # 25 us alone: the goal is not out of reach
    assert measured == "+60.0 us; bound, same rounds (a pickle hook with the fence): +25.0 us"
    warm["bound"] = _case(41.0)
    assert _targets(data)["warm over the floor <= +40 us at 1M"][0] == "BOUND"
    warm["sharedarrays"]["median_us"] = 39.0  # within the goal: PASS whatever the bound
    assert _targets(data)["warm over the floor <= +40 us at 1M"][0] == "PASS"


def test_the_least_handoff_takes_the_fence_and_loads_as_a_kept_native_array() -> None:
    """The ``bound`` entry on the host pickles through its backend's fence (asked once per
    pickling), carries the token, and loads as an object whose ``.array`` is one native
    array the worker keeps (made once) and whose ``close`` drops it."""
    import pickle

    from harness import handoffs, worker

    class Backend:
        asked = 0

        def export_fence(self) -> Any:
            Backend.asked += 1
            return type("Fence", (), {"token": b"t" * 8})()

    least = handoffs.LeastHandoff(b"x" * 100, (0, (4,), (4,), "<f4", False), Backend())
    blob = pickle.dumps(least)
    assert Backend.asked == 1 and b"t" * 8 in blob and b"x" * 100 in blob
    first, second = pickle.loads(blob), pickle.loads(blob)
    assert first.array is second.array and first.array.shape == (1 << 18,)
    assert worker.task_sharedarrays(first, False) == float(1 << 18)
    assert first.array is None  # (closed by the task)


def test_a_warm_goal_the_safe_entry_exceeds_in_the_same_rounds_is_bound() -> None:
    """The ``safe`` entry (the bound and the least the guarantees add) is named in the warm
    row; where it alone exceeds the goal, the row is BOUND."""
    data = _partial_run()
    warm = data["overhead"]["warm"]["sizes"][str(1 << 20)]["methods"]
    warm["sharedarrays"]["median_us"] = 60.0
    warm["bound"] = _case(25.0)
    warm["safe"] = _case(38.0)
    status, measured = _targets(data)["warm over the floor <= +40 us at 1M"]
    assert status == "MISS"
    assert measured.endswith("; safe, same rounds (the bound and the guarantees): +38.0 us")
    warm["safe"] = _case(44.0)
    assert _targets(data)["warm over the floor <= +40 us at 1M"][0] == "BOUND"


def test_the_safe_handoff_counts_once_per_message_and_checks_what_a_view_must() -> None:
    """The ``safe`` entry counts one payload in flight per message however many times a
    message carries it, refuses when closed, loads a view whose ``.array`` is the worker's
    kept native array while nothing else holds it (a new one where something does), and
    refuses a view outside the memory."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from harness import handoffs

    class Backend:
        def export_fence(self) -> None:
            return None

    view = (0, (1 << 18,), (4,), "<f4", False)
    safe = handoffs.SafeHandoff(b"safe test".ljust(360, b"."), view, Backend())

    class Again:  # another view of the same memory in the same message
        def __reduce__(self) -> Any:
            return safe.__reduce__()

    one = ForkingPickler.dumps([safe])
    assert safe._sent == 1
    both = ForkingPickler.dumps([safe, Again(), Again()])
    assert safe._sent == 2  # one message, one count
    ForkingPickler.dumps(safe)
    assert safe._sent == 3
    first, second = pickle.loads(one)[0], pickle.loads(both)[1]
    kept = first.array
    assert kept.shape == (1 << 18,)
    assert second.array is not kept  # (the first one's native is held: a new one)
    del kept
    first.close()
    second.close()
    third = pickle.loads(one)[0]
    assert third.array is handoffs._safe[safe.blob].native  # nothing else holds it
    third.close()
    with pytest.raises(ValueError, match="closed"):
        _ = third.array
    with pytest.raises(ValueError, match="outside"):
        handoffs._safe_loaded(safe.blob, (16, (1 << 18,), (4,), "<f4", False), None)
    safe.closed = True
    with pytest.raises(ValueError, match="closed"):
        pickle.dumps(safe)


@pytest.mark.gpu
def test_the_least_handoff_on_cuda_queries_the_stream_and_leaves_a_busy_one_to_the_fence() -> None:
    """On CUDA the ``bound`` entry makes the idle fence's two driver calls itself: an idle
    stream carries no token and records nothing; a busy stream goes to the backend's fence,
    which records an event (a token), and is counted."""
    import pickle

    import cupy
    from cuda_helpers import Spin
    from harness import handoffs

    import sharedarrays as sa
    from sharedarrays.process import STATE

    a = sa.zeros(256, "float32", device="cuda:0")
    try:
        least = handoffs.LeastHandoff(b"x" * 64, a._view_tuple(), a.allocation.backend, 0)
        cupy.cuda.Device(0).synchronize()
        before = STATE.backends.records
        blob = pickle.dumps(least)
        assert least.busy == 0 and STATE.backends.records == before
        assert pickle.loads(blob).array is not None
        scratch = cupy.zeros(1024, dtype=cupy.float32)
        Spin()(scratch, 1.0, seconds=1.0)  # the stream is busy from here on
        busy = pickle.loads(pickle.dumps(least.__reduce__()[1]))
        assert least.busy == 1 and STATE.backends.records == before + 1
        assert isinstance(busy[2], bytes)  # the record's token
        cupy.cuda.Device(0).synchronize()
    finally:
        a.close()


def test_a_cold_goal_its_fixed_steps_exceed_alone_is_bound() -> None:
    """A cold miss names the bound measured in the same run; where the handle request and
    the mapping alone exceed the goal, the row is BOUND, not MISS."""
    data = _partial_run()
    gib = data["overhead"]["cold"]["sizes"][str(1 << 30)]
    gib["bound"] = {"fetch_ms": 0.15, "map_ms": 0.3, "bound_ms": 0.45, "repeats": 21}
    status, measured = _targets(data)["cold over the floor <= +0.5 ms at 1G"]
    assert status == "MISS"  # 0.45 ms alone: the goal is not out of reach
    assert measured == "+0.650 ms; bound, alone: handle request 0.150 + mapping 0.300 = 0.450 ms"
    gib["bound"] = {"fetch_ms": 0.2, "map_ms": 0.4, "bound_ms": 0.6, "repeats": 21}
    assert _targets(data)["cold over the floor <= +0.5 ms at 1G"][0] == "BOUND"
    mib = data["overhead"]["cold"]["sizes"][str(1 << 20)]
    mib["bound"] = {"fetch_ms": 0.2, "map_ms": 0.4, "bound_ms": 0.6, "repeats": 21}
    assert _targets(data)["cold over the floor <= +0.35 ms at 1M"] == ("PASS", "+0.340 ms")
    gib["bound"] = {"failed": "RuntimeError: x"}
    assert _targets(data)["cold over the floor <= +0.5 ms at 1G"] == ("MISS", "+0.650 ms")


def test_a_cold_goal_the_safe_entry_exceeds_in_the_same_rounds_is_bound() -> None:
    """The cold rounds' ``safe`` entry (the two steps and the least the guarantees add) is
    named in a cold miss; where it exceeds the goal, the row is BOUND even where the two
    steps timed alone do not."""
    data = _partial_run()
    gib = data["overhead"]["cold"]["sizes"][str(1 << 30)]
    gib["bound"] = {"fetch_ms": 0.15, "map_ms": 0.3, "bound_ms": 0.45, "repeats": 21}
    gib["methods"]["safe"] = _case(480.0)
    status, measured = _targets(data)["cold over the floor <= +0.5 ms at 1G"]
    assert status == "MISS"
    assert measured.endswith("; safe, same rounds (the two steps and the guarantees): +0.480 ms")
    gib["methods"]["safe"] = _case(520.0)
    assert _targets(data)["cold over the floor <= +0.5 ms at 1G"][0] == "BOUND"


@pytest.mark.timeout(120)
def test_the_safe_cold_handoff_maps_a_new_array_in_a_worker_and_refuses_bad_names() -> None:
    """The cold ``safe`` entry hands a new array to a spawn worker through the handle
    server (the worker reads the parent's data), leaves no fd behind in the parent once
    the array is closed, and its loader refuses malformed names and a view outside the
    chunks before anything is asked or mapped."""
    import multiprocessing

    from conftest import open_fds
    from harness import handoffs, worker

    import sharedarrays as sa

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        counts = []
        for value in (3.0, 5.0, 7.0):
            a = sa.full(1 << 10, value, "float32", device="cpu")
            safe = handoffs.SafeColdHandoff(a)
            got = pool.apply_async(worker.task_sharedarrays, (safe, True)).get(60)
            assert got == value * (1 << 10) and safe._sent == 1
            safe.close()
            pool.apply_async(worker.task_drop, (0.0,)).get(60)
            counts.append(open_fds())  # (the first handoff connects: counted from there)
        assert counts[1] == counts[2] <= counts[0], counts
        with pytest.raises(ValueError, match="closed"):
            safe.__reduce__()
    b = sa.zeros(1 << 10, "float32", device="cpu")
    try:
        names, view, token = handoffs.SafeColdHandoff(b).__reduce__()[1]
        with pytest.raises(ValueError, match="malformed"):
            handoffs._safe_cold_loaded((*names[:3], b"short", *names[4:]), view, token)
        with pytest.raises(sa.PayloadError, match="outside"):
            handoffs._safe_cold_loaded(names, (sum(names[4]), *view[1:]), token)
    finally:
        b.close()


def test_a_run_without_the_table_plots_its_rounds(tmp_path: Path) -> None:
    """A run of the warm and cold parts alone (no method x size table) still gets its plot:
    a panel per part, over the floor against size."""
    pytest.importorskip("matplotlib")
    data = _partial_run()
    del data["results"]
    report.plot(data, str(tmp_path / "rounds.png"))
    assert (tmp_path / "rounds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="nothing to plot"):
        report.plot({"meta": data["meta"], "config": data["config"]}, str(tmp_path / "x.png"))


def test_table_shows_rounds_many_and_targets() -> None:
    data = _partial_run()
    data["targets"] = report.evaluate_targets(data)
    table = report.format_table(data)
    assert "skipped cold torch" in table
    assert "  PASS  warm over the floor <= +40 us at 1M: +35.0 us" in table
    assert "  MISS  cold over the floor <= +0.5 ms at 1G: +0.650 ms" in table
    assert "warm: over the floor, median of per-round differences (301" in table
    assert re.search(r"1M +torch +not measured: not available", table)
    assert re.search(r"sharedarrays +50,000 arrays/s", table)
    assert re.search(r"torch +26,000 arrays/s", table)


@pytest.mark.parametrize("n", range(1, 9))
def test_round_order_balances_places_and_neighbours(n: int) -> None:
    names = ["floor", *(f"m{i}" for i in range(1, n))]
    period = n if n % 2 == 0 else 2 * n
    orders = [rounds.round_order(names, i) for i in range(period)]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert rounds.round_order(names, 2 * period + 1) == orders[1 % period]  # (it repeats)
    for place in range(n):  # every name in every place equally often
        counts = Counter(o[place] for o in orders)
        assert set(counts.values()) == {period // n} and len(counts) == n
    # every name follows every other one within a round equally often (a rotation does not:
    # there each name follows the same one in every round where it is not first)
    follows = Counter((o[j - 1], o[j]) for o in orders for j in range(1, n))
    if n > 1:
        assert len(follows) == n * (n - 1)
        assert set(follows.values()) == {period // n}
    assert rounds.round_order([], 3) == []


class _Clock:
    """A fake ``time_one``: the floor drifts from round to round, each method costs a fixed
    amount over the floor of its round; records the order of the calls."""

    def __init__(self, extra_s: dict[str, float], names: int) -> None:
        self.extra_s = extra_s
        self.names = names
        self.calls: list[str] = []

    def __call__(self, name: str) -> float:
        round_index = len(self.calls) // self.names
        self.calls.append(name)
        drift = 0.001 * (round_index % 7) ** 2  # far larger than the differences
        return 0.0003 + drift + self.extra_s.get(name, 0.0)


def test_rounds_interleave_and_differences_cancel_the_floor_drift() -> None:
    names = ["floor", "a", "b"]
    clock = _Clock({"a": 40e-6, "b": -5e-6}, len(names))
    events: list[tuple[str, int]] = []
    samples = rounds.run_rounds(
        names,
        9,
        clock,
        warmup=2,
        before_round=lambda i: events.append(("before", i)),
        after_round=lambda i: events.append(("after", i)),
    )
    assert events == [(w, i) for i in range(11) for w in ("before", "after")]
    # rounds 0..10 in their balanced order, warm-up included
    assert clock.calls == [n for i in range(11) for n in rounds.round_order(names, i)]
    assert all(len(v) == 9 for v in samples.values())
    over = rounds.over_floor(samples)
    assert set(over) == {"a", "b"}
    assert over["a"]["median_us"] == pytest.approx(40.0)
    assert over["b"]["median_us"] == pytest.approx(-5.0)
    assert over["a"]["diffs_us"] == pytest.approx([40.0] * 9)
    # the floor moves by up to 36 ms between rounds: only the same round's floor gives 40 us
    assert max(samples["floor"]) - min(samples["floor"]) > 0.03
    assert over["a"]["method_median_ms"] == pytest.approx(statistics.median(samples["a"]) * 1e3)


def test_a_lead_in_before_each_round_charges_a_methods_leftovers_to_every_entry_alike() -> None:
    """An entry that leaves work behind (``heavy``: the next call pays 1.0) charges it, in
    the Williams design, to each other entry once per period within the rounds; but the
    first entry of a round follows the last of the round before, a neighbour the design
    does not balance (with 4 entries: always the same one), so one entry pays it once more
    per period and its median over the floor reads high. An untimed lead-in before each
    round (which pays it instead) leaves every median at the true difference."""
    names = ["floor", "a", "b", "heavy"]
    base = {"floor": 1.0, "a": 1.5, "b": 1.5, "heavy": 2.0}
    left = [0.0]

    def time_one(name: str) -> float:
        took = base[name] + left[0]
        left[0] = 1.0 if name == "heavy" else 0.0
        return took

    def lead_in() -> None:
        left[0] = 0.0

    unbalanced = rounds.over_floor(rounds.run_rounds(names, 400, time_one))
    left[0] = 0.0
    balanced = rounds.over_floor(rounds.run_rounds(names, 400, time_one, lead_in=lead_in))
    # (b is first after heavy in every round it leads: it reads high without the lead-in)
    assert unbalanced["b"]["median_us"] > unbalanced["a"]["median_us"]
    assert balanced["a"]["median_us"] == pytest.approx(0.5e6)
    assert balanced["b"]["median_us"] == pytest.approx(0.5e6)
    assert balanced["heavy"]["median_us"] == pytest.approx(1.0e6)


def test_a_timed_call_ends_when_the_worker_is_idle_so_leftovers_are_their_owners(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A task that leaves work behind in the worker after its result (torch unmaps a
    tensor's memory when its task returns) delays whatever the worker runs next. Each timed
    call of the bench's rounds ends with a settling floor task, so the leftover is charged
    to the entry that left it (its cost over the floor plus its leftover), and every other
    entry reads its own difference, whatever it follows."""
    from types import SimpleNamespace

    from harness import measure, methods, overhead

    now = [0.0]
    cost = {"floor": 1.0, "a": 1.5, "heavy": 2.0, "settle": 1.0}
    leftover = {"heavy": 5.0}
    pending = [0.0]

    class Pool:
        def apply_async(self, task: Any, args: tuple[Any, ...]) -> Any:
            key = "settle" if args[0] == methods.FLOOR_ARG else args[0]
            now[0] += pending[0] + cost[key]  # the work left behind runs first
            pending[0] = leftover.get(key, 0.0)
            return SimpleNamespace(get=lambda timeout=None: None)

    def method(name: str) -> methods.Method:
        return methods.Method(name, methods.task_floor, list, lambda box: name, list, False)

    monkeypatch.setattr(overhead, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    run = object.__new__(measure.Run)
    run.cfg = SimpleNamespace(rounds=60, warmup=0, round_seconds=None)  # type: ignore[assignment]
    entries = {name: method(name) for name in ("floor", "a", "heavy")}
    samples = run._rounds(Pool(), entries, {n: [n] for n in entries}, 1, False)  # type: ignore[arg-type]
    over = rounds.over_floor(samples)
    assert over["a"]["diffs_us"] == pytest.approx([0.5e6] * 60)
    assert over["heavy"]["diffs_us"] == pytest.approx([(1.0 + 5.0) * 1e6] * 60)


def test_rounds_per_round_difference_is_against_the_same_rounds_floor() -> None:
    samples = {"floor": [1.0, 2.0, 3.0], "m": [1.5, 2.1, 3.7]}
    over = rounds.over_floor(samples)["m"]
    assert over["diffs_us"] == pytest.approx([0.5e6, 0.1e6, 0.7e6])
    assert over["median_us"] == pytest.approx(0.5e6)
    with pytest.raises(ValueError, match="rounds"):
        rounds.over_floor({"floor": [1.0, 2.0], "m": [1.0]})


def test_median_interval_covers_the_true_median_about_95_in_100_times() -> None:
    """The interval of :func:`rounds.median_interval` (order statistics) holds the true
    median of the distribution sampled in about 95% of samples: checked over 400 samples of
    301 skewed values (an exponential, median ln 2), and its ranks on a known list."""
    rng = random.Random(19)
    hits = 0
    for _ in range(400):
        values = [rng.expovariate(1.0) for _ in range(301)]
        low, high = rounds.median_interval(values)
        assert low <= statistics.median(values) <= high
        hits += low <= math.log(2) <= high
    assert 0.90 * 400 <= hits <= 0.99 * 400
    # n = 301: ranks floor(150.5 - 17.0) = 133 and ceil(1 + 150.5 + 17.0) = 169 (1-based)
    assert rounds.median_interval([float(v) for v in range(301, 0, -1)]) == (133.0, 169.0)
    assert rounds.median_interval([2.0, 1.0]) == (1.0, 2.0)
    with pytest.raises(ValueError):
        rounds.median_interval([])
    over = rounds.over_floor({"floor": [0.0] * 5, "m": [1e-6 * v for v in (5, 1, 4, 2, 3)]})
    assert over["m"]["ci95_us"] == pytest.approx([1.0, 5.0])


def test_rounds_free_after_a_failed_round_and_stop_after_max_seconds() -> None:
    freed: list[int] = []

    def fails(name: str) -> float:
        if name == "b":
            raise RuntimeError("b broke")
        return 0.001

    with pytest.raises(RuntimeError, match="b broke"):
        rounds.run_rounds(["floor", "b"], 5, fails, after_round=freed.append)
    assert freed == [0]

    def slow(name: str) -> float:
        time.sleep(0.01)
        return 0.01

    samples = rounds.run_rounds(["floor", "a"], 1000, slow, max_seconds=0.05, min_rounds=3)
    assert 3 <= len(samples["floor"]) < 20


def test_round_options() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu"]))
    assert cfg.rounds == 301 and cfg.warm_sizes == [1 << 20, 16 << 20]
    quick = config.config_from_args(parser.parse_args(["--device", "cpu", "--quick"]))
    assert quick.rounds == 31 and quick.cold_sizes == [1 << 20]
    cfg = config.config_from_args(
        parser.parse_args(
            ["--device", "cpu", "--rounds", "7", "--warm-sizes", "4K,1M", "--cold-sizes", "2M"]
        )
    )
    assert (cfg.rounds, cfg.warm_sizes, cfg.cold_sizes) == (7, [4096, 1 << 20], [2 << 20])
    with pytest.raises(argparse.ArgumentTypeError, match="--rounds"):
        config.config_from_args(parser.parse_args(["--device", "cpu", "--rounds", "0"]))
    with pytest.raises(argparse.ArgumentTypeError, match="--skip"):
        config.config_from_args(parser.parse_args(["--device", "cpu", "--skip", "pairs"]))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--many", "0"], "--many"),
        (["--many", "-1"], "--many"),
        (["--many-size", "0"], "--many-size"),
        (["--case-seconds", "-1"], "--case-seconds"),
        (["--case-seconds", "nan"], "--case-seconds"),
        (["--round-seconds", "inf"], "--round-seconds"),
        (["--workers", "100000"], "--workers"),
        (["--workers", "two"], "--workers"),
        (["--json", "/proc/nope/x.json"], "--json /proc/nope/x.json: .* not a writable folder"),
        (["--plot", "/nonexistent-folder/p.png"], "--plot"),
        (["--json", "/tmp"], "a folder, not a file name"),
        (["--bandwidth-size", "0"], "--bandwidth-size"),
    ],
)
def test_bad_options_are_usage_errors_before_the_run(args: list[str], match: str) -> None:
    # (a ZeroDivisionError, nan accepted, 100,000 workers started, or the results lost
    # after the whole run for want of a folder)
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        config.config_from_args(parser.parse_args(["--device", "cpu", "--quick", *args]))


@pytest.mark.parametrize("device", ["bogus", "cpu:1", "npu:99"])
def test_a_bad_bench_device_is_a_usage_error(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from harness.command import main as bench_main

    assert bench_main(["--device", device, "--quick"]) == 2
    assert f"bench: --device {device}:" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_failing_method_is_dropped_and_the_size_rerun_without_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A method whose task fails in the worker is not measured (with the error), the rest of
    its part runs in a fresh pool without it."""
    from harness import measure, methods, overhead, worker

    real = methods.family_methods

    def broken_shm(cfg: config.Config, peers: Any, family: str) -> Any:
        warm, cold = real(cfg, peers, family)
        if family == "shm":  # a segment name that does not exist: the worker raises
            warm.send = lambda box: ("sa-bench-no-such-segment", 4096)
        return warm, cold

    monkeypatch.setattr(overhead, "family_methods", broken_shm)
    cfg = config.Config(
        device="cpu",
        sizes=[1 << 20],
        rounds=5,
        warmup=0,
        methods=list(config.HOST_METHODS),
        warm_sizes=[4096, 1 << 20],
    )
    run = measure.Run(cfg)
    run.overhead("warm")
    part = run.data["overhead"]["warm"]
    for case in part["sizes"].values():
        assert set(case["methods"]) == {"sharedarrays", "control", "bound", "safe"}
        assert case["methods"]["sharedarrays"]["rounds"] == 5
        assert case["not_measured"]["shm"].startswith("failed: FileNotFoundError")
    assert run.data["skipped"]["warm shm"].startswith("failed: FileNotFoundError")
    assert worker.task_shm.__name__ in run.data["errors"]["warm shm"]


@pytest.mark.parametrize(("text", "n"), [("4K", 4096), ("1M", 1 << 20), ("32G", 32 << 30)])
def test_sizes(text: str, n: int) -> None:
    assert sizes.parse_size(text) == n
    assert sizes.size_label(n) == text


def _run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )


def test_import_sharedarrays_leaves_the_tools_out() -> None:
    """The benchmark and the command line are tools on top of the library, not part of it."""
    proc = _run_python(
        "import sys, sharedarrays\n"
        "print(sorted(m for m in sys.modules if m.startswith(('harness', 'sharedarrays.bench', "
        "'sharedarrays.cli'))))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_command_line_has_no_bench_and_loads_no_harness() -> None:
    proc = _run_python(
        "import sys\n"
        "from sharedarrays.cli import main\n"
        "main(['status'])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('harness', 'sharedarrays.bench'))))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    bench = _run_python("from sharedarrays.cli import main; main(['bench', '--help'])")
    assert bench.returncode == 2 and "invalid choice: 'bench'" in bench.stderr


def test_the_bench_script_takes_its_options() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    options = proc.stdout.partition("options:")[2]
    assert "--sizes" in options and "--only" in options and "--full" in options
    assert proc.stdout.startswith("usage: python benchmarks/bench.py")


@pytest.mark.timeout(120)
def test_cold_sizes_follow_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the round's new objects do not fit together each is made before its own slot;
    a size that does not fit once is not run, and says why."""
    from harness import measure, overhead

    mib = 1 << 20
    monkeypatch.setattr(overhead, "free_bytes", lambda cfg: int(1.5 * mib))
    cfg = config.Config(
        device="cpu",
        sizes=[mib],
        rounds=4,
        warmup=0,
        methods=list(config.HOST_METHODS),
        cold_sizes=[mib, 2 * mib],
    )
    run = measure.Run(cfg)
    run.overhead("cold")
    fits, too_big = (run.data["overhead"]["cold"]["sizes"][str(s)] for s in (mib, 2 * mib))
    assert fits["objects"] == "made before each slot"  # 3 x 1 MiB > 1.5 MiB free
    assert set(fits["methods"]) == {"sharedarrays", "shm", "safe"}
    assert fits["methods"]["shm"]["rounds"] == 4
    assert not too_big["methods"]
    assert too_big["not_measured"]["sharedarrays"] == "needs 2M at a time, 0.0 GiB free"
    monkeypatch.setattr(overhead, "free_bytes", lambda cfg: 64 * mib)
    run = measure.Run(cfg)
    run.overhead("cold")
    for case in run.data["overhead"]["cold"]["sizes"].values():
        assert case["objects"] == "made before the round"
        assert set(case["methods"]) == {"sharedarrays", "shm", "safe"}


def test_bench_dask_part_alone(tmp_path: Path) -> None:
    pytest.importorskip("distributed", reason="pip install 'sharedarrays[dask]'")
    out_json = tmp_path / "bench.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--only", "dask",
         "--dask-sizes", "4K,1M", "--repeats", "3", "--warmup", "1", "--json", str(out_json)],
        capture_output=True, text=True, timeout=150, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert "results" not in data  # --only dask: no method x size table
    part = data["dask"]
    assert not part["skipped"], part["skipped"]
    assert part["sizes"] == [4096, 1 << 20]
    for method in ("sharedarrays", "dask"):
        for size in ("4096", str(1 << 20)):
            case = part["results"][method][size]
            assert case["repeats"] >= 3 and len(case["samples_ms"]) == case["repeats"]
            assert 0 < case["p10_ms"] <= case["median_ms"] <= case["p90_ms"]
    assert set(part["ratios"]) == {"4096", str(1 << 20)}
    assert all(r > 0 for r in part["ratios"].values())
    assert "dask / sa" in proc.stdout and "handoff: median ms" not in proc.stdout


def test_only_selects_parts() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu", "--only", "dask"]))
    assert not cfg.runs_measurements and set(cfg.skip) == set(config.PARTS) - {"dask"}
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu", "--only", "many,dask"]))
    assert cfg.runs_measurements and "many" not in cfg.skip and "dask" not in cfg.skip
    assert "table" in cfg.skip  # the method x size table only when asked for
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu", "--only", "table"]))
    assert cfg.runs_measurements and set(cfg.skip) == set(config.PARTS) - {"table"}
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu"]))
    assert cfg.runs_measurements and not cfg.skip
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu", "--quick"]))
    assert cfg.runs_measurements and "dask" not in cfg.skip
    assert cfg.dask_sizes == [1 << 20, 16 << 20]
    with pytest.raises(argparse.ArgumentTypeError, match="--only"):
        config.config_from_args(parser.parse_args(["--device", "cpu", "--only", "nothing"]))
