"""SIGKILL at each stage, and many processes handing views around.

Every test runs on the host backend (CI) and on CUDA (marker ``gpu``, in
``scripts/gpu_check.sh``), where device memory must also come back once every process let go.

After every kill: no fd leaked in the survivors, the data the survivors see is intact, and a
payload whose handles are gone fails with a clear SharedArrayError. The counts these tests
reach are recorded in docs/reliability.md.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import random
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import open_fds
from keeper_helpers import (
    close_pipes,
    keeper_memfds,
    lock_holder,
    private_keeper,
    read_json_line,
    spawn,
    wait_gone,
)

import sharedarrays as sa
from sharedarrays.memory import registry as sa_registry
from sharedarrays.transport import keeper

__all__ = ["private_keeper"]

KILLS = 8  # kills per stage

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _free_device_memory(device: str) -> int | None:
    """Free bytes of the device (CUDA), after CuPy gave back its cached blocks; None on cpu."""
    if device == "cpu":
        return None
    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.cuda.Device(0).synchronize()
    return int(cupy.cuda.runtime.memGetInfo()[0])


def _assert_device_memory_back(device: str, before: int | None, timeout: float = 20.0) -> None:
    """On CUDA: free memory returns to within 2 MiB of ``before`` (other processes exit and
    release asynchronously, so wait a little)."""
    if before is None:
        return
    deadline = time.monotonic() + timeout
    free = _free_device_memory(device)
    while free is not None and free < before - (2 << 20) and time.monotonic() < deadline:
        sa_registry.drop_parked()
        time.sleep(0.1)
        free = _free_device_memory(device)
    assert free is not None and free >= before - (2 << 20), (
        f"{(before - free) / 2**20:.1f} MiB of device memory not returned"
    )


LOOP_IMPORTS = (
    "import sharedarrays as sa, pickle, sys, json\n"
    "from sharedarrays.memory import registry as sa_registry\n"
    "blob = bytes.fromhex(sys.stdin.readline())\n"
    "print(json.dumps({'ready': True}), flush=True)\n"
    "while True:\n"
    "    a = pickle.loads(blob); a.close(); del a\n"
    "    sa_registry.drop_parked()\n"
)


def _wait_fds(target: int, timeout: float = 10.0) -> int:
    """Open fds once they are back to ``target`` or fewer (other tests' pools may still be
    closing theirs in the background: fewer is not a leak), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    n = open_fds()
    while n > target and time.monotonic() < deadline:
        time.sleep(0.02)
        n = open_fds()
    return n


@pytest.mark.parametrize("device", DEVICES)
def test_sigkill_consumer_mid_import(device: str) -> None:
    free_before = _free_device_memory(device)
    a = sa.from_array(np.arange(4096.0), device=device, pack=False)
    want = a.get()
    blob = pickle.dumps(a)
    baseline = open_fds()
    rng = random.Random(6)
    for _ in range(KILLS):
        child = spawn(LOOP_IMPORTS)
        assert child.stdin is not None
        child.stdin.write(blob.hex() + "\n")
        child.stdin.flush()
        read_json_line(child)
        time.sleep(rng.uniform(0, 0.05))  # somewhere inside connect / recv_fds / mmap
        child.send_signal(signal.SIGKILL)
        child.wait()
        close_pipes(child)
    assert _wait_fds(baseline) <= baseline, "the exporter leaked fds to killed importers"
    np.testing.assert_array_equal(a.get(), want)
    a.close()
    del a
    _assert_device_memory_back(device, free_before)


@pytest.mark.parametrize("device", DEVICES)
def test_sigkill_consumer_holding_a_mapping(private_keeper: Path, device: str) -> None:
    free_before = _free_device_memory(device)
    a = sa.from_array(np.arange(1000.0), device=device, name="held")
    kpid = lock_holder(private_keeper)
    assert kpid is not None
    holder_code = (
        "import sharedarrays as sa, sys, json\n"
        "a = sa.attach('held'); a.array[:10] = -1\n"
        "print(json.dumps({'ok': 1}), flush=True); sys.stdin.read()\n"
    )
    for _ in range(KILLS):
        holder = spawn(holder_code)
        read_json_line(holder)
        assert holder.pid in sa.list_named()[0].pids
        holder.kill()
        holder.wait()
        close_pipes(holder)
        deadline = time.monotonic() + 10
        while holder.pid in sa.list_named()[0].pids and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sa.list_named()[0].pids == (os.getpid(),)
    assert a.get()[10:].tolist() == list(range(10, 1000)) and (a.get()[:10] == -1).all()
    sa.unlink("held")
    a.close()
    del a
    gc.collect()
    deadline = time.monotonic() + 10
    while keeper_memfds(kpid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert keeper_memfds(kpid) == 0  # nothing leaked in the keeper either
    _assert_device_memory_back(device, free_before)


@pytest.mark.parametrize("device", DEVICES)
def test_sigkill_producer_right_after_export(private_keeper: Path, device: str) -> None:
    producer_code = (
        "import sharedarrays as sa, numpy as np, pickle, sys, json\n"
        "n, dev = int(sys.argv[1]), sys.argv[2]\n"
        "a = sa.from_array(np.full(512, n, dtype=np.int64), device=dev, name=f'p{n}')\n"
        "b = sa.from_array(np.full(64, n, dtype=np.int64), device=dev, pack=False); b.park()\n"
        "c = sa.from_array(np.full(8, n, dtype=np.int64), device=dev, pack=False)\n"
        "print(json.dumps({'parked': pickle.dumps(b).hex(), 'plain': pickle.dumps(c).hex()}),"
        " flush=True)\n"
        "sys.stdin.read()\n"
    )
    import subprocess
    import sys

    free_before = _free_device_memory(device)
    payloads = []
    for n in range(KILLS):
        p = subprocess.Popen(
            [sys.executable, "-c", producer_code, str(n), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        payloads.append(read_json_line(p))
        p.kill()  # right after exporting: its handle server dies with it
        p.wait()
        close_pipes(p)
    keeper.ensure_running()  # our keeper connection is not a leak
    baseline = open_fds()
    for n, blobs in enumerate(payloads):
        a = sa.attach(f"p{n}")  # the keeper holds the named array
        assert (a.get() == n).all()
        b = pickle.loads(bytes.fromhex(str(blobs["parked"])))  # and the parked one
        assert (b.get() == n).all()
        with pytest.raises(sa.HandleUnavailable, match="no longer available"):
            pickle.loads(bytes.fromhex(str(blobs["plain"])))  # nobody holds this one
        sa.unlink(f"p{n}")
        b.unpark()
        a.close()
        b.close()
        del a, b
    gc.collect()
    sa_registry.drop_parked()
    assert _wait_fds(baseline) <= baseline
    _assert_device_memory_back(device, free_before)


@pytest.mark.parametrize("device", DEVICES)
def test_sigkill_keeper_while_serving_and_restart(private_keeper: Path, device: str) -> None:
    attach_loop = (
        "import sharedarrays as sa, json, sys\n"
        "ok = errors = 0\n"
        "print(json.dumps({'ready': 1}), flush=True)\n"
        "for _ in range(100000):\n"
        "    try:\n"
        "        a = sa.attach('served'); assert a.get().sum() == 4950; a.close(); ok += 1\n"
        "    except sa.SharedArrayError:\n"
        "        errors += 1\n"
        "        if errors > 20: break\n"
        "print(json.dumps({'ok': ok, 'errors': errors}), flush=True)\n"
    )
    survivors = 0
    free_before = _free_device_memory(device)
    for round_ in range(KILLS // 2):
        a = sa.from_array(np.arange(100.0), device=device, name="served")
        kpid = lock_holder(private_keeper)
        assert kpid is not None
        loaders = [spawn(attach_loop) for _ in range(2)]
        for p in loaders:
            read_json_line(p)
        time.sleep(0.2 + 0.1 * round_)
        os.kill(kpid, signal.SIGKILL)  # while it serves the loaders
        wait_gone(kpid)
        for p in loaders:
            out = read_json_line(p, timeout=120)
            assert p.wait(60) == 0
            assert int(out["errors"]) > 0  # a clean SharedArrayError, no hang, no crash
            close_pipes(p)
        # the survivor (us) still has its data; the name went with the keeper
        np.testing.assert_array_equal(a.get(), np.arange(100.0))
        survivors += 1
        # a new keeper starts on next need, replacing the dead one's socket
        with pytest.raises(sa.NameNotFound):
            sa.attach("served")
        b = sa.zeros(1, device=device, name="served")
        assert lock_holder(private_keeper) not in (None, kpid)
        sa.unlink("served")
        a.close()
        del a, b
        gc.collect()
    assert survivors == KILLS // 2
    _assert_device_memory_back(device, free_before)
    before = open_fds()
    keeper.disconnect()
    assert open_fds() == before - 1  # just our keeper connection


# ---------------------------------------------------------------------------------------------
# concurrency

PROCESSES = 16
HANDOFFS = 100
LIMIT = 180  # seconds for each round of handoffs


def _checksum(view: sa.SharedDeviceArray) -> float:
    return float(view.get().astype(np.float64).sum())


def _views(base: sa.SharedDeviceArray, rng: random.Random, n: int) -> list[sa.SharedDeviceArray]:
    out = []
    for _ in range(n):
        r0 = rng.randrange(base.shape[0])
        r1 = rng.randrange(r0, base.shape[0]) + 1
        c0 = rng.randrange(base.shape[1])
        step = rng.choice([1, 2, 3, -1])
        view = base[r0:r1, c0::step] if step > 0 else base[r0:r1, ::-1]
        out.append(view)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_16_processes_100_handoffs_of_random_views(device: str) -> None:
    import keeper_helpers
    import workers

    rng = random.Random(1616)
    free_before = _free_device_memory(device)
    base = sa.from_array(
        np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32), device=device
    )
    views = _views(base, rng, PROCESSES * HANDOFFS)
    want = [_checksum(v) for v in views]
    start = time.perf_counter()
    with mp.get_context("forkserver").Pool(PROCESSES) as pool:
        # map_async + get(timeout): a hang fails the test instead of stalling the suite
        got = pool.map_async(workers.checksum, views, chunksize=4).get(LIMIT)
        pids = set(pool.map_async(keeper_helpers.pid_of, range(PROCESSES * 4), 1).get(LIMIT))
        # plain pickle bytes as well, through a keeper-less path, half of them
        blobs = [pickle.dumps(v) for v in views[::2]]
        got_blobs = pool.map_async(keeper_helpers.checksum_blob, blobs, 4).get(LIMIT)
    elapsed = time.perf_counter() - start
    assert len(pids) >= 2
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if not np.isclose(g, w, rtol=1e-5)]
    assert not bad, f"{len(bad)} checksums differ"
    assert all(np.isclose(g, w, rtol=1e-5) for g, w in zip(got_blobs, want[::2]))
    print(f"{len(views) + len(blobs)} handoffs in {elapsed:.1f} s")
    assert psutil.Process().num_fds() < 200
    del views, base
    _assert_device_memory_back(device, free_before)
