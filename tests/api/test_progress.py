"""Progress bars of fills and copies: shown when asked for (``progress=True``) and, unasked,
only in a Jupyter kernel's own process; never in a script's stderr or a pool worker by
default, and never a "leaked semaphore" warning at a script's exit."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from keeper_helpers import private_keeper

import sharedarrays as sa
from sharedarrays.api import creation

__all__ = ["private_keeper"]  # a fixture, used by name

TIMEOUT = 180  # seconds a script may take (about 10 s on two busy cores)
BAR = "%|"  # what every tqdm text bar prints ("fill:  50%|█████     | ...")
LEAK = "resource_tracker"

# Fills and copies of 256 MiB in the workers of the standard library's Pool, and a fill in
# the script itself; sys.argv[1] is the start method, sys.argv[2] the progress keyword.
SCRIPT = """
import multiprocessing as mp
import sys

import numpy as np
import sharedarrays as sa

PROGRESS = {"default": None, "asked": True}[sys.argv[2]]
N = 256 << 17  # float64 elements: 256 MiB


def fill(i):
    a = sa.ones(N, device="cpu", progress=PROGRESS)
    return float(a[-1])


def copy(i):
    a = sa.from_array(np.full(N, 2.0), device="cpu", progress=PROGRESS)
    return float(a[-1])


if __name__ == "__main__":
    with mp.get_context(sys.argv[1]).Pool(2) as pool:
        print(pool.map(fill, range(2)), pool.map(copy, range(2)))
    print(float(sa.full(N, 3.0, device="cpu")[-1]))
"""


def _run_script(tmp_path: Path, method: str, progress: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "script.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(sa.__file__).parents[1]))
    return subprocess.run(
        [sys.executable, "script.py", method, progress],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_script_and_its_pool_workers_show_no_bar_unasked(
    method: str,
    tmp_path: Path,
    private_keeper: Path,
) -> None:
    done = _run_script(tmp_path, method, "default")
    assert done.returncode == 0, done.stderr
    assert "[1.0, 1.0] [2.0, 2.0]" in done.stdout and "3.0" in done.stdout
    assert BAR not in done.stderr, done.stderr
    assert LEAK not in done.stderr, done.stderr


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_bar_asked_for_in_a_worker_leaks_no_semaphore(
    method: str,
    tmp_path: Path,
    private_keeper: Path,
) -> None:
    done = _run_script(tmp_path, method, "asked")
    assert done.returncode == 0, done.stderr
    assert "fill: " in done.stderr and "copy: " in done.stderr
    assert LEAK not in done.stderr, done.stderr


def _fake_kernel(monkeypatch: pytest.MonkeyPatch, kernel: object | None) -> None:
    """Make this process look like an IPython shell, with ``kernel`` as its kernel."""
    shell = types.SimpleNamespace(kernel=kernel)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))


def test_unasked_bars_show_only_in_a_notebook_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    big = creation.PROGRESS_BYTES
    assert not creation.show_progress(None, big)  # (pytest: no kernel)
    _fake_kernel(monkeypatch, kernel=None)  # a terminal IPython shell
    assert not creation.show_progress(None, big)
    _fake_kernel(monkeypatch, kernel=object())
    assert creation.show_progress(None, big)
    assert not creation.show_progress(None, big - 1)
    assert not creation.show_progress(False, big)
    assert creation.show_progress(True, 1)


def test_a_worker_of_a_notebook_kernel_shows_no_bar_unasked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _fake_kernel(monkeypatch, kernel=object())
    monkeypatch.setattr(creation.multiprocessing, "parent_process", lambda: object())
    assert not creation.show_progress(None, creation.PROGRESS_BYTES)
