"""``python -m sharedarrays ls``: a keeper that is stopped is said in one line, never as a
traceback, and its sizes read as ``top``'s (``24 KiB``, not ``24K``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from keeper_helpers import lock_holder, private_keeper, run_cli

import sharedarrays as sa

__all__ = ["private_keeper"]

TIMEOUT = 60


def _park_one() -> None:
    """A process that parks a 3000-float array (24 000 bytes: 24 KiB mapped) and exits."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(sa.__file__).parents[1])
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sharedarrays as sa\n"
            "a = sa.zeros(3000, device='cpu', pack=False)\na.park()\na.close()",
        ],
        check=True,
        timeout=TIMEOUT,
        env=env,
    )


@pytest.mark.timeout(120)
def test_ls_sizes_read_as_tops(private_keeper: Path) -> None:
    _park_one()
    out = run_cli("ls", "--all")
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("(parked "))
    # (SIZE said 24K beside LOST's 576 B)
    assert " 24 KiB " in row and " 576 B " in row and "24K" not in row


@pytest.mark.timeout(120)
def test_ls_and_top_with_a_stopped_keeper_say_so_without_a_traceback(
    private_keeper: Path,
) -> None:
    _park_one()
    pid = lock_holder(private_keeper)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        ls = run_cli("ls", "--all")
        top = run_cli("top", "--once", "--timeout", "0.5")
    finally:
        os.kill(pid, signal.SIGCONT)
    # (ls printed KeeperError's traceback)
    assert ls.returncode == 1 and "Traceback" not in ls.stderr
    assert ls.stderr.startswith("ls: the keeper did not answer"), ls.stderr
    # (top said "keeper: no answer" and not which process it was)
    assert top.returncode == 0, top.stderr
    assert f"keeper: no answer; pid {pid} (keeper) no answer" in top.stdout, top.stdout
