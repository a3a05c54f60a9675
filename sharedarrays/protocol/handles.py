"""The handle server's wire format: requests, replies and notices between processes.

A request (:class:`Request`) is one ``SOCK_SEQPACKET`` message; its magic gives its kind:

=========  ==============  ====================================================================
magic      kind            meaning
=========  ==============  ====================================================================
``SAH1``   ``FETCH``       "send me the chunks of this allocation" (reply: :class:`Handles`)
``SAG1``   ``GROW``        "send me a growable allocation's chunks from index ``count``"
                           (reply: :class:`Growth`)
``SAX1``   ``RELEASED``    exporter -> importer: "I released this allocation; I loaded
                           ``count`` of your payloads of it" (reply: status only)
``SAC1``   ``CLOSED``      importer -> exporter of exporter-owned memory: "I closed it"
``SAL1``   ``LOADED``      importer -> sender: "I loaded ``count`` of your payloads from the
                           mapping I had" (no reply)
``SAS1``   ``SNAPSHOT``    any process of the user: "what do you hold?" (reply:
                           :class:`Snapshot`; the id and secret are zeros and not read)
``SAD1``   ``DROP``        any process of the user: "drop your parked mapping of this
                           allocation" (reply: status only; the secret is not read: dropping a
                           mapping no view uses costs at most a new import)
=========  ==============  ====================================================================

Each carries the allocation's id and secret, the counted kinds a 32-bit count, and it may
end with the sender's own handle server path. A reply (:class:`Reply`) is ``b"SAR1"``, a
status byte and its fd count, then a JSON body.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

from sharedarrays.errors import PayloadError
from sharedarrays.protocol.unix import MAX_PATH

__all__ = [
    "Kind",
    "Status",
    "Request",
    "Reply",
    "Handles",
    "Growth",
    "MAX_REQUEST",
    "COUNTED_SIZE",
    "REPLY_SIZE",
    "MAX_EXPORT",
    "MAX_SNAPSHOT_ROWS",
    "HeldAllocation",
    "Snapshot",
]

_PLAIN = struct.Struct("4s16s32s")  # magic, allocation id, secret
_COUNTED = struct.Struct("4s16s32sI")  # and a count
_REPLY = struct.Struct("4sBI")  # magic, status, number of fds
REPLY_MAGIC = b"SAR1"
REPLY_SIZE = _REPLY.size
"""Bytes of a reply before its JSON body."""
MAX_REQUEST = _COUNTED.size + MAX_PATH
"""Longest request in bytes."""
COUNTED_SIZE = _COUNTED.size
"""Bytes of a request of a counted kind (``GROW``, ``RELEASED``, ``LOADED``) with no path."""
MAX_EXPORT = 512
"""Longest portable chunk handle a :class:`Handles` reply carries, in hex digits."""
_INCONSISTENT = "the handle server sent an inconsistent reply"
MAX_SNAPSHOT_ROWS = 256
"""Most allocations a :class:`Snapshot` lists, so that it fits a default socket buffer."""
MAX_COMMAND = 200
"""Longest command line a :class:`Snapshot` carries, in characters (cut beyond)."""


class Kind(enum.Enum):
    """What a request asks; its value is the request's magic."""

    FETCH = b"SAH1"
    GROW = b"SAG1"
    RELEASED = b"SAX1"
    CLOSED = b"SAC1"
    LOADED = b"SAL1"
    SNAPSHOT = b"SAS1"
    DROP = b"SAD1"
    DONE = b"SAU1"
    ASK = b"SAQ1"

    @property
    def counted(self) -> bool:
        """Whether its requests carry a count (and have the longer layout)."""
        return self in (Kind.GROW, Kind.RELEASED, Kind.LOADED, Kind.DONE)


_KINDS = {kind.value: kind for kind in Kind}


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
    """One request (or notice) to a handle server.

    Attributes
    ----------
    kind : Kind
        What it asks.
    alloc_id : str
        The allocation's id (32 hex digits).
    secret : bytes
        The allocation's 32-byte secret.
    count : int
        ``GROW``: the first chunk wanted; ``RELEASED``, ``LOADED``: how many payloads.
    reply_to : str
        The sender's own handle server path, or ``""``; at most :data:`MAX_PATH` bytes.
    """

    kind: Kind
    alloc_id: str
    secret: bytes
    count: int = 0
    reply_to: str = ""

    def encode(self) -> bytes:
        """The message's bytes."""
        raw_id = bytes.fromhex(self.alloc_id)
        if self.kind.counted:
            head = _COUNTED.pack(self.kind.value, raw_id, self.secret, self.count)
        else:
            head = _PLAIN.pack(self.kind.value, raw_id, self.secret)
        return head + self.reply_to.encode()

    @classmethod
    def decode(cls, data: bytes) -> Request:
        """The request in ``data``.

        Raises
        ------
        PayloadError
            An unknown magic, or a message too short or too long for its kind.
        """
        kind = _KINDS.get(bytes(data[:4]))
        if kind is None:
            raise PayloadError("not a sharedarrays handle request (unknown magic)")
        layout = _COUNTED if kind.counted else _PLAIN
        if not layout.size <= len(data) <= layout.size + MAX_PATH:
            raise PayloadError(
                f"a handle request of kind {kind.name} is {layout.size} to "
                f"{layout.size + MAX_PATH} bytes, not {len(data)}"
            )
        fields = layout.unpack_from(data)
        count = fields[3] if kind.counted else 0
        reply_to = bytes(data[layout.size :]).decode(errors="replace")
        return cls(kind, fields[1].hex(), fields[2], count, reply_to)


@dataclass(frozen=True)
class Reply:
    """A handle server's reply: a status, how many fds come with it, and a JSON body.

    Attributes
    ----------
    status : int
        A :class:`Status` (an int, so that an unknown one decodes and is refused later).
    fds : int
        How many fds come with it.
    body : bytes
        JSON (:class:`Handles` or :class:`Growth`), or empty.
    """

    status: int
    fds: int = 0
    body: bytes = b""

    def encode(self) -> bytes:
        """The message's bytes."""
        return _REPLY.pack(REPLY_MAGIC, self.status, self.fds) + self.body

    @classmethod
    def decode(cls, data: bytes) -> Reply:
        """The reply in ``data``.

        Raises
        ------
        PayloadError
            Too short, or not a handle server's reply (wrong magic).
        """
        if len(data) < _REPLY.size:
            raise PayloadError(f"a handle server reply is at least {_REPLY.size} bytes")
        magic, status, fds = _REPLY.unpack_from(data)
        if magic != REPLY_MAGIC:
            raise PayloadError("not a sharedarrays handle server reply (wrong magic)")
        return cls(status, fds, bytes(data[_REPLY.size :]))


@dataclass(frozen=True)
class Handles:
    """The body of a ``FETCH`` reply: chunk sizes and, for a pointer backend, chunk handles.

    Attributes
    ----------
    sizes : list of int
        The chunk sizes (checked by the importer against its payload).
    exports : tuple of bytes or None
        A pointer backend's portable handles; ``None`` for a mapping backend.
    """

    sizes: list[int]
    exports: tuple[bytes, ...] | None = None

    def encode(self) -> bytes:
        """The body's bytes (JSON)."""
        if self.exports is None:
            return json.dumps(self.sizes).encode()
        doc = {"sizes": self.sizes, "exports": [e.hex() for e in self.exports]}
        return json.dumps(doc).encode()

    @classmethod
    def decode(cls, body: bytes) -> Handles:
        """The body in ``body``.

        Raises
        ------
        PayloadError
            Not JSON of this shape.
        """
        doc = _json(body)
        sizes: Any = doc
        exports: Any = None
        if type(doc) is dict and set(doc) == {"sizes", "exports"}:
            sizes, exports = doc["sizes"], doc["exports"]
            if type(exports) is not list or not all(
                type(e) is str and 0 < len(e) <= MAX_EXPORT for e in exports
            ):
                raise PayloadError(_INCONSISTENT)
            try:
                exports = tuple(bytes.fromhex(e) for e in exports)
            except ValueError:
                raise PayloadError(_INCONSISTENT) from None
        if type(sizes) is not list or not all(type(n) is int and n > 0 for n in sizes):
            raise PayloadError(_INCONSISTENT)  # (a float equals an int: 2097152.0 passed)
        return cls(sizes, exports)


@dataclass(frozen=True)
class Growth:
    """The body of a ``GROW`` reply: a growable allocation's chunk sizes and sizes now.

    Attributes
    ----------
    sizes : list of int
        Every chunk size (positive).
    capacity, used : int
        Reserved bytes, and the bytes of the array.
    """

    sizes: list[int]
    capacity: int
    used: int

    def encode(self) -> bytes:
        """The body's bytes (JSON)."""
        doc = {"sizes": self.sizes, "capacity": self.capacity, "used": self.used}
        return json.dumps(doc).encode()

    @classmethod
    def decode(cls, body: bytes) -> Growth:
        """The body in ``body``.

        Raises
        ------
        PayloadError
            Not JSON of this shape, or a negative capacity or length.
        """
        doc = _json(body)
        if type(doc) is not dict or set(doc) != {"sizes", "capacity", "used"}:
            raise PayloadError(_INCONSISTENT)
        sizes, capacity, used = doc["sizes"], doc["capacity"], doc["used"]
        if (
            type(sizes) is not list
            or not all(type(n) is int and n > 0 for n in sizes)
            or type(capacity) is not int
            or type(used) is not int
            or capacity < 0
            or used < 0  # (a refresh gave the array a negative length: shape (-1000,))
        ):
            raise PayloadError(_INCONSISTENT)
        return cls(sizes, capacity, used)


@dataclass(frozen=True)
class HeldAllocation:
    """One allocation a process holds: a :class:`Snapshot` row.

    Attributes
    ----------
    alloc_id : str
        The allocation id (32 hex digits).
    backend, device : str
        Its memory system and device (``"host"``, ``"cpu"``).
    size : int
        Bytes mapped (the chunks' sum).
    used : int
        Bytes the exporter asked for (``size`` in an importer).
    created_here : bool
        This process made it, or imported it.
    origin_pid : int
        This process, or the one it was imported from.
    since : float
        When it was made or imported here (``time.time()``).
    views : int
        View leases using it here (:attr:`~sharedarrays.memory.Allocation.view_leases`).
    parked : bool
        Kept mapped with no view, ready for the next handoff.
    draining : bool
        Released here but held by importers (exporter-owned memory).
    served : tuple of (int, float)
        The processes it was served to (pid, when), most recent last.
    in_flight : int
        Payloads pickled here that may still be loaded.
    cached : bool
        Released here and kept for reuse (:mod:`sharedarrays.memory.cache`).
    """

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
        """The row as a JSON object."""
        return {
            "id": self.alloc_id,
            "backend": self.backend,
            "device": self.device,
            "size": self.size,
            "used": self.used,
            "created_here": self.created_here,
            "origin_pid": self.origin_pid,
            "since": self.since,
            "views": self.views,
            "parked": self.parked,
            "draining": self.draining,
            "served": [list(s) for s in self.served],
            "in_flight": self.in_flight,
            "cached": self.cached,
        }

    @classmethod
    def from_doc(cls, doc: Any) -> HeldAllocation:
        """The row in a JSON object.

        Raises
        ------
        PayloadError
            Not an object of this shape.
        """
        if type(doc) is not dict or set(doc) != _HELD_FIELDS:
            raise PayloadError(_INCONSISTENT)
        alloc_id = doc["id"]
        if type(alloc_id) is not str or len(alloc_id) != 32:
            raise PayloadError(_INCONSISTENT)
        try:
            bytes.fromhex(alloc_id)
        except ValueError:
            raise PayloadError(_INCONSISTENT) from None
        for key in ("backend", "device"):
            if type(doc[key]) is not str or not 0 < len(doc[key]) <= 64:
                raise PayloadError(_INCONSISTENT)
        for key in ("size", "used", "origin_pid", "views", "in_flight"):
            if type(doc[key]) is not int or doc[key] < 0:
                raise PayloadError(_INCONSISTENT)
        for key in ("created_here", "parked", "draining", "cached"):
            if type(doc[key]) is not bool:
                raise PayloadError(_INCONSISTENT)
        if not isinstance(doc["since"], (int, float)) or isinstance(doc["since"], bool):
            raise PayloadError(_INCONSISTENT)
        served = doc["served"]
        if type(served) is not list or not all(
            type(s) is list
            and len(s) == 2
            and type(s[0]) is int
            and isinstance(s[1], (int, float))
            and not isinstance(s[1], bool)
            for s in served
        ):
            raise PayloadError(_INCONSISTENT)
        return cls(
            alloc_id,
            doc["backend"],
            doc["device"],
            doc["size"],
            doc["used"],
            doc["created_here"],
            doc["origin_pid"],
            float(doc["since"]),
            doc["views"],
            doc["parked"],
            doc["draining"],
            tuple((int(p), float(t)) for p, t in served),
            doc["in_flight"],
            doc["cached"],
        )


_HELD_FIELDS = {
    "id",
    "backend",
    "device",
    "size",
    "used",
    "created_here",
    "origin_pid",
    "since",
    "views",
    "parked",
    "draining",
    "served",
    "in_flight",
    "cached",
}


@dataclass(frozen=True)
class Snapshot:
    """The body of a ``SNAPSHOT`` reply: what one process holds.

    Attributes
    ----------
    pid : int
        The answering process.
    command : str
        Its command line (at most :data:`MAX_COMMAND` characters).
    allocations : tuple of HeldAllocation
        At most :data:`MAX_SNAPSHOT_ROWS` of them, the largest.
    left_out : int
        How many more it holds than it lists.
    """

    pid: int
    command: str
    allocations: tuple[HeldAllocation, ...]
    left_out: int = 0

    def encode(self) -> bytes:
        """The body's bytes (JSON)."""
        doc = {
            "pid": self.pid,
            "command": self.command[:MAX_COMMAND],
            "allocations": [a.to_doc() for a in self.allocations[:MAX_SNAPSHOT_ROWS]],
            "left_out": self.left_out + max(0, len(self.allocations) - MAX_SNAPSHOT_ROWS),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> Snapshot:
        """The body in ``body``.

        Raises
        ------
        PayloadError
            Not JSON of this shape, or more rows than :data:`MAX_SNAPSHOT_ROWS`.
        """
        doc = _json(body)
        if type(doc) is not dict or set(doc) != {"pid", "command", "allocations", "left_out"}:
            raise PayloadError(_INCONSISTENT)
        pid, command, rows, left_out = (
            doc["pid"],
            doc["command"],
            doc["allocations"],
            doc["left_out"],
        )
        if (
            type(pid) is not int
            or pid <= 0
            or type(command) is not str
            or len(command) > MAX_COMMAND
            or type(rows) is not list
            or len(rows) > MAX_SNAPSHOT_ROWS
            or type(left_out) is not int
            or left_out < 0
        ):
            raise PayloadError(_INCONSISTENT)
        return cls(pid, command, tuple(HeldAllocation.from_doc(r) for r in rows), left_out)


def _json(body: bytes) -> Any:
    try:
        return json.loads(bytes(body).decode())  # (str: bytes would have their encoding guessed)
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise PayloadError(_INCONSISTENT) from None
