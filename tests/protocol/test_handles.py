"""The handle server's wire format: records round-trip, the bytes keep their layout, and
every decoder refuses truncated, oversized and wrong-magic input."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

import sharedarrays as sa
from sharedarrays.protocol.handles import (
    COUNTED_SIZE,
    MAX_REQUEST,
    REPLY_SIZE,
    Growth,
    Handles,
    Kind,
    Reply,
    Request,
    Status,
)
from sharedarrays.protocol.unix import MAX_PATH

ID = "0123456789abcdef" * 2
SECRET = bytes(range(32))
PLAIN = struct.Struct("4s16s32s")
COUNTED = struct.Struct("4s16s32sI")


def test_the_magics_are_pinned() -> None:
    """A magic's last digit is its version (ASK carries a count since version 2; DONE is not
    answered since version 2)."""
    assert {k.name: k.value for k in Kind} == {
        "FETCH": b"SAH1",
        "GROW": b"SAG1",
        "RELEASED": b"SAX1",
        "CLOSED": b"SAC1",
        "LOADED": b"SAL1",
        "SNAPSHOT": b"SAS1",
        "DROP": b"SAD1",
        "DONE": b"SAU2",
        "ASK": b"SAQ2",
        "TOOK": b"SAT2",
        "SETTLE": b"SAY1",
        "TELL": b"SAN1",
    }
    assert [int(s) for s in Status] == list(range(6))
    assert [k.name for k in Kind if not k.replied] == ["LOADED", "DONE", "TOOK"]


@pytest.mark.parametrize("kind", list(Kind))
@pytest.mark.parametrize("reply_to", ["", "/run/user/1000/sharedarrays/12-ab.sock"])
def test_requests_round_trip_with_the_same_layout(kind: Kind, reply_to: str) -> None:
    count = 7 if kind.counted else 0
    request = Request(kind, ID, SECRET, count, reply_to)
    data = request.encode()
    if kind.counted:
        assert data == COUNTED.pack(kind.value, bytes.fromhex(ID), SECRET, 7) + reply_to.encode()
    else:
        assert data == PLAIN.pack(kind.value, bytes.fromhex(ID), SECRET) + reply_to.encode()
    assert Request.decode(data) == request


@given(
    kind=st.sampled_from(list(Kind)),
    alloc_id=st.binary(min_size=16, max_size=16).map(bytes.hex),
    secret=st.binary(min_size=32, max_size=32),
    count=st.integers(0, 2**32 - 1),
    reply_to=st.text(st.characters(min_codepoint=1, max_codepoint=127), max_size=MAX_PATH),
)
def test_any_request_round_trips(
    kind: Kind, alloc_id: str, secret: bytes, count: int, reply_to: str
) -> None:
    request = Request(kind, alloc_id, secret, count if kind.counted else 0, reply_to)
    assert Request.decode(request.encode()) == request


@pytest.mark.parametrize("kind", list(Kind))
def test_requests_too_short_or_too_long_are_refused(kind: Kind) -> None:
    data = Request(kind, ID, SECRET, 1).encode()
    for cut in range(len(data)):
        with pytest.raises(sa.PayloadError):
            Request.decode(data[:cut])
    Request.decode(data + b"/" * MAX_PATH)  # the longest path fits
    with pytest.raises(sa.PayloadError, match="bytes, not"):
        Request.decode(data + b"/" * (MAX_PATH + 1))
    assert len(COUNTED.pack(kind.value, b"", b"", 0)) + MAX_PATH == MAX_REQUEST


@pytest.mark.parametrize("magic", [b"SAR1", b"SAK1", b"SA1\0", b"sah1", b"\0\0\0\0"])
def test_requests_of_another_magic_are_refused(magic: bytes) -> None:
    data = magic + Request(Kind.FETCH, ID, SECRET).encode()[4:]
    with pytest.raises(sa.PayloadError, match="unknown magic"):
        Request.decode(data)


def test_a_counted_kind_needs_its_count() -> None:
    """A GROW request in the plain layout (no count) is too short for its kind."""
    data = PLAIN.pack(Kind.GROW.value, bytes.fromhex(ID), SECRET)
    assert len(data) < COUNTED_SIZE
    with pytest.raises(sa.PayloadError, match="GROW"):
        Request.decode(data)


def test_replies_round_trip_with_the_same_layout() -> None:
    reply = Reply(Status.NOT_ALLOWED, 3, b"[1,2,3]")
    data = reply.encode()
    assert data == struct.pack("4sBI", b"SAR1", 5, 3) + b"[1,2,3]"
    assert Reply.decode(data) == reply
    assert Reply.decode(Reply(Status.OK).encode()) == Reply(Status.OK, 0, b"")
    assert Reply.decode(struct.pack("4sBI", b"SAR1", 200, 0)).status == 200  # read, not judged


def test_replies_truncated_or_of_another_magic_are_refused() -> None:
    data = Reply(Status.OK, 1, b"[4096]").encode()
    for cut in range(REPLY_SIZE):
        with pytest.raises(sa.PayloadError, match="at least"):
            Reply.decode(data[:cut])
    with pytest.raises(sa.PayloadError, match="wrong magic"):
        Reply.decode(b"SAH1" + data[4:])


@pytest.mark.parametrize(
    "body",
    [
        Handles([4096, 8192]),
        Handles([4096], (b"\x01" * 64,)),
        Handles([], ()),
        Growth([4096, 4096], 1 << 20, 8000),
    ],
)
def test_bodies_round_trip(body: Handles | Growth) -> None:
    data = body.encode()
    assert type(body).decode(data) == body


def test_a_mapping_backends_body_is_the_bare_list_of_sizes() -> None:
    assert Handles([4096, 8192]).encode() == json.dumps([4096, 8192]).encode()
    assert json.loads(Growth([1], 2, 1).encode()) == {"sizes": [1], "capacity": 2, "used": 1}


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[1, 2",
        b"\xff",
        b"[" * 100000,
        b'{"sizes": 4}',
        b'{"sizes": [1], "exports": "ab"}',
        b'{"sizes": [1], "exports": ["zz"]}',
        b'{"sizes": [1], "exports": [""]}',
        json.dumps({"sizes": [1], "exports": ["ab" * 257]}).encode(),
        b'"sizes"',
    ],
)
def test_bad_handles_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(sa.PayloadError, match="inconsistent reply"):
        Handles.decode(body)


@pytest.mark.parametrize(
    "doc",
    [
        [1, 2],
        {"sizes": [1], "capacity": 2},
        {"sizes": [1], "capacity": 2, "used": 1, "more": 0},
        {"sizes": [0], "capacity": 2, "used": 1},
        {"sizes": [1.5], "capacity": 2, "used": 1},
        {"sizes": [1], "capacity": "2", "used": 1},
        {"sizes": [1], "capacity": 2, "used": None},
        # (a refresh took a negative length: shape (-1000,), and a raw ValueError on use)
        {"sizes": [1], "capacity": 2, "used": -8000},
        {"sizes": [1], "capacity": -2, "used": 1},
    ],
)
def test_bad_growth_bodies_are_refused(doc: object) -> None:
    with pytest.raises(sa.PayloadError, match="inconsistent reply"):
        Growth.decode(json.dumps(doc).encode())


def test_a_snapshot_round_trips_and_malformed_ones_are_refused() -> None:
    from sharedarrays.protocol.handles import MAX_SNAPSHOT_ROWS, HeldAllocation, Snapshot

    row = HeldAllocation(
        ID, "host", "cpu", 8192, 8000, True, 12, 1.5, 2, False, False, ((7, 2.5),), 1
    )
    snap = Snapshot(12, "python x.py", (row,))
    assert Snapshot.decode(snap.encode()) == snap
    many = Snapshot(12, "p", (row,) * (MAX_SNAPSHOT_ROWS + 3))
    cut = Snapshot.decode(many.encode())
    assert len(cut.allocations) == MAX_SNAPSHOT_ROWS and cut.left_out == 3
    doc = json.loads(snap.encode())
    for bad in (
        {**doc, "pid": 0},
        {**doc, "extra": 1},
        {**doc, "allocations": [{**doc["allocations"][0], "size": -1}]},
        {**doc, "allocations": [{**doc["allocations"][0], "id": "zz" * 16}]},
        {**doc, "allocations": [{**doc["allocations"][0], "served": [[1]]}]},
    ):
        with pytest.raises(sa.PayloadError):
            Snapshot.decode(json.dumps(bad).encode())
    with pytest.raises(sa.PayloadError):
        Snapshot.decode(b"not json")
