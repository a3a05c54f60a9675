"""Fuzzing: malformed payloads (client side) and malformed keeper messages (keeper side).

Every malformed payload raises a SharedArrayError subclass; every malformed keeper message
gets an error reply (or, for a message with no reply, nothing), and the keeper keeps serving
with no fd leaked. The counts are recorded in docs/reliability.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from keeper_helpers import lock_holder, private_keeper

import sharedarrays as sa
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol.payload import MAGIC, TAG_BYTES, _tag
from sharedarrays.transport import keeper

__all__ = ["private_keeper"]

PAYLOAD_CASES = 6000
KEEPER_CASES = 4000

_A = sa.from_array(np.arange(64, dtype=np.int32).reshape(8, 8), device="cpu", pack=False)
_BLOB = _A[2:, 1::3].payload().to_bytes()
_DOC = json.loads(_BLOB[len(MAGIC) + TAG_BYTES :])
_COUNT = {"payloads": 0, "keeper": 0, "loaded": 0}

_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)


def _reseal(doc: dict[str, object]) -> bytes:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + _tag(body, bytes.fromhex(str(doc["secret"]))) + body


@st.composite
def malformed_payloads(draw: st.DrawFn) -> tuple[str, bytes]:
    """(kind, bytes): for kind "pickle" a pickle of the reconstructor's argument."""
    kind = draw(st.sampled_from(["bytes", "flip", "splice", "field", "fields", "drop", "pickle"]))
    return kind, _malformed(draw, kind)


def _malformed(draw: st.DrawFn, kind: str) -> bytes:
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    blob = bytearray(_BLOB)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(blob) - 1))
            blob[i] ^= draw(st.integers(1, 255))
        return bytes(blob)
    if kind == "splice":
        i = draw(st.integers(0, len(blob)))
        j = draw(st.integers(i, len(blob)))
        return bytes(blob[:i] + draw(st.binary(max_size=40)) + blob[j:])
    if kind == "pickle":  # a pickle that calls the reconstructor with junk arguments
        arg = draw(st.binary(max_size=64) | st.just(_BLOB[:-1]))
        return pickle.dumps(arg)
    doc = dict(_DOC)
    keys = sorted(set(doc) - {"secret"})
    if kind == "drop":
        del doc[draw(st.sampled_from(keys))]
    else:
        many = 1 if kind == "field" else 4
        for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=many)):
            doc[key] = draw(_JSON)
    return _reseal(doc)


@settings(max_examples=PAYLOAD_CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=malformed_payloads())
def test_malformed_payloads_raise_shared_array_errors(case: tuple[str, bytes]) -> None:
    _COUNT["payloads"] += 1
    kind, blob = case
    try:
        if kind == "pickle":  # the reconstructor called with a junk allocation payload
            from sharedarrays.api.array import _rebuild_view
            from sharedarrays.importing import import_part

            v = _rebuild_view(import_part(pickle.loads(blob)), _A[2:, 1::3]._view_tuple())
        else:
            v = sa.load(blob)
    except sa.SharedArrayError:
        return
    # a forged payload may be well formed: then it is a view inside the same allocation
    _COUNT["loaded"] += 1
    assert v.allocation is _A.allocation
    from sharedarrays.protocol.payload import view_extent

    low, high = view_extent(v.itemsize, v.shape, v.strides)
    assert v.offset + low >= 0 and v.offset + high <= _A.allocation.size


# ---------------------------------------------------------------------------------------------
# keeper messages

_OPS = ["hello", "keep", "attach", "fetch", "release", "unlink", "list", "status", "", "nope"]
_FIELDS = ["op", "name", "id", "secret", "sizes", "doc", "allow_pids"]
_GOOD = {
    "name": "fuzz",
    "id": "ab" * 16,
    "secret": "cd" * 32,
    "sizes": [4096],
    "doc": {"backend": "host"},
    "allow_pids": None,
}


@st.composite
def keeper_messages(draw: st.DrawFn) -> tuple[bytes, int]:
    """(message bytes, number of fds to attach)."""
    kind = draw(st.sampled_from(["raw", "magic-junk", "json", "request", "request", "request"]))
    nfds = draw(st.sampled_from([0, 0, 0, 1, 2]))
    if kind == "raw":
        return draw(st.binary(min_size=1, max_size=200)), nfds
    if kind == "magic-junk":
        return wire.MAGIC + draw(st.binary(max_size=200)), nfds
    if kind == "json":
        return wire.MAGIC + json.dumps(draw(_JSON)).encode(), nfds
    req: dict[str, object] = {"op": draw(st.sampled_from(_OPS) | st.text(max_size=8) | _JSON)}
    for key in draw(st.lists(st.sampled_from(_FIELDS[1:]), max_size=6, unique=True)):
        req[key] = draw(st.just(_GOOD[key]) | _JSON | st.text(max_size=140))
    if draw(st.booleans()) and "name" in req:
        req["name"] = draw(st.sampled_from(["x" * 129, "../x", "", "ok-name", "a b"]))
    return wire.MAGIC + json.dumps(req).encode(), nfds


class _Client:
    def __init__(self, path: str) -> None:
        self.path = path
        self.sock = self._open()

    def _open(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        s.connect(self.path)
        return s

    def send(self, msg: bytes, nfds: int) -> None:
        fds = [os.memfd_create("fuzz", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING) for _ in range(nfds)]
        for fd in fds:  # sealed like a chunk: the keeper refuses a memfd that could shrink
            os.ftruncate(fd, 4096)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        try:
            socket.send_fds(self.sock, [msg], fds) if fds else self.sock.send(msg)
        except OSError:
            self.sock.close()
            self.sock = self._open()
        finally:
            for fd in fds:
                os.close(fd)

    def replies_until_hello(self) -> list[tuple[int, dict[str, object]]]:
        """Ping the keeper and collect every reply up to the ping's (a liveness check)."""
        self.sock.send(wire.MAGIC + b'{"op":"hello","ping":1}')
        out = []
        while True:
            msg, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_MESSAGE, wire.MAX_FDS)
            for fd in fds:
                os.close(fd)
            assert msg, "the keeper closed the connection"
            assert msg[:4] == wire.MAGIC
            status, body = msg[4], json.loads(msg[5:])
            if status == wire.OK and set(body) == {"pid", "version"}:
                return out
            out.append((status, body))


@pytest.fixture
def fuzz_client(private_keeper: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Client]:
    # (no idle exit mid-run: a loaded machine may pause between examples longer than the
    # test keeper's 2 s, and the keeper holds nothing; the fixture stops it at the end)
    monkeypatch.setenv("SHAREDARRAYS_KEEPER_IDLE", "600")
    keeper.ensure_running()
    client = _Client(str(private_keeper / "keeper.sock"))
    client.replies_until_hello()  # accepted: the keeper's fds now count this connection
    yield client
    client.sock.close()


@settings(max_examples=KEEPER_CASES, deadline=None, suppress_health_check=list(HealthCheck))
@given(message=keeper_messages())
def test_malformed_keeper_messages_get_error_replies(
    fuzz_client: _Client, message: tuple[bytes, int]
) -> None:
    _COUNT["keeper"] += 1
    msg, nfds = message
    fuzz_client.send(msg, nfds)
    replies = fuzz_client.replies_until_hello()
    assert len(replies) <= 1
    for status, body in replies:
        assert status in (wire.OK, wire.ERROR, wire.NOT_FOUND, wire.EXISTS, wire.DENIED)
        if status != wire.OK:
            assert isinstance(body.get("error"), str)


def _settled_fd_count(pid: int, expected: int, timeout: float = 5.0) -> int:
    """The number of fds ``pid`` has once it equals ``expected`` or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while True:
        count = len(os.listdir(f"/proc/{pid}/fd"))
        if count == expected or time.monotonic() > deadline:
            return count
        time.sleep(0.01)


def test_keeper_survives_fuzzing_without_leaks(fuzz_client: _Client, private_keeper: Path) -> None:
    """Run after the fuzz test's pattern: junk, then check the keeper's fds balance."""
    kpid = lock_holder(private_keeper)
    assert kpid is not None
    fuzz_client.replies_until_hello()  # the keeper has accepted our connection: counted
    before = len(os.listdir(f"/proc/{kpid}/fd"))
    for i in range(300):
        fuzz_client.send(wire.MAGIC + json.dumps({"op": "keep", "id": i}).encode(), 2)
        fuzz_client.send(b"\xff" * (wire.MAX_MESSAGE + 10), 1)  # too long: truncated
    fuzz_client.replies_until_hello()
    # a too-long message may make the client reconnect; the keeper closes the old connection
    # when it reads its EOF, which can come after it answered the new one's hello
    assert _settled_fd_count(kpid, before) == before
    # a keep with valid fields is kept, and freed when unlinked
    req = {"op": "keep", **_GOOD}
    fuzz_client.send(wire.MAGIC + json.dumps(req).encode(), 1)
    [(status, _)] = fuzz_client.replies_until_hello()
    assert status == wire.OK
    assert _settled_fd_count(kpid, before + 1) == before + 1
    fuzz_client.send(wire.MAGIC + b'{"op":"unlink","name":"fuzz"}', 0)
    fuzz_client.replies_until_hello()
    fuzz_client.sock.close()  # our connection held it: now nobody does
    fuzz_client.sock = fuzz_client._open()
    fuzz_client.replies_until_hello()
    # a too-long message may make the client reconnect; the keeper closes the old connection
    # when it reads its EOF, which can come after it answered the new one's hello
    assert _settled_fd_count(kpid, before) == before
    # and it still serves real clients
    a = sa.zeros(3, device="cpu", name="after-fuzz")
    assert sa.attach("after-fuzz").allocation is a.allocation
    sa.unlink("after-fuzz")


def test_counts() -> None:
    """Records how many cases ran in this session (see docs/reliability.md)."""
    print(f"fuzz cases: {_COUNT}")
