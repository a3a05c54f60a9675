from __future__ import annotations

import gc
import mmap
import subprocess
import sys

import client_workers
import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.backends import get_backend
from sharedarrays.backends.device import CPU
from sharedarrays.memory import Allocation, Origin, live_allocations, lookup


def mapped(address: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return "memfd:sharedarrays" in line
    return False


def test_multi_chunk_allocation_is_contiguous(fd_baseline: None) -> None:
    page = mmap.PAGESIZE
    a = sa.empty(10 * page // 8 + 3, "float64", device="cpu", chunk_bytes=3 * page)
    alloc = a.allocation
    assert [c.size for c in alloc.chunks] == [3 * page, 3 * page, 3 * page, 2 * page]
    assert [m.offset for m in alloc.mappings] == [0, 3 * page, 6 * page, 9 * page]
    assert len({c.fd for c in alloc.chunks}) == 4
    ref = np.arange(a.size, dtype=np.float64)
    a[...] = ref  # one array spans chunk boundaries
    np.testing.assert_array_equal(a.get(), ref)
    assert "mapping" in alloc.describe() and alloc.describe().count(" rw") == 4
    del alloc
    a.close()


@pytest.mark.usefixtures("no_cache")  # (a release frees: nothing kept for reuse)
def test_release_unmaps_and_closes_fds(fd_baseline: None) -> None:
    a = sa.zeros(1 << 16, device="cpu", chunk_bytes=1 << 16)
    address, alloc_id = a.address, a.allocation.id
    assert mapped(address)
    assert lookup(alloc_id) is not None
    a.close()
    gc.collect()
    assert lookup(alloc_id) is None
    assert not mapped(address)


def test_registry_lists_live_allocations() -> None:
    a = sa.zeros(4, device="cpu", pack=False)
    b = sa.zeros(4, device="cpu", pack=False)
    ids = [x.id for x in live_allocations()]
    assert a.allocation.id in ids and b.allocation.id in ids
    assert ids.index(a.allocation.id) < ids.index(b.allocation.id)


def test_failed_build_releases_everything(fd_baseline: None) -> None:
    backend = get_backend(CPU)

    class Exploding:
        def __init__(self) -> None:
            self.n = 0

        def __call__(self, size: int) -> object:
            self.n += 1
            if self.n == 3:
                raise OSError("chunk 3 failed")
            return backend.create_chunk(size)

    with pytest.raises(OSError, match="chunk 3 failed"):
        Allocation._build(
            backend, "0" * 32, b"x" * 32, Origin(True, 1, 0.0), [4096] * 4, Exploding(), "rw"
        )
    assert lookup("0" * 32) is None


def test_import_with_mismatched_sizes_closes_fds(fd_baseline: None) -> None:
    import os

    backend = get_backend(CPU)
    r, w = os.pipe()
    with pytest.raises(sa.PayloadError):
        Allocation.import_(backend, "1" * 32, b"y" * 32, [4096], [r, w], 1)


def test_import_of_wrong_size_handle_is_payload_error(fd_baseline: None) -> None:
    a = sa.zeros(10, device="cpu", pack=False)
    import os

    fd = os.dup(a.allocation.chunks[0].fd)
    with pytest.raises(sa.PayloadError, match="describes"):
        Allocation.import_(get_backend(CPU), "2" * 32, b"z" * 32, [8192], [fd], 1)


def test_release_never_takes_a_mapping_from_under_a_view() -> None:
    """A parked import leased again (say by another thread) is not dropped: release() does
    nothing while a view uses the allocation."""
    import os

    from sharedarrays.memory import drop_parked, parked_allocations

    drop_parked()  # (what earlier tests in this process left parked: this test counts its own)
    a = sa.from_array(np.arange(512.0), device="cpu", pack=False)
    fd = os.dup(a.allocation.chunks[0].fd)
    imported = Allocation.import_(
        get_backend(CPU), "3" * 32, b"w" * 32, a.allocation.chunk_sizes(), [fd], os.getpid()
    )
    view = sa.SharedDeviceArray(imported, a.dtype, a.shape, a.strides, 0)
    del imported
    view.close()
    gc.collect()
    assert [p.id for p in parked_allocations()] == ["3" * 32]  # parked, no view
    again = sa.SharedDeviceArray(lookup("3" * 32), a.dtype, a.shape, a.strides, 0)  # unparks
    lookup("3" * 32).release()  # e.g. a release notice racing the new view: refused
    drop_parked()
    assert again.get().sum() == np.arange(512.0).sum()  # still mapped
    again.close()
    gc.collect()
    assert drop_parked() == 1 and lookup("3" * 32) is None


@pytest.mark.parametrize("pid", [2**22 + 1, 2**31, 2**63, 2**80, 0, -1, -(2**40)])
def test_a_closed_import_never_stays_live_whatever_its_source_pid(
    pid: int, fd_baseline: None
) -> None:
    """``running`` takes any int: an import whose source pid names no process (too large
    for ``kill``, or 0 and negatives, which ``kill`` takes for process groups) is released
    when its last view closes, not kept in the registry for good."""
    import os

    from sharedarrays.process import running, start_time

    assert not running(pid) and start_time(pid) is None
    a = sa.zeros(512, device="cpu", pack=False)
    fd = os.dup(a.allocation.chunk_fds()[0])
    alloc = Allocation.import_(
        get_backend(CPU), "7" * 32, b"s" * 32, [a.allocation.size], [fd], pid
    )
    v = sa.SharedDeviceArray(alloc, np.dtype("float64"), (512,), (8,), 0)
    del alloc
    v.close()
    gc.collect()
    assert lookup("7" * 32) is None
    assert all(al.id != "7" * 32 for al in live_allocations())
    a.close()


@pytest.mark.usefixtures("no_cache")  # (a release frees: nothing kept for reuse)
def test_dropping_the_last_lease_releases_the_allocation(fd_baseline: None) -> None:
    """Dropping the last lease releases the allocation (fds closed, unmapped), and the
    lease is not brought back by its finalizer."""
    import weakref

    alloc = Allocation.create(get_backend(CPU), 4096)
    alloc_id, address = alloc.id, alloc.address
    lease = alloc.lease()
    gone = weakref.ref(lease)
    del alloc, lease
    gc.collect()
    assert gone() is None
    assert lookup(alloc_id) is None and not mapped(address)


def test_a_release_that_fails_in_a_finalizer_is_reported(
    monkeypatch: pytest.MonkeyPatch, fd_baseline: None
) -> None:
    """A failure has nowhere to be raised to when a lease is collected: it is a warning
    that names the allocation, never silence."""
    alloc = Allocation.create(get_backend(CPU), 4096)
    lease = alloc.lease()

    def broken(end: int) -> None:
        raise OSError("unmap failed")

    monkeypatch.setattr(alloc, "_unlease", broken)
    with pytest.warns(RuntimeWarning, match=f"releasing allocation {alloc.id} failed: unmap"):
        del lease
        gc.collect()
    monkeypatch.undo()
    alloc_id = alloc.id
    alloc._unlease(alloc.size)  # the hold the failed finalizer left: released now
    del alloc
    assert lookup(alloc_id) is None


def test_a_pinned_reservation_outlives_a_move_until_its_lease_goes(fd_baseline: None) -> None:
    page = mmap.PAGESIZE
    alloc = Allocation.create(get_backend(CPU), page, capacity=page)
    view = alloc.lease()
    pinned = alloc.lease(pin=True)  # a native array's lease: the addresses it holds
    old = alloc.address
    alloc.grow(4 * page)  # past the capacity: moves to a new reservation
    assert alloc.address != old and mapped(old) and mapped(alloc.address)
    del pinned
    gc.collect()
    assert not mapped(old) and mapped(alloc.address)  # the retired reservation is freed
    new = alloc.address
    del alloc, view
    gc.collect()
    assert not mapped(new)


@pytest.mark.timeout(120)
def test_a_lease_collected_late_in_shutdown_prints_nothing() -> None:
    """A view collected after the interpreter cleared the modules' globals (``sys`` is None
    there) ends its lease silently: no "Exception ignored in Lease.__del__" at exit."""
    r = subprocess.run(
        [sys.executable, "-c", client_workers.SHUTDOWN], capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, "ok\n", "")
