"""Node identity (sharedarrays.node), its setting, and the refusal of a payload made on
another node."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.node import NODE_VARIABLE, machine_node, this_node
from sharedarrays.protocol.payload import Payload
from sharedarrays.settings import env_word

_LOAD = """
import pickle, sys
import sharedarrays as sa
blob = sys.stdin.buffer.read()
try:
    a = pickle.loads(blob)
except sa.WrongNode as e:
    print("WrongNode", e)
else:
    a[0] = 7
    print("loaded", float(a[1]))
"""


def _load_in_child(blob: bytes, node: str | None) -> str:
    env = dict(os.environ)
    env.pop(NODE_VARIABLE, None)
    if node is not None:
        env[NODE_VARIABLE] = node
    out = subprocess.run(
        [sys.executable, "-c", _LOAD], input=blob, env=env, capture_output=True, timeout=60
    )
    assert out.returncode == 0, out.stderr.decode()
    return out.stdout.decode()


def test_the_machine_node_is_a_digest_of_this_process_facts() -> None:
    node = machine_node()
    assert re.fullmatch(r"[0-9a-f]{32}", node)
    child = subprocess.run(
        [sys.executable, "-c", "from sharedarrays.node import machine_node; print(machine_node())"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != NODE_VARIABLE},
    )
    assert child.stdout.strip() == node  # same boot, user and namespaces: same node


def test_the_setting_claims_another_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_VARIABLE, raising=False)
    assert this_node() == machine_node()
    monkeypatch.setenv(NODE_VARIABLE, "rack2-node7")
    assert this_node() == "rack2-node7"
    monkeypatch.setenv(NODE_VARIABLE, "not a node/id")
    with pytest.raises(ValueError, match=NODE_VARIABLE):
        this_node()


def test_env_word(monkeypatch: pytest.MonkeyPatch) -> None:
    pattern = re.compile(r"[a-z]+")
    monkeypatch.delenv("SHAREDARRAYS_TEST_WORD", raising=False)
    assert env_word("SHAREDARRAYS_TEST_WORD", pattern, "letters") is None
    monkeypatch.setenv("SHAREDARRAYS_TEST_WORD", " abc ")
    assert env_word("SHAREDARRAYS_TEST_WORD", pattern, "letters") == "abc"
    monkeypatch.setenv("SHAREDARRAYS_TEST_WORD", "ab1")
    with pytest.raises(ValueError, match="SHAREDARRAYS_TEST_WORD='ab1' is not letters"):
        env_word("SHAREDARRAYS_TEST_WORD", pattern, "letters")


def test_a_payload_carries_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_VARIABLE, raising=False)
    a = sa.zeros(4, pack=False)
    p = a.payload()
    assert p.node == machine_node()
    assert Payload.from_bytes(p.to_bytes()).node == p.node
    assert Payload.from_doc(p.to_doc()) == p
    doc = p.to_doc()
    doc["node"] = "bad node"
    with pytest.raises(sa.PayloadError, match="node"):
        Payload.from_doc(doc)
    a.close()


@pytest.mark.timeout(120)
def test_a_payload_loaded_on_another_node_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_VARIABLE, raising=False)
    a = sa.from_array(np.arange(4.0), pack=False)
    blob = pickle.dumps(a)
    out = _load_in_child(blob, "elsewhere")
    assert out.startswith("WrongNode"), out
    assert "elsewhere" in out and machine_node() in out
    assert a[0] == 0  # nothing was opened there
    # the same payload on this node loads and writes through
    assert _load_in_child(blob, None) == "loaded 1.0\n"
    assert a[0] == 7
    a.close()


@pytest.mark.timeout(120)
def test_processes_claiming_one_node_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_VARIABLE, "node-a")
    a = sa.from_array(np.arange(4.0), pack=False)
    blob = pickle.dumps(a)
    assert a.payload().node == "node-a"
    assert _load_in_child(blob, "node-a") == "loaded 1.0\n"
    assert _load_in_child(blob, None).startswith("WrongNode")
    a.close()


_AT_FD_LIMIT = """
import os, resource, sys
import sharedarrays as sa
from sharedarrays import node
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    got = node.machine_node()
except sa.HandleUnavailable as e:
    print("refused", "ulimit -n" in str(e))
else:
    print("answered", got == sys.argv[1])
for fd in held:
    os.close(fd)
print("then", node.machine_node() == sys.argv[1])
"""


@pytest.mark.timeout(120)
def test_a_node_id_unread_at_the_fd_limit_is_read_again() -> None:
    # at the fd limit the boot id cannot be read: an error, not a node id of its own kept
    # for the process's life (which would refuse every payload as another machine's)
    out = subprocess.run(
        [sys.executable, "-c", _AT_FD_LIMIT, machine_node()],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != NODE_VARIABLE},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n") == ["refused True", "then True", ""], out.stdout
