"""The ordering token's wire format: what an importer waits for before using memory.

A token names one record of an interprocess GPU event
(:mod:`sharedarrays.backends.cuda.sync`). 88 bytes, little-endian::

    offset  size  field
    0       8     pid          exporter's process id
    8       8     start        exporter's start time, clock ticks since boot (0: unknown)
    16      64    handle       the event's IPC handle (``CUipcEventHandle``), opaque
    80      8     seq          which record of that event
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from sharedarrays.errors import PayloadError

__all__ = ["OrderingToken", "TOKEN_SIZE", "HANDLE_SIZE", "encode", "decode"]

_HEAD = struct.Struct("<QQ")
_SEQ = struct.Struct("<Q")
HANDLE_SIZE = 64
"""Bytes of the event handle in a token."""
TOKEN_SIZE = _HEAD.size + HANDLE_SIZE + _SEQ.size
"""Bytes of a token."""
_U64 = 1 << 64


@dataclass(frozen=True)
class OrderingToken:
    """One record of an exporter's interprocess event.

    Attributes
    ----------
    pid : int
        The exporting process.
    start : int
        Its start time in clock ticks since boot (``0`` when unknown).
    handle : bytes
        The event's IPC handle (64 bytes).
    seq : int
        Which record of the event this token names.
    """

    pid: int
    start: int
    handle: bytes
    seq: int

    def __post_init__(self) -> None:
        for name in ("pid", "start", "seq"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < _U64:
                raise PayloadError(f"an ordering token's {name} is a 64-bit unsigned int")
        if type(self.handle) is not bytes or len(self.handle) != HANDLE_SIZE:
            raise PayloadError(f"an ordering token's event handle has {HANDLE_SIZE} bytes")


def encode(token: OrderingToken) -> bytes:
    """The token's :data:`TOKEN_SIZE` bytes."""
    return _HEAD.pack(token.pid, token.start) + token.handle + _SEQ.pack(token.seq)


def decode(data: bytes) -> OrderingToken:
    """Read a token.

    Raises
    ------
    PayloadError
        ``data`` is not bytes of a sync token's size.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError(f"a sync token is bytes, not {type(data).__name__}")
    if len(data) != TOKEN_SIZE:
        raise PayloadError(f"a sync token has {TOKEN_SIZE} bytes, not {len(data)}")
    pid, start = _HEAD.unpack_from(data)
    (seq,) = _SEQ.unpack_from(data, _HEAD.size + HANDLE_SIZE)
    return OrderingToken(pid, start, bytes(data[_HEAD.size : _HEAD.size + HANDLE_SIZE]), seq)
