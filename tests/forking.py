"""Run a function in a forked child, with a time limit, and get back what it returned."""

from __future__ import annotations

import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any


def in_forked_child(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Fork, call ``fn`` in the child and return its JSON-able result here.

    The child ends with ``os._exit`` (no test machinery runs there); one that does not answer
    within ``timeout`` seconds is killed and the test fails.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            os.close(r)
            try:
                out = {"ok": fn()}
            except BaseException as e:
                out = {"error": f"{type(e).__name__}: {e}"}
            os.write(w, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"the forked child did not answer within {timeout} s")
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    out = json.loads(data)
    if "error" in out:
        raise AssertionError(f"in the forked child: {out['error']}")
    return out["ok"]
