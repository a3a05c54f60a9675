"""Shared fixtures. Tests mirror the package: test_<module>.py per module."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Spawned children import helper functions from ``workers``: make tests/ importable there.
TESTS = str(Path(__file__).parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS, str(Path(TESTS).parent), os.environ.get("PYTHONPATH", "")) if p
)

# The suite never shares a runtime directory (handle-server sockets, the keeper) with the
# user's: one private directory for this run and every process it starts (a short path:
# Unix socket paths are limited to 107 bytes). Removed at exit, after sharedarrays' own exit
# hooks (atexit runs them last-registered first), with its keeper stopped.
RUNTIME_BASE = tempfile.mkdtemp(prefix="sa-test-", dir="/tmp")
os.environ["XDG_RUNTIME_DIR"] = RUNTIME_BASE


@atexit.register
def _remove_runtime_dir() -> None:
    try:  # (its keeper's pid is in its lock file; nothing is imported this late)
        pid = int((Path(RUNTIME_BASE) / "sharedarrays" / "keeper.lock").read_text())
        if b"sharedarrays" in Path(f"/proc/{pid}/cmdline").read_bytes():  # (not a pid reused)
            os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass
    shutil.rmtree(RUNTIME_BASE, ignore_errors=True)


NUMERIC_DTYPES = [
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
"""Every dtype a shared array holds."""


def open_fds() -> int:
    """Number of open file descriptors of this process (after a full collection, and once
    the notifier thread has sent what it was asked to: it holds a socket while it sends),
    not counting the handle connections transport keeps open on purpose (one per peer
    process, bounded, closed with their peer:
    :func:`sharedarrays.transport.handles.open_connections`)."""
    import time

    import psutil

    from sharedarrays.transport import client
    from sharedarrays.transport import handles as transport

    gc.collect()
    deadline = time.monotonic() + 10
    while client.pending_notices() and time.monotonic() < deadline:
        time.sleep(0.01)

    def count() -> int:
        return psutil.Process().num_fds() - transport.open_connections()

    # a server thread accepting or closing a connection changes the two counts one after
    # the other: take a count that holds for 10 ms
    last = count()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        now = count()
        if now == last:
            break
        last = now
    return last


def open_memfds() -> int:
    """memfds open in this process (the host backend's chunks, which views or handles hold):
    unlike :func:`open_fds`, not moved by sockets other threads open and close meanwhile."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        except OSError:  # (closed since it was listed)
            pass
    return n


def fd_targets() -> set[str]:
    """This process's open fds as ``"N -> target"`` lines (to say which ones leaked)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue
    return out


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (read without blocking, after the replies it had
    queued)."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


@pytest.fixture
def fd_baseline() -> Iterator[None]:
    """Fail the test if it leaves file descriptors open (more than before, as
    :func:`open_fds` counts them).

    Fewer is no leak: what an earlier test left behind may close its fds while this one
    runs (a pool's threads close its pipes a moment after it ends; this process's handle
    server closes the connection of an importer that has exited when it sees it closed)."""
    import time

    before = open_fds()
    yield
    # (counted again for a few seconds when it differs: this process's handle server closes
    # an importer's connection when it sees it closed, on its own thread, and stops counting
    # it just before; a leak stays, that moment passes)
    from sharedarrays.process import STATE

    STATE.memory.cache.trim()  # (what it keeps for reuse is held, not leaked: freed here)
    after = open_fds()
    deadline = time.monotonic() + 5
    while after > before and time.monotonic() < deadline:
        time.sleep(0.05)
        STATE.memory.cache.trim()  # (and what a DONE notice moved there since)
        after = open_fds()
    assert after <= before, f"{after - before} file descriptors leaked"


def cuda_reason() -> str | None:
    from sharedarrays.backends import kind_unusable

    return kind_unusable("cuda", 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = None
    checked = False
    for item in items:
        if item.get_closest_marker("gpu") is None:
            continue
        if not checked:
            reason, checked = cuda_reason(), True
        if reason is not None:
            item.add_marker(pytest.mark.skip(reason=f"no usable CUDA device: {reason}"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Skipped tests as one line per reason with a count (``-rfE`` in pyproject.toml
    reports failures and errors one by one, skips not at all)."""
    from skips import summarise_skips

    summarise_skips(terminalreporter)


@pytest.fixture(autouse=True)
def _transport_loads_ask_the_server(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handle server's tests (``tests/transport/``) load through it: no load there takes
    the fds out of an exporter itself (those that test taking set the setting back to 1)."""
    if request.path.parent.name == "transport":
        monkeypatch.setenv("SHAREDARRAYS_TAKE_FDS", "0")  # (spawned workers inherit it)


@pytest.fixture
def no_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrays made in the test (and its children) are not kept for reuse when released
    (``SHAREDARRAYS_CACHE_BYTES=0``), and nothing an earlier test released is kept: what a
    release does to memory the cache does not keep."""
    from sharedarrays.memory import empty_cache

    monkeypatch.setenv("SHAREDARRAYS_CACHE_BYTES", "0")
    empty_cache()
