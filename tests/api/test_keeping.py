"""Naming and parking (api/keeping.py) at the fd limit: a read-only array's handles are
opened again read-only to hand them on, which needs an fd."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from keeper_helpers import private_keeper

__all__ = ["private_keeper"]

_AT_FD_LIMIT = """
import os, resource
import numpy as np
import sharedarrays as sa
from sharedarrays.memory import live_allocations

a = sa.from_array(np.arange(4.0), readonly=True, pack=False)
a.payload()  # (this process's handle server runs: a payload names it)
before = len(os.listdir("/proc/self/fd"))
allocations = len(live_allocations())
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass


def attempt(what, fn):
    try:
        fn()
    except sa.HandleUnavailable as e:
        print(what, "refused", "ulimit -n" in str(e))
    except Exception as e:
        print(what, "raw", type(e).__name__, e)
    else:
        print(what, "done")


attempt("park", a.park)
os.close(held.pop())  # one fd: the new array's memfd, and none to open it again read-only
attempt("name", lambda: sa.from_array(np.arange(4.0), name="h2-limit", readonly=True, pack=False))
for fd in held:
    os.close(fd)
print("left", len(os.listdir("/proc/self/fd")) == before, len(live_allocations()) == allocations)
a.park()
b = sa.from_array(np.arange(4.0), name="h2-limit", readonly=True, pack=False)
print("then", sa.attach("h2-limit")[1])
sa.unlink("h2-limit")
"""


@pytest.mark.timeout(120)
def test_naming_or_parking_a_read_only_array_at_the_fd_limit(private_keeper: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _AT_FD_LIMIT], capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "park refused True",
        "name refused True",
        "left True True",
        "then 1.0",
    ], out.stdout
