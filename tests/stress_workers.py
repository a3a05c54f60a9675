"""A child script for tests/test_stress.py: every user operation under one stress condition.

    python tests/stress_workers.py CONDITION [MIB]

CONDITION is ``fds`` (``RLIMIT_NOFILE`` 32, then the operations again with 0 to 6 fds left),
``memory`` (``RLIMIT_AS`` MIB above the interpreter's own size), ``keeper-stopped``
(the keeper SIGSTOPped after it holds a named array) or ``keeper-killed``. The operations
run one after the other; each prints one JSON line: ``{"op", "error", "shared", "seconds"}``
(``error`` is the exception's type name or ``null``; ``shared``, whether it is a
SharedArrayError). The caller's environment gives the private runtime directory.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import sharedarrays as sa
from sharedarrays.transport import keeper


def report(op: str, fn: Callable[[], Any]) -> Any:
    start = time.monotonic()
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:
        error = e
    print(
        json.dumps(
            {
                "op": op,
                "error": None if error is None else type(error).__name__,
                "message": "" if error is None else str(error)[:300],
                "shared": isinstance(error, sa.SharedArrayError),
                "seconds": round(time.monotonic() - start, 3),
            }
        ),
        flush=True,
    )
    return result


def load_elsewhere(blob: bytes) -> float:
    """Load ``blob`` in a fresh interpreter (it inherits this process's limits)."""
    code = "import pickle, sys; a = pickle.loads(sys.stdin.buffer.read()); print(float(a.sum()))"
    run = subprocess.run(
        [sys.executable, "-c", code], input=blob, capture_output=True, timeout=60, check=False
    )
    if run.returncode:
        raise sa.SharedArrayError(run.stderr.decode()[-300:])  # (judged by its own report)
    return float(run.stdout)


def operations(tag: str) -> None:
    """Every operation a user does, each reported on its own."""
    a = report(f"{tag}zeros", lambda: sa.zeros(1000))
    if a is not None:
        report(f"{tag}write", lambda: a.__setitem__(slice(None), 1.0))
        blob = report(f"{tag}dumps", lambda: pickle.dumps(a))
        if blob is not None:
            b = report(f"{tag}loads", lambda: pickle.loads(blob))
            if b is not None:
                report(f"{tag}close-import", b.close)
        report(f"{tag}park", a.park)
        report(f"{tag}unpark", a.unpark)
        report(f"{tag}close", a.close)
    ro = report(
        f"{tag}name-readonly",
        lambda: sa.from_array(np.arange(10.0), name=f"ro-{tag}", readonly=True),
    )
    report(f"{tag}attach", lambda: sa.attach(f"ro-{tag}").close())
    report(f"{tag}list", sa.list_named)
    report(f"{tag}unlink", lambda: sa.unlink(f"ro-{tag}"))
    if ro is not None:
        report(f"{tag}park-readonly", ro.park)
        report(f"{tag}close-readonly", ro.close)
    report(f"{tag}big", lambda: sa.empty(1 << 40, "uint8", device="cpu"))


def use_up_fds(spare: int) -> list[int]:
    """Open fds until only ``spare`` are left under the soft limit."""
    held = []
    while True:
        try:
            held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            break
    for _ in range(min(spare, len(held))):
        os.close(held.pop())
    return held


def main(condition: str) -> None:
    if condition == "fds":
        resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
        operations("")
        for spare in range(7):
            held = use_up_fds(spare)
            operations(f"spare{spare}-")
            for fd in held:
                os.close(fd)
    elif condition == "memory":
        with open("/proc/self/status") as f:
            size = next(int(x.split()[1]) for x in f if x.startswith("VmSize:")) * 1024
        margin = int(sys.argv[2]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (size + margin, resource.RLIM_INFINITY))
        operations("")
    elif condition in ("keeper-stopped", "keeper-killed"):
        named = sa.from_array(np.arange(10.0), name="held")
        pid = keeper.running_pid()
        assert pid is not None, "no keeper"
        os.kill(pid, signal.SIGSTOP if condition == "keeper-stopped" else signal.SIGKILL)
        report("attach-held", lambda: sa.attach("held").close())
        operations("")
        report("close-named", named.close)
        in_flight = [sa.zeros(10) for _ in range(2)]
        report("dumps-in-flight", lambda: [pickle.dumps(x) for x in in_flight])
        report("load-elsewhere", lambda: load_elsewhere(pickle.dumps(in_flight[0])))
        print(json.dumps({"op": "exit", "at": time.time()}), flush=True)
    else:
        raise SystemExit(f"unknown condition {condition!r}")


if __name__ == "__main__":
    main(sys.argv[1])
