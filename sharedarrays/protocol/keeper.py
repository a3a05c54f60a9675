"""The keeper's wire format: requests and replies, as typed records.

A request on ``keeper.sock`` is ``b"SAK1"`` + a JSON object with an ``"op"``; a ``keep``
carries one chunk fd per size. A reply is ``b"SAK1"`` + a status byte + a JSON object, with
any fds batched by :func:`sharedarrays.protocol.unix.send_fds`; ``release`` has no reply.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from sharedarrays.errors import KeeperError
from sharedarrays.protocol.unix import FDS_PER_MESSAGE

__all__ = [
    "MAGIC",
    "OK",
    "ERROR",
    "NOT_FOUND",
    "EXISTS",
    "DENIED",
    "MAX_MESSAGE",
    "MAX_FDS",
    "MAX_CHUNKS",
    "MAX_NAME",
    "MAX_NAMESPACE",
    "MAX_IN_FLIGHT",
    "SOCKET_NAME",
    "LOCK_NAME",
    "BadRequest",
    "check_name",
    "Hello",
    "Keep",
    "InFlight",
    "Attach",
    "Fetch",
    "Release",
    "Unlink",
    "Drop",
    "List",
    "LIST_PAGE",
    "MAX_DOC",
    "list_pages",
    "Status",
    "Request",
    "decode_request",
    "Reply",
]

MAGIC = b"SAK1"
_STATUS = struct.Struct("4sB")
OK, ERROR, NOT_FOUND, EXISTS, DENIED = range(5)
MAX_MESSAGE = 1 << 16
"""Largest keeper message in bytes (requests and replies)."""
MAX_FDS = FDS_PER_MESSAGE
"""Most fds one keeper message carries; the rest follow on messages of their own."""
MAX_CHUNKS = 2048
"""Most chunks a kept array may have."""
MAX_NAME = 128
"""Longest array name in characters."""
MAX_NAMESPACE = 64
"""Longest namespace in characters (the keeper holds a name as ``namespace/name``)."""
MAX_IN_FLIGHT = 7 * 86400.0
"""Longest bound the keeper accepts for payloads in flight (seconds)."""
MAX_SIZE = 1 << 56
"""Largest chunk size a ``keep`` request may give."""
MAX_ALLOW_PIDS = 4096
"""Most pids in a ``keep`` request's ``allow_pids``."""
MAX_DOC = 8 << 10
"""Longest ``doc`` of a ``keep`` (bytes of JSON), well within a ``list`` page."""
LIST_PAGE = 48 << 10
"""Bytes of array descriptions in one ``list`` reply (under :data:`MAX_MESSAGE`)."""
SOCKET_NAME = "keeper.sock"
"""The keeper's socket, in the runtime directory."""
LOCK_NAME = "keeper.lock"
"""The lock file a live keeper holds (``fcntl.flock``), in the runtime directory."""
_NAME = re.compile(r"^(?:([A-Za-z0-9][A-Za-z0-9._-]*)/)?([A-Za-z0-9][A-Za-z0-9._-]*)\Z")
_HEX32 = re.compile(r"^[0-9a-f]{32}\Z")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")


class BadRequest(KeeperError):
    """A malformed keeper request (the keeper answers it with ``ERROR`` and the message)."""


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid array name in the keeper, else raise.

    1 to 128 characters of ``A-Z a-z 0-9 . _ -``, not starting with ``.``, ``_`` or ``-``,
    after an optional ``namespace/`` of up to 64 such characters.

    Raises
    ------
    TypeError
        ``name`` is not a str.
    ValueError
        Empty, too long, or with other characters.
    """
    if not isinstance(name, str):
        raise TypeError(f"an array name is a str, not {type(name).__name__}")
    found = _NAME.match(name)
    if found is None or len(found[2]) > MAX_NAME or len(found[1] or "") > MAX_NAMESPACE:
        raise ValueError(
            f"invalid array name {name!r}: use 1 to {MAX_NAME} characters from A-Z a-z 0-9 . _ -, "
            f"starting with a letter or digit, after an optional namespace (at most "
            f"{MAX_NAMESPACE} such characters) and '/'"
        )
    return name


# field validation (each raises BadRequest) ---------------------------------------------------


def _field(req: dict[str, Any], key: str, kind: type) -> Any:
    value = req.get(key)
    if type(value) is not kind:
        raise BadRequest(f"field {key!r} must be a {kind.__name__}")
    return value


def _hex(req: dict[str, Any], key: str, pattern: re.Pattern[str]) -> str:
    value = _field(req, key, str)
    if not pattern.match(value):
        raise BadRequest(f"field {key!r} is not valid hex of the right length")
    return str(value)


def _secret(req: dict[str, Any]) -> bytes:
    return bytes.fromhex(_hex(req, "secret", _HEX64))


def _name(req: dict[str, Any], optional: bool = False) -> str | None:
    value = req.get("name")
    if value is None and optional:
        return None
    try:
        return check_name(value)
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None


def _int_list(value: object, key: str, low: int, high: int, max_len: int) -> list[int]:
    if type(value) is not list or not 0 < len(value) <= max_len:
        raise BadRequest(f"field {key!r} must be a list of 1 to {max_len} ints")
    for x in value:
        if type(x) is not int or not low <= x <= high:
            raise BadRequest(f"field {key!r} has {x!r}, not an int in [{low}, {high}]")
    return list(value)


def _encode(op: str, fields: dict[str, Any]) -> bytes:
    return MAGIC + json.dumps({"op": op, **fields}, separators=(",", ":")).encode()


# requests: encode() gives the bytes, from_fields(req) validates a decoded JSON object

_T = TypeVar("_T", bound="_Bare")
_ById_T = TypeVar("_ById_T", bound="_ById")


@dataclass(frozen=True)
class _Bare:
    """A request with no fields."""

    op: ClassVar[str]

    def encode(self) -> bytes:
        return _encode(self.op, {})

    @classmethod
    def from_fields(cls: type[_T], req: dict[str, Any]) -> _T:
        return cls()


@dataclass(frozen=True)
class Hello(_Bare):
    """``hello``: the keeper's pid and protocol version (also: start it, see it runs)."""

    op: ClassVar[str] = "hello"


@dataclass(frozen=True)
class Status(_Bare):
    """``status``: the keeper's counters (arrays, bytes, connections, ...)."""

    op: ClassVar[str] = "status"


@dataclass(frozen=True)
class InFlight:
    """A ``keep`` for payloads in flight: dropped after ``loads`` fetches or ``seconds``."""

    loads: int
    seconds: float


@dataclass(frozen=True)
class Keep:
    """``keep``: hold these chunk fds (one per size); ``allow_pids`` limits who may attach."""

    op: ClassVar[str] = "keep"
    alloc_id: str
    secret: bytes
    name: str | None
    sizes: list[int]
    doc: dict[str, Any]
    allow_pids: list[int] | None = None
    in_flight: InFlight | None = None

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"id": self.alloc_id, "secret": self.secret.hex()}
        if self.name is not None:
            fields["name"] = self.name
        fields.update(sizes=self.sizes, doc=self.doc, allow_pids=self.allow_pids)
        if self.in_flight is not None:
            fields["in_flight"] = {"loads": self.in_flight.loads, "seconds": self.in_flight.seconds}
        return _encode(self.op, fields)

    @classmethod
    def from_fields(cls, req: dict[str, Any]) -> Keep:
        alloc_id, secret, name = _hex(req, "id", _HEX32), _secret(req), _name(req, optional=True)
        sizes = _int_list(req.get("sizes"), "sizes", 1, MAX_SIZE, MAX_CHUNKS)
        doc = req.get("doc")
        if type(doc) is not dict:
            raise BadRequest("field 'doc' must be a JSON object")
        if len(json.dumps(doc, separators=(",", ":"))) > MAX_DOC:
            raise BadRequest(f"field 'doc' is longer than {MAX_DOC} bytes")
        allow = req.get("allow_pids")
        if allow is not None:
            allow = _int_list(allow, "allow_pids", 1, 1 << 31, MAX_ALLOW_PIDS)
        flight = req.get("in_flight")
        if flight is not None:
            if type(flight) is not dict or name is not None:
                raise BadRequest("field 'in_flight' must be an object, and only without a name")
            loads = _int_list([flight.get("loads")], "in_flight.loads", 1, 1 << 31, 1)[0]
            seconds = flight.get("seconds")
            if not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_IN_FLIGHT:
                raise BadRequest(f"field 'in_flight.seconds' must be in (0, {MAX_IN_FLIGHT}]")
            flight = InFlight(loads, float(seconds))
        return cls(alloc_id, secret, name, sizes, doc, allow, flight)


@dataclass(frozen=True)
class Attach:
    """``attach``: the handles of the array named ``name``."""

    op: ClassVar[str] = "attach"
    name: str

    def encode(self) -> bytes:
        return _encode(self.op, {"name": self.name})

    @classmethod
    def from_fields(cls, req: dict[str, Any]) -> Attach:
        return cls(str(_name(req)))


@dataclass(frozen=True)
class Fetch:
    """``fetch``: the handles of a parked (or named) allocation, by id and secret."""

    op: ClassVar[str] = "fetch"
    alloc_id: str
    secret: bytes

    def encode(self) -> bytes:
        return _encode(self.op, {"id": self.alloc_id, "secret": self.secret.hex()})

    @classmethod
    def from_fields(cls, req: dict[str, Any]) -> Fetch:
        return cls(_hex(req, "id", _HEX32), _secret(req))


@dataclass(frozen=True)
class _ById:
    """A request that names an allocation by its id alone."""

    op: ClassVar[str]
    alloc_id: str

    def encode(self) -> bytes:
        return _encode(self.op, {"id": self.alloc_id})

    @classmethod
    def from_fields(cls: type[_ById_T], req: dict[str, Any]) -> _ById_T:
        return cls(_hex(req, "id", _HEX32))


@dataclass(frozen=True)
class Release(_ById):
    """``release``: this process no longer holds ``alloc_id`` (no reply)."""

    op: ClassVar[str] = "release"


@dataclass(frozen=True)
class Drop(_ById):
    """``drop``: let go of an unnamed allocation by id alone (``python -m sharedarrays rm``)."""

    op: ClassVar[str] = "drop"


@dataclass(frozen=True)
class Unlink:
    """``unlink``: drop a name, or a parked allocation (``alloc_id`` and ``secret``)."""

    op: ClassVar[str] = "unlink"
    name: str | None = None
    alloc_id: str | None = None
    secret: bytes | None = None

    def encode(self) -> bytes:
        if self.name is not None:
            return _encode(self.op, {"name": self.name})
        assert self.alloc_id is not None and self.secret is not None
        return _encode(self.op, {"id": self.alloc_id, "secret": self.secret.hex()})

    @classmethod
    def from_fields(cls, req: dict[str, Any]) -> Unlink:
        if "name" in req:
            return cls(name=_name(req))
        return cls(alloc_id=_hex(req, "id", _HEX32), secret=_secret(req))


@dataclass(frozen=True)
class List:
    """``list``: one page of the arrays held, those whose id comes after ``after``."""

    op: ClassVar[str] = "list"
    after: str | None = None

    def encode(self) -> bytes:
        return _encode(self.op, {} if self.after is None else {"after": self.after})

    @classmethod
    def from_fields(cls, req: dict[str, Any]) -> List:
        after = req.get("after")
        if after is not None and (type(after) is not str or len(after) > 64):
            raise BadRequest("field 'after' must be an allocation id")
        return cls(after)


def list_pages(ask: Callable[[List], tuple[int, dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    """Every array the keeper holds, asked page by page with ``ask``; a bad reply ends it."""
    arrays: list[Any] = []
    after: str | None = None
    while True:
        status, body = ask(List(after))
        page = body.get("arrays")
        if status != OK or type(page) is not list:
            return status, body
        arrays.extend(page)
        more = body.get("more")
        if type(more) is not str or (after is not None and more <= after):
            return status, {**body, "arrays": arrays, "more": None}
        after = more


Request = Hello | Keep | Attach | Fetch | Release | Unlink | Drop | List | Status
"""Any keeper request."""

_OPS: dict[str, type[Request]] = {
    cls.op: cls for cls in (Hello, Keep, Attach, Fetch, Release, Unlink, Drop, List, Status)
}


def decode_request(msg: bytes, fds: int = 0) -> Request:
    """The request in ``msg``, which came with ``fds`` file descriptors.

    Raises
    ------
    BadRequest
        A malformed message, an unknown op, fds with an op but ``keep``, or a bad field.
    """
    if len(msg) > MAX_MESSAGE or fds > MAX_FDS:
        raise BadRequest(f"message too long (at most {MAX_MESSAGE} bytes, {MAX_FDS} fds)")
    if not msg.startswith(MAGIC):
        raise BadRequest("not a sharedarrays keeper request (bad magic)")
    try:
        req = json.loads(msg[len(MAGIC) :])
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest("request body is not valid JSON") from None
    if type(req) is not dict:
        raise BadRequest("request body must be a JSON object")
    op = req.get("op")
    if op != "keep" and fds:
        raise BadRequest(f"op {op!r} takes no file descriptors")
    cls = _OPS.get(op) if type(op) is str else None
    if cls is None:
        raise BadRequest(f"unknown op {op!r}")
    return cls.from_fields(req)


@dataclass(frozen=True)
class Reply:
    """A keeper reply: a status (:data:`OK`, :data:`ERROR`, ...) and a JSON object."""

    status: int
    body: dict[str, Any]

    def encode(self) -> bytes:
        body = json.dumps(self.body, separators=(",", ":")).encode()
        return _STATUS.pack(MAGIC, self.status) + body

    @classmethod
    def decode(cls, msg: bytes) -> Reply:
        """The reply in ``msg``; raises :class:`~sharedarrays.KeeperError` if truncated or
        not a keeper reply."""
        if len(msg) < _STATUS.size:
            raise KeeperError("the keeper sent a truncated reply")
        magic, status = _STATUS.unpack_from(msg)
        try:
            body = json.loads(msg[_STATUS.size :])
        except (ValueError, RecursionError) as e:
            raise KeeperError(str(e)) from None
        if magic != MAGIC or type(body) is not dict:
            raise KeeperError("the keeper sent something that is not a keeper reply")
        return cls(status, body)
