"""Functions the Dask, joblib and Ray tests run in their workers (importable there: conftest
puts tests/ on the workers' PYTHONPATH)."""

from __future__ import annotations

import os
import pickle
from typing import Any

import numpy as np

import sharedarrays as sa
from sharedarrays.node import this_node


def describe(v: Any) -> dict[str, Any]:
    """What a worker got: its type, allocation, node, values and pid."""
    out: dict[str, Any] = {"type": type(v).__name__, "pid": os.getpid(), "node": this_node()}
    if isinstance(v, sa.SharedDeviceArray):
        out["alloc"] = v.allocation.id
        out["origin_pid"] = v.allocation.origin.pid
        out["values"] = v.get().tolist()
    return out


def write(v: sa.SharedDeviceArray, index: int, value: float) -> float:
    """Write one element in place; return what was there."""
    old = float(v[index])
    v[index] = value
    v.synchronize()  # a CUDA write is queued on a stream: done before the task reports
    return old


def make(n: int, value: float) -> sa.SharedDeviceArray:
    """A new shared array made in the worker."""
    return sa.full(n, value, device="cpu")


def make_cuda(n: int, value: float) -> sa.SharedDeviceArray:
    """A new shared CUDA array (cuda-vmm) made in the worker, its values written."""
    a = sa.full(n, value, device="cuda:0", backend="cuda-vmm")
    a.synchronize()
    return a


def make_cupy(n: int) -> Any:
    """A plain CuPy array of ``n`` zeros made in the worker (Dask's own path)."""
    import cupy

    return cupy.zeros(n)


def fill_block_cuda(block: Any, block_info: Any = None) -> Any:
    """:func:`fill_block` as a CuPy array."""
    import cupy

    return cupy.asarray(fill_block(block, block_info))


def load_pickled(blob: bytes) -> Any:
    """Load a pickled shared array here (refused with WrongNode on another node)."""
    return describe(pickle.loads(blob))


def identity(v: Any) -> Any:
    """What the task got, as its result."""
    return v


def repickle(v: Any) -> dict[str, Any]:
    """:func:`describe` what plain ``pickle`` makes of ``v`` here (what user code sees)."""
    return describe(pickle.loads(pickle.dumps(v)))


_written = [0]


def count_frames() -> None:
    """From now on, count the bytes of every frame this process writes to a TCP comm (what
    goes on the wire, before the kernel's framing): the test's own instrument."""
    import distributed.comm.tcp as tcp

    if getattr(tcp.to_frames, "counting", False):
        return
    original = tcp.to_frames

    async def counting(*args: Any, **kwargs: Any) -> Any:
        frames = await original(*args, **kwargs)
        _written[0] += sum(memoryview(f).nbytes for f in frames)
        return frames

    counting.counting = True  # type: ignore[attr-defined]
    tcp.to_frames = counting


def frames_written() -> int:
    """Bytes of frames written to TCP comms since :func:`count_frames`."""
    return _written[0]


def fill_block(block: np.ndarray, block_info: Any = None) -> np.ndarray:
    """A chunk whose values are the global flat index of each element (C order)."""
    info = block_info[None]
    shape = info["shape"]
    loc = info["array-location"]
    grids = np.meshgrid(*(np.arange(lo, hi) for lo, hi in loc), indexing="ij")
    return np.ravel_multi_index(grids, shape).astype(np.float64)


def joblib_task(v: Any, i: int, folder: str) -> tuple[int, str, str, list[str], Any]:
    """joblib task: write v[i] in place; return the worker's pid, the type it got, the
    allocation it mapped (if shared), the files under joblib's temp folder, and a view of
    the element it wrote."""
    v[i] = i + 100
    files = [name for _, _, names in os.walk(folder) for name in names]
    alloc = v.allocation.id if isinstance(v, sa.SharedDeviceArray) else ""
    return os.getpid(), type(v).__name__, alloc, files, v[i : i + 1]


def ray_task(v: sa.SharedDeviceArray) -> tuple[str, float]:
    """Ray task: the allocation it got, and writes 5 into v[0]."""
    v[0] = 5
    return v.allocation.id, float(v.sum())
