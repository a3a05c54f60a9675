"""Cross-process ordering (``sharedarrays.backends.cuda.sync``) on the CPU: the ``no_sync``
switch, token parsing, process start times. The GPU side (events ordering a consumer after a
producer, one record per message, the ring) is in ``backends/test_cuda_vmm.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sharedarrays.backends.cuda import sync
from sharedarrays.errors import PayloadError
from sharedarrays.process import start_time

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def child_env() -> dict[str, str]:
    """The environment for a fresh interpreter that must import sharedarrays from here."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def test_no_sync_switch() -> None:
    assert sync.sync_enabled()
    with sync.no_sync():
        assert not sync.sync_enabled()
        assert sync.export_sync(object()) is None  # type: ignore[arg-type]
        seen: list[bool] = []
        t = threading.Thread(target=lambda: seen.append(sync.sync_enabled()))
        t.start()
        t.join()
        assert seen == [True]  # the switch is local to this thread
        with sync.no_sync():
            pass
        assert not sync.sync_enabled()
    assert sync.sync_enabled()


def test_sync_token_checks() -> None:
    with pytest.raises(PayloadError, match="sync token"):
        sync._event_for(None, b"short")
    # A token whose exporter has exited needs no wait (and touches no driver).
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = int(proc.stdout)
    token = sync._HEAD.pack(dead, 12345) + bytes(64) + bytes(8)
    assert sync._event_for(None, token) is None
    # A token naming this process but no event of it is malformed.
    mine = sync._HEAD.pack(os.getpid(), 0) + b"\x01" * 64 + bytes(8)
    with pytest.raises(PayloadError, match="never exported"):
        sync._event_for(None, mine)


def test_process_start_time() -> None:
    assert start_time(os.getpid()) == sync._my_start_time() > 0
    assert start_time(2**31 + 7) is None
