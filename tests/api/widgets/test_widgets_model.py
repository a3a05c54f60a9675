"""The memory-map model, computed from real host allocations.

Arrays here are larger than the small-array packing threshold (64 KiB), or pass
``chunk_bytes``, so that each has an allocation of its own."""

from __future__ import annotations

import mmap
import os
import pickle
import time
import types

import numpy as np
import pytest
from keeper_helpers import private_keeper  # noqa: F401 - a fixture

import sharedarrays as sa
from sharedarrays.api.widgets import build_map, build_maps, table_rows, views_of
from sharedarrays.api.widgets.model import _levels
from sharedarrays.process import STATE, running

PAGE = mmap.PAGESIZE


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def test_single_chunk_lost_bytes_and_view():
    a = sa.zeros(10_000, dtype="float64", device="cpu")  # 80 000 bytes
    m = build_map(a.allocation)
    assert m.size == _pages(80_000)
    assert [(c.chunk, c.start, c.size) for c in m.chunks] == [(0, 0, _pages(80_000))]
    assert m.gaps == ()
    assert m.used == 80_000
    assert m.lost == _pages(80_000) - 80_000
    assert [(v.start, v.stop, v.label) for v in m.views] == [(0, 80_000, "10000 float64")]
    assert m.access == {"cpu": "rw"}
    assert m.created_here and m.origin_text.startswith("exporter: this process")
    assert m.backend == "host" and m.device == "cpu" and m.granularity == PAGE
    assert m.address == a.allocation.address


def test_multi_chunk_bars_cover_reservation():
    a = sa.zeros((5, PAGE), dtype="uint8", device="cpu", chunk_bytes=2 * PAGE)
    m = build_map(a.allocation)
    assert [(c.chunk, c.start, c.size) for c in m.chunks] == [
        (0, 0, 2 * PAGE),
        (1, 2 * PAGE, 2 * PAGE),
        (2, 4 * PAGE, PAGE),
    ]
    assert [c.fd for c in m.chunks] == [c.fd for c in a.allocation.chunks]
    assert m.lost == 0 and m.gaps == ()


def test_views_are_brackets_on_levels():
    a = sa.zeros((4, 8192), dtype="float32", device="cpu")  # rows of 32 KiB
    row = a[1]
    rev = a[::-1]
    m = build_map(a.allocation)
    spans = {(v.start, v.stop, v.label) for v in m.views}
    assert (0, 4 * 32768, "4×8192 float32") in spans
    assert (0, 4 * 32768, "4×8192 float32 (strided)") in spans  # the reversed view
    assert (32768, 65536, "8192 float32") in spans
    assert len({v.level for v in m.views}) == 3  # all three overlap
    assert len(views_of(a.allocation)) == 3
    row.close()
    rev.close()
    assert len(build_map(a.allocation).views) == 1


def test_closed_and_collected_views_disappear():
    a = sa.zeros(100_000, device="cpu")
    v = a[2:4]
    assert len(views_of(a.allocation)) == 2
    del v
    assert len(views_of(a.allocation)) == 1


def test_levels_reuse_free_rows():
    assert _levels([(0, 10), (2, 5), (10, 20), (5, 8)]) == [0, 1, 0, 1]


def test_table_rows():
    a = sa.zeros((3, PAGE // 8), device="cpu", chunk_bytes=PAGE)
    b = sa.zeros(10_000, device="cpu")
    v = a[1]
    maps = build_maps([a, b, v])  # a and v share one allocation
    assert len(maps) == 2
    rows = table_rows(maps)
    kinds = [(r.alloc_id, r.kind) for r in rows]
    ida, idb = a.allocation.id[:8], b.allocation.id[:8]
    assert kinds == [
        (ida, "reservation"),
        (ida, "mapping of chunk 0"),
        (ida, "mapping of chunk 1"),
        (ida, "mapping of chunk 2"),
        (ida, "view"),
        (ida, "view"),
        (idb, "reservation"),
        (idb, "mapping of chunk 0"),
        (idb, "lost to granularity"),
        (idb, "view"),
    ]
    base = a.allocation.address
    assert (rows[2].start, rows[2].stop, rows[2].size) == (base + PAGE, base + 2 * PAGE, PAGE)
    # (the rows were "chunk N": they are mappings, which say where and which chunk bytes)
    assert rows[2].detail.startswith(f"at offset {PAGE:#x}, chunk bytes 0x0-{PAGE:#x}, fd ")
    lost = rows[8]
    assert lost.stop == b.allocation.address + b.allocation.size
    assert lost.size == _pages(80_000) - 80_000


def test_registry_maps_include_every_live_allocation():
    a = sa.zeros(100_000, device="cpu")
    ids = {m.alloc_id for m in build_maps(None)}
    assert a.allocation.id in ids


class _FakeAllocation(types.SimpleNamespace):
    """An allocation's fields for :func:`build_map`; hashable and weakly referable, as an
    Allocation is."""

    __hash__ = object.__hash__


def test_unmapped_gaps_from_mappings():
    """Gaps come from the mappings: a stand-in allocation with a hole in the middle."""
    from sharedarrays.memory import ChunkInfo, MappingInfo, Origin

    fake = _FakeAllocation(
        id="f" * 32,
        address=0x1000_0000,
        size=4 * PAGE,
        chunks=(ChunkInfo(0, PAGE, 7), ChunkInfo(1, PAGE, 8)),
        mappings=(MappingInfo(0, PAGE, 0, 0, "rw"), MappingInfo(2 * PAGE, PAGE, 1, 0, "r")),
        device=sa.Device("cpu"),
        capacity=4 * PAGE,
        access_by_device={sa.Device("cpu"): "rw"},
        backend=types.SimpleNamespace(name="host", granularity=PAGE, maps=True),
        origin=Origin(False, 4242, 0.0),
        served=(),
        lifetime="any holder",
        holders=(),
        export_readonly=False,
        parked=False,
    )
    m = build_map(fake, views=[])  # type: ignore[arg-type]
    assert [(g.start, g.size) for g in m.gaps] == [(PAGE, PAGE), (3 * PAGE, PAGE)]
    assert [c.access for c in m.chunks] == ["rw", "r"]
    assert m.origin_text.startswith("importer of pid 4242's allocation")
    kinds = [r.kind for r in table_rows([m])]
    assert kinds == [
        "reservation",
        "mapping of chunk 0",
        "mapping of chunk 1",
        "unmapped",
        "unmapped",
    ]


def test_build_maps_rejects_other_objects():
    with pytest.raises(TypeError):
        build_maps([object()])


def test_a_growable_arrays_lost_row_ends_where_its_mapping_does():
    # (the lost row ran to the end of the reservation: 61 MiB of "waste" over the free
    # capacity, which the map's bar and its unmapped row showed as 1.5 MiB and unmapped)
    g = sa.empty((0, 128), "float32", capacity=64 << 20)
    for _ in range(5):
        g.append(np.ones((1000, 128), "float32"))
    m = build_map(g.allocation)
    assert m.mapped < m.size  # free capacity left
    rows = {r.kind: r for r in table_rows([m])}
    lost, free = rows["lost to granularity"], rows["unmapped"]
    assert lost.size == m.lost == m.mapped - 5000 * 128 * 4
    assert lost.stop == m.address + m.mapped == free.start  # side by side, no overlap
    g.close()


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 60  # (a pool's worker is gone when the pool has closed)
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid)


def _made_in_worker(park: bool) -> tuple[int, bytes | sa.SharedDeviceArray]:
    a = sa.full(100_000, 3.0, device="cpu")
    if park:
        a.park()
        return os.getpid(), pickle.dumps(a)
    return os.getpid(), a


@pytest.mark.timeout(120)
def test_an_importer_whose_exporter_exited_says_so():
    # (it still read "imported from pid N" after the pool that made it had closed)
    with sa.Pool(1) as pool:
        pid, d = pool.apply(_made_in_worker, (False,))
        assert "exporter exited" not in build_map(d.allocation).origin_text
    _wait_gone(pid)
    text = build_map(d.allocation).origin_text
    # (the worker lets go of its array once the result is sent: where that comes before the
    # parent's handle request, the payload in flight was handed to the keeper and the parent
    # had the handles from it, which the map then says too)
    kept = "; the keeper holds it" if d.allocation in STATE.keeper.kept else ""
    assert text.startswith(
        f"importer of pid {pid}'s allocation, whose exporter exited{kept}, since"
    ), text
    assert float(d.array.sum()) == 300_000.0  # (still mapped here)


@pytest.mark.timeout(120)
def test_an_importer_whose_exporter_exited_says_the_keeper_holds_it(private_keeper):  # noqa: F811
    with sa.Pool(1) as pool:
        pid, blob = pool.apply(_made_in_worker, (True,))
    _wait_gone(pid)
    d = pickle.loads(blob)  # from the keeper: its exporter is gone
    text = build_map(d.allocation).origin_text
    assert f"importer of pid {pid}'s allocation, whose exporter exited; the keeper holds it" in text
    d.unpark()


def _parked_in_worker(a: sa.SharedDeviceArray) -> tuple[tuple[str, ...], tuple[str, ...]]:
    alloc = a.allocation
    before = build_map(alloc).marks
    a.close()  # the importer keeps the mapping, parked, for the next handoff
    return before, build_map(alloc).marks if alloc.parked else ("not parked",)


@pytest.mark.timeout(120)
def test_named_and_parked_arrays_are_marked(private_keeper):  # noqa: F811
    # (the map showed a named or parked array as any other)
    from sharedarrays.api.widgets import render_html, render_text

    named = sa.empty(100_000, device="cpu", name="widgets-marked")
    parked = sa.zeros(100_000, device="cpu")
    parked.park()
    plain = sa.zeros(100_000, device="cpu")
    maps = build_maps([named, parked, plain])
    assert [m.marks for m in maps] == [('named "widgets-marked"',), ("parked in the keeper",), ()]
    text, html = render_text(maps), render_html(maps)
    assert f'{maps[0].short_id} [named "widgets-marked"]' in text
    assert f"{maps[1].short_id} [parked in the keeper]" in text
    assert "named &quot;widgets-marked&quot;" in html and "parked in the keeper" in html
    parked.unpark()
    sa.unlink("widgets-marked")
    assert [m.marks for m in build_maps([named, parked])] == [(), ()]
    with sa.Pool(1) as pool:
        before, after = pool.apply(_parked_in_worker, (plain,))
    assert before == () and after == ("parked mapping, no view",)


def test_a_packed_arrays_map_is_its_own_bytes_of_a_shared_slab():
    # (a.show() of a small array drew the whole 2 MiB slab with its neighbours' views and
    # "waste 2 MiB", as if the slab were the array's and rounding up had lost the rest)
    from sharedarrays.api.widgets import render_html, render_text

    neighbour = sa.zeros(100, device="cpu")
    a = sa.zeros(100, device="cpu")  # 800 bytes, packed beside it
    assert a.allocation is neighbour.allocation and a.allocation in STATE.memory.packed
    m = build_maps(a)[0]
    assert m.slab and m.lost == 0
    assert m.own == (a.offset, a.offset + 800)
    assert [(v.start, v.stop) for v in m.views] == [m.own]  # not the neighbour's
    assert m.neighbours >= 1
    assert m.packed_text.startswith(f"packed: this array's 800 B at offset {a.offset:#x} of a ")
    assert "slab shared with" in m.packed_text
    rows = {r.kind: r for r in table_rows([m])}
    assert "lost to granularity" not in rows
    assert rows["packed array"].size == 800
    assert m.packed_text in render_text([m]) and "sa-packed" in render_html([m])
    shown = a.show()
    assert shown.maps[0].own == m.own and len(shown.refresh()[0].views) == 1
    whole = build_map(a.allocation)  # the slab itself (sa.show()): every view in it, no own
    assert whole.own is None and whole.lost == 0 and len(whole.views) >= 2
    assert whole.packed_text.startswith("a slab of packed small arrays")
    big = build_map(sa.zeros(100_000, device="cpu").allocation)
    assert not big.slab and big.packed_text == ""
