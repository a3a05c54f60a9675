"""Dask: shared arrays through distributed and dask.array (sharedarrays.api.dask), on a
LocalCluster of worker processes on the CPU.

Small arrays are made with pack=False: a slab served to the workers would show "served to"
in later tests' arrays packed into it."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api import dask as sadask
from sharedarrays.node import NODE_VARIABLE, machine_node

distributed = pytest.importorskip("distributed", reason="pip install 'sharedarrays[dask]'")
da = pytest.importorskip("dask.array", reason="pip install 'sharedarrays[dask]'")
dask = pytest.importorskip("dask", reason="pip install 'sharedarrays[dask]'")

import dask_workers as w  # noqa: E402  (tests/: importable in the workers too)
from conftest import open_memfds  # noqa: E402
from distributed.protocol import serialize  # noqa: E402

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
SAME_HOST = {
    "sender": {"address": "tcp://127.0.0.1:1"},
    "recipient": {"address": "tcp://127.0.0.1:2"},
}
OTHER_HOST = {
    "sender": {"address": "tcp://10.0.0.1:1"},
    "recipient": {"address": "tcp://10.0.0.2:2"},
}


def _cluster(**kwargs: object) -> Iterator[distributed.Client]:
    before = open_memfds()
    yield from _run_cluster(**kwargs)
    # what the cluster's messages held (results distributed dropped, arrays its threads
    # deserialised) is let go of a little after it closes; later tests count fds. Waited for
    # while the count falls: what is still held once it has stopped falling for 2 s (arrays
    # this process made and got back, kept mapped by sharedarrays.importing's cache of
    # received parts) no wait lets go of: it used to wait the whole 30 s, twice a run.
    deadline = time.monotonic() + 30
    last, since = open_memfds(), time.monotonic()
    while last > before and time.monotonic() < deadline and time.monotonic() - since < 2:
        gc.collect()
        time.sleep(0.1)
        if (now := open_memfds()) != last:
            last, since = now, time.monotonic()


def _run_cluster(**kwargs: object) -> Iterator[distributed.Client]:
    with (
        distributed.LocalCluster(
            processes=True,
            threads_per_worker=1,
            dashboard_address=None,
            worker_dashboard_address=None,
            **kwargs,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def client() -> Iterator[distributed.Client]:
    """Two worker processes on this node."""
    yield from _cluster(n_workers=2)


@pytest.fixture(scope="module")
def other_node() -> Iterator[distributed.Client]:
    """One worker process that claims another node and listens on another address (the
    client connects from 127.0.0.1 to 127.0.0.2: another host to distributed)."""
    yield from _cluster(n_workers=1, host="127.0.0.2", env={NODE_VARIABLE: "other-node"})


@pytest.fixture(autouse=True)
def _this_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_VARIABLE, raising=False)


def _workers(client: distributed.Client) -> list[str]:
    return sorted(client.scheduler_info()["workers"])


# registration ---------------------------------------------------------------------------------
def test_import_sharedarrays_imports_no_dask() -> None:
    code = "import sys, sharedarrays; print('dask' in sys.modules, 'distributed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_registered_once_distributed_is_imported_in_either_order() -> None:
    for first in ("sharedarrays", "distributed"):
        second = "distributed" if first == "sharedarrays" else "sharedarrays"
        code = (
            f"import {first}, {second}, pickle\n"
            "from sharedarrays.api import dask as d\n"
            "from distributed.protocol import serialize\n"
            "a = sharedarrays.zeros(3, device='cpu')\n"
            "before = d.registered()\n"
            "pickle.dumps(a)\n"
            "print(before, d.registered(), serialize(a)[0]['serializer'])\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        expected = ["False" if first == "sharedarrays" else "True", "True", "dask"]
        assert out.stdout.split() == expected, (first, out.stderr)


# the choice per transfer ----------------------------------------------------------------------
def test_same_host_travels_as_the_payload_other_host_as_data() -> None:
    sadask.register()
    a = sa.from_array(np.arange(MiB // 8, dtype=np.float64), device="cpu", pack=False)
    header, frames = serialize(a, context=SAME_HOST)
    assert header["serializer"] == "dask"
    assert header["sub-header"]["form"] == "payload"
    assert sum(len(memoryview(f)) for f in frames) < 4096
    same = distributed.protocol.deserialize(header, frames)
    assert same.allocation is a.allocation

    header, frames = serialize(a, context=OTHER_HOST)
    assert header["sub-header"]["form"] == "data"
    assert sum(memoryview(f).nbytes for f in frames) >= a.nbytes
    copy = distributed.protocol.deserialize(header, frames)
    assert isinstance(copy, sa.SharedDeviceArray)
    assert copy.allocation is not a.allocation and copy.device.kind == "cpu"
    np.testing.assert_array_equal(copy.get(), a.get())
    assert sadask.same_node_transfer(None)
    inproc = {"sender": {"address": "inproc://1/2/3"}, "recipient": {"address": "inproc://1/2/4"}}
    assert sadask.same_node_transfer(inproc)
    for x in (a, same, copy):
        x.close()


# a cluster on this node -------------------------------------------------------------------------
def test_scatter_submit_and_write_in_place(client: distributed.Client) -> None:
    a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    fut = client.scatter(a)
    got = client.submit(w.describe, fut).result()
    assert got["type"] == "SharedDeviceArray"
    assert got["alloc"] == a.allocation.id and got["pid"] != os.getpid()
    assert got["values"] == list(range(8))
    assert client.submit(w.write, fut, 1, 41.0).result() == 1.0
    assert client.submit(w.write, a, 2, 42.0, pure=False).result() == 2.0  # a task argument
    assert a[1] == 41 and a[2] == 42  # the workers wrote this very memory
    del fut
    a.close()


def test_map_over_views(client: distributed.Client) -> None:
    a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
    got = client.gather(client.map(w.describe, [a[i : i + 2] for i in range(0, 8, 2)]))
    assert {g["alloc"] for g in got} == {a.allocation.id}
    assert [g["values"] for g in got] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    a.close()


def test_worker_to_worker_and_back(client: distributed.Client) -> None:
    w1, w2 = _workers(client)
    pids = client.run(os.getpid)
    made = client.submit(w.make, 4, 3.0, workers=[w1])  # exported by worker 1
    seen = client.submit(w.describe, made, workers=[w2], allow_other_workers=False).result()
    assert seen["pid"] == pids[w2] and seen["origin_pid"] == pids[w1]
    assert seen["values"] == [3.0] * 4
    client.submit(w.write, made, 0, 9.0, workers=[w2], pure=False).result()
    back = made.result()  # to the client
    assert isinstance(back, sa.SharedDeviceArray) and back.allocation.id == seen["alloc"]
    assert back.allocation.origin.pid in (pids[w1], pids[w2])  # whichever worker sent it
    assert back.get().tolist() == [9.0, 3.0, 3.0, 3.0]  # worker 2's write, seen here
    back.close()


def test_bytes_on_the_wire_are_the_payload_not_the_data(client: distributed.Client) -> None:
    w1, w2 = _workers(client)
    n = 32 * MiB
    a = sa.zeros(n // 8, device="cpu", pack=False)
    plain = np.zeros(n // 8)

    client.run(w.count_frames, workers=[w1])

    def worker_to_worker(value: object) -> int:
        fut = client.scatter(value, workers=[w1])
        before = client.run(w.frames_written, workers=[w1])[w1]
        client.submit(len, fut, workers=[w2], allow_other_workers=False).result()
        return int(client.run(w.frames_written, workers=[w1])[w1] - before)

    shared = worker_to_worker(a)
    copied = worker_to_worker(plain)
    assert copied >= n  # the measure sees a copy of the data
    assert shared < MiB, shared  # a shared array moved as its payload
    a.close()


def test_to_dask_chunks_are_shared_views(client: distributed.Client) -> None:
    a = sa.from_array(np.arange(24.0).reshape(4, 6), device="cpu", pack=False)
    x = sa.to_dask(a, chunks=(2, 3))
    assert x.chunks == ((2, 2), (3, 3))
    a[0, 0] = 1000.0  # after the graph was made: the tasks read the shared memory
    assert float(x.sum().compute()) == float(np.arange(24.0).sum() + 1000)
    blocks = dask.compute(*[dask.delayed(w.describe)(b) for b in x.to_delayed().ravel()])
    assert {b["type"] for b in blocks} == {"SharedDeviceArray"}
    assert {b["alloc"] for b in blocks} == {a.allocation.id}
    assert sa.to_dask(a, chunks=(2, 3)).name == x.name
    a.close()


def test_from_dask_writes_each_chunk_in_place(client: distributed.Client) -> None:
    y = da.zeros((100, 100), chunks=(25, 50)).map_blocks(w.fill_block, dtype=np.float64)
    out = sa.from_dask(y, device="cpu")  # 80 kB: an allocation of its own, not packed
    assert isinstance(out, sa.SharedDeviceArray) and out.shape == (100, 100)
    np.testing.assert_array_equal(out.get(), np.arange(10000.0).reshape(100, 100))
    out.close()
    with pytest.raises(TypeError, match=r"dask\.array\.Array"):
        sa.from_dask(np.zeros(3))


def test_from_dask_names_the_result_once_written_and_refuses_creation_keywords(
    client: distributed.Client,
) -> None:
    y = da.zeros((10, 10), chunks=(5, 5)).map_blocks(w.fill_block, dtype=np.float64)
    out = sa.from_dask(y, device="cpu", name="from-dask-named")
    seen = sa.attach("from-dask-named")
    np.testing.assert_array_equal(seen.get(), np.arange(100.0).reshape(10, 10))
    seen.close()
    sa.unlink("from-dask-named")
    out.close()
    # (dask.array.store would take these and ignore them: the array made unpacked, unnamed)
    for bad in ({"pack": False}, {"chunk_bytes": 4096}, {"readonly": True}):
        with pytest.raises(TypeError, match="from_dask does not take"):
            sa.from_dask(y, device="cpu", **bad)
    with pytest.raises(ValueError, match="invalid array name"):
        sa.from_dask(y, device="cpu", name="bad name")


# another node -----------------------------------------------------------------------------------
def test_to_another_node_by_value_and_back(other_node: distributed.Client) -> None:
    a = sa.from_array(np.arange(6.0), device="cpu", pack=False)
    fut = other_node.scatter(a)
    got = other_node.submit(w.describe, fut).result()
    assert got["node"] == "other-node" and got["type"] == "SharedDeviceArray"
    assert got["alloc"] != a.allocation.id  # a new array of that node
    assert got["values"] == list(range(6))
    other_node.submit(w.write, fut, 0, -1.0).result()
    assert a[0] == 0  # a copy there: this array is untouched
    made = other_node.submit(w.make, 3, 2.5).result()  # back, by value
    assert isinstance(made, sa.SharedDeviceArray)
    assert made.payload().node == machine_node() and made.get().tolist() == [2.5] * 3
    made.close()
    a.close()


def test_a_payload_on_another_node_is_refused(other_node: distributed.Client) -> None:
    a = sa.from_array(np.arange(3.0), device="cpu", pack=False)
    fut = other_node.submit(w.load_pickled, pickle.dumps(a))
    with pytest.raises(sa.WrongNode, match="other-node") as refused:
        fut.result()
    assert r"client.submit(f, client.scatter(a))" in str(refused.value)  # what to do
    a.close()


def test_scatter_first_then_submit_reaches_another_node(other_node: distributed.Client) -> None:
    """The documented recipe for an array a task on another node needs: scatter it first
    (a task argument is pickled with the task as its payload, which that node refuses)."""
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    got = other_node.submit(w.describe, other_node.scatter(a)).result()
    assert got["node"] == "other-node" and got["type"] == "SharedDeviceArray"
    assert got["alloc"] != a.allocation.id and got["values"] == [0.0, 1.0, 2.0, 3.0]
    a.close()


# another node: arrays inside tasks ----------------------------------------------------------------
def _submit(c: distributed.Client, a: sa.SharedDeviceArray) -> object:
    return c.submit(w.write, a, 0, -1.0, pure=False).result(timeout=60)


def _map(c: distributed.Client, a: sa.SharedDeviceArray) -> object:
    futures = c.map(w.write, [a[0:2], a[2:4]], [0, 0], [-1.0, -1.0], pure=False)
    return c.gather(futures, errors="raise")


def _delayed(c: distributed.Client, a: sa.SharedDeviceArray) -> object:
    return c.compute(dask.delayed(w.write)(a, 0, -1.0)).result(timeout=60)


def _to_dask(c: distributed.Client, a: sa.SharedDeviceArray) -> object:
    return c.compute(sa.to_dask(a, chunks=2).sum()).result(timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("run", [_submit, _map, _delayed, _to_dask], ids=lambda f: f.__name__)
def test_a_task_argument_for_another_node_fails_the_task_not_the_worker(
    other_node: distributed.Client, run: object
) -> None:
    """An array placed directly in a task reaches a worker of another node as its payload:
    the task fails with WrongNode's message (what to do), the worker stays and runs the next
    task (before, the refusal broke the worker's connection and result() waited forever)."""
    pids = other_node.run(os.getpid)
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    with pytest.raises(sa.WrongNode, match="other-node") as refused:
        run(a=a, c=other_node)  # type: ignore[operator]
    assert r"client.submit(f, client.scatter(a))" in str(refused.value)
    assert a.get().tolist() == [0.0, 1.0, 2.0, 3.0]  # nothing was written
    assert other_node.run(os.getpid) == pids  # the same worker, still in the cluster
    assert other_node.submit(w.describe, 1, pure=False).result(timeout=60)["node"] == "other-node"
    a.close()


@pytest.mark.timeout(120)
def test_a_task_argument_on_another_node_pickles_back_as_the_array(
    other_node: distributed.Client,
) -> None:
    """What the task holds there is a placeholder (not a shared array); plain pickle there
    still refuses it; returned to this node it is the array again."""
    a = sa.from_array(np.arange(3.0), device="cpu", pack=False)
    got = other_node.submit(w.describe, a, pure=False).result(timeout=60)
    assert got["type"] == "OtherNodeArray" and got["node"] == "other-node"
    with pytest.raises(sa.WrongNode, match="other-node"):
        other_node.submit(w.repickle, a, pure=False).result(timeout=60)
    back = other_node.submit(w.identity, a, pure=False).result(timeout=60)
    assert isinstance(back, sa.SharedDeviceArray) and back.allocation is a.allocation
    back.close()
    a.close()


# one GPU: dask_cuda.LocalCUDACluster ----------------------------------------------------------
CUDA = "cuda:0"


@pytest.fixture(scope="module")
def cuda_client() -> Iterator[distributed.Client]:
    """One worker process on GPU 0 (dask-cuda), plus the client, over TCP."""
    pytest.importorskip("cupy", reason="pip install cupy-cuda12x")
    dask_cuda = pytest.importorskip(
        "dask_cuda",
        reason="pip install dask-cuda (the GPU machine gets it as carried wheels: "
        "scripts/gpu_check.sh)",
    )
    with (
        dask_cuda.LocalCUDACluster(
            n_workers=1,
            CUDA_VISIBLE_DEVICES="0",
            protocol="tcp",
            dashboard_address=None,
            worker_dashboard_address=None,
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        yield client


@pytest.mark.gpu
def test_cuda_scatter_submit_and_write_in_place(cuda_client: distributed.Client) -> None:
    a = sa.from_array(np.arange(8.0), device=CUDA, backend="cuda-vmm", pack=False)
    assert type(a.array).__module__.startswith("cupy")
    fut = cuda_client.scatter(a)
    got = cuda_client.submit(w.describe, fut).result()
    assert got["type"] == "SharedDeviceArray"
    assert got["alloc"] == a.allocation.id and got["pid"] != os.getpid()
    assert got["values"] == list(range(8))
    assert cuda_client.submit(w.write, fut, 1, 41.0).result() == 1.0
    assert cuda_client.submit(w.write, a, 2, 42.0, pure=False).result() == 2.0
    assert a.get().tolist()[:3] == [0.0, 41.0, 42.0]  # the worker wrote this GPU memory
    del fut
    a.close()


@pytest.mark.gpu
def test_cuda_bytes_on_the_wire_are_the_payload(cuda_client: distributed.Client) -> None:
    (worker,) = _workers(cuda_client)
    n = 32 * MiB
    cuda_client.run(w.count_frames)

    made = cuda_client.submit(w.make_cuda, n // 8, 2.0, pure=False)
    before = cuda_client.run(w.frames_written)[worker]
    shared = made.result()
    shared_bytes = cuda_client.run(w.frames_written)[worker] - before
    plain_fut = cuda_client.submit(w.make_cupy, n // 8, pure=False)
    before = cuda_client.run(w.frames_written)[worker]
    plain = plain_fut.result()
    copied_bytes = cuda_client.run(w.frames_written)[worker] - before
    assert type(plain).__module__.startswith("cupy")
    assert copied_bytes >= n  # the measure sees Dask's copy of a CuPy array
    assert shared_bytes < MiB, shared_bytes  # a shared CUDA array moved as its payload
    assert isinstance(shared, sa.SharedDeviceArray) and shared.device.kind == "cuda"
    assert float(shared.array[-1]) == 2.0
    del made, plain_fut
    shared.close()


@pytest.mark.gpu
def test_cuda_to_dask_computed_on_the_worker(cuda_client: distributed.Client) -> None:
    a = sa.from_array(np.arange(24.0).reshape(4, 6), device=CUDA, backend="cuda-vmm", pack=False)
    x = sa.to_dask(a, chunks=(2, 3))
    assert type(x._meta).__module__.startswith("cupy")
    a[0, 0] = 1000.0
    a.synchronize()
    assert float(x.sum().compute()) == float(np.arange(24.0).sum() + 1000)
    blocks = dask.compute(*[dask.delayed(w.describe)(b) for b in x.to_delayed().ravel()])
    assert {b["type"] for b in blocks} == {"SharedDeviceArray"}
    assert {b["alloc"] for b in blocks} == {a.allocation.id}
    assert {b["pid"] for b in blocks} == set(cuda_client.run(os.getpid).values())
    a.close()


@pytest.mark.gpu
def test_cuda_from_dask_writes_each_chunk_in_place(cuda_client: distributed.Client) -> None:
    import cupy

    y = da.zeros((100, 100), chunks=(25, 50)).map_blocks(
        w.fill_block_cuda, dtype=np.float64, meta=cupy.empty((0, 0))
    )
    out = sa.from_dask(y)  # CuPy chunks: a new shared array on the GPU
    assert isinstance(out, sa.SharedDeviceArray) and out.device.kind == "cuda"
    np.testing.assert_array_equal(out.get(), np.arange(10000.0).reshape(100, 100))
    out.close()
