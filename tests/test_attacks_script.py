"""benchmarks/attacks.py (the table of attacks in docs/reliability.md) still runs: one fast
attack, once, must be defended and printed as a table row. The whole table is refreshed by
hand (``python benchmarks/attacks.py --markdown out.md``), not in the test suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "attacks.py"


@pytest.mark.timeout(120)
def test_the_attack_script_runs_one_attack(tmp_path: Path) -> None:
    out = tmp_path / "attacks.md"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--tries", "1", "--only", "pid-2-31", "--markdown", str(out)],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| payload resealed")]
    assert rows == ["| payload resealed with pid `2**31` | 1 | 1/1 PayloadError | fds +0 |"], (
        r.stdout
    )
    assert rows[0] in out.read_text()


def test_the_attack_script_lists_its_attacks() -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert "pid-2-31" in r.stdout.split() and "other-user" in r.stdout.split()
