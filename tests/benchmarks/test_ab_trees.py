"""``benchmarks/ab_trees.py``: its ``--off`` copies switch off exactly the cache they name, so
the A/B figures quoted beside each cache stay reproducible (no timing assertions)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ab_trees.py"
_spec = importlib.util.spec_from_file_location("ab_trees", SCRIPT)
assert _spec is not None and _spec.loader is not None
ab_trees = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_trees)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(ROOT / "sharedarrays", root / "sharedarrays")
    return root


@pytest.mark.parametrize("cache", sorted(ab_trees.OFF))
def test_off_changes_one_line_of_the_package(tree: Path, cache: str) -> None:
    path, line, off = ab_trees.OFF[cache]
    copy = Path(ab_trees._without(str(tree), cache))
    changed = [
        p.relative_to(copy).as_posix()
        for p in copy.rglob("*.py")
        if p.read_text() != (tree / p.relative_to(copy)).read_text()
    ]
    assert changed == [f"sharedarrays/{path}"]
    text = (copy / changed[0]).read_text()
    assert line not in text.replace(off, "") and off in text


def test_a_short_run_prints_the_paired_differences(tree: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--pairs", "20", "--off", "parts", str(tree)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    assert "20 interleaved pairs, warm" in out
    assert "B - A (order-balanced)" in out


def test_a_short_cold_run_prints_the_paired_differences(tree: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--pairs", "10", "--case", "cold", str(tree), str(tree)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    ).stdout
    assert "10 interleaved pairs, cold" in out
    assert "B - A (order-balanced)" in out
