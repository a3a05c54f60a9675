"""The handle server's wire format: a :class:`Request` is one ``SOCK_SEQPACKET`` message (its
:class:`Kind`'s magic, allocation id, secret, a count, maybe the sender's server path); a
:class:`Reply` is ``b"SAR1"``, a status byte, its fd count and a JSON body."""

from __future__ import annotations

import enum
import json
import re
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from sharedarrays.errors import PayloadError
from sharedarrays.protocol.unix import MAX_PATH

_PLAIN = struct.Struct("4s16s32s")  # magic, allocation id, secret
_COUNTED = struct.Struct("4s16s32sI")  # and a count
_REPLY = struct.Struct("4sBI")  # magic, status, number of fds
REPLY_MAGIC = b"SAR1"
REPLY_SIZE = _REPLY.size  # bytes of a reply before its JSON body
MAX_REQUEST = _COUNTED.size + MAX_PATH  # longest request in bytes
COUNTED_SIZE = _COUNTED.size  # bytes of a request of a counted kind with no path
MAX_EXPORT = 512  # longest portable chunk handle in a Handles reply, in hex digits
MAX_SNAPSHOT_ROWS = 256  # most rows a Snapshot lists: it fits a default socket buffer
MAX_COMMAND = 200  # longest command line a Snapshot carries, in characters (cut beyond)
_INCONSISTENT = "the handle server sent an inconsistent reply"
_HEX = re.compile(r"(?:[0-9a-f]{2})+\Z")


class Kind(enum.Enum):
    """What a request asks (who sends it, what is answered); its value is its magic."""

    FETCH = b"SAH1"  # send the chunks of this allocation (Handles)
    GROW = b"SAG1"  # send a growable allocation's chunks from index count (Growth)
    RELEASED = b"SAX1"  # exporter: I released it, having loaded count of your payloads
    CLOSED = b"SAC1"  # importer of exporter-owned memory: I closed it
    LOADED = b"SAL1"  # importer: I loaded count of your payloads warm (no reply)
    SNAPSHOT = b"SAS1"  # what do you hold? (Snapshot; id and secret zeros, not read)
    DROP = b"SAD1"  # drop your parked mapping of it (secret not read: costs an import)
    DONE = b"SAU2"  # importer: my last view of your block closed, after count loads (no reply)
    ASK = b"SAQ2"  # exporter: say DONE when your last view of this block goes (count of
    # your payloads that came back here, loaded: no longer in flight there)
    TOOK = b"SAT2"  # importer: I took count chunk fds from your fd table (no reply)
    SETTLE = b"SAY1"  # the process itself: read what was sent to you, then answer (no id)
    TELL = b"SAN1"  # exporter: send me LOADED for your warm loads of my payloads, then answer

    @property
    def counted(self) -> bool:
        return self in (Kind.GROW, Kind.RELEASED, Kind.LOADED, Kind.DONE, Kind.ASK, Kind.TOOK)

    @property
    def replied(self) -> bool:
        """Whether the server answers it; not the notices sent as arrays flow, which must
        never wait on a busy exporter (a block waits for its DONE to be reused)."""
        return self not in (Kind.LOADED, Kind.DONE, Kind.TOOK)


class Status(enum.IntEnum):
    """A reply's status byte."""

    OK = 0
    GONE = 1
    BAD_SECRET = 2
    BAD_UID = 3
    BAD_REQUEST = 4
    NOT_ALLOWED = 5


@dataclass(frozen=True)
class Request:
    """A request (or notice) to a handle server; ``count``: ``GROW``'s first chunk wanted,
    else how many payloads; ``reply_to``: the sender's own handle server path or ``""``."""

    kind: Kind
    alloc_id: str
    secret: bytes
    count: int = 0
    reply_to: str = ""

    def encode(self) -> bytes:
        head = (self.kind.value, bytes.fromhex(self.alloc_id), self.secret)
        packed = _COUNTED.pack(*head, self.count) if self.kind.counted else _PLAIN.pack(*head)
        return packed + self.reply_to.encode()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        """The request in ``data``; PayloadError for an unknown magic or a wrong length."""
        try:
            kind = Kind(bytes(data[:4]))
        except ValueError:
            raise PayloadError("not a sharedarrays handle request (unknown magic)") from None
        layout = _COUNTED if kind.counted else _PLAIN
        if not layout.size <= len(data) <= layout.size + MAX_PATH:
            raise PayloadError(
                f"a handle request of kind {kind.name} is {layout.size} to "
                f"{layout.size + MAX_PATH} bytes, not {len(data)}"
            )
        _, raw_id, secret, *count = layout.unpack_from(data)
        reply_to = bytes(data[layout.size :]).decode(errors="replace")
        return cls(kind, raw_id.hex(), secret, count[0] if count else 0, reply_to)


@dataclass(frozen=True)
class Reply:
    """A handle server's reply: a status (an int: an unknown one decodes, refused later),
    how many fds come with it, and a JSON body or ``b""``."""

    status: int
    fds: int = 0
    body: bytes = b""

    def encode(self) -> bytes:
        return _REPLY.pack(REPLY_MAGIC, self.status, self.fds) + self.body

    @classmethod
    def decode(cls, data: bytes) -> Reply:
        """The reply in ``data``; PayloadError if too short or of a wrong magic."""
        if len(data) < _REPLY.size:
            raise PayloadError(f"a handle server reply is at least {_REPLY.size} bytes")
        magic, status, fds = _REPLY.unpack_from(data)
        if magic != REPLY_MAGIC:
            raise PayloadError("not a sharedarrays handle server reply (wrong magic)")
        return cls(status, fds, bytes(data[_REPLY.size :]))


@dataclass(frozen=True)
class Handles:
    """The body of a ``FETCH`` reply: the chunk sizes (checked by the importer against its
    payload) and a pointer backend's portable handles (``None`` for a mapping backend)."""

    sizes: list[int]
    exports: tuple[bytes, ...] | None = None

    def encode(self) -> bytes:
        if self.exports is None:
            return json.dumps(self.sizes).encode()
        doc = {"sizes": self.sizes, "exports": [e.hex() for e in self.exports]}
        return json.dumps(doc).encode()

    @classmethod
    def decode(cls, body: bytes) -> Handles:
        """The body in ``body``; PayloadError if not JSON of this shape."""
        doc = _json(body)
        sizes, exports = doc, None
        if type(doc) is dict and set(doc) == {"sizes", "exports"}:
            sizes, exports = doc["sizes"], doc["exports"]
            _check(type(exports) is list and all(_hex(e, 1, MAX_EXPORT) for e in exports))
            exports = tuple(bytes.fromhex(e) for e in exports)
        _check(_sizes(sizes))
        return cls(sizes, exports)


@dataclass(frozen=True)
class Growth:
    """The body of a ``GROW`` reply: every chunk size (positive), the bytes reserved
    (``capacity``) and the bytes of the array (``used``)."""

    sizes: list[int]
    capacity: int
    used: int

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, body: bytes) -> Growth:
        """The body in ``body``; PayloadError if not JSON of this shape or a size < 0."""
        doc = _json(body, {"sizes", "capacity", "used"})
        # (used < 0: a refresh gave the array a negative length, shape (-1000,))
        _check(_sizes(doc["sizes"]) and _natural(doc["capacity"]) and _natural(doc["used"]))
        return cls(doc["sizes"], doc["capacity"], doc["used"])


@dataclass(frozen=True)
class HeldAllocation:
    """A :class:`Snapshot` row: bytes mapped (``size``) and asked for (``used``), whence
    (``origin_pid``) and ``since`` when, ``views`` leased (``parked``: none), ``draining``
    (released here, held by importers), served to ``(pid, when)``, payloads ``in_flight``
    here, ``cached`` for reuse."""

    alloc_id: str
    backend: str
    device: str
    size: int
    used: int
    created_here: bool
    origin_pid: int
    since: float
    views: int
    parked: bool
    draining: bool
    served: tuple[tuple[int, float], ...] = ()
    in_flight: int = 0
    cached: bool = False

    def to_doc(self) -> dict[str, Any]:
        doc = dict(zip(_ROW, (getattr(self, f.name) for f in fields(self))))
        doc["served"] = [list(s) for s in self.served]
        return doc

    @classmethod
    def from_doc(cls, doc: Any) -> HeldAllocation:
        """The row in a JSON object; PayloadError if not an object of this shape."""
        _check(type(doc) is dict and set(doc) == _ROW.keys())
        _check(all(valid(doc[key]) for key, valid in _ROW.items()))
        row = cls(*(doc[key] for key in _ROW))
        served = tuple((int(p), float(t)) for p, t in row.served)
        return replace(row, since=float(row.since), served=served)


@dataclass(frozen=True)
class Snapshot:
    """The body of a ``SNAPSHOT`` reply: what process ``pid`` (its ``command``) holds, the
    largest :data:`MAX_SNAPSHOT_ROWS` ``allocations`` and how many more (``left_out``)."""

    pid: int
    command: str
    allocations: tuple[HeldAllocation, ...]
    left_out: int = 0

    def encode(self) -> bytes:
        doc = {
            "pid": self.pid,
            "command": self.command[:MAX_COMMAND],
            "allocations": [a.to_doc() for a in self.allocations[:MAX_SNAPSHOT_ROWS]],
            "left_out": self.left_out + max(0, len(self.allocations) - MAX_SNAPSHOT_ROWS),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> Snapshot:
        """The body in ``body``; PayloadError if not JSON of this shape or too many rows."""
        doc = _json(body, {"pid", "command", "allocations", "left_out"})
        pid, command, rows = doc["pid"], doc["command"], doc["allocations"]
        _check(type(pid) is int and pid > 0 and _natural(doc["left_out"]))
        _check(type(command) is str and len(command) <= MAX_COMMAND)
        _check(type(rows) is list and len(rows) <= MAX_SNAPSHOT_ROWS)
        return cls(pid, command, tuple(map(HeldAllocation.from_doc, rows)), doc["left_out"])


def _check(valid: bool) -> None:
    if not valid:
        raise PayloadError(_INCONSISTENT)


def _json(body: bytes, keys: set[str] | None = None) -> Any:
    try:
        doc = json.loads(bytes(body).decode())  # (str: bytes would have their encoding guessed)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise PayloadError(_INCONSISTENT) from None
    _check(keys is None or (type(doc) is dict and set(doc) == keys))
    return doc


def _hex(v: object, low: int, high: int) -> bool:
    return type(v) is str and low <= len(v) <= high and _HEX.match(v) is not None


def _natural(v: object) -> bool:
    return type(v) is int and v >= 0


def _real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sizes(v: object) -> bool:  # (type: a float equals an int, 2097152.0 passed)
    return type(v) is list and all(type(n) is int and n > 0 for n in v)


def _served(v: object) -> bool:
    return type(v) is list and all(
        type(s) is list and len(s) == 2 and type(s[0]) is int and _real(s[1]) for s in v
    )


_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: type(v) is str and 0 < len(v) <= 64,
    "int": _natural,
    "float": _real,
    "bool": lambda v: type(v) is bool,
}
_ROW: MappingProxyType[str, Callable[[Any], bool]] = MappingProxyType(  # keys in field order
    {"id": lambda v: _hex(v, 32, 32)}
    | {f.name: _CHECKS.get(str(f.type), _served) for f in fields(HeldAllocation)[1:]}
)
