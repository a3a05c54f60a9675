"""Growable arrays (issue 8): capacity=, resize, append, refresh, importers seeing growth."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time
from collections.abc import Iterator
from typing import Any

import growth_workers
import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api.widgets.model import build_map, table_rows
from sharedarrays.memory import growth_sizes
from sharedarrays.transport import handles as transport

MiB = 1 << 20


@pytest.fixture
def server() -> str:
    """This process's handle server, started before an fd baseline is taken."""
    return transport.server_address()


class Importer:
    """A spawned process that loads payloads and answers questions about them."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=growth_workers.importer, args=(child,))
        self.proc.start()
        child.close()

    def ask(self, op: str, arg: Any = None) -> Any:
        self.conn.send((op, arg))
        assert self.conn.poll(60), f"the importer did not answer {op!r}"
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"importer: {value}")
        return value

    def error(self, op: str, arg: Any = None) -> str:
        self.conn.send((op, arg))
        assert self.conn.poll(60)
        status, value = self.conn.recv()
        assert status == "error", f"expected an error from {op!r}, got {value!r}"
        return str(value)

    def stop(self) -> None:
        """Let the process exit (its fds here stay open until :meth:`close`)."""
        if self.proc.is_alive():
            self.ask("exit")
        self.proc.join(30)

    def close(self) -> None:
        self.stop()
        self.conn.close()
        self.proc.close()


@pytest.fixture
def importer(server: str) -> Iterator[Importer]:
    imp = Importer()
    try:
        yield imp
    finally:
        imp.close()


@pytest.fixture
def fds_settle(server: str) -> Iterator[None]:
    """Like ``fd_baseline``, but waits up to 5 s for the fds to come back: a release tells
    the importers served (off-thread, through a socket of its own)."""
    from conftest import open_fds

    before = open_fds()
    yield
    deadline = time.monotonic() + 5
    while open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    # (fewer is no leak: a kept connection an earlier test left may be tidied meanwhile)
    assert open_fds() <= before, f"{open_fds() - before} file descriptors leaked"


def _col0(a: sa.SharedDeviceArray) -> float:
    return float(np.asarray(a.array)[:, 0].astype(np.float64).sum())


# --- growth policy -----------------------------------------------------------------------


def test_growth_sizes_double_up_to_chunk_bytes() -> None:
    g = 4096
    assert growth_sizes(g, 1, g, 1 << 30) == []
    assert growth_sizes(g, 2 * g, g, 1 << 30) == [g]
    assert growth_sizes(2 * g, 3 * g, g, 1 << 30) == [2 * g]  # at least what is mapped
    assert growth_sizes(2 * g, 5 * g, g, 1 << 30) == [3 * g]  # at least what is missing
    assert growth_sizes(g, 100 * g, g, 1 << 30) == [99 * g]  # at least what is missing
    assert growth_sizes(8 * g, 9 * g, g, 1 << 30, chunk_bytes=2 * g) == [2 * g]
    assert growth_sizes(2 * g, 7 * g, g, 1 << 30, chunk_bytes=2 * g) == [2 * g] * 3
    assert growth_sizes(4 * g, 5 * g, g, 6 * g) == [2 * g]  # cut to the room left
    assert growth_sizes(4 * g, 7 * g, g, 6 * g) == [4 * g]  # does not fit: runs past


# --- the exporter ------------------------------------------------------------------------


def test_appends_to_64_mib_copy_nothing(fd_baseline: None, record_property: Any) -> None:
    row = 4096  # bytes per row: 16384 single-row appends reach 64 MiB
    a = sa.empty((0, row // 4), "float32", device="cpu", capacity=64 * MiB)
    first = a.address
    fds = a.allocation.chunk_fds()
    times = []
    for i in range(64 * MiB // row):
        t = time.perf_counter()
        a.append(np.full(row // 4, i, "float32"))
        times.append(time.perf_counter() - t)
        assert a.address == first  # element 0 never moves: nothing was copied
    assert a.shape == (16384, 1024) and a.nbytes == 64 * MiB
    assert a.allocation.capacity == 64 * MiB and a.allocation.size == 64 * MiB
    assert a.allocation.chunk_fds()[: len(fds)] == fds  # the first chunks are the same ones
    assert len(a.allocation.chunks) <= 16  # doubling: O(log n) chunks and fds
    data = a.array
    np.testing.assert_array_equal(data[:, 0], np.arange(16384, dtype="float32"))
    np.testing.assert_array_equal(data[:, -1], np.arange(16384, dtype="float32"))
    # (plain floats: pytest-xdist sends a report's properties to the controller with execnet,
    # which serialises no NumPy scalar)
    early, late = float(np.median(times[:1000])), float(np.median(times[-1000:]))
    record_property("append_median_us_first_1000", round(early * 1e6, 1))
    record_property("append_median_us_last_1000", round(late * 1e6, 1))
    record_property("append_MBps", round(64 * MiB / sum(times) / 1e6, 1))
    del data
    a.close()


def test_append_rows_and_resize_within_the_mapped_chunk() -> None:
    a = sa.from_array(np.arange(6).reshape(3, 2), device="cpu", capacity=1 * MiB)
    assert a.allocation.growable and len(a.allocation.chunks) == 1
    a.append([[6, 7], [8, 9]])
    a.append(np.array([10, 11]))
    np.testing.assert_array_equal(a.get(), np.arange(12).reshape(6, 2))
    a.resize(2)
    np.testing.assert_array_equal(a.get(), [[0, 1], [2, 3]])
    a.resize(6)  # the same chunk: the rows are still there
    np.testing.assert_array_equal(a.get(), np.arange(12).reshape(6, 2))
    a.refresh()  # in the exporter: the length of the last resize
    assert a.shape == (6, 2)
    b = a[:3]
    b.resize(4)  # a prefix view may resize too
    assert b.shape == (4, 2) and a.shape == (6, 2)
    z = sa.zeros((0,), "int16", device="cpu", capacity=4096)
    z.resize(3)
    np.testing.assert_array_equal(z.get(), [0, 0, 0])  # host chunks read as zeros


@pytest.mark.timeout(60)
def test_an_absurd_resize_is_refused_at_once_and_leaves_the_array_as_it_was() -> None:
    # (it planned the growth chunk by chunk first: 2**29 chunks of 2 GiB for 2**60 bytes)
    a = sa.zeros((4, 4), device="cpu", capacity=1 * MiB)
    with pytest.raises(sa.OutOfMemory):
        a.resize(1 << 60)
    g = sa.zeros(4, device="cpu", capacity=1 << 30, chunk_bytes=4096)
    with pytest.raises(ValueError, match="larger chunk_bytes"):
        g.resize(1 << 28)  # 2 GiB... in 4 KiB chunks: past the limit of chunks
    assert a.shape == (4, 4) and g.shape == (4,) and len(g.allocation.chunks) == 1
    a.close()
    g.close()


def test_old_views_and_native_arrays_stay_valid_while_growing() -> None:
    a = sa.empty((0, 16), "int64", device="cpu", capacity=16 * MiB)
    a.append(np.ones((100, 16), "int64"))
    head, native = a[:100], a.array
    for _ in range(50):
        a.append(np.full((1000, 16), 2, "int64"))
    assert head.shape == (100, 16) and native.shape == (100, 16)
    assert int(native.sum()) == int(head.array.sum()) == 1600
    native[0, 0] = 7  # writes through the old native array reach the same memory
    assert int(a.array[0, 0]) == 7


def test_shrink_unmaps_whole_chunks_unless_something_reaches_them() -> None:
    a = sa.empty((0, 1024), "float32", device="cpu", capacity=64 * MiB)
    a.resize(4096)  # 16 MiB
    chunks = len(a.allocation.chunks)
    native = a.array
    with pytest.raises(sa.ResizeRefused, match="reaches byte 16777216"):
        a.resize(1)
    assert a.shape == (4096, 1024)  # unchanged
    del native
    view = a[4000:]
    with pytest.raises(sa.ResizeRefused, match="Close those views"):
        a.resize(1)
    view.close()
    a.resize(1)
    assert len(a.allocation.chunks) == 1 < chunks
    assert a.allocation.size == 4096
    a.resize(3000)  # grows again with new chunks
    assert a.shape == (3000, 1024) and a.allocation.size >= 3000 * 4096


def test_capacity_overflow_moves_without_losing_data() -> None:
    ref = np.arange(5000, dtype=np.float64)
    a = sa.from_array(ref[:10], device="cpu", capacity=4096)
    old_native = a.array
    old_address = a.address
    view = a[:10]
    for start in range(10, 5000, 990):
        a.append(ref[start : start + 990])
    assert a.shape == (5000,)
    assert a.allocation.capacity >= 5000 * 8 and a.address != old_address
    np.testing.assert_array_equal(a.get(), ref)
    # made before the move: still valid, at the old address, on the same memory
    assert old_native.ctypes.data == old_address
    np.testing.assert_array_equal(old_native, ref[:10])
    old_native[3] = -1
    assert a.get()[3] == -1 and view.get()[3] == -1
    assert view.address == a.address  # views use the current reservation


def test_moved_reservation_is_freed_when_its_last_native_array_goes() -> None:
    a = sa.from_array(np.arange(10.0), device="cpu", capacity=4096)
    native = a.array
    a.resize(10_000)  # beyond the capacity: moves
    import weakref

    res = weakref.ref(native.base.owner.reservation)  # type: ignore[union-attr]
    assert res() is not None and res().retired is not None  # type: ignore[union-attr]
    del native
    assert res() is None


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="does not hold"):
        sa.empty((1000,), device="cpu", capacity=100)
    with pytest.raises(ValueError, match="pack=True"):
        sa.empty(4, device="cpu", capacity=4096, pack=True)
    with pytest.raises(ValueError, match="named array"):
        sa.empty(4, device="cpu", capacity=4096, name="growth-test-name")
    with pytest.raises(ValueError, match="C order"):
        sa.empty((2, 2), device="cpu", capacity=4096, order="F")
    with pytest.raises(ValueError, match="0-d"):
        sa.empty((), device="cpu", capacity=4096)
    with pytest.raises(TypeError):
        sa.empty(4, device="cpu", capacity=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be named or parked"):
        sa.empty(4, device="cpu", capacity=4096).park()
    fixed = sa.zeros((4, 2), device="cpu")
    with pytest.raises(ValueError, match="without capacity="):
        fixed.resize(8)
    with pytest.raises(ValueError, match="without capacity="):
        fixed.append([1, 2])
    a = sa.zeros((4, 3), device="cpu", capacity=1 * MiB)
    with pytest.raises(ValueError, match="negative"):
        a.resize(-1)
    with pytest.raises(TypeError):
        a.resize(2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="C-contiguous"):
        a[:, 1:].resize(8)
    with pytest.raises(ValueError, match="C-contiguous"):
        a[1:].resize(8)
    with pytest.raises(ValueError, match="0-d"):
        a[0, 0, ...].resize(1)
    with pytest.raises(ValueError, match="cannot append values of shape"):
        a.append(np.zeros((2, 4)))
    empty_rows = sa.zeros((2, 0), device="cpu", capacity=4096)
    with pytest.raises(ValueError, match="rows hold no bytes"):
        empty_rows.resize(4)
    a.close()
    with pytest.raises(sa.ClosedArrayError):
        a.resize(1)


def test_memory_map_shows_reservation_mapped_prefix_and_free_capacity() -> None:
    a = sa.zeros((1024,), "uint8", device="cpu", capacity=1 * MiB)
    m = build_map(a.allocation)
    assert m.size == 1 * MiB and m.mapped == 4096
    assert [(g.start, g.size) for g in m.gaps] == [(4096, 1 * MiB - 4096)]
    rows = [r for r in table_rows([m]) if r.kind == "unmapped"]
    assert rows and rows[0].detail == "free capacity"
    a.resize(100_000)
    m = build_map(a.allocation)
    assert m.mapped == a.allocation.size >= 100_000
    assert m.gaps[-1].start == m.mapped


# --- importers ---------------------------------------------------------------------------


def test_importer_sees_appended_rows(importer: Importer, fds_settle: None) -> None:
    a = sa.empty((0, 8), "int64", device="cpu", capacity=16 * MiB)
    a.append(np.arange(100 * 8, dtype="int64").reshape(100, 8))
    shape, col0, _, chunks = importer.ask("load", ("first", pickle.dumps(a)))
    assert shape == (100, 8) and col0 == _col0(a) and chunks == len(a.allocation.chunks)
    # grow by many chunks: the importer maps them on its next load of a newer payload
    for _ in range(100):
        a.append(np.full((1000, 8), 3, "int64"))
    shape, col0, _, chunks = importer.ask("load", ("second", pickle.dumps(a)))
    assert shape == a.shape == (100_100, 8)
    assert col0 == _col0(a) and chunks == len(a.allocation.chunks) > 1
    assert importer.ask("describe", "first")[0] == (100, 8)  # old views stay valid
    # grow again: refresh() pulls the current length from the exporter
    a.append(np.full((5000, 8), 4, "int64"))
    shape, col0, _, chunks = importer.ask("refresh", "second")
    assert shape == a.shape and col0 == _col0(a) and chunks == len(a.allocation.chunks)
    # an older payload loads too, and maps nothing
    assert importer.ask("load", ("again", pickle.dumps(a[:10])))[0] == (10, 8)
    # importers do not resize
    assert "ResizeRefused" in importer.error("resize", ("second", 5))
    # a shrink that unmaps chunks the importer maps is refused while it runs...
    with pytest.raises(sa.ResizeRefused, match="imported them"):
        a.resize(10)
    a.resize(a.shape[0] - 1000)  # ...one within the chunks everybody maps is not
    np.testing.assert_array_equal(a.array[:100, 0], np.arange(0, 800, 8))
    importer.stop()
    a.resize(10)  # the importer exited: nothing maps those chunks any more
    assert len(a.allocation.chunks) == 1
    del a


def test_importer_follows_a_move_beyond_the_capacity(importer: Importer, fds_settle: None) -> None:
    ref = np.arange(40_000, dtype=np.float64).reshape(-1, 4)
    a = sa.from_array(ref[:10], device="cpu", capacity=8192)
    shape, _, address, _ = importer.ask("load", ("a", pickle.dumps(a)))
    assert shape == (10, 4)
    a.append(ref[10:])  # 320 KB: beyond the capacity, the exporter moves
    assert a.allocation.capacity >= ref.nbytes
    shape, col0, moved, _ = importer.ask("refresh", "a")
    assert shape == ref.shape and col0 == float(ref[:, 0].sum())
    assert moved != address  # the importer moved too (its old addresses were unused)
    shape, col0, _, _ = importer.ask("load", ("b", pickle.dumps(a)))
    assert shape == ref.shape and col0 == float(ref[:, 0].sum())
    importer.ask("drop", "a")
    importer.ask("drop", "b")


def test_fresh_importer_of_an_old_payload_maps_the_current_chunks(importer: Importer) -> None:
    a = sa.empty((0, 4), "float32", device="cpu", capacity=8 * MiB)
    a.append(np.ones((10, 4), "float32"))
    old = pickle.dumps(a)
    a.append(np.ones((100_000, 4), "float32"))
    shape, _, _, chunks = importer.ask("load", ("old", old))
    assert shape == (10, 4) and chunks == len(a.allocation.chunks) > 1
    assert importer.ask("refresh", "old")[0] == a.shape


def test_payload_of_a_shrunk_array_is_refused_clearly(importer: Importer) -> None:
    a = sa.empty((0, 1024), "float32", device="cpu", capacity=8 * MiB)
    a.resize(1000)
    blob = pickle.dumps(a)
    a.resize(1)
    assert "shrunk since this payload was made" in importer.error("load", ("x", blob))
    with pytest.raises(sa.PayloadError, match="shrunk since"):
        pickle.loads(blob)


def test_growable_payload_names_the_exporter_and_its_capacity() -> None:
    a = sa.empty((3, 3), device="cpu", capacity=1 * MiB)
    p = a.payload()
    assert p.capacity == 1 * MiB and p.chunks == (4096,)
    assert sa.load(p.to_bytes()).allocation is a.allocation
    fixed = sa.empty((3, 3), device="cpu", pack=False)
    assert fixed.payload().capacity is None
    assert b"capacity" not in fixed.payload().to_bytes()


def test_pool_workers_see_growth() -> None:
    import workers

    a = sa.empty((0, 100), device="cpu", capacity=4 * MiB)
    a.append(np.ones((10, 100)))
    with mp.get_context("spawn").Pool(1) as pool:
        assert pool.apply(workers.checksum, (a,)) == 1000.0
        a.append(np.ones((4000, 100)))
        assert pool.apply(workers.checksum, (a,)) == 401_000.0
        with pytest.raises(sa.ResizeRefused):
            a.resize(0)
    a.resize(0)  # the pool's worker exited


# --- CUDA --------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_appends_from_2_mib_to_8_gib(importer: Importer, record_property: Any) -> None:
    import cupy

    row = 2 * MiB // 4  # float32: one row is 2 MiB, one granule of an H200
    a = sa.empty((1, row), "float32", device="cuda", capacity=8 << 30)
    a.array[0] = 0
    ptr = a.array.data.ptr
    shape, _, _, _ = importer.ask("load", ("g", pickle.dumps(a)))
    assert shape == (1, row)
    values = cupy.empty(row, "float32")
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for i in range(1, 4096):
        values.fill(i)
        a.append(values)
        assert a.array.data.ptr == ptr  # the first element never moves: nothing copied
    cupy.cuda.Device().synchronize()
    elapsed = time.perf_counter() - t0
    record_property("cuda_append_GBps", round(4095 * 2 * MiB / elapsed / 1e9, 2))
    record_property("cuda_chunks", len(a.allocation.chunks))
    assert a.nbytes == 8 << 30 and a.allocation.size == 8 << 30
    col = a.array[:, 0].get()
    np.testing.assert_array_equal(col, np.arange(4096, dtype="float32"))
    shape, col0, _, chunks = importer.ask("refresh", "g")
    assert shape == (4096, row) and chunks == len(a.allocation.chunks)
    assert col0 == float(np.arange(4096).sum())
    shape, col0, _, _ = importer.ask("load", ("h", pickle.dumps(a[4000:])))
    assert shape == (96, row) and col0 == float(np.arange(4000, 4096).sum())
    importer.ask("drop", "g")
    importer.ask("drop", "h")


@pytest.mark.timeout(120)
def test_a_forked_child_may_use_an_inherited_growable_array_but_not_resize_it() -> None:
    # (the child grew it: two processes then held different chunks under one allocation id,
    # and a third that loaded both payloads read the child's memory for the parent's rows)
    from forking import in_forked_child

    g = sa.empty((0, 4), "float64", capacity=1 << 20, device="cpu")
    g.append(np.ones((10, 4)))
    before = pickle.dumps(g)

    def child() -> list[object]:
        out: list[object] = []
        for grow in (lambda: g.append(np.full((5, 4), 2.0)), lambda: g.resize(20)):
            try:
                grow()
                out.append("resized")
            except sa.ResizeRefused as e:
                out.append(str(e))
        out.append([list(g.shape), float(g.get().sum())])  # its data: the parent's
        try:  # (its payload would name this process, which cannot tell its length)
            pickle.dumps(g)
            out.append("pickled")
        except sa.NotShareable as e:
            out.append(str(e))
        try:
            g.refresh()
            out.append("refreshed")
        except sa.SharedArrayError as e:
            out.append(f"{type(e).__name__}: {e}")
        return out

    refused_append, refused_resize, seen, not_pickled, refreshed = in_forked_child(child)
    assert "only the process that created a growable array resizes it" in refused_append
    assert "inherited it through fork" in refused_append and "refresh" not in refused_append
    assert "only the process that created" in refused_resize
    assert "inherited through fork cannot be handed on" in not_pickled
    assert seen == [[10, 4], 40.0]
    assert "inherited it through fork" in refreshed
    g.append(np.full((5, 4), 7.0))  # the parent still grows it
    assert g.shape == (15, 4) and g.get()[-1, 0] == 7.0
    assert pickle.loads(before).shape == (10, 4)


@pytest.mark.timeout(240)
def test_a_growable_array_made_in_a_pool_worker_and_returned_loads() -> None:
    # (the worker let go of its last view as it sent the result, and a growable array is
    # never handed to the keeper: its memory was freed before the parent loaded it, which
    # raised HandleUnavailable)
    with sa.Pool(1) as pool:
        g = pool.apply(growth_workers.make_growable, (3,))
        assert g.shape == (3, 4) and float(g.get().sum()) == 24.0
        assert pool.apply(growth_workers.draining) == 0  # loaded: the worker freed its own
