"""``python -m sharedarrays top``'s live view: on a pipe it prints each refresh in full (no
terminal codes), on a terminal it redraws in place and gives the screen back; Ctrl-C ends
both with status 0 and no traceback."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sharedarrays as sa
from sharedarrays.cli import CLEAR, ENTER, LEAVE

HEADER = b"sharedarrays on this node at "
TIMEOUT = 60


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(sa.__file__).parents[1])
    return env


def _read_until(fd: int, enough: bytes, count: int, deadline: float) -> bytes:
    """Read ``fd`` until ``enough`` occurred ``count`` times (or fail at ``deadline``)."""
    data = b""
    while data.count(enough) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {data.count(enough)} refreshes before the deadline: {data!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # a pty whose other end closed
                chunk = b""
            assert chunk, f"top exited early: {data!r}"
            data += chunk
    return data


def _read_rest(fd: int, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.timeout(120)
def test_top_on_a_pipe_prints_each_refresh_and_ends_on_ctrl_c() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sharedarrays", "top", "--interval", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        assert proc.stdout is not None
        seen = _read_until(proc.stdout.fileno(), HEADER, 3, time.monotonic() + TIMEOUT)
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    out = seen + rest
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()
    assert b"\x1b" not in out  # no terminal codes in a log
    assert out.count(HEADER) >= 3
    assert b"keeper:" in out  # each refresh is the whole picture, as --once prints it


@pytest.mark.timeout(120)
def test_top_on_a_terminal_redraws_in_place_and_gives_the_screen_back() -> None:
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sharedarrays", "top", "--interval", "0.1"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=_env(),
            start_new_session=True,
        )
        os.close(slave)
        slave = -1
        try:
            seen = _read_until(master, CLEAR.encode(), 2, time.monotonic() + TIMEOUT)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(TIMEOUT) == 0
            out = seen + _read_rest(master, time.monotonic() + 10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(TIMEOUT)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert out.startswith(ENTER.encode())
    assert out.count(CLEAR.encode()) >= 2 and HEADER in out
    assert out.rstrip(b"\r\n").endswith(LEAVE.encode())
    assert b"Traceback" not in out and b"KeyboardInterrupt" not in out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m sharedarrays ARGS``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "sharedarrays", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
    )


@pytest.mark.parametrize(
    "bad",
    [
        ["--interval", "0"],
        ["--interval", "nan"],
        ["--interval", "1e300"],
        ["--once", "--timeout", "inf"],
        ["--once", "--timeout", "nan"],
        ["--once", "--timeout", "-1"],
    ],
)
def test_top_refuses_a_bad_number_of_seconds(bad: list[str]) -> None:
    # (nan and inf are floats: a socket's timeout and a sleep raised them as tracebacks)
    out = _cli("top", *bad)
    assert out.returncode == 2 and bad[-2] in out.stderr and "Traceback" not in out.stderr
    assert "usage: python -m sharedarrays top" in out.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--device", "bogus"], "usage: python -m sharedarrays demo"),
        (["--workers", "0"], "usage: python -m sharedarrays demo"),
        (["--device", "cpu", "--size", "256T", "--no-progress"], "demo: OutOfMemory: "),
        # (no such device anywhere: no driver here; on a GPU machine, no device 63)
        (["--device", "cuda:63"], "demo: BackendUnavailable: |usage: python -m sharedarrays demo"),
    ],
)
def test_demo_says_what_is_wrong_without_a_traceback(args: list[str], said: str) -> None:
    out = _cli("demo", *args)
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr
    assert any(one in out.stderr for one in said.split("|")), out.stderr


@pytest.mark.timeout(240)
def test_demo_prints_one_progress_bar() -> None:
    # (it filled its array twice, each time with a bar, so the same bar showed twice)
    out = _cli("demo", "--device", "cpu", "--size", "8M", "--workers", "2")
    assert out.returncode == 0, out.stderr
    assert "all elements verified" in out.stdout
    assert out.stderr.count("fill:   0%") == 1, out.stderr
    quiet = _cli("demo", "--device", "cpu", "--size", "8M", "--workers", "2", "--no-progress")
    assert quiet.returncode == 0 and "%|" not in quiet.stderr, quiet.stderr


@pytest.mark.timeout(240)
def test_rm_that_frees_nothing_exits_1() -> None:
    # (rm of an orphaned allocation with a payload in flight, no terminal and no --yes, left
    # it alone and exited 0: a script could not tell that nothing was freed)
    import json

    made = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sharedarrays as sa\n"
            "a = sa.zeros(1000, device='cpu', pack=False)\n"
            "pickle.dumps(a)\nprint(a.allocation.id)",
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=_env(),
    )
    assert made.returncode == 0, made.stderr
    alloc_id = made.stdout.strip()
    try:
        rm = subprocess.run(
            [sys.executable, "-m", "sharedarrays", "rm", alloc_id[:12]],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env=_env(),
            stdin=subprocess.DEVNULL,
        )
        assert rm.returncode == 1 and "left alone: payloads in flight" in rm.stdout
        listed = json.loads(_cli("top", "--json").stdout)["allocations"]
        assert any(row["id"] == alloc_id for row in listed)
    finally:
        assert _cli("rm", "--yes", alloc_id[:12]).returncode == 0
