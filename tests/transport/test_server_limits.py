"""The handle server where no thread can start (``ulimit -v``): a SharedArrayError, and
nothing of it (socket, socket file) left behind."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

import sharedarrays as sa

_NO_THREADS = """
import glob, os, pickle, resource, sys, threading
import numpy as np
import sharedarrays as sa
from sharedarrays.protocol.unix import runtime_dir

blob = sys.stdin.buffer.read()
mine = sa.from_array(np.arange(4.0), pack=False)
threading.stack_size(64 << 20)  # (a thread needs more than the limit leaves: no new thread)


def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def held():
    socks = glob.glob(f"{runtime_dir()}/{os.getpid()}-*")
    maps = sum("memfd" in line for line in open("/proc/self/maps"))
    return len(os.listdir("/proc/self/fd")), len(socks), maps


before = held()
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (16 << 20), resource.RLIM_INFINITY))
for attempt in (lambda: pickle.loads(blob), lambda: pickle.dumps(mine)) * 2:
    try:
        attempt()
    except sa.ThreadUnavailable as e:
        print("refused", "ulimit -v" in str(e))
    except Exception as e:
        print("raw", type(e).__name__, e)
    else:
        print("done")
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print("left", held() == before)
threading.stack_size(0)
print("then", pickle.loads(blob)[1], len(pickle.dumps(mine)) > 0)
"""


@pytest.mark.timeout(120)
def test_no_thread_for_the_handle_server_is_an_error_that_leaves_nothing() -> None:
    a = sa.from_array(np.arange(4.0), pack=False)
    out = subprocess.run(
        [sys.executable, "-c", _NO_THREADS],
        input=pickle.dumps(a),
        capture_output=True,
        text=False,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr.decode()
    lines = out.stdout.decode().splitlines()
    assert lines == ["refused True"] * 4 + ["left True", "then 1.0 True"], lines
    a.close()
