"""The worker side: tasks run in the spawn Pool's workers (module-level functions, so that
a worker unpickles them by importing this module). The rounds' ``bound`` and ``safe``
entries are in :mod:`harness.handoffs`."""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import statistics
import time
from typing import Any

import numpy as np

from sharedarrays.backends.device import parse_name

__all__ = [
    "init_worker",
    "raise_fd_limit",
    "cuda_core",
    "task_floor",
    "task_sharedarrays",
    "task_copy",
    "task_torch",
    "task_cuda_core",
    "task_shm",
    "task_cold_bound",
    "task_many",
    "task_many_torch",
    "task_result",
    "task_result_torch",
    "task_drop",
    "task_cleanup",
    "task_bandwidth",
    "task_steps",
]

_worker_state: dict[str, Any] = {}


def raise_fd_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def init_worker(device: str, memory_resource: Any = None, preload: str | None = None) -> None:
    """Pool initializer: raise the fd limit, start CUDA and the peer's library (so no task
    pays for them), and keep the cuda.core memory resource alive (its registry holds it
    only weakly)."""
    raise_fd_limit()
    if os.environ.get("SHAREDARRAYS_BENCH_DEBUG"):
        import faulthandler

        faulthandler.enable()
        faulthandler.dump_traceback_later(20, repeat=True)
    if parse_name(device).is_cuda:
        import cupy

        index = int(device.split(":")[1])
        _worker_state.update(cuda=True, index=index)
        cupy.cuda.Device(index).use()
        float(cupy.arange(4, dtype=cupy.float32).sum())
        if memory_resource is not None:
            _worker_state["mr"] = memory_resource
            cuda_core().Device(index).set_current()
        if preload == "torch":
            torch = importlib.import_module("torch")
            float(torch.ones(4, device=device).sum())


def _consume(x: Any, read: bool) -> float:
    """The end of every task: a tiny value (handoff) or the synchronised sum (read)."""
    if read:
        return float(x.sum())  # float() of a CuPy/torch scalar waits for the kernel
    return float(x.shape[0])


def task_floor(arg: bytes, read: bool) -> float:
    return float(len(arg))


def task_sharedarrays(a: Any, read: bool) -> float:
    x = a.array
    value = _consume(x, read)
    del x
    a.close()
    return value


def task_copy(host: np.ndarray[Any, Any], read: bool) -> float:
    x: Any = host
    if _worker_state.get("cuda"):
        import cupy

        x = cupy.asarray(host)
    return _consume(x, read)


def task_torch(t: Any, read: bool) -> float:
    return _consume(t, read)


def task_cuda_core(blob: bytes, read: bool) -> float:
    import cupy

    buf = pickle.loads(blob)  # the memory resource comes from the registry
    mem = cupy.cuda.UnownedMemory(int(buf.handle), buf.size, buf, _worker_state["index"])
    x = cupy.ndarray((buf.size // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    value = _consume(x, read)
    del x, mem
    buf.close()
    return value


def task_shm(spec: tuple[str, int], read: bool) -> float:
    from multiprocessing import shared_memory

    name, nbytes = spec
    shm = shared_memory.SharedMemory(name=name)
    x = np.ndarray((nbytes // 4,), np.float32, buffer=shm.buf)
    value = _consume(x, read)
    del x
    shm.close()
    return value


def task_many(arrays: list[Any]) -> int:
    natives = [a.array for a in arrays]
    count = len(natives)
    del natives
    for a in arrays:
        a.close()
    return count


def task_many_torch(tensors: list[Any]) -> int:
    """The torch row of the ``many`` part: the tensors arrive whole (torch's reductions open
    each storage's IPC handle on unpickling, with its cache); touch each, as
    :func:`task_many` touches each array's ``.array``."""
    pointers = [t.data_ptr() for t in tensors]
    count = len(pointers)
    del pointers
    return count


def task_result(spec: tuple[int, float]) -> Any:
    """The ``results`` part (sharedarrays): a new array of ``nbytes`` filled with ``value``,
    made here and returned."""
    import sharedarrays as sa

    nbytes, value = spec
    device = f"cuda:{_worker_state['index']}" if _worker_state.get("cuda") else "cpu"
    return sa.full(nbytes // 4, value, "float32", device=device)


def task_result_torch(spec: tuple[int, float]) -> Any:
    """The ``results`` part (torch.multiprocessing): a new tensor (CUDA, else CPU), returned."""
    import torch
    import torch.multiprocessing  # (its reductions: a CPU tensor goes by an shm file)

    nbytes, value = spec
    device = f"cuda:{_worker_state['index']}" if _worker_state.get("cuda") else "cpu"
    return torch.full((nbytes // 4,), value, dtype=torch.float32, device=device)


def task_drop(pause: float) -> int:
    """Release this worker's parked mappings (so a cold repeat's memory returns)."""
    from sharedarrays.memory import drop_parked

    drop_parked()
    if pause:
        time.sleep(pause)
    return os.getpid()


def task_cleanup(_: object) -> int:
    from sharedarrays.memory import drop_parked

    gc.collect()
    drop_parked()
    if _worker_state.get("cuda"):
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    return os.getpid()


def task_bandwidth(x_shared: Any, y_shared: Any, repeats: int) -> dict[str, list[float]]:
    """Time ``copyto(y, x)`` on shared arrays and on plain ones of the same size, alternating."""
    xs, ys = x_shared.array, y_shared.array
    if isinstance(xs, np.ndarray):
        xp_, yp = np.ones_like(xs), np.empty_like(ys)

        def run(src: Any, dst: Any) -> float:
            t = time.perf_counter()
            np.copyto(dst, src)
            return (time.perf_counter() - t) * 1e3

    else:
        import cupy

        xp_, yp = cupy.ones_like(xs), cupy.empty_like(ys)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()

        def run(src: Any, dst: Any) -> float:
            start.record()
            cupy.copyto(dst, src)
            end.record()
            end.synchronize()
            return float(cupy.cuda.get_elapsed_time(start, end))

    xs[...] = 1
    for _ in range(2):
        run(xs, ys)
        run(xp_, yp)
    shared: list[float] = []
    plain: list[float] = []
    for _ in range(repeats):
        shared.append(run(xs, ys))
        plain.append(run(xp_, yp))
    del xs, ys, xp_, yp
    x_shared.close()
    y_shared.close()
    task_cleanup(None)
    return {"shared_ms": shared, "plain_ms": plain}


def task_cold_bound(blob: bytes) -> dict[str, float]:
    """The two steps of a cold load that no cut of this library's Python removes, timed
    alone (seconds): ``fetch``, the request to the exporter's handle server for the chunk
    handles of the allocation whose payload ``blob`` is (the importer shows the payload's
    secret before any handle is given: one round trip), and ``map``, mapping them here (the
    driver's import, reserve, map and access calls, with the allocation's record). The
    mapping is released after (not timed)."""
    from sharedarrays import importing
    from sharedarrays.memory import drop_parked
    from sharedarrays.protocol.payload import Payload
    from sharedarrays.transport import client
    from sharedarrays.transport import handles as transport

    p = Payload.from_bytes(blob)
    request = importing.Request(p)
    request.backend()  # (a backend's first use here is not what is timed)
    reply_to = transport.server_address()
    t0 = time.perf_counter()
    sizes, fds, exports = client.fetch_handles(p.server, p.pid, p.alloc_id, p.secret, reply_to)
    t1 = time.perf_counter()
    driver = _driver_map(sizes, fds, p.device) if p.backend == "cuda-vmm" else {}
    t2 = time.perf_counter()
    alloc = _map(importing, request, sizes, fds, exports)
    t3 = time.perf_counter()
    alloc.lease()  # (a lease that ends at once: the mapping is released or parked)
    del alloc
    drop_parked()
    return {"fetch": t1 - t0, "map": t3 - t2, **driver}


def handoff_part(name: str) -> Any:
    """The handoff's ``name`` (``allocation_bytes``, ``import_part``) where the tree measured
    defines it: api/array.py or importing.py, or an older tree's api/message.py (ab.sh)."""
    for module in ("sharedarrays.api.array", "sharedarrays.importing", "sharedarrays.api.message"):
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    raise ImportError(f"the sharedarrays measured defines no {name}")


def _map(importing: Any, request: Any, sizes: list[int], fds: list[int], exports: Any) -> Any:
    """``importing._map`` of the tree measured: an older one (ab.sh's A side) takes a
    ``Handles`` record of the chunks found."""
    if hasattr(importing, "Handles"):
        return importing._map(request, importing.Handles(sizes, fds, exports))
    return importing._map(request, sizes, fds, exports)


def _driver_map(sizes: list[int], fds: list[int], index: int) -> dict[str, float]:
    """The driver's own cold import, the floor of any library's (seconds): import each chunk's
    fd, reserve the address range, map the chunks, set read-write access for the device
    (``driver``); and undoing it (``driver_teardown``: a cold round pays that too, after its
    task). Nothing of this library runs in between."""
    from cuda.bindings import driver as d

    def ok(result: Any) -> Any:
        if result[0] != d.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"driver floor: {result[0]!r}")
        return result[1] if len(result) > 1 else None

    fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = index
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    total = sum(sizes)
    t0 = time.perf_counter()
    handles = [ok(d.cuMemImportFromShareableHandle(fd, fd_type)) for fd in fds]
    base = int(ok(d.cuMemAddressReserve(total, 0, 0, 0)))
    offset = 0
    for size, handle in zip(sizes, handles):
        ok(d.cuMemMap(base + offset, size, 0, handle, 0))
        offset += size
    ok(d.cuMemSetAccess(base, total, [desc], 1))
    t1 = time.perf_counter()
    ok(d.cuMemUnmap(base, total))
    for handle in handles:
        ok(d.cuMemRelease(handle))
    ok(d.cuMemAddressFree(base, total))
    return {"driver": t1 - t0, "driver_teardown": time.perf_counter() - t1}


def task_steps(
    blob: bytes, view: tuple[Any, ...], sync: bytes | None, repeats: int
) -> dict[str, float]:
    """Where a warm sharedarrays load spends its time in the worker (medians, microseconds).

    ``blob`` and ``view`` are what a pickle of an array this worker already maps carries
    (its allocation's payload and the view's fields: a warm load)."""
    from sharedarrays.api.array import _rebuild_view

    import_part = handoff_part("import_part")
    from sharedarrays.protocol.payload import Payload, ViewFields

    steps: dict[str, list[float]] = {
        "payload_from_bytes": [],
        "view_fields": [],
        "load": [],
        "native_array": [],
        "close": [],
        "import_sync": [],
    }
    for _ in range(repeats):
        t0 = time.perf_counter()
        p = Payload.from_bytes(blob)  # a warm load finds it decoded already
        t1 = time.perf_counter()
        ViewFields.from_tuple(view, p.size)
        t2 = time.perf_counter()
        loaded = _rebuild_view(import_part(blob), view)  # as unpickling a message does
        t3 = time.perf_counter()
        x = loaded.array
        t4 = time.perf_counter()
        del x
        loaded.close()
        t5 = time.perf_counter()
        steps["payload_from_bytes"].append(t1 - t0)
        steps["view_fields"].append(t2 - t1)
        steps["load"].append(t3 - t2)
        steps["native_array"].append(t4 - t3)
        steps["close"].append(t5 - t4)
        if sync is not None:
            # (holds the allocation while import_sync is timed)
            keep = _rebuild_view(import_part(blob), view)
            backend = keep.allocation.backend
            t6 = time.perf_counter()
            backend.import_sync(sync)
            steps["import_sync"].append(time.perf_counter() - t6)
            keep.close()
    return {k: statistics.median(v) * 1e6 for k, v in steps.items() if v}


def cuda_core() -> Any:
    """The cuda.core module (``cuda.core`` in 1.x, ``cuda.core.experimental`` before)."""
    mod = importlib.import_module("cuda.core")
    if not hasattr(mod, "DeviceMemoryResource"):
        mod = importlib.import_module("cuda.core.experimental")
    return mod
