from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sharedarrays as sa
from sharedarrays.protocol.payload import MAGIC, TAG_BYTES, Payload, _tag, remember, view_extent

_A = sa.from_array(np.arange(48, dtype=np.float32).reshape(6, 8), device="cpu", pack=False)
_BLOB = _A[1:, ::2].payload().to_bytes()


def reseal(doc: dict[str, object]) -> bytes:
    """A payload with altered fields but a valid tag: only validation can catch it."""
    body = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + _tag(body, bytes.fromhex(str(doc["secret"]))) + body


def fields() -> dict[str, object]:
    return json.loads(_BLOB[len(MAGIC) + TAG_BYTES :])


def test_round_trip() -> None:
    p = Payload.from_bytes(_BLOB)
    assert p.to_bytes() == _BLOB
    assert p.fds is not None and p.fds.chunks == tuple(_A.allocation.chunk_fds())
    assert p.fds.inode == os.fstat(p.fds.table).st_ino  # (this process's take table)
    assert p.alloc_id == _A.allocation.id and p.secret == _A.allocation.secret
    assert p.shape == (5, 4) and p.strides == (32, 8) and p.offset == 32
    assert p.dtype == np.float32


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_byte_level_tampering_is_a_payload_error(data: st.DataObject) -> None:
    blob = bytearray(_BLOB)
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "replace_tail"]))
    if kind == "flip":
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    elif kind == "insert":
        i = data.draw(st.integers(0, len(blob)))
        blob[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    else:
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i:] = data.draw(st.binary(max_size=64))
    if bytes(blob) == _BLOB:
        return
    with pytest.raises(sa.PayloadError):
        sa.load(bytes(blob))


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(set(fields()) - {"secret"})), value=_JSONISH)
def test_resealed_field_tampering_never_escapes(key: str, value: object) -> None:
    """A forged payload (fields altered, tag recomputed) either fails with a SharedArrayError
    or loads a view that stays inside the allocation."""
    doc = fields()
    if doc[key] == value and type(doc[key]) is type(value):
        return
    doc[key] = value
    try:
        v = sa.load(reseal(doc))
    except sa.PayloadError:
        return
    except (sa.HandleUnavailable, sa.PermissionDenied):
        assert key in ("id", "server", "pid")  # names another allocation or process
        return
    except sa.WrongNode:
        assert key == "node"  # names another node: refused before anything is opened
        return
    # (a payload naming another node still loads where its allocation is mapped already: it
    # is this node's, and nothing is opened)
    assert key in ("offset", "shape", "strides", "readonly", "pid", "device", "server", "node")
    assert v.allocation is _A.allocation
    low, high = view_extent(v.itemsize, v.shape, v.strides)
    assert v.offset + low >= 0 and v.offset + high <= _A.allocation.size


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("shape", [5, 4000]),
        ("strides", [32, -80]),
        ("offset", 10**9),
        ("dtype", "O"),
        ("dtype", "<U4"),
        ("dtype", "V8"),
        ("chunks", []),
        ("chunks", [0]),
        ("id", "zz"),
        ("backend", "ROCm"),  # (a well-formed unknown name: test_unknown_backend_...)
        ("server", "relative.sock"),
        ("shape", [1] * 65),
        ("shape", [2**40, 2**40]),
        ("pid", 0),
        ("pid", -1),
        ("pid", 2**22 + 1),
        ("pid", 2**31),
        ("pid", 2**64),
        ("device", True),
        ("device", -1),
        ("device", 1 << 10),
        ("device", 2**63),
        ("readonly", 1),
        ("chunks", [2**47 + 4096]),
        ("chunks", [2**46, 2**46, 4096]),
        ("offset", 2**63),
        ("strides", [2**48, 4]),
        ("shape", [2**48, 0]),
        ("capacity", 2**47 + 4096),
        ("capacity", 2**64),
        ("dtype", "<f8\n"),  # (a regular expression's $ matched before a final newline)
        ("id", "0" * 32 + "\n"),
        ("fds", []),
        ("fds", [3, 1, 0, []]),  # (one fd per chunk)
        ("fds", [3, 1, 0, [4, 5]]),
        ("fds", [3, 1, 0]),
        ("fds", [3, 1, 0, [-1]]),
        ("fds", [3, 1, 0, [2**31]]),
        ("fds", [2**31, 1, 0, [4]]),
        ("fds", [3, 2**64, 0, [4]]),
        ("fds", [3, 1, 2**31, [4]]),
        ("fds", [3, True, 0, [4]]),
        ("fds", [3, 1, 0, 4]),
        ("fds", "3"),
    ],
)
def test_specific_bad_fields(key: str, value: object) -> None:
    doc = fields()
    doc[key] = value
    with pytest.raises(sa.PayloadError):
        Payload.from_bytes(reseal(doc))


def test_missing_or_extra_fields() -> None:
    doc = fields()
    del doc["shape"]
    with pytest.raises(sa.PayloadError, match="fields"):
        Payload.from_bytes(reseal(doc))
    doc = fields()
    doc["evil"] = "__import__('os')"
    with pytest.raises(sa.PayloadError, match="fields"):
        Payload.from_bytes(reseal(doc))


@pytest.mark.parametrize("bad", [None, "SA1", 12, b"", b"SA2" + _BLOB[3:], b"x" * (2 << 20)])
def test_not_a_payload(bad: object) -> None:
    with pytest.raises(sa.PayloadError):
        sa.load(bad)  # type: ignore[arg-type]


def test_payload_with_wrong_chunks_for_a_mapped_allocation() -> None:
    doc = fields()
    doc["chunks"] = [doc["chunks"][0] * 2]  # type: ignore[index]
    with pytest.raises(sa.PayloadError, match="does not match"):
        sa.load(reseal(doc))


def test_malformed_ordering_tokens_are_payload_errors() -> None:
    for token in ("abc", b"", b"x" * 257, 5):
        with pytest.raises(sa.PayloadError, match="ordering token"):
            sa.load(_BLOB, token)  # type: ignore[arg-type]


def test_decoded_payloads_are_remembered_by_their_bytes() -> None:
    assert Payload.from_bytes(_BLOB) is Payload.from_bytes(bytes(bytearray(_BLOB)))


def test_a_mapping_backend_refuses_exports() -> None:
    import os

    from sharedarrays.backends import get_backend
    from sharedarrays.backends.device import CPU
    from sharedarrays.memory.allocation import Allocation

    host = get_backend(CPU, "host")
    fd = os.dup(_A.allocation.chunk_fds()[0])
    with pytest.raises(sa.PayloadError, match="exports"):  # a mapping backend takes none
        Allocation.import_(
            host, "e" * 32, b"s" * 32, [_A.allocation.size], [fd], 1, exports=(b"x" * 64,)
        )
    with pytest.raises(OSError):
        os.fstat(fd)  # taken and closed


def test_unknown_backend_is_a_payload_error() -> None:
    """A well-formed name of a backend this process does not know: the payload decodes (it
    is pure data), and loading it refuses it."""
    doc = fields()
    doc["backend"] = "cuda-hip"
    assert Payload.from_bytes(reseal(doc)).backend == "cuda-hip"
    with pytest.raises(sa.PayloadError, match="unknown backend 'cuda-hip' in payload"):
        sa.load(reseal(doc))


@pytest.mark.parametrize(
    "name", ["", "CUDA", "-host", "a" * 33, "cuda vmm", 7, None, ["host"], "host\n"]
)
def test_malformed_backend_name_is_a_payload_error(name: object) -> None:
    doc = fields()
    doc["backend"] = name
    with pytest.raises(sa.PayloadError, match="unknown backend"):
        Payload.from_bytes(reseal(doc))


def test_doc_round_trip() -> None:
    p = Payload.from_bytes(_BLOB)
    doc = p.to_doc()
    assert doc == fields()  # the JSON body, as a dict
    assert Payload.from_doc(doc) == p
    grown = Payload.from_doc({**doc, "capacity": p.size * 2})
    assert grown.capacity == p.size * 2 and grown.to_doc()["capacity"] == p.size * 2


@pytest.mark.parametrize(
    "change",
    [
        {"secret": "ab"},
        {"id": "xyz"},
        {"offset": -1},
        {"extra": 1},
        {"shape": [1000]},
        {"dtype": "O"},
        {"backend": "Host!"},
        {"server": "/\ud800"},  # (a lone surrogate: no path; UnicodeEncodeError before)
    ],
)
def test_from_doc_validates_like_from_bytes(change: dict[str, object]) -> None:
    doc = {**fields(), **change}
    with pytest.raises(sa.PayloadError):
        Payload.from_doc(doc)
    with pytest.raises(sa.PayloadError):
        Payload.from_bytes(reseal(doc))


@pytest.mark.parametrize("doc", [None, [], "x", {"backend": "host"}])
def test_from_doc_refuses_what_is_not_a_payload_dict(doc: object) -> None:
    with pytest.raises(sa.PayloadError, match="wrong set of fields"):
        Payload.from_doc(doc)


@settings(max_examples=300, deadline=None)
@given(
    key=st.sampled_from(["pid", "device", "offset", "capacity"]),
    value=st.integers(min_value=-(2**70), max_value=2**70),
)
def test_numeric_fields_are_bounded_by_what_the_os_allows(key: str, value: int) -> None:
    """Every number either lies within its bound (pid up to Linux's PID_MAX_LIMIT, device
    ordinals below MAX_DEVICES, byte counts within the address space) or is a PayloadError."""
    from sharedarrays.process import PID_MAX_LIMIT
    from sharedarrays.protocol.payload import MAX_DEVICES, MAX_SIZE

    doc = fields()
    doc[key] = value
    size = sum(doc["chunks"])  # type: ignore[call-overload]
    low, high = {
        "pid": (1, PID_MAX_LIMIT),
        "device": (0, MAX_DEVICES - 1),
        "offset": (0, size),
        "capacity": (size, MAX_SIZE),
    }[key]
    try:
        Payload.from_bytes(reseal(doc))
    except sa.PayloadError:
        assert not low <= value <= high or key == "offset"  # (an offset may put the view out)
        return
    assert low <= value <= high


def _growable_payload_of_a_new_allocation(capacity: int) -> tuple[bytes, int]:
    """A resealed growable payload under a fresh id, and a dup of its chunk's fd."""
    import os

    g = sa.zeros(512, "uint8", device="cpu", capacity=1 << 20)
    doc = json.loads(g.payload().to_bytes()[len(MAGIC) + TAG_BYTES :])
    doc.update(id=os.urandom(16).hex(), capacity=capacity)
    return reseal(doc), os.dup(g.allocation.chunk_fds()[0])


class _Handed:
    """Stands for multiprocessing's DupFd: a handle that travelled with a payload."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


def test_a_capacity_no_process_can_reserve_is_out_of_memory(fd_baseline: None) -> None:
    from sharedarrays.protocol.payload import MAX_SIZE

    blob, fd = _growable_payload_of_a_new_allocation(MAX_SIZE)  # valid, yet cannot be reserved
    with pytest.raises(sa.OutOfMemory, match="address space") as err:
        sa.load(blob, None, (_Handed(fd),))
    assert isinstance(err.value, sa.SharedArrayError)


READONLY_FORGER = (
    "import gc, json, pickle, sys\n"
    "import psutil\n"
    "import sharedarrays as sa\n"
    "from sharedarrays.memory import live_allocations\n"
    "from sharedarrays.transport import handles as transport\n"
    "def fds():\n"
    "    gc.collect()\n"
    "    return psutil.Process().num_fds() - transport.open_connections()\n"
    "transport.server_address()  # (its socket and selector are no leak)\n"
    "before = fds()\n"
    "try:\n"
    "    sa.load(bytes.fromhex(sys.stdin.readline()))\n"
    "    out = {'loaded': True}\n"
    "except Exception as e:\n"
    "    out = {'error': type(e).__name__, 'library': isinstance(e, sa.SharedArrayError),\n"
    "           'message': str(e)}\n"
    "out['leaked'] = fds() - before\n"
    "out['mapped'] = len(live_allocations())\n"
    "print(json.dumps(out), flush=True)\n"
)


@pytest.mark.timeout(120)
def test_a_payload_resealed_without_readonly_is_permission_denied() -> None:
    """The secret is in the payload, so anyone holding one can recompute its tag: an importer
    that flips ``readonly`` gets a library error that says what happened, not an OSError."""
    from keeper_helpers import py

    a = sa.from_array(np.arange(8.0), device="cpu", readonly=True)
    doc = json.loads(a.payload().to_bytes()[len(MAGIC) + TAG_BYTES :])
    assert doc["readonly"] is True
    doc["readonly"] = False
    r = py(READONLY_FORGER, input=reseal(doc).hex() + "\n", timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["error"] == "PermissionDenied" and out["library"], out
    assert "readonly=True" in out["message"]
    assert out["leaked"] == 0 and out["mapped"] == 0  # the fd closed, nothing left mapped


def test_remember_forgets_the_oldest_at_the_limit() -> None:
    table: dict[bytes, int] = {}
    for i in range(5):
        remember(table, bytes([i]), i, 3)
    assert table == {b"\x02": 2, b"\x03": 3, b"\x04": 4}
