"""The ordering token's wire format (``sharedarrays.protocol.token``)."""

from __future__ import annotations

import pytest

from sharedarrays.errors import PayloadError
from sharedarrays.protocol.token import HANDLE_SIZE, TOKEN_SIZE, OrderingToken, decode, encode


def test_a_token_round_trips() -> None:
    token = OrderingToken(pid=4242, start=987654321, handle=bytes(range(64)), seq=2**64 - 1)
    data = encode(token)
    assert type(data) is bytes and len(data) == TOKEN_SIZE == 16 + HANDLE_SIZE + 8
    assert decode(data) == token
    assert decode(bytearray(data)) == token and decode(memoryview(data)) == token
    assert data[:8] == (4242).to_bytes(8, "little") and data[16:80] == bytes(range(64))


@pytest.mark.parametrize("data", [b"", b"short", bytes(TOKEN_SIZE - 1), bytes(TOKEN_SIZE + 1)])
def test_a_token_of_the_wrong_size_is_refused(data: bytes) -> None:
    with pytest.raises(PayloadError, match=f"sync token has {TOKEN_SIZE} bytes"):
        decode(data)


def test_a_token_that_is_not_bytes_is_refused() -> None:
    with pytest.raises(PayloadError, match="sync token is bytes"):
        decode("x" * TOKEN_SIZE)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("field", "value"),
    [("pid", -1), ("start", 2**64), ("seq", 1.5), ("pid", True), ("handle", bytes(63))],
)
def test_a_bad_record_is_refused(field: str, value: object) -> None:
    fields: dict[str, object] = {"pid": 1, "start": 0, "handle": bytes(64), "seq": 0}
    fields[field] = value
    with pytest.raises(PayloadError, match=field if field != "handle" else "event handle"):
        OrderingToken(**fields)  # type: ignore[arg-type]
