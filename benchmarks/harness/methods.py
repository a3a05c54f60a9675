"""The parent side of each peer: how the parent makes, sends and frees the objects that one
method hands to a worker (sharedarrays on each backend, torch.multiprocessing, cuda.core
IPC buffers, ``multiprocessing.shared_memory``, plain pickled copies, the empty floor)."""

from __future__ import annotations

import gc
import importlib
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.pool import Pool
from typing import Any

import numpy as np

from harness.config import COPY_MAX_BYTES, TASK_TIMEOUT, Config
from harness.handoffs import LeastHandoff, SafeColdHandoff, SafeHandoff
from harness.worker import (
    cuda_core,
    handoff_part,
    task_copy,
    task_cuda_core,
    task_drop,
    task_floor,
    task_sharedarrays,
    task_shm,
    task_torch,
)
from sharedarrays.backends.device import parse_name

__all__ = [
    "FLOOR_ARG",
    "Method",
    "Peers",
    "drop_everywhere",
    "floor_method",
    "control_method",
    "bound_method",
    "safe_cold_method",
    "safe_method",
    "family_methods",
    "sa_methods",
    "copy_method",
    "torch_methods",
    "cuda_core_methods",
    "shm_methods",
]

FLOOR_ARG = b"x" * 64
"""The floor task's argument (and the argument of the pool's start-up tasks)."""


@dataclass
class Method:
    """How the parent makes, sends and frees one method's objects.

    ``new(size)`` returns a box (a list holding the object), made before the timer;
    ``send(box)`` runs inside the timer and returns the task's argument; ``free(box)`` runs
    after the timer (cold methods: after every sample; warm ones: after the size).
    """

    name: str
    task: Callable[[Any, bool], float]
    new: Callable[[int], list[Any]]
    send: Callable[[list[Any]], Any]
    free: Callable[[list[Any]], None]
    cold: bool
    max_size: int | None = None
    after_cold: Callable[[Pool], None] | None = None


def _first(box: list[Any]) -> Any:
    return box[0]


def _drop_in(pool: Pool) -> None:
    pool.apply_async(task_drop, (0.0,)).get(TASK_TIMEOUT)


def drop_everywhere(pool: Pool, workers: int) -> None:
    """Run :func:`task_drop` until every one of ``workers`` workers has run it."""
    seen: set[int] = set()
    for _ in range(50):
        pids = pool.map_async(task_drop, [0.002] * workers, chunksize=1).get(TASK_TIMEOUT)
        seen.update(pids)
        if len(seen) >= workers:
            return


class Peers:
    """Imports and per-device state of the peers, made on first use; reasons for skips."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._torch: Any = None
        self._mr: Any = None
        self._stream: Any = None

    def cupy(self) -> Any:
        import cupy

        cupy.cuda.Device(self.cfg.index).use()
        return cupy

    def torch(self) -> Any:
        if self._torch is None:
            torch = importlib.import_module("torch")
            importlib.import_module("torch.multiprocessing")  # registers the reductions
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            self._torch = torch
        return self._torch

    def memory_resource(self) -> tuple[Any, Any]:
        if self._mr is None:
            core = cuda_core()
            dev = core.Device(self.cfg.index)
            dev.set_current()
            largest = max([*self.cfg.sizes, *self.cfg.warm_sizes, *self.cfg.cold_sizes])
            max_size = ((2 * largest + (256 << 20)) + (2 << 20) - 1) // (2 << 20) * (2 << 20)
            options = core.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=max_size)
            self._mr = core.DeviceMemoryResource(dev, options)
            self._stream = dev.create_stream()
        return self._mr, self._stream

    def why_not(self, family: str) -> str | None:
        """Why the peer ``family`` (``torch``, ``cuda.core``) cannot run here, or None."""
        if not self.cfg.is_cuda:
            return f"{family} rows need a CUDA device (the run is on {self.cfg.device})"
        try:
            if family == "torch":
                self.torch()
            elif family == "cuda.core":
                self.memory_resource()
        except Exception as e:
            return f"not available: {type(e).__name__}: {e}"
        return None

    def close_memory_resource(self) -> None:
        if self._stream is not None:
            self._stream.sync()
        if self._mr is not None:
            self._mr.close()
        self._mr = self._stream = None

    def free_device_memory(self) -> None:
        gc.collect()
        if not self.cfg.is_cuda:
            return
        cupy = self.cupy()
        cupy.cuda.Device(self.cfg.index).synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        if self._torch is not None:
            self._torch.cuda.synchronize()
            self._torch.cuda.ipc_collect()
            self._torch.cuda.empty_cache()


def sa_methods(cfg: Config, backend: str = "auto", prefix: str = "sharedarrays") -> list[Method]:
    """sharedarrays warm and cold, on ``backend`` (``sa.ipc-*``: cuda-ipc, ``sa.pool-*``:
    cuda-pool; ``sharedarrays-*``: the default, cuda-vmm)."""
    import sharedarrays as sa

    def new(size: int) -> list[Any]:
        a = sa.empty(size // 4, "float32", device=cfg.device, backend=backend)
        if not cfg.is_cuda:
            a.array[...] = 1  # touch the pages, as the other host methods do
        return [a]

    def free(box: list[Any]) -> None:
        box[0].close()
        box.clear()

    return [
        Method(f"{prefix}-warm", task_sharedarrays, new, _first, free, cold=False),
        Method(
            f"{prefix}-cold",
            task_sharedarrays,
            new,
            _first,
            free,
            cold=True,
            after_cold=_drop_in,
        ),
    ]


def floor_method() -> Method:
    return Method(
        "floor",
        task_floor,
        lambda size: [FLOOR_ARG],
        _first,
        lambda box: box.clear(),
        cold=False,
    )


def control_method(nbytes: int) -> Method:
    """The floor's empty task with an argument of ``nbytes`` bytes: what the Pool charges for
    a message the size of a pickled array, without the array (a control of the warm rounds)."""
    return Method(
        "control",
        task_floor,
        lambda size: [b"x" * nbytes],
        _first,
        lambda box: box.clear(),
        cold=False,
    )


def bound_method(cfg: Config, array: Any) -> Method:
    """The warm rounds' ``bound`` entry (:class:`~harness.handoffs.LeastHandoff`)
    for the sharedarrays ``array`` of the same rounds: its payload's size, its view tuple
    and its backend; the worker's task is sharedarrays' own (``.array``, ``close``)."""
    allocation_bytes = handoff_part("allocation_bytes")

    blob = bytes(len(allocation_bytes(array.allocation)))
    device = parse_name(cfg.device).index if cfg.is_cuda else None
    least = LeastHandoff(blob, array._view_tuple(), array.allocation.backend, device)
    return Method("bound", task_sharedarrays, lambda size: [least], _first, _clear, cold=False)


def safe_method(cfg: Config, array: Any) -> Method:
    """The warm rounds' ``safe`` entry (:class:`~harness.handoffs.SafeHandoff`): the
    bound and the least more that the library's guarantees need, for the sharedarrays
    ``array`` of the same rounds; the worker's task is sharedarrays' own."""
    allocation_bytes = handoff_part("allocation_bytes")

    # (bytes of the payload's size, one value per array: each has its record in the worker)
    blob = f"safe {array.nbytes} ".encode().ljust(len(allocation_bytes(array.allocation)), b".")
    device = parse_name(cfg.device).index if cfg.is_cuda else None
    safe = SafeHandoff(blob, array._view_tuple(), array.allocation.backend, device)
    return Method("safe", task_sharedarrays, lambda size: [safe], _first, _clear, cold=False)


def safe_cold_method(cfg: Config) -> Method:
    """The cold rounds' ``safe`` entry (:class:`~harness.handoffs.SafeColdHandoff`):
    a new sharedarrays array per round, as ``sharedarrays-cold``'s, handed off by the cold
    bound's two steps and the least more that the library's guarantees need."""
    import sharedarrays as sa

    device = parse_name(cfg.device).index if cfg.is_cuda else None

    def new(size: int) -> list[Any]:
        a = sa.empty(size // 4, "float32", device=cfg.device)
        if not cfg.is_cuda:
            a.array[...] = 1  # touch the pages, as the other host methods do
        return [SafeColdHandoff(a, device)]

    def free(box: list[Any]) -> None:
        box[0].close()
        box.clear()

    return Method("safe", task_sharedarrays, new, _first, free, cold=True, after_cold=_drop_in)


def _clear(box: list[Any]) -> None:
    box.clear()


def family_methods(cfg: Config, peers: Peers, family: str) -> tuple[Method, Method]:
    """The warm and the cold method of one family (``sharedarrays``, ``sa.ipc``, ``sa.pool``,
    ``torch``, ``cuda.core``, ``shm``).

    Raises
    ------
    ValueError
        An unknown family.
    Exception
        Whatever the peer raises when it cannot run (not installed, no CUDA device).
    """
    if family == "sharedarrays":
        warm, cold = sa_methods(cfg)
    elif family == "sa.ipc":
        warm, cold = sa_methods(cfg, "cuda-ipc", "sa.ipc")
    elif family == "sa.pool":
        warm, cold = sa_methods(cfg, "cuda-pool", "sa.pool")
    elif family == "torch":
        warm, cold = torch_methods(peers)
    elif family == "cuda.core":
        warm, cold = cuda_core_methods(peers)
    elif family == "shm":
        warm, cold = shm_methods()
    else:
        raise ValueError(f"no methods for family {family!r}")
    return warm, cold


def copy_method(cfg: Config, peers: Peers) -> Method:
    if cfg.is_cuda:
        cupy = peers.cupy()

        def new(size: int) -> list[Any]:
            return [cupy.ones(size // 4, cupy.float32)]

        def send(box: list[Any]) -> Any:
            return cupy.asnumpy(box[0])

        return Method("copy", task_copy, new, send, lambda b: b.clear(), False, COPY_MAX_BYTES)
    return Method(
        "copy",
        task_copy,
        lambda size: [np.ones(size // 4, np.float32)],
        _first,
        lambda b: b.clear(),
        cold=False,
    )


def torch_methods(peers: Peers) -> list[Method]:
    torch = peers.torch()
    device = peers.cfg.device

    def new(size: int) -> list[Any]:
        return [torch.empty(size // 4, dtype=torch.float32, device=device)]

    def free(box: list[Any]) -> None:
        box.clear()
        torch.cuda.ipc_collect()  # else sent blocks pile up until torch's own limit

    return [
        Method("torch-warm", task_torch, new, _first, free, cold=False),
        Method("torch-cold", task_torch, new, _first, free, cold=True),
    ]


def cuda_core_methods(peers: Peers) -> list[Method]:
    mr, stream = peers.memory_resource()

    def new(size: int) -> list[Any]:
        buf = mr.allocate(size, stream=stream)
        stream.sync()  # allocation is stream-ordered: done before the worker imports it
        return [buf]

    def send(box: list[Any]) -> bytes:
        return pickle.dumps(box[0])

    def free(box: list[Any]) -> None:
        box[0].close(stream)
        stream.sync()
        box.clear()

    return [
        Method("cuda.core-warm", task_cuda_core, new, send, free, cold=False),
        Method("cuda.core-cold", task_cuda_core, new, send, free, cold=True),
    ]


def shm_methods() -> list[Method]:
    from multiprocessing import shared_memory

    def new(size: int) -> list[Any]:
        shm = shared_memory.SharedMemory(create=True, size=size)
        np.ndarray((size // 4,), np.float32, buffer=shm.buf)[...] = 1
        return [shm]

    def send(box: list[Any]) -> tuple[str, int]:
        return (box[0].name, box[0].size)

    def free(box: list[Any]) -> None:
        box[0].close()
        box[0].unlink()
        box.clear()

    return [
        Method("shm-warm", task_shm, new, send, free, cold=False),
        Method("shm-cold", task_shm, new, send, free, cold=True),
    ]
