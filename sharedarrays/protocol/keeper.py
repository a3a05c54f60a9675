"""The keeper's wire format: a request is ``b"SAK1"`` + a JSON object with an ``"op"`` (a
``keep`` carries one chunk fd per size); a reply is ``b"SAK1"`` + a status byte + a JSON object,
its fds batched by :func:`~sharedarrays.protocol.unix.send_fds`. ``release`` has no reply."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

from sharedarrays.errors import KeeperError
from sharedarrays.protocol.unix import FDS_PER_MESSAGE

MAGIC = b"SAK1"
_STATUS = struct.Struct("4sB")
OK, ERROR, NOT_FOUND, EXISTS, DENIED = range(5)
MAX_MESSAGE = 1 << 16  # bytes of a keeper message, request or reply
MAX_FDS = FDS_PER_MESSAGE  # fds of one message; the rest follow on messages of their own
MAX_CHUNKS = 2048  # chunks of a kept array
MAX_NAME = 128  # characters of an array name
MAX_NAMESPACE = 64  # characters of a namespace (a name is held as ``namespace/name``)
MAX_IN_FLIGHT = 7 * 86400.0  # seconds a payload in flight may be held
MAX_SIZE = 1 << 56  # bytes of a chunk in a ``keep``
MAX_ALLOW_PIDS = 4096  # pids in a ``keep``'s ``allow_pids``
MAX_DOC = 8 << 10  # bytes of a ``keep``'s ``doc`` as JSON, well within a ``list`` page
LIST_PAGE = 48 << 10  # bytes of array descriptions in one ``list`` reply
SOCKET_NAME = "keeper.sock"  # in the runtime directory
LOCK_NAME = "keeper.lock"  # held (``fcntl.flock``) by the live keeper
_NAME = re.compile(r"^(?:([A-Za-z0-9][A-Za-z0-9._-]*)/)?([A-Za-z0-9][A-Za-z0-9._-]*)\Z")
TOO_LONG = f"message too long (at most {MAX_MESSAGE} bytes, {MAX_FDS} fds)"


class BadRequest(KeeperError):
    """A malformed keeper request (the keeper answers it with ``ERROR`` and the message)."""


def check_name(name: object) -> str:
    """Return ``name`` if it is a valid array name, else raise TypeError or ValueError: 1 to
    128 characters of ``A-Z a-z 0-9 . _ -``, not starting with ``.``, ``_`` or ``-``, after
    an optional ``namespace/`` of up to 64 such characters."""
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


# field checks: (value, wire key) -> the field's value, or BadRequest --------------------------

_Check = Callable[[Any, str], Any]


def _hex(digits: int) -> _Check:
    pattern = re.compile(f"^[0-9a-f]{{{digits}}}\\Z")

    def check(value: object, key: str) -> str:
        if type(value) is not str:
            raise BadRequest(f"field {key!r} must be a str")
        if not pattern.match(value):
            raise BadRequest(f"field {key!r} is not valid hex of the right length")
        return value

    return check


def _ints(high: int, most: int) -> _Check:
    def check(value: object, key: str) -> list[int]:
        if type(value) is not list or not 0 < len(value) <= most:
            raise BadRequest(f"field {key!r} must be a list of 1 to {most} ints")
        for x in value:
            if type(x) is not int or not 1 <= x <= high:
                raise BadRequest(f"field {key!r} has {x!r}, not an int in [1, {high}]")
        return list(value)

    return check


def _name(value: object, key: str) -> str:
    try:
        return check_name(value)
    except (TypeError, ValueError) as e:
        raise BadRequest(str(e)) from None


def _doc(value: object, key: str) -> dict[str, Any]:
    if type(value) is not dict:
        raise BadRequest("field 'doc' must be a JSON object")
    if len(_dumps(value)) > MAX_DOC:
        raise BadRequest(f"field 'doc' is longer than {MAX_DOC} bytes")
    return value


def _in_flight(value: object, key: str) -> InFlight:
    if type(value) is not dict:
        raise BadRequest("field 'in_flight' must be an object, and only without a name")
    loads = _ints(1 << 31, 1)([value.get("loads")], "in_flight.loads")[0]
    seconds = value.get("seconds")
    if not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_IN_FLIGHT:
        raise BadRequest(f"field 'in_flight.seconds' must be in (0, {MAX_IN_FLIGHT}]")
    return InFlight(loads, float(seconds))


def _after(value: object, key: str) -> str:
    if type(value) is not str or len(value) > 64:
        raise BadRequest("field 'after' must be an allocation id")
    return value


_FIELDS: Mapping[str, tuple[str, _Check]] = MappingProxyType(
    {  # a request's attribute: its key in the JSON object, and its check
        "alloc_id": ("id", _hex(32)),
        "secret": ("secret", lambda value, key: bytes.fromhex(_hex(64)(value, key))),
        "name": ("name", _name),
        "sizes": ("sizes", _ints(MAX_SIZE, MAX_CHUNKS)),
        "doc": ("doc", _doc),
        "allow_pids": ("allow_pids", _ints(1 << 31, MAX_ALLOW_PIDS)),
        "in_flight": ("in_flight", _in_flight),
        "after": ("after", _after),
    }
)


def _dumps(value: object) -> bytes:
    """Compact JSON; a secret as hex, an :class:`InFlight` as an object."""
    plain = lambda o: o.hex() if isinstance(o, bytes) else dataclasses.asdict(o)  # noqa: E731
    return json.dumps(value, separators=(",", ":"), default=plain).encode()


@dataclass(frozen=True)
class _Request:
    """A request, its op its class's name in lower case (a field ``X | None`` may be absent)."""

    op: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.op = cls.__name__.lower()

    def encode(self) -> bytes:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields = {_FIELDS[k][0]: v for k, v in values.items() if v is not None}
        return MAGIC + _dumps({"op": self.op, **fields})

    @classmethod
    def from_fields(cls, req: dict[str, Any]) -> Any:
        values = {}
        for f in dataclasses.fields(cls):
            key, check = _FIELDS[f.name]
            absent = str(f.type).endswith("| None") and req.get(key) is None
            values[f.name] = None if absent else check(req.get(key), key)
        return cls(**values)


class Hello(_Request):
    """``hello``: the keeper's pid and protocol version (also: start it, see it runs)."""


class Status(_Request):
    """``status``: the keeper's counters (arrays, bytes, connections, ...)."""


@dataclass(frozen=True)
class InFlight:
    """A ``keep`` for payloads in flight: dropped after ``loads`` fetches or ``seconds``."""

    loads: int
    seconds: float


@dataclass(frozen=True)
class Keep(_Request):
    """``keep``: hold these chunk fds (one per size); ``allow_pids`` limits who may attach."""

    alloc_id: str
    secret: bytes
    name: str | None
    sizes: list[int]
    doc: dict[str, Any]
    allow_pids: list[int] | None = None
    in_flight: InFlight | None = None

    def __post_init__(self) -> None:
        if self.in_flight is not None and self.name is not None:
            raise BadRequest("field 'in_flight' must be an object, and only without a name")


@dataclass(frozen=True)
class Attach(_Request):
    """``attach``: the handles of the array named ``name``."""

    name: str


@dataclass(frozen=True)
class Fetch(_Request):
    """``fetch``: the handles of a parked (or named) allocation, by id and secret."""

    alloc_id: str
    secret: bytes


@dataclass(frozen=True)
class Release(_Request):
    """``release``: this process no longer holds ``alloc_id`` (no reply)."""

    alloc_id: str


@dataclass(frozen=True)
class Drop(_Request):
    """``drop``: let go of an unnamed allocation by id alone (``python -m sharedarrays rm``)."""

    alloc_id: str


@dataclass(frozen=True)
class Unlink(_Request):
    """``unlink``: drop a name, or a parked allocation (``alloc_id`` and ``secret``)."""

    name: str | None = None
    alloc_id: str | None = None
    secret: bytes | None = None

    @classmethod
    def from_fields(cls, req: dict[str, Any]) -> Unlink:
        if "name" in req:
            return cls(name=_name(req["name"], "name"))
        return cls(**dataclasses.asdict(Fetch.from_fields(req)))  # (id and secret, required)


@dataclass(frozen=True)
class List(_Request):
    """``list``: one page of the arrays held, those whose id comes after ``after``."""

    after: str | None = None


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
OPS: Mapping[str, type[Request]] = MappingProxyType({c.op: c for c in typing.get_args(Request)})


def decode_request(msg: bytes, fds: int = 0) -> Request:
    """The request in ``msg``, which came with ``fds`` file descriptors; BadRequest where it
    is malformed, of an unknown op, has a bad field, or fds with an op but ``keep``."""
    if len(msg) > MAX_MESSAGE or fds > MAX_FDS:
        raise BadRequest(TOO_LONG)
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
    cls = OPS.get(op) if type(op) is str else None
    if cls is None:
        raise BadRequest(f"unknown op {op!r}")
    return cls.from_fields(req)


@dataclass(frozen=True)
class Reply:
    """A keeper reply: a status (:data:`OK`, :data:`ERROR`, ...) and a JSON object."""

    status: int
    body: dict[str, Any]

    def encode(self) -> bytes:
        return _STATUS.pack(MAGIC, self.status) + _dumps(self.body)

    @classmethod
    def decode(cls, msg: bytes) -> Reply:
        """The reply in ``msg``; KeeperError if truncated or not a keeper reply."""
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
