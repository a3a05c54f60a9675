"""The ordering token: what an importer waits for before using memory, one record of an
exporter's interprocess GPU event (:mod:`sharedarrays.backends.cuda.sync`). 88 bytes,
little-endian: pid, start time (clock ticks since boot, 0: unknown), event handle, seq."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from sharedarrays.errors import PayloadError

HANDLE_SIZE = 64  # bytes of the event handle in a token
_TOKEN = struct.Struct(f"<QQ{HANDLE_SIZE}sQ")  # pid, start, handle, seq
TOKEN_SIZE = _TOKEN.size  # bytes of a token


@dataclass(frozen=True)
class OrderingToken:
    """One record (``seq``) of the interprocess event ``handle`` of process ``pid``."""

    pid: int
    start: int
    handle: bytes
    seq: int

    def __post_init__(self) -> None:
        for name in ("pid", "start", "seq"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value < 1 << 64:
                raise PayloadError(f"an ordering token's {name} is a 64-bit unsigned int")
        if type(self.handle) is not bytes or len(self.handle) != HANDLE_SIZE:
            raise PayloadError(f"an ordering token's event handle has {HANDLE_SIZE} bytes")


def encode(token: OrderingToken) -> bytes:
    """The token's :data:`TOKEN_SIZE` bytes."""
    return _TOKEN.pack(token.pid, token.start, token.handle, token.seq)


def decode(data: bytes) -> OrderingToken:
    """The token in ``data``; PayloadError unless it is bytes of :data:`TOKEN_SIZE`."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError(f"a sync token is bytes, not {type(data).__name__}")
    if len(data) != TOKEN_SIZE:
        raise PayloadError(f"a sync token has {TOKEN_SIZE} bytes, not {len(data)}")
    return OrderingToken(*_TOKEN.unpack(data))
