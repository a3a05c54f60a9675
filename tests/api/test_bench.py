"""The benchmark command runs end to end on the host backend (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sharedarrays.bench import config, report, sizes

ROOT = Path(__file__).resolve().parents[2]
REPEATS = 21


def test_bench_cpu_quick(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharedarrays",
            "bench",
            "--device",
            "cpu",
            "--quick",
            "--repeats",
            str(REPEATS),
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["config"]["device"] == "cpu"
    assert not data["skipped"], data["skipped"]
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
    assert data["bandwidth"]["ratio"] > 0
    assert data["many"]["count"] > 0 and data["many"]["arrays_per_s"] > 0
    assert set(data["scaling"]) == {"1", "4"}
    assert {t["status"] for t in data["targets"]} <= {"PASS", "MISS", "n/a"}
    for key in ("date_utc", "hostname", "python", "versions"):
        assert key in data["meta"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "handoff: median ms (x floor)" in proc.stdout
    assert "sharedarrays-warm" in proc.stdout and "targets" in proc.stdout


def test_targets_and_table_from_partial_results() -> None:
    gib = 1 << 30
    data = {
        "meta": {"date_utc": "d", "hostname": "h", "machine": "x86_64", "cpus": 1},
        "config": {"sizes": [gib], "tasks": ["handoff"]},
        "skipped": {"torch-warm": "not available"},
        "results": {
            m: {"handoff": {str(gib): {"median_ms": v, "p10_ms": v, "p90_ms": v, "size": gib}}}
            for m, v in [
                ("floor", 0.1),
                ("sharedarrays-warm", 0.12),
                ("sharedarrays-cold", 0.9),
                ("copy", 5000.0),
            ]
        },
    }

    def status(*words: str) -> str:
        """The status of the one target whose name has all ``words``."""
        (found,) = [r["status"] for r in report.evaluate_targets(data)
                    if all(w in r["target"] for w in words)]  # fmt: skip
        return str(found)

    assert status("warm overhead", "every size") == "PASS"
    assert status("warm overhead", "interleaved pairs") == "n/a"  # no steps part in this run
    assert status("torch") == "n/a"
    assert status("cold") == "MISS"
    assert status("1 GiB") == "PASS"
    data["steps"] = {"pairs": {"warm_minus_floor_us": 61.0, "control_minus_floor_us": 1.0,
                               "pairs": 1001}}  # fmt: skip
    assert status("warm overhead", "interleaved pairs") == "MISS"
    data["steps"]["pairs"]["warm_minus_floor_us"] = 12.0  # type: ignore[index]
    assert status("warm overhead", "interleaved pairs") == "PASS"
    data["targets"] = report.evaluate_targets(data)
    table = report.format_table(data)
    assert "skipped torch-warm" in table and "PASS" in table


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
        "print(sorted(m for m in sys.modules if m.startswith(('sharedarrays.bench', "
        "'sharedarrays.cli', 'sharedarrays.keeper_cli'))))"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_command_line_loads_the_measuring_code_only_to_run_the_bench() -> None:
    proc = _run_python(
        "import sys\n"
        "from sharedarrays.cli import main\n"
        "main(['status'])\n"
        "print(sorted(m for m in sys.modules if m.startswith('sharedarrays.bench')))"
    )
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stdout.strip().splitlines()[-1]
    assert "sharedarrays.bench.config" in loaded  # the bench's options are on the parser
    assert "sharedarrays.bench.measure" not in loaded and "sharedarrays.bench.worker" not in loaded


def test_python_m_sharedarrays_bench_takes_the_same_options() -> None:
    proc = _run_python("from sharedarrays.bench.command import main; main(['--help'])")
    via_cli = _run_python("from sharedarrays.cli import main; main(['bench', '--help'])")
    assert proc.returncode == 0 and via_cli.returncode == 0, proc.stderr + via_cli.stderr
    options = proc.stdout.partition("options:")[2]
    assert "--sizes" in options and options == via_cli.stdout.partition("options:")[2]


def test_bench_dask_part_alone(tmp_path: Path) -> None:
    pytest.importorskip("distributed", reason="pip install 'sharedarrays[dask]'")
    out_json = tmp_path / "bench.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "sharedarrays", "bench", "--device", "cpu", "--only", "dask",
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
    assert not cfg.runs_table and set(cfg.skip) == set(config.PARTS) - {"dask"}
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu", "--only", "many,dask"]))
    assert cfg.runs_table and "many" not in cfg.skip and "dask" not in cfg.skip
    cfg = config.config_from_args(parser.parse_args(["--device", "cpu", "--quick"]))
    assert cfg.runs_table and cfg.dask_sizes == [1 << 20, 16 << 20] and "dask" not in cfg.skip
    with pytest.raises(argparse.ArgumentTypeError, match="--only"):
        config.config_from_args(parser.parse_args(["--device", "cpu", "--only", "nothing"]))
