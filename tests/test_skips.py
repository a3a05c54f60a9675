"""``make test``'s report: skips as one line per reason with a count, failures and errors in
full (pyproject.toml's addopts and conftest.py's ``pytest_terminal_summary``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from skips import summarise_skips

def pytest_terminal_summary(terminalreporter):
    summarise_skips(terminalreporter)
"""

CASES = """
import pytest

@pytest.mark.parametrize("i", range(3))
def test_gpu(i):
    pytest.skip("no usable CUDA device: no driver")

@pytest.mark.skip(reason="needs Ray")
def test_ray():
    pass

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "the failure in full"

@pytest.fixture
def broken():
    raise RuntimeError("the error in full")

def test_errs(broken):
    pass
"""


@pytest.mark.timeout(120)
def test_skips_are_one_line_per_reason_and_failures_stay_in_full(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(CASES)
    config = ["-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *config, "-p", "no:cacheprovider", "test_cases.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=100,
    )
    out = done.stdout
    assert done.returncode == 1, out
    assert "4 skipped, by reason" in out
    assert out.count("3 skipped: no usable CUDA device: no driver") == 1, out
    assert out.count("1 skipped: needs Ray") == 1, out
    assert "SKIPPED [" not in out, out  # (-ra's line per skipped test)
    assert "FAILED test_cases.py::test_fails - AssertionError: the failure in full" in out
    assert "ERROR test_cases.py::test_errs - RuntimeError: the error in full" in out
    assert "1 failed, 1 passed, 4 skipped, 1 error" in out
