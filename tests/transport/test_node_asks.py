"""Asking every process of this user (sharedarrays.transport.node): processes that do not
answer are asked at the same time, so a node with many stopped processes answers in about
one timeout, each one named."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from keeper_helpers import private_keeper

from sharedarrays.transport import node as transport_node

__all__ = ["private_keeper"]

pytestmark = pytest.mark.timeout(120)


def test_handle_servers_are_asked_at_the_same_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # (they were asked one after the other: each stopped process added its whole timeout)
    n = 8
    together = threading.Barrier(n, timeout=30)

    def ask(pid: int, path: str, timeout: float = 1.0) -> transport_node.Answer:
        together.wait()  # only returns once all n are being asked at once
        return transport_node.Answer(pid, path, "no answer")

    servers = [(100_000 + i, f"/nowhere/{100_000 + i}-x.sock") for i in range(n)]
    monkeypatch.setattr(transport_node, "handle_servers", lambda: servers)
    monkeypatch.setattr(transport_node, "ask", ask)
    answers = transport_node.ask_all(1.0)
    assert [(a.pid, a.path) for a in answers] == servers  # (still by pid)


def test_many_processes_that_do_not_answer_cost_about_one_timeout(private_keeper: Path) -> None:
    # Handle-server sockets that listen and never accept, as a SIGSTOPped process's: named by one
    # that runs (a sleeping child), so each is "no answer", not "gone".
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    n, timeout = 10, 2.0
    listeners = []
    try:
        private_keeper.mkdir(mode=0o700, exist_ok=True)
        for i in range(n):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(str(private_keeper / f"{child.pid}-stopped{i}.sock"))
            s.listen(4)
            listeners.append(s)
        started = time.monotonic()
        answers = transport_node.ask_all(timeout)
        took = time.monotonic() - started
    finally:
        for s in listeners:
            s.close()
        child.kill()
        child.wait()
    assert [a.status for a in answers] == ["no answer"] * n
    assert {a.pid for a in answers} == {child.pid}
    assert took < n * timeout / 2, f"{n} silent processes took {took:.1f} s"
