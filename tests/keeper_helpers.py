"""Shared by the keeper, fault and fuzz tests: a private keeper per test, subprocess helpers."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from sharedarrays.protocol import keeper as wire
from sharedarrays.transport import handles as transport
from sharedarrays.transport import keeper

IDLE = "2"  # seconds a test keeper waits, holding nothing, before it exits
CLI_TIMEOUT = 60  # seconds one `python -m sharedarrays` command of a test may take


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``python -m sharedarrays *args`` with this checkout's package, ``stdin`` as its input,
    its output captured as text; killed after :data:`CLI_TIMEOUT` seconds."""
    import sharedarrays

    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(sharedarrays.__file__).parents[1])
    return subprocess.run(
        [sys.executable, "-m", "sharedarrays", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
        env=env,
        input=stdin,
    )


@pytest.fixture
def private_keeper(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh runtime directory (so a fresh keeper) for this test and its subprocesses.

    A short path under /tmp: Unix socket paths are limited to 107 bytes.
    """
    transport.server_address()  # this process's handle server stays in the usual directory
    base = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    os.chmod(base, 0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    monkeypatch.setenv("SHAREDARRAYS_KEEPER_IDLE", IDLE)
    keeper.disconnect()
    try:
        yield base / "sharedarrays"
    finally:
        keeper.disconnect()
        pid = lock_holder(base / "sharedarrays")
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
                wait_gone(pid)
            except ProcessLookupError:
                pass
        shutil.rmtree(base, ignore_errors=True)


def lock_holder(directory: Path) -> int | None:
    """The pid of the live keeper of ``directory`` (from its lock file), if any."""
    try:
        text = (directory / "keeper.lock").read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        return None
    pid = int(text)
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.NoSuchProcess:
        return None
    return pid


def wait_gone(pid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} did not exit within {timeout} s")


def keeper_memfds(pid: int) -> int:
    """How many chunk handles the process ``pid`` holds open: memfds of the host backend,
    and CUDA's exported handles (fds of /dev/nvidiactl; the keeper has no CUDA context, so
    every such fd it holds is a chunk). A keeper that exited (idle) holds none."""
    n = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/memfd:sharedarrays") or target == "/dev/nvidiactl":
                n += 1
        except OSError:
            continue
    return n


def keeper_status() -> dict[str, object]:
    status, body, _ = keeper.request(wire.Status(), start=False)
    assert status == wire.OK
    return body


def py(code: str, timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; fail with its stderr if it fails."""
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, **kw
    )  # type: ignore[call-overload]
    assert r.returncode == 0, f"subprocess failed ({r.returncode}):\n{r.stderr}"
    return r  # type: ignore[no-any-return]


def spawn(code: str) -> subprocess.Popen[str]:
    """Start ``code`` in a fresh interpreter with pipes for stdin and stdout."""
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop(pid: int, timeout: float = 30.0) -> None:
    """Stop process ``pid`` with SIGSTOP and return once every thread of it is stopped.

    ``kill`` returns as soon as the signal is queued; the process stops when one of its
    threads takes the signal, and until then the others run on (a handle server thread can
    still answer a request). Fails the test if it is not stopped within ``timeout`` seconds.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat", "rb") as f:
                    states.append(f.read().rsplit(b")", 1)[1].split()[0])
            except FileNotFoundError:  # (a thread that just ended)
                continue
        if states and all(state in (b"T", b"t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.001)


def takes_refused() -> str | None:
    """Why this system refuses a parent the fds of its children (``pidfd_getfd``), or ``None``."""
    release = os.uname().release
    if tuple(int(x) for x in release.split(".")[:2]) < (5, 6):
        return f"Linux {release} has no pidfd_getfd (5.6 and later)"
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if scope.exists() and int(scope.read_text()) >= 2:
        return f"Yama's ptrace_scope is {scope.read_text().strip()}: only admins may take fds"
    return None


def close_pipes(proc: subprocess.Popen[str]) -> None:
    """Close a finished child's pipes (each test counts its fds)."""
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def read_json_line(proc: subprocess.Popen[str], timeout: float = 60) -> dict[str, object]:
    """The next stdout line of ``proc``, as JSON (fails on EOF)."""
    assert proc.stdout is not None
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise AssertionError("subprocess said nothing in time")
    line = proc.stdout.readline()
    if not line:
        err = proc.stderr.read() if proc.stderr else ""
        raise AssertionError(f"subprocess ended early:\n{err}")
    return json.loads(line)  # type: ignore[no-any-return]


def pid_of(_: object) -> int:
    """Pool task: the worker's pid."""
    return os.getpid()


def checksum_blob(blob: bytes) -> float:
    """Pool task: load a plain-pickle payload and sum it (float64)."""
    import pickle

    import numpy as np

    a = pickle.loads(blob)
    return float(a.get().astype(np.float64).sum())
