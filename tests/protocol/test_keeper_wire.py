"""The keeper's wire format: each request record round-trips, and the decoders refuse
truncated, oversized, wrong-magic and malformed input."""

from __future__ import annotations

import json

import pytest

import sharedarrays as sa
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol.keeper import (
    MAX_CHUNKS,
    MAX_FDS,
    MAX_MESSAGE,
    Attach,
    BadRequest,
    Fetch,
    Hello,
    InFlight,
    Keep,
    List,
    Release,
    Reply,
    Request,
    Status,
    Unlink,
    check_name,
    decode_request,
)

ID = "ab" * 16
SECRET = bytes(range(32))
DOC = {"backend": "host", "device": 0, "readonly": False}

REQUESTS: list[tuple[Request, int]] = [
    (Hello(), 0),
    (Keep(ID, SECRET, "features", [4096, 8192], DOC, None), 2),
    (Keep(ID, SECRET, None, [4096], DOC, [12, 13]), 1),
    (Keep(ID, SECRET, None, [4096], DOC, None, InFlight(3, 60.0)), 1),
    (Attach("features"), 0),
    (Fetch(ID, SECRET), 0),
    (Release(ID), 0),
    (Unlink("features"), 0),
    (Unlink(alloc_id=ID, secret=SECRET), 0),
    (List(), 0),
    (List(ID), 0),
    (Status(), 0),
]


@pytest.mark.parametrize(("request_", "fds"), REQUESTS, ids=lambda r: getattr(r, "op", ""))
def test_requests_round_trip(request_: Request, fds: int) -> None:
    data = request_.encode()
    assert data.startswith(b'SAK1{"op":"' + request_.op.encode() + b'"')
    assert decode_request(data, fds) == request_


def test_requests_carry_the_fields_of_version_1() -> None:
    keep = Keep(ID, SECRET, None, [4096], DOC, [5], InFlight(2, 9.5))
    assert json.loads(keep.encode()[4:]) == {
        "op": "keep",
        "id": ID,
        "secret": SECRET.hex(),
        "sizes": [4096],
        "doc": DOC,
        "allow_pids": [5],
        "in_flight": {"loads": 2, "seconds": 9.5},
    }
    assert json.loads(Fetch(ID, SECRET).encode()[4:]) == {
        "op": "fetch",
        "id": ID,
        "secret": SECRET.hex(),
    }
    assert Release(ID).encode() == b'SAK1{"op":"release","id":"' + ID.encode() + b'"}'
    # (a field that is None is left out; the keeper reads it as absent)
    assert set(json.loads(Keep(ID, SECRET, None, [1], DOC).encode()[4:])) == {
        "op",
        "id",
        "secret",
        "sizes",
        "doc",
    }


def test_the_op_table_is_read_only() -> None:
    assert set(wire.OPS) == {cls.op for cls, _ in REQUESTS} | {"drop"}
    with pytest.raises(TypeError):
        wire.OPS["explode"] = Hello  # type: ignore[index]


@pytest.mark.parametrize(
    ("msg", "fds", "match"),
    [
        (b"", 0, "bad magic"),
        (b"SAK", 0, "bad magic"),
        (b"SAH1" + Hello().encode()[4:], 0, "bad magic"),
        (b"SAK1", 0, "not valid JSON"),
        (Keep(ID, SECRET, "x", [1], DOC).encode()[:-3], 1, "not valid JSON"),
        (b"SAK1\xff", 0, "not valid JSON"),
        (b"SAK1" + b"[" * 50000, 0, "not valid JSON"),
        (b"SAK1[]", 0, "JSON object"),
        (b'SAK1{"op":"explode"}', 0, "unknown op 'explode'"),
        (b'SAK1{"op":["hello"]}', 0, "unknown op"),
        (b'SAK1{"op":{"a":1}}', 0, "unknown op"),
        (b"SAK1{}", 0, "unknown op None"),
        (Hello().encode(), 1, "takes no file descriptors"),
        (b"SAK1" + b" " * MAX_MESSAGE, 0, "too long"),
        (Keep(ID, SECRET, "x", [1], DOC).encode(), MAX_FDS + 1, "too long"),
    ],
)
def test_malformed_requests_are_refused(msg: bytes, fds: int, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        decode_request(msg, fds)


def _keep(**change: object) -> bytes:
    doc = json.loads(Keep(ID, SECRET, None, [4096], DOC).encode()[4:])
    doc.update(change)
    return wire.MAGIC + json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (_keep(id="AB" * 16), "'id' is not valid hex"),
        (_keep(id=7), "'id' must be a str"),
        (_keep(secret="ab"), "'secret' is not valid hex"),
        (_keep(name=".hidden"), "invalid array name"),
        (_keep(name=5), "an array name is a str"),
        (_keep(sizes=[]), "'sizes' must be a list of 1 to 2048"),
        (_keep(sizes=[1] * (MAX_CHUNKS + 1)), "'sizes' must be a list"),
        (_keep(sizes=[0]), "not an int in"),
        (_keep(sizes=[True]), "not an int in"),
        (_keep(doc=[]), "'doc' must be a JSON object"),
        (_keep(doc={"dtype": "x" * 9000}), "'doc' is longer than 8192 bytes"),
        (_keep(allow_pids=[0]), "'allow_pids' has 0"),
        (_keep(in_flight=5), "'in_flight' must be an object"),
        (_keep(name="n", in_flight={"loads": 1, "seconds": 1}), "only without a name"),
        (_keep(in_flight={"loads": 0, "seconds": 1}), "in_flight.loads"),
        (_keep(in_flight={"loads": 1, "seconds": 0}), "in_flight.seconds"),
        (_keep(in_flight={"loads": 1, "seconds": 1e9}), "in_flight.seconds"),
        (b'SAK1{"op":"attach"}', "an array name is a str"),
        (b'SAK1{"op":"attach","name":""}', "invalid array name"),
        (b'SAK1{"op":"fetch","id":"' + ID.encode() + b'"}', "'secret' must be a str"),
        (b'SAK1{"op":"release"}', "'id' must be a str"),
        (b'SAK1{"op":"unlink","name":null}', "an array name is a str"),
        (b'SAK1{"op":"unlink","id":"' + ID.encode() + b'"}', "'secret' must be a str"),
        (b'SAK1{"op":"list","after":5}', "'after' must be an allocation id"),
        (b'SAK1{"op":"list","after":"' + b"a" * 65 + b'"}', "'after' must be an"),
    ],
)
def test_requests_with_bad_fields_are_refused(msg: bytes, match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        decode_request(msg, 1 if b'"keep"' in msg else 0)


def test_other_fields_are_ignored() -> None:
    assert decode_request(b'SAK1{"op":"hello","ping":1}') == Hello()
    keep = _keep(name=None, extra=1)  # (a null name: no name)
    assert decode_request(keep, 1) == Keep(ID, SECRET, None, [4096], DOC)


def test_a_bad_request_is_a_keeper_error() -> None:
    assert issubclass(BadRequest, sa.KeeperError)


def test_replies_round_trip() -> None:
    for reply in (Reply(wire.OK, {"pid": 12, "version": 1}), Reply(wire.DENIED, {"error": "x"})):
        data = reply.encode()
        assert data[:5] == b"SAK1" + bytes([reply.status])
        assert Reply.decode(data) == reply


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (b"", "truncated"),
        (b"SAK1", "truncated"),
        (b"SAK1\x00", "Expecting value"),
        (b"SAK1\x00{", "Expecting property name"),
        (b"SAK2\x00{}", "not a keeper reply"),
        (b"SAK1\x00[]", "not a keeper reply"),
    ],
)
def test_bad_replies_are_refused(msg: bytes, match: str) -> None:
    with pytest.raises(sa.KeeperError, match=match):
        Reply.decode(msg)


@pytest.mark.parametrize(
    "name", ["a", "features", "A.b_c-9", "x" * 128, "a/b", "ns-1a2b/x", "y" * 64 + "/" + "x" * 128]
)
def test_valid_names(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        ".a",
        "_a",
        "-a",
        "a b",
        "/a",
        "a/b/c",
        "a/",
        ".n/a",
        "y" * 65 + "/a",
        "é",
        "x" * 129,
        "evil\n",
        "a\nb",
        "x\r",
    ],
)
def test_invalid_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid array name"):
        check_name(name)
    with pytest.raises(TypeError):
        check_name(name.encode())


def test_list_pages_asks_until_no_more_and_stops_on_a_bad_reply() -> None:
    from sharedarrays.protocol.keeper import OK, list_pages

    pages = {None: ([{"id": "a"}, {"id": "b"}], "b"), "b": ([{"id": "c"}], None)}
    asked: list[str | None] = []

    def ask(req: List) -> tuple[int, dict[str, object]]:
        asked.append(req.after)
        arrays, more = pages[req.after]
        return OK, {"arrays": arrays, "more": more}

    status, body = list_pages(ask)
    assert (status, asked) == (OK, [None, "b"])
    assert [a["id"] for a in body["arrays"]] == ["a", "b", "c"]
    # a keeper whose "more" does not move on is not asked forever
    status, body = list_pages(lambda req: (OK, {"arrays": [{"id": "x"}], "more": "x"}))
    assert [a["id"] for a in body["arrays"]] == ["x", "x"]
    # an error, or a body without arrays, ends it as it is
    assert list_pages(lambda req: (3, {"error": "no"})) == (3, {"error": "no"})
    assert list_pages(lambda req: (OK, {"arrays": 5})) == (OK, {"arrays": 5})
