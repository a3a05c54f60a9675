"""The chunk sizing policy (memory/growth.py); growing arrays end to end are in
tests/api/test_growth.py."""

from __future__ import annotations

import pytest

from sharedarrays.memory import chunk_sizes
from sharedarrays.memory.growth import MAX_CHUNKS, growth_sizes


def test_chunk_policy() -> None:
    assert chunk_sizes(0, 4096) == [4096]
    assert chunk_sizes(1, 4096) == [4096]
    assert chunk_sizes(10_000, 4096, 8192) == [8192, 4096]
    assert chunk_sizes(3 << 30, 2 << 20) == [3 << 30]  # one chunk unless told otherwise
    assert chunk_sizes(3 << 30, 2 << 20, 2 << 30) == [2 << 30, 1 << 30]
    assert chunk_sizes(5000, 4096, 100) == [4096, 4096]  # chunk_bytes rounds up to a granule
    with pytest.raises(ValueError, match="chunk_bytes"):
        chunk_sizes(10, 4096, 0)
    with pytest.raises(ValueError, match="larger chunk_bytes"):
        chunk_sizes(1 << 40, 4096, 4096)


def test_env_chunk_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAREDARRAYS_CHUNK_BYTES", "8192")
    assert chunk_sizes(20_000, 4096) == [8192, 8192, 4096]
    monkeypatch.setenv("SHAREDARRAYS_CHUNK_BYTES", "lots")
    with pytest.raises(ValueError, match="SHAREDARRAYS_CHUNK_BYTES"):
        chunk_sizes(1, 4096)


def test_too_many_chunks_refused_before_any_list_is_made() -> None:
    # 2**48 chunks of one granule: counted, not built (a list of them would not fit memory)
    with pytest.raises(ValueError, match="would need 281474976710656 chunks"):
        chunk_sizes(1 << 60, 4096, 1)


def test_a_growth_of_too_many_chunks_is_refused_before_they_are_planned() -> None:
    # twice the limit of chunks of one granule past what is mapped: refused, not planned one
    # chunk at a time (a growth to 2**60 bytes would loop 2**29 times)
    with pytest.raises(ValueError, match="more than 65536 chunks"):
        growth_sizes(4096, 4096 * 2 * MAX_CHUNKS, 4096, 1 << 40, 4096)
    assert growth_sizes(4096, 4096 * 4, 4096, 1 << 40, 4096) == [4096, 4096, 4096]
