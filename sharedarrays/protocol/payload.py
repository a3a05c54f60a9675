"""Payloads, what a pickle carries per allocation: ``b"SA1"``, a 16-byte BLAKE2b tag keyed
with its secret, a JSON object; each view's fields as a tuple (:class:`ViewFields`). Anything
malformed or altered raises :class:`~sharedarrays.PayloadError`."""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass, fields
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np

from sharedarrays.errors import PayloadError
from sharedarrays.node import NODE_PATTERN
from sharedarrays.process import PID_MAX_LIMIT, STATE

MAGIC = b"SA1"
TAG_BYTES = 16
MAX_PAYLOAD_BYTES = 1 << 20
MAX_NDIM = 64
MAX_SIZE = 1 << 47  # bound on every size, offset, stride and count: x86-64's 128 TiB
MAX_DEVICES = 1 << 10  # device ordinals are below this
MAX_TAKEN = 250  # most chunk fds a payload names for taking (as many as one message sends)
_HEX32 = re.compile(r"^[0-9a-f]{32}\Z")
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_DTYPE = re.compile(r"^[<>|=]?[biufc][0-9]{1,2}\Z")
_BACKEND = re.compile(r"^[a-z][a-z0-9-]{0,31}\Z")  # (whether it is known: the importer's question)
_OPTIONAL = frozenset(("capacity", "node", "block", "fds"))
_DECODED_LIMIT = 16384  # validated payloads remembered by their bytes (warm loads skip JSON)


def view_extent(itemsize: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """Lowest and one-past-highest byte a view touches, relative to its offset (or 0, 0)."""
    low, high = 0, itemsize
    for n, s in zip(shape, strides):
        if n == 0:
            return 0, 0
        if s < 0:
            low += s * (n - 1)
        else:
            high += s * (n - 1)
    return low, high


def contiguous_strides(shape: tuple[int, ...], itemsize: int, order: str = "C") -> tuple[int, ...]:
    """The strides of a contiguous array of ``shape`` in ``order`` (``"C"`` or ``"F"``)."""
    strides = [0] * len(shape)
    step = itemsize
    axes = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    for ax in axes:
        strides[ax] = step
        step *= max(shape[ax], 1)
    return tuple(strides)


_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


def remember(table: dict[_K, _V], key: _K, value: _V, limit: int) -> None:
    """Keep ``value`` in ``table`` by ``key``, forgetting the oldest past ``limit``; thread-safe."""
    if len(table) >= limit:
        try:
            del table[next(iter(table))]  # the oldest
        except (StopIteration, KeyError, RuntimeError):  # another thread got there first
            pass
    table[key] = value


_COMPACT = json.JSONEncoder(separators=(",", ":"))  # (json.dumps makes one per call)


def _tag(body: bytes, secret: bytes) -> bytes:
    return hashlib.blake2b(body, key=secret, digest_size=TAG_BYTES).digest()


def _int(doc: dict[str, Any], key: str, low: int, high: int) -> int:
    v = doc[key]
    if type(v) is not int or not low <= v <= high:
        raise PayloadError(f"payload field {key!r} must be an int in [{low}, {high}], got {v!r}")
    return v


def _ints(
    v: object, key: str, low: int, high: int = MAX_SIZE, max_len: int = MAX_NDIM, what: str = "view"
) -> tuple[int, ...]:
    """``v`` as a tuple, if a list (a payload field) or a tuple (``what`` is ``"view"``) of
    at most ``max_len`` ints in [``low``, ``high``]."""
    kind = tuple if what == "view" else list
    if type(v) is not kind or len(v) > max_len:
        raise PayloadError(
            f"{what} field {key!r} must be a {kind.__name__} of at most {max_len} ints"
        )
    for x in v:
        if type(x) is not int or not low <= x <= high:
            raise PayloadError(f"{what} field {key!r} has {x!r}, not an int in [{low}, {high}]")
    return tuple(v)


def _text(v: object, matches: Callable[[str], object], error: str) -> Any:
    """``v``, if a string that ``matches`` (and can be encoded); else PayloadError(``error``)."""
    try:
        if type(v) is str and matches(v):
            return v
    except UnicodeError:
        pass
    raise PayloadError(error)


def _numeric_dtype(value: object, what: str) -> np.dtype[Any]:
    """The numeric (or bool) dtype that the string ``value`` names, or PayloadError."""
    if type(value) is str:
        known: np.dtype[Any] | None = STATE.pickling.dtypes.get(value)
        if known is not None:
            return known
        if _DTYPE.match(value):
            try:
                dtype = np.dtype(value)
            except TypeError:
                pass
            else:
                STATE.pickling.dtypes[value] = dtype
                return dtype
    raise PayloadError(f"{what} 'dtype' is not a numeric dtype: {value!r}")


def misaligned(
    dtype: np.dtype[Any], shape: tuple[int, ...], strides: tuple[int, ...], offset: int
) -> str:
    """Why a view of device memory is misaligned for ``dtype`` (fatal to a CUDA context)."""
    bits = offset
    for n, st in zip(shape, strides):
        if n == 0:
            return ""
        if n > 1:
            bits |= st
    if not bits & (dtype.alignment - 1):
        return ""
    return (
        f"a view of {dtype} on device memory at byte offset {offset} with strides "
        f"{strides} is misaligned: the offset and every stride must be multiples of "
        f"{dtype.alignment} (the dtype's alignment), or a GPU kernel reading it fails "
        "with a misaligned address and ends the process's GPU work (host memory allows "
        "misaligned views, as NumPy does)"
    )


@dataclass(frozen=True, slots=True)
class Payload:
    """A validated payload: the memory (``backend``, ``device`` ordinal, ``alloc_id``,
    ``secret``: whoever holds it may import it, the ``pid`` serving its handles at ``server``,
    ``chunks`` sizes), the view (``dtype``, ``shape``, ``strides`` and ``offset`` in bytes,
    ``readonly``), maybe a growable array's ``capacity``, the maker's ``node`` (a load
    elsewhere is refused), the ``block`` token of memory kept for reuse, and where an importer
    may take the chunks' ``fds`` from the exporter itself (:class:`Takeable`)."""

    backend: str
    device: int
    alloc_id: str
    secret: bytes
    pid: int
    server: str
    chunks: tuple[int, ...]
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    readonly: bool
    capacity: int | None = None
    node: str | None = None
    block: bytes | None = None
    fds: Takeable | None = None

    @property
    def size(self) -> int:
        """Bytes of the whole allocation (the sum of the chunk sizes)."""
        return sum(self.chunks)

    def view_fields(self) -> ViewFields:
        """The payload's view (dtype, shape, strides, offset, readonly)."""
        return ViewFields(self.offset, self.shape, self.strides, self.dtype, self.readonly)

    def to_doc(self) -> dict[str, Any]:
        """The payload as its JSON body's dict (what :meth:`from_doc` takes back)."""
        block = None if self.block is None else self.block.hex()
        fds = None if self.fds is None else [*self.fds[:3], list(self.fds.chunks)]
        optional = {"capacity": self.capacity, "node": self.node, "block": block, "fds": fds}
        return {
            "backend": self.backend,
            "device": self.device,
            "id": self.alloc_id,
            "secret": self.secret.hex(),
            "pid": self.pid,
            "server": self.server,
            "chunks": list(self.chunks),
            "dtype": self.dtype.str,
            "shape": list(self.shape),
            "strides": list(self.strides),
            "offset": self.offset,
            "readonly": self.readonly,
            **{key: value for key, value in optional.items() if value is not None},
        }

    def to_bytes(self) -> bytes:
        """Encode as ``b"SA1" + tag + JSON``."""
        body = _COMPACT.encode(self.to_doc()).encode()
        return MAGIC + _tag(body, self.secret) + body

    @classmethod
    def from_bytes(cls, data: object) -> Payload:
        """Decode and validate a payload (remembered by its bytes); else PayloadError."""
        # remembered: a growable array's warm load (which keeps no part) is 30-42 us faster
        # on the host (ab_trees.py --off decoded --growable, 1,000 pairs x 4)
        if type(data) is bytes:
            known: Payload | None = STATE.pickling.decoded.get(data)
            if known is not None:
                return known
        elif not isinstance(data, bytes):
            raise PayloadError(f"a payload is bytes, not {type(data).__name__}")
        if len(data) > MAX_PAYLOAD_BYTES:
            raise PayloadError(f"payload of {len(data)} bytes is larger than any valid one")
        if not data.startswith(MAGIC):
            raise PayloadError(
                "not a sharedarrays payload of version 1 (was it made by another version of "
                "sharedarrays? use the same version in every process)"
            )
        tag, body = data[len(MAGIC) : len(MAGIC) + TAG_BYTES], data[len(MAGIC) + TAG_BYTES :]
        try:
            doc = json.loads(body.decode())  # (str: bytes would have their encoding guessed)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise PayloadError("payload is corrupted: its body is not valid JSON") from None
        payload = cls.from_doc(doc, tag, body)
        remember(STATE.pickling.decoded, bytes(data), payload, _DECODED_LIMIT)
        return payload

    @classmethod
    def from_doc(cls, doc: object, tag: bytes | None = None, body: bytes = b"") -> Payload:
        """Validate a payload's dict (:meth:`to_doc`) and, unless ``None``, its ``tag`` of
        ``body``: PayloadError if a field is missing, unknown or invalid, or the tag wrong."""
        if type(doc) is not dict or set(doc) - _OPTIONAL != _KEYS:
            raise PayloadError("payload is corrupted: wrong set of fields")
        secret = bytes.fromhex(
            _text(doc["secret"], _HEX64.match, "payload field 'secret' must be 64 hex digits")
        )
        if tag is not None and (
            len(tag) != TAG_BYTES or not hmac.compare_digest(tag, _tag(body, secret))
        ):
            raise PayloadError("payload was altered or truncated after it was made (tag mismatch)")
        backend = _text(
            doc["backend"], _BACKEND.match, f"unknown backend {doc['backend']!r} in payload"
        )
        alloc_id = _text(doc["id"], _HEX32.match, "payload field 'id' must be 32 hex digits")
        server = _text(
            doc["server"],
            lambda v: v.startswith("/") and "\0" not in v and len(v.encode()) <= 107,
            "payload field 'server' must be an absolute socket path",
        )
        readonly = doc["readonly"]
        if type(readonly) is not bool:
            raise PayloadError("payload field 'readonly' must be a bool")
        dtype = _numeric_dtype(doc["dtype"], "payload field")
        device = _int(doc, "device", 0, MAX_DEVICES - 1)
        pid = _int(doc, "pid", 1, PID_MAX_LIMIT)
        chunks = _ints(doc["chunks"], "chunks", 1, MAX_SIZE, 1 << 16, "payload")
        if not chunks:
            raise PayloadError("payload has no chunks")
        size = sum(chunks)
        if size > MAX_SIZE:
            raise PayloadError(
                f"payload's chunks add up to {size} bytes, more than any address space holds"
            )
        shape = _ints(doc["shape"], "shape", 0, what="payload")
        strides = _ints(doc["strides"], "strides", -MAX_SIZE, what="payload")
        offset = _int(doc, "offset", 0, size)
        if len(shape) != len(strides):
            raise _dims(shape, strides)
        _place(dtype, shape, strides, offset, size)
        capacity = _int(doc, "capacity", size, MAX_SIZE) if "capacity" in doc else None
        node = doc.get("node")
        if "node" in doc:
            _text(
                node,
                NODE_PATTERN.fullmatch,
                "payload field 'node' must be a node id (sharedarrays.node)",
            )
        block = doc.get("block")
        if "block" in doc:
            block = bytes.fromhex(
                _text(block, _HEX64.match, "payload field 'block' must be 64 hex digits")
            )
        fds = _takeable(doc["fds"], len(chunks)) if "fds" in doc else None
        memory = (backend, device, alloc_id, secret, pid, server, chunks)
        return cls(*memory, dtype, shape, strides, offset, readonly, capacity, node, block, fds)


class Takeable(NamedTuple):
    """The exporter's fds that an importer may take itself (``pidfd_getfd``): its take
    ``table``'s fd and inode, the allocation's ``slot`` there, the ``chunks``' fds
    (:mod:`sharedarrays.memory.takeable` says how the slot proves what was taken)."""

    table: int
    inode: int
    slot: int
    chunks: tuple[int, ...]


def _takeable(v: object, chunks: int) -> Takeable:
    """The ``fds`` field: ``[table fd, its inode, slot, [chunk fd, ...]]``."""
    if type(v) is not list or len(v) != 4 or chunks > MAX_TAKEN:
        raise PayloadError("payload field 'fds' must be [table fd, inode, slot, chunk fds]")
    table, inode, slot = _ints(v[:3], "fds", 0, (1 << 64) - 1, 3, "payload")
    fds = _ints(v[3], "fds", 0, (1 << 31) - 1, chunks, "payload")
    if len(fds) != chunks or table >= 1 << 31 or slot >= 1 << 31:
        raise PayloadError("payload field 'fds' must name one fd per chunk")
    return Takeable(table, inode, slot, fds)


# a payload's required fields: its record's (``id`` for ``alloc_id``) less the optional ones
_KEYS = frozenset("id" if f.name == "alloc_id" else f.name for f in fields(Payload)) - _OPTIONAL

ViewTuple = tuple[int, tuple[int, ...], tuple[int, ...], str, bool]
"""``(offset, shape, strides, dtype.str, readonly)``: a view as a pickle carries it."""


class ViewFields(NamedTuple):
    """A validated view of an allocation, what a pickle carries per view beside the payload
    (fields as :class:`Payload`'s; read-only if either says so)."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype[Any]
    readonly: bool

    def to_tuple(self) -> ViewTuple:
        """The plain tuple a pickle carries: what :meth:`from_tuple` takes back."""
        return (self.offset, self.shape, self.strides, self.dtype.str, self.readonly)

    @classmethod
    def from_tuple(cls, data: object, size: int, device: bool = False) -> ViewFields:
        """Validate a view's tuple (:meth:`to_tuple`) against an allocation of ``size`` bytes:
        PayloadError for a malformed field, a view outside it, or (``device``) misaligned."""
        dtype, _, _ = check_view(data, size, device)
        offset, shape, strides, _, readonly = cast(ViewTuple, data)  # (checked)
        return cls(offset, shape, strides, dtype, readonly)


def check_view(data: object, size: int, device: bool = False) -> tuple[np.dtype[Any], int, int]:
    """:meth:`ViewFields.from_tuple` without the record: the view's dtype and extent."""
    if type(data) is not tuple or len(data) != 5:
        raise PayloadError("a pickled view is corrupted: its view fields are not 5 values")
    offset, shape, strides, dtype_str, readonly = data
    if type(offset) is not int or not 0 <= offset <= size:
        raise PayloadError(f"view field 'offset' must be an int in [0, {size}], got {offset!r}")
    if type(shape) is not tuple or type(strides) is not tuple or len(shape) != len(strides):
        _ints(shape, "shape", 0)
        _ints(strides, "strides", -MAX_SIZE)
        raise _dims(shape, strides)
    if len(shape) > MAX_NDIM:
        raise PayloadError(f"view field 'shape' must be a tuple of at most {MAX_NDIM} ints")
    dtype = STATE.pickling.dtypes.get(dtype_str) if type(dtype_str) is str else None
    if dtype is None:
        dtype = _numeric_dtype(dtype_str, "view field")
    if type(readonly) is not bool:
        raise PayloadError("view field 'readonly' must be a bool")
    low, high = _place(dtype, shape, strides, offset, size, device)
    return dtype, low, high


def _place(
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    offset: int,
    size: int,
    device: bool = False,
) -> tuple[int, int]:
    """The view's extent (:func:`view_extent`); PayloadError if it has too many elements,
    lies outside ``size`` bytes or (``device``) is misaligned. One pass over the axes."""
    count, low, high = 1, 0, dtype.itemsize
    for n, st in zip(shape, strides):
        if (
            type(n) is not int
            or type(st) is not int
            or not 0 <= n <= MAX_SIZE
            or not -MAX_SIZE <= st <= MAX_SIZE
        ):
            _ints(shape, "shape", 0)  # (one of the two raises)
            _ints(strides, "strides", -MAX_SIZE)
        count *= n
        if st < 0:
            low += st * (n - 1)
        else:
            high += st * (n - 1)
    if count > MAX_SIZE:
        raise PayloadError(f"payload's shape {shape} has more elements than any valid array")
    if count * dtype.itemsize > size:
        raise PayloadError(
            f"payload's view of shape {shape} and strides {strides} has more bytes of elements "
            f"than its allocation of {size} bytes holds (overlapping strides)"
        )
    if count == 0:  # touches nothing
        low = high = 0
    if offset + low < 0 or offset + high > size:
        raise PayloadError(
            f"payload's view reaches bytes [{offset + low}, {offset + high}) outside its "
            f"allocation of {size} bytes"
        )
    if device and (why := misaligned(dtype, shape, strides, offset)):
        raise PayloadError(f"a pickled view is refused: {why}")
    return low, high


def _dims(shape: tuple[int, ...], strides: tuple[int, ...]) -> PayloadError:
    return PayloadError(f"payload has {len(shape)} dims in shape but {len(strides)} strides")
