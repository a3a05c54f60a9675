"""One conformance suite for every memory system: the same cases, parametrised by backend.

Each case runs for every backend this machine has: ``host`` and the ``host-pointer`` test
double (``pointer_backend.py``: a pointer backend with exporter-owned lifetime, on the CPU)
everywhere, and ``cuda-vmm``, ``cuda-ipc`` and ``cuda-pool`` (marked ``gpu``) where a CUDA
device supports them; a backend the device lacks is skipped with the reason
``sharedarrays.list_backends()`` gives. A new backend is proven by adding it to ``BACKENDS``.

Where the semantics differ, the test says so. The one difference is lifetime:

- ``any holder`` (host, cuda-vmm): the memory lives while any process maps it or holds a
  handle; an exporter may release or exit while importers keep using the array.
- ``exporter`` (cuda-ipc, cuda-pool; host-pointer imitates them): only the exporter keeps
  the memory. An exporter that releases an array keeps it *draining* until every importer it
  served has closed it or exited, and an exporter that exits waits for them first
  (``SHAREDARRAYS_EXIT_WAIT``); an import after the exporter is gone raises
  ``HandleUnavailable``.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import conformance_workers as cw
import numpy as np
import pointer_backend  # noqa: F401 - registers host-pointer
import pytest
from conftest import fd_targets, open_fds

import sharedarrays as sa
from sharedarrays.backends import get_backend
from sharedarrays.backends.device import parse_device
from sharedarrays.memory.cache import empty_cache
from sharedarrays.memory.registry import draining_allocations, drop_parked, lookup

TESTS = Path(__file__).parent
BACKENDS = [
    pytest.param(("host", "cpu"), id="host"),
    pytest.param(("host-pointer", "cpu"), id="host-pointer"),
    pytest.param(("cuda-vmm", "cuda:0"), id="cuda-vmm", marks=pytest.mark.gpu),
    pytest.param(("cuda-ipc", "cuda:0"), id="cuda-ipc", marks=pytest.mark.gpu),
    pytest.param(("cuda-pool", "cuda:0"), id="cuda-pool", marks=pytest.mark.gpu),
    pytest.param(("hip-vmm", "hip:0"), id="hip-vmm-simulated"),
    pytest.param(("hip-pool", "hip:0"), id="hip-pool-simulated"),
    pytest.param(("ascend", "npu:0"), id="ascend-simulated"),
]
SIMULATED = {
    "SHAREDARRAYS_HIP_MODULE": "simulated.hip",
    "SHAREDARRAYS_ASCEND_MODULE": "simulated.ascend",
}
"""The simulated drivers (``tests/simulated/``), set while this module runs (and inherited by
every process it starts), so that ``device=None`` elsewhere still means what it did."""


@pytest.fixture(scope="module", autouse=True)
def simulated_drivers() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp_:
        for name, value in SIMULATED.items():
            if name not in os.environ:
                mp_.setenv(name, value)
        yield


class Target:
    """A backend under test and the device it serves."""

    def __init__(self, backend: str, device: str) -> None:
        self.backend = backend
        self.device = device
        self.exporter_owned = get_backend(parse_device(device), backend).exporter_owned

    def from_array(self, ref: np.ndarray[Any, Any], **kw: Any) -> sa.SharedDeviceArray:
        return sa.from_array(ref, device=self.device, backend=self.backend, **kw)

    def device_free(self) -> int | None:
        """Free device memory in bytes (CUDA), or None on the host."""
        backend = get_backend(parse_device(self.device), self.backend)
        info = getattr(backend, "mem_get_info", None)
        return None if info is None else int(info()[0])


@pytest.fixture(params=BACKENDS)
def target(request: pytest.FixtureRequest) -> Target:
    backend, device = request.param
    if device != "cpu":
        why = sa.list_backends()[backend]
        if why is not None:
            pytest.skip(f"{backend} cannot be used here: {why}")
    return Target(backend, device)


@pytest.fixture(scope="module")
def pool() -> Iterator[Any]:
    with mp.get_context("spawn").Pool(2) as p:
        yield p


def test_pool_workers_write_in_place(target: Target, pool: Any) -> None:
    ref = np.arange(4 * 1000, dtype=np.float64).reshape(4, 1000)
    a = target.from_array(ref, pack=False)
    sums = pool.map(cw.double_row, [(a, i) for i in range(4)])
    assert sums == [float(2 * ref[i].sum()) for i in range(4)]
    np.testing.assert_array_equal(a.get(), 2 * ref)  # the workers wrote the exporter's memory


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int64", "float16", "float32"])
def test_views_of_every_layout_reach_workers(target: Target, pool: Any, dtype: str) -> None:
    ref = (np.arange(60) % 7).astype(dtype).reshape(6, 10)
    a = target.from_array(ref)
    views = [a, a[1:5, ::3], a[::-2, 7], a[2, 1:9:2], a[..., None, ::-1], a[3:3]]
    refs = [ref, ref[1:5, ::3], ref[::-2, 7], ref[2, 1:9:2], ref[..., None, ::-1], ref[3:3]]
    got = pool.map(cw.checksum, views)
    assert got == [float(r.astype(np.float64).sum()) for r in refs]


def test_plain_pickle_loads_in_a_fresh_interpreter(target: Target, tmp_path: Path) -> None:
    a = target.from_array(np.zeros(1000, dtype=np.int64), pack=False)
    blob = tmp_path / "a.pickle"
    blob.write_bytes(pickle.dumps(a[::2]))
    code = (
        "import pickle, sys, pointer_backend\n"
        f"v = pickle.loads(open({str(blob)!r}, 'rb').read())\n"
        "v.array[...] = 7\n"
        "v.array[0] = 1\n"
        "print(v.allocation.backend.name, v.shape)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=TESTS
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [target.backend, "(500,)"]
    got = a.get()
    assert got[0] == 1 and (got[2::2] == 7).all() and (got[1::2] == 0).all()


def test_many_small_arrays_share_one_allocation(target: Target, pool: Any) -> None:
    refs = [np.full(1024, i, dtype=np.float32) for i in range(200)]  # 4 KiB each
    arrays = [target.from_array(r) for r in refs]
    assert len({x.allocation.id for x in arrays}) <= 2  # packed: one 2 MiB slab (or two)
    total, allocations = pool.apply(cw.checksums, (arrays,))
    assert total == float(sum(r.sum() for r in refs))
    assert allocations == len({x.allocation.id for x in arrays})


def _memory_of(native: Any) -> object:
    """The memory object a native array looks into (NumPy: its base; CuPy: its memory)."""
    data = getattr(native, "data", None)
    mem = getattr(data, "mem", None)
    return mem if mem is not None else native.base


def test_native_arrays_share_the_memory_and_hold_it_after_their_views(target: Target) -> None:
    """The native arrays of two views of one allocation keep it mapped after the views are
    closed, each until it goes; where the backend derives them from one native array of the
    allocation (``native_view``), they share its memory object."""
    ref = np.arange(4096, dtype=np.float32)
    a = target.from_array(ref, pack=False)
    alloc_id = a.allocation.id
    shares = getattr(a.allocation.backend, "native_view", None) is not None
    first, second = a[:1024], a[1024:]
    n1, n2 = first.array, second.array
    if shares:
        assert _memory_of(n1) is _memory_of(n2)
    first.close()
    second.close()
    a.close()
    del a, first, second
    gc.collect()
    assert lookup(alloc_id) is not None  # the native arrays hold it
    assert float(n1.sum()) + float(n2.sum()) == float(ref.sum())
    del n1
    gc.collect()
    assert lookup(alloc_id) is not None
    del n2
    gc.collect()
    assert lookup(alloc_id) is None  # released with the last of them


def test_release_while_an_importer_holds_it(target: Target) -> None:
    """Any holder: the importer keeps the memory. Exporter-owned memory, and memory its
    exporter keeps for reuse (memory/cache.py), drains while the importer holds it: valid
    for the importer, and freed (or cached) once the importer closed it; other memory's
    exporter lets go of its own hold at once."""
    ctx = mp.get_context("spawn")
    ready, go, result = ctx.Event(), ctx.Event(), ctx.Queue()
    a = target.from_array(np.arange(100_000, dtype=np.float64), pack=False)
    alloc_id = a.allocation.id
    waits = target.exporter_owned or a.allocation.block is not None
    # (multiprocessing's pickle, loaded once: the memory its exporter may keep for reuse)
    blob = bytes(ForkingPickler.dumps(a))
    child = ctx.Process(target=cw.hold_then_read, args=(blob, ready, go, result))
    child.start()
    try:
        assert ready.wait(60), "the importer did not load the array"
        holders = a.allocation.holders
        del a
        gc.collect()
        assert lookup(alloc_id) is None  # released here: nothing new is served
        draining = [x.id for x in draining_allocations()]
        assert holders == ((child.pid,) if target.exporter_owned else ())
        assert (alloc_id in draining) == waits  # kept for the importer
        go.set()
        assert result.get(timeout=60) == float(np.arange(100_000).sum())
        child.join(60)
        assert child.exitcode == 0
        deadline = time.monotonic() + 15
        while lookup(alloc_id, draining=True) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lookup(alloc_id, draining=True) is None  # freed (or cached) once closed
    finally:
        go.set()
        child.join(10)
        if child.is_alive():
            child.kill()


def test_exporter_exit(target: Target, tmp_path: Path) -> None:
    """Any holder: the exporter exits at once and the importer keeps the data. Exporter-
    owned: the exporter's exit waits until the importer closed its views."""
    path, go = tmp_path / "payload", tmp_path / "go"
    exporter, a = cw.start_exporter(path, target.device, target.backend, go, exit_wait=60)
    try:
        expected = float(np.arange(4096, dtype=np.float32).sum())
        go.touch()
        if target.exporter_owned:
            time.sleep(1.5)
            assert exporter.poll() is None, "the exporter exited while an importer held its memory"
            assert a.get().sum() == expected
            a.close()
            del a
            gc.collect()
            drop_parked()
        else:
            exporter.wait(60)
            assert a.get().sum() == expected  # the memory outlived its exporter
            a.close()
        out, err = exporter.communicate(timeout=30)
        assert exporter.returncode == 0, err
        assert "exporter exiting" in out and "still hold" not in err
    finally:
        if exporter.poll() is None:
            exporter.kill()
            exporter.communicate()


def test_import_after_the_exporter_exited_is_refused(target: Target, tmp_path: Path) -> None:
    """With no bound for payloads in flight (``SHAREDARRAYS_IN_FLIGHT=0``) nothing keeps
    the memory of an exporter that exited."""
    path, go = tmp_path / "payload", tmp_path / "go"
    go.touch()  # the exporter exits as soon as it has written the payload
    subprocess.run(
        [sys.executable, str(TESTS / "conformance_workers.py"), str(path), target.device,
         target.backend, str(go)],
        cwd=TESTS, check=True, timeout=120, capture_output=True,
        env=dict(os.environ, SHAREDARRAYS_IN_FLIGHT="0"),
    )  # fmt: skip
    with pytest.raises(sa.HandleUnavailable):
        pickle.loads(path.read_bytes())


@pytest.mark.timeout(180)
def test_a_payload_in_flight_loads_after_its_exporter_exited(
    target: Target, tmp_path: Path
) -> None:
    """The exporter exits right after pickling: memory that outlives its exporter is handed
    to the keeper at exit; an exporter of exporter-owned memory waits at exit until the
    payload was loaded and closed."""
    path, go = tmp_path / "payload", tmp_path / "go"
    go.touch()
    exporter, a = cw.start_exporter(path, target.device, target.backend, go, exit_wait=60)
    try:
        ref = float(np.arange(4096, dtype=np.float32).sum())
        assert cw.checksum(a) == ref
        if not target.exporter_owned:
            exporter.communicate(timeout=60)
            assert cw.checksum(a) == ref  # the exporter is gone, the memory is not
            assert pickle.loads(path.read_bytes()).get().sum() == ref  # nor the payload
    finally:
        a.close()
        del a
        gc.collect()
        drop_parked()  # (an exporter-owned array's exporter is told it was closed)
        _, err = exporter.communicate(timeout=60)
    assert exporter.returncode == 0 and "still hold" not in err, err


def test_round_trips_leak_no_fds_and_no_memory(target: Target, pool: Any) -> None:
    ref = np.ones(1 << 18, dtype=np.float32)  # 1 MiB
    warm = target.from_array(ref, pack=False)
    assert pool.map(cw.checksum, [warm, warm]) == [float(1 << 18)] * 2
    del warm
    gc.collect()
    time.sleep(0.5)
    empty_cache()
    fds, free, before = open_fds(), target.device_free(), fd_targets()
    made = []
    for _ in range(20):
        a = target.from_array(ref, pack=False)
        made.append(a.allocation.id)
        assert pool.map(cw.checksum, [a, a[::2]]) == [float(1 << 18), float(1 << 17)]
        del a
    gc.collect()

    def draining() -> list[str]:
        return [i for i in made if lookup(i, draining=True) is not None]

    deadline = time.monotonic() + 60  # (a bound, not a timing: 15 s broke on a loaded host)
    while draining() and time.monotonic() < deadline:
        time.sleep(0.05)  # exporter-owned memory and blocks wait for the workers' notices
    assert draining() == []
    deadline = time.monotonic() + 20
    while open_fds() > fds and time.monotonic() < deadline:
        empty_cache()  # (what it keeps for reuse is held, not leaked)
        time.sleep(0.05)  # the notifier thread may still be telling busy workers (a socket)
    # (fewer is no leak: the CUDA driver closes a /dev/nvidiactl fd of its own at times)
    assert open_fds() <= fds, (sorted(fd_targets() - before), sorted(before - fd_targets()))
    if free is not None:
        after = target.device_free()
        assert after is not None and after >= free - (8 << 20), (free, after)


def test_bad_arguments_say_what_to_do(target: Target) -> None:
    if not target.exporter_owned:
        pytest.skip("the refusals below are those of pointer backends")
    with pytest.raises(ValueError, match="capacity= needs a backend that maps"):
        sa.zeros(10, device=target.device, backend=target.backend, capacity=1 << 20)
    with pytest.raises(ValueError, match="named array must outlive"):
        sa.zeros(10, device=target.device, backend=target.backend, name="conformance-x")
    with pytest.raises(ValueError, match="chunk_bytes= and capacity= need"):
        sa.zeros(10, device=target.device, backend=target.backend, chunk_bytes=1 << 20)
    a = target.from_array(np.arange(10.0), pack=False)
    with pytest.raises(ValueError, match="cannot be named or parked"):
        a.park()
