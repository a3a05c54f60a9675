"""Small arrays packed into shared slabs (memory/slabs.py)."""

from __future__ import annotations

import gc
import itertools

import pytest

import sharedarrays as sa
from sharedarrays.memory import PACK_BYTES, SLAB_BYTES, lookup
from sharedarrays.process import STATE


def test_small_arrays_are_packed_into_shared_slabs() -> None:
    with (
        STATE.memory.slabs_lock
    ):  # start from fresh slabs: earlier tests leave the current one part-used
        STATE.memory.slabs.clear()
    arrays = [sa.full(512, float(i), device="cpu") for i in range(2000)]  # 4 KiB each
    slabs = {a.allocation.id: a.allocation.size for a in arrays}
    payload = sum(a.nbytes for a in arrays)
    assert len(slabs) == -(-payload // SLAB_BYTES)
    assert sum(slabs.values()) <= 1.25 * payload
    assert all(a.address % 256 == 0 for a in arrays)
    assert [float(a.array[0]) for a in arrays[::97]] == [float(i) for i in range(0, 2000, 97)]
    by_slab: dict[str, list[tuple[int, int]]] = {}
    for a in arrays:
        by_slab.setdefault(a.allocation.id, []).append((a.offset, a.offset + a.nbytes))
    for spans in by_slab.values():  # no two arrays overlap
        spans.sort()
        assert all(hi <= lo for (_, hi), (lo, _) in itertools.pairwise(spans))
    big = sa.zeros(PACK_BYTES // 8 + 1, device="cpu")
    assert big.allocation.id not in slabs  # above the threshold: an allocation of its own
    with pytest.raises(ValueError, match="pack=False"):
        sa.zeros(SLAB_BYTES + 1, "uint8", device="cpu", pack=True)
    with pytest.raises(ValueError, match="cannot be combined"):
        sa.zeros(4, device="cpu", pack=True, chunk_bytes=4096)


def test_a_full_slab_is_released_when_its_arrays_go() -> None:
    per_slab = SLAB_BYTES // 4096
    arrays = [sa.zeros(512, device="cpu") for _ in range(2 * per_slab + 1)]
    first = arrays[0].allocation
    first_id = first.id
    assert arrays[per_slab * 2].allocation is not first  # later arrays went to new slabs
    del first
    for a in arrays[:per_slab]:
        a.close()
    del a
    gc.collect()
    assert lookup(first_id) is None  # full, no longer current, no array left: released
    assert lookup(arrays[-1].allocation.id) is not None
