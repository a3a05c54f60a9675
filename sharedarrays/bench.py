"""``python -m sharedarrays bench``: hand an array to a spawn Pool worker, against every peer.

Everything runs in one process tree on one machine. The parent process creates an object,
then times ``pool.apply_async(task, (obj, read)).get()`` (what ``pool.apply`` does) with
:func:`time.perf_counter`; the worker receives the object and makes it usable.

Two task kinds:

* **handoff**: the worker receives the object and materialises the native array (for
  sharedarrays ``a.array``; for torch the tensor; for cuda.core the Buffer wrapped as a CuPy
  array; for the copy path ``cupy.asarray`` of the unpickled NumPy array), returns a tiny
  value and launches no kernel.
* **read**: the same, plus a full sum of the array, synchronised (``float(x.sum())``).

Methods (one line each in the table and the plot):

* ``floor``: an empty task with a 64-byte argument: the Pool's own round trip.
* ``copy``: ``cupy.asnumpy`` in the parent (timed), the NumPy array pickled through the Pool,
  ``cupy.asarray`` in the worker (GPU, up to 1 GiB); plain pickling of a NumPy array on the
  host.
* ``torch-warm`` / ``torch-cold``: a CUDA tensor through torch.multiprocessing's reductions
  (registered by ``import torch.multiprocessing`` in the parent): the same tensor each time,
  or a new one each time (torch's caching allocator may hand back the same segment).
* ``cuda.core-warm`` / ``cuda.core-cold``: a Buffer of an IPC-enabled
  ``DeviceMemoryResource``; the resource goes to the worker once, in the Pool's initializer
  (which registers it there), and each Buffer is sent as ``pickle.dumps(buffer)`` (timed),
  which the registry resolves on ``pickle.loads`` in the worker.
* ``shm-warm`` / ``shm-cold`` (host only): a ``multiprocessing.shared_memory.SharedMemory``
  segment attached by name in the worker and wrapped as a NumPy array.
* ``sharedarrays-warm``: the same :class:`~sharedarrays.SharedDeviceArray` again (the
  worker keeps its mapping parked between tasks); ``sharedarrays-cold``: a new array each
  repeat, created before the timer and closed after it (and the worker's parked mapping
  dropped), so each task is a first import in that worker. These use the default memory
  system (cuda-vmm on a GPU, host on the CPU).
* ``sa.ipc-warm`` / ``sa.ipc-cold`` and ``sa.pool-warm`` / ``sa.pool-cold`` (GPU only): the
  same with ``backend="cuda-ipc"`` and ``backend="cuda-pool"``.

Cold methods create the new object before the timer and release it after; warm methods
create one object per size and send it ``warmup + repeats`` times.

Also measured: copy-kernel bandwidth in the worker on shared memory against a plain CuPy
(NumPy) array; 10,000 small arrays handed off in one task; and fan-out of one array to 1, 4
and 16 workers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib
import json
import math
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path
from typing import Any

import numpy as np

from sharedarrays.cli import parse_size

__all__ = [
    "TASKS",
    "GPU_METHODS",
    "HOST_METHODS",
    "Config",
    "add_arguments",
    "config_from_args",
    "run",
    "evaluate_targets",
    "format_table",
    "plot",
    "main",
    "run_from_args",
]

TASKS = ("handoff", "read")
"""Task kinds: ``handoff`` materialises the native array; ``read`` also sums it."""

GPU_METHODS = (
    "floor",
    "sharedarrays-warm",
    "sharedarrays-cold",
    "sa.ipc-warm",
    "sa.ipc-cold",
    "sa.pool-warm",
    "sa.pool-cold",
    "torch-warm",
    "torch-cold",
    "cuda.core-warm",
    "cuda.core-cold",
    "copy",
)
HOST_METHODS = ("floor", "sharedarrays-warm", "sharedarrays-cold", "shm-warm", "shm-cold", "copy")

PARTS = ("bandwidth", "many", "scaling", "steps")
"""Measurements besides the method x size table (``--skip`` takes these names)."""

COPY_MAX_BYTES = 1 << 30
"""The copy path runs up to this size only (about 5 s per GiB on an H200)."""

DEFAULT_SIZES = {"cuda": "1M,64M,1G,8G,32G", "cpu": "1M,64M,256M"}
QUICK_SIZES = {"cuda": "1M,64M", "cpu": "1M,16M"}
DEFAULT_BANDWIDTH = {"cuda": "4G", "cpu": "256M"}
QUICK_BANDWIDTH = {"cuda": "256M", "cpu": "16M"}
FLOOR_ARG = b"x" * 64
TASK_TIMEOUT = float(os.environ.get("SHAREDARRAYS_BENCH_TIMEOUT", "120"))
"""Seconds one task may take before its method is abandoned (a dead worker never answers);
``SHAREDARRAYS_BENCH_TIMEOUT`` overrides it. ``SHAREDARRAYS_BENCH_DEBUG=1`` makes every
worker dump its threads' stacks to stderr every 20 s (to see where a task hangs)."""

TARGETS = {
    "warm_overhead_ms": 0.05,
    "warm_vs_torch": 3.0,
    "cold_overhead_ms": 0.5,
    "copy_ratio": 1000.0,
    "bandwidth_ratio": 0.97,
    "many_memory_ratio": 1.25,
    "many_arrays_per_s": 20000.0,
}
"""The issue's targets (ratios within one run on the H200)."""


# ---------------------------------------------------------------------------------------
# configuration

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size_label(n: int) -> str:
    """``1048576`` -> ``"1M"`` (binary units, as the command line takes them)."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


@dataclass
class Config:
    """What one benchmark run measures.

    Attributes
    ----------
    device : str
        ``"cpu"`` or ``"cuda:N"``.
    sizes : list of int
        Array sizes in bytes.
    repeats : int
        Timed samples per case (after ``warmup`` untimed ones); a case whose samples take
        longer than ``case_seconds`` in all stops early with at least 3.
    methods : list of str
        Methods to run (``floor`` always runs: every ratio needs it).
    tasks : list of str
        Task kinds (:data:`TASKS`).
    workers : list of int
        Worker counts of the fan-out measurement.
    skip : list of str
        Parts of :data:`PARTS` not to run.
    pairs : int
        Interleaved floor / warm-handoff pairs of the ``steps`` part (``--pairs``).
    """

    device: str
    sizes: list[int]
    repeats: int = 21
    warmup: int = 3
    methods: list[str] = field(default_factory=list)
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    workers: list[int] = field(default_factory=lambda: [1, 4, 16])
    skip: list[str] = field(default_factory=list)
    many_count: int = 10000
    many_bytes: int = 4096
    bandwidth_bytes: int = 4 << 30
    bandwidth_repeats: int = 21
    pairs: int = 1001
    case_seconds: float = 10.0
    quick: bool = False
    json_path: str | None = None
    plot_path: str | None = None

    @property
    def is_cuda(self) -> bool:
        """Whether the run is on a CUDA device."""
        return self.device.startswith("cuda")

    @property
    def index(self) -> int:
        """The CUDA device ordinal (0 on cpu)."""
        return int(self.device.split(":")[1]) if ":" in self.device else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``bench`` options to a parser."""
    p.add_argument("--device", default="auto", help="auto (default), cpu or cuda:N")
    p.add_argument(
        "--sizes",
        default=None,
        help="comma-separated sizes (default 1M,64M,1G,8G,32G on GPU, 1M,64M,256M on host)",
    )
    p.add_argument("--repeats", type=int, default=21, help="timed samples per case (>= 1)")
    p.add_argument("--warmup", type=int, default=3, help="untimed samples before them")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods or families (sharedarrays, torch, cuda.core, copy, shm); "
        "default all of the backend's",
    )
    p.add_argument("--tasks", default="handoff,read", help="handoff, read or both")
    p.add_argument("--workers", default="1,4,16", help="worker counts of the fan-out")
    p.add_argument("--skip", default="", help=f"parts not to run: {', '.join(PARTS)}")
    p.add_argument("--many", type=int, default=None, help="small arrays in one task (10000)")
    p.add_argument("--many-size", type=parse_size, default=4096, help="bytes each (4K)")
    p.add_argument("--bandwidth-size", type=parse_size, default=None, help="copy-kernel bytes")
    p.add_argument(
        "--case-seconds",
        type=float,
        default=10.0,
        help="a case stops early (with >= 3 samples) once its samples took this long",
    )
    p.add_argument("--json", default=None, help="write raw results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="interleaved floor / warm pairs in the steps part (default 1001, 101 with --quick)",
    )
    p.add_argument("--quick", action="store_true", help="fewer, smaller sizes (a smoke test)")
    p.add_argument(
        "--full",
        action="store_true",
        help="the committed defaults; writes benchmarks/results/<device>-<date>.json/.png",
    )


def _resolve_device(text: str) -> str:
    if text in ("cpu", "host"):
        return "cpu"
    from sharedarrays.backends import cuda_usable

    if text == "auto":
        return "cuda:0" if cuda_usable() is None else "cpu"
    from sharedarrays.backends.device import parse_device

    dev = parse_device(text)
    return str(dev) if dev.is_cuda else "cpu"


def _expand_methods(text: str | None, available: Sequence[str]) -> list[str]:
    if not text:
        return list(available)
    chosen: list[str] = ["floor"]
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        matches = [m for m in available if m == word or m.rsplit("-", 1)[0] == word]
        if not matches:
            raise argparse.ArgumentTypeError(
                f"unknown method {word!r} for this device; choose from {', '.join(available)}"
            )
        chosen.extend(m for m in matches if m not in chosen)
    return [m for m in available if m in chosen]


def config_from_args(args: argparse.Namespace) -> Config:
    """Turn parsed ``bench`` options into a :class:`Config`.

    Raises
    ------
    argparse.ArgumentTypeError
        A bad size, method, task or worker count.
    """
    device = _resolve_device(args.device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    sizes_text = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)[kind]
    sizes = sorted({parse_size(s) for s in sizes_text.split(",") if s.strip()})
    if not sizes or sizes[0] < 4:
        raise argparse.ArgumentTypeError("sizes must be at least 4 bytes")
    if args.repeats < 1 or args.warmup < 0:
        raise argparse.ArgumentTypeError("--repeats must be >= 1 and --warmup >= 0")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        raise argparse.ArgumentTypeError(f"--tasks takes {', '.join(TASKS)}")
    workers_text = "1,4" if args.quick and args.workers == "1,4,16" else args.workers
    workers = [int(w) for w in workers_text.split(",") if w.strip()]
    if any(w < 1 for w in workers):
        raise argparse.ArgumentTypeError("--workers must be positive")
    skip = [s.strip() for s in args.skip.split(",") if s.strip()]
    if any(s not in PARTS for s in skip):
        raise argparse.ArgumentTypeError(f"--skip takes {', '.join(PARTS)}")
    available = GPU_METHODS if kind == "cuda" else HOST_METHODS
    bandwidth = args.bandwidth_size or parse_size(
        (QUICK_BANDWIDTH if args.quick else DEFAULT_BANDWIDTH)[kind]
    )
    many = args.many if args.many is not None else (1000 if args.quick else 10000)
    json_path, plot_path = args.json, args.plot
    if args.full:
        stem = Path("benchmarks") / "results" / f"{_device_slug(device)}-{_today()}"
        json_path = json_path or str(stem.with_suffix(".json"))
        plot_path = plot_path or str(stem.with_suffix(".png"))
    return Config(
        device=device,
        sizes=sizes,
        repeats=args.repeats,
        warmup=args.warmup if not args.quick else min(args.warmup, 2),
        methods=_expand_methods(args.methods, available),
        tasks=tasks,
        workers=workers,
        skip=skip,
        many_count=many,
        pairs=args.pairs if args.pairs is not None else (101 if args.quick else 1001),
        many_bytes=args.many_size,
        bandwidth_bytes=bandwidth,
        case_seconds=args.case_seconds,
        quick=args.quick,
        json_path=json_path,
        plot_path=plot_path,
    )


# ---------------------------------------------------------------------------------------
# the worker side (module-level functions: spawn workers import this module)

_worker_state: dict[str, Any] = {}


def _raise_fd_limit() -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def _init_worker(device: str, memory_resource: Any = None, preload: str | None = None) -> None:
    """Pool initializer: raise the fd limit, start CUDA and the peer's library (so no task
    pays for them), and keep the cuda.core memory resource alive (its registry holds it
    only weakly)."""
    _raise_fd_limit()
    if os.environ.get("SHAREDARRAYS_BENCH_DEBUG"):
        import faulthandler

        faulthandler.enable()
        faulthandler.dump_traceback_later(20, repeat=True)
    if device.startswith("cuda"):
        import cupy

        index = int(device.split(":")[1])
        _worker_state.update(cuda=True, index=index)
        cupy.cuda.Device(index).use()
        float(cupy.arange(4, dtype=cupy.float32).sum())
        if memory_resource is not None:
            _worker_state["mr"] = memory_resource
            _cuda_core().Device(index).set_current()
        if preload == "torch":
            torch = importlib.import_module("torch")
            float(torch.ones(4, device=device).sum())


def _consume(x: Any, read: bool) -> float:
    """The end of every task: a tiny value (handoff) or the synchronised sum (read)."""
    if read:
        return float(x.sum())  # float() of a CuPy/torch scalar waits for the kernel
    return float(x.shape[0])


def _task_floor(arg: bytes, read: bool) -> float:
    return float(len(arg))


def _task_sharedarrays(a: Any, read: bool) -> float:
    x = a.array
    value = _consume(x, read)
    del x
    a.close()
    return value


def _task_copy(host: np.ndarray[Any, Any], read: bool) -> float:
    x: Any = host
    if _worker_state.get("cuda"):
        import cupy

        x = cupy.asarray(host)
    return _consume(x, read)


def _task_torch(t: Any, read: bool) -> float:
    return _consume(t, read)


def _task_cuda_core(blob: bytes, read: bool) -> float:
    import cupy

    buf = pickle.loads(blob)  # the memory resource comes from the registry
    mem = cupy.cuda.UnownedMemory(int(buf.handle), buf.size, buf, _worker_state["index"])
    x = cupy.ndarray((buf.size // 4,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))
    value = _consume(x, read)
    del x, mem
    buf.close()
    return value


def _task_shm(spec: tuple[str, int], read: bool) -> float:
    from multiprocessing import shared_memory

    name, nbytes = spec
    shm = shared_memory.SharedMemory(name=name)
    x = np.ndarray((nbytes // 4,), np.float32, buffer=shm.buf)
    value = _consume(x, read)
    del x
    shm.close()
    return value


def _task_many(arrays: list[Any]) -> int:
    natives = [a.array for a in arrays]
    count = len(natives)
    del natives
    for a in arrays:
        a.close()
    return count


def _task_drop(pause: float) -> int:
    """Release this worker's parked mappings (so a cold repeat's memory returns)."""
    from sharedarrays.memory import drop_parked

    drop_parked()
    if pause:
        time.sleep(pause)
    return os.getpid()


def _task_cleanup(_: object) -> int:
    from sharedarrays.memory import drop_parked

    gc.collect()
    drop_parked()
    if _worker_state.get("cuda"):
        import cupy

        cupy.get_default_memory_pool().free_all_blocks()
    return os.getpid()


def _task_bandwidth(x_shared: Any, y_shared: Any, repeats: int) -> dict[str, list[float]]:
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
    _task_cleanup(None)
    return {"shared_ms": shared, "plain_ms": plain}


def _task_steps(blob: bytes, sync: bytes | None, repeats: int) -> dict[str, float]:
    """Where a warm sharedarrays load spends its time in the worker (medians, microseconds).

    ``blob`` is the payload of an array this worker already maps (a warm load)."""
    from sharedarrays.api import array as array_mod
    from sharedarrays.protocol.payload import Payload

    steps: dict[str, list[float]] = {
        "payload_from_bytes": [],
        "load": [],
        "native_array": [],
        "close": [],
        "import_sync": [],
    }
    for _ in range(repeats):
        t0 = time.perf_counter()
        Payload.from_bytes(blob)  # a warm load finds it decoded already
        t1 = time.perf_counter()
        view = array_mod.load(blob)
        t2 = time.perf_counter()
        x = view.array
        t3 = time.perf_counter()
        del x
        view.close()
        t4 = time.perf_counter()
        steps["payload_from_bytes"].append(t1 - t0)
        steps["load"].append(t2 - t1)
        steps["native_array"].append(t3 - t2)
        steps["close"].append(t4 - t3)
        if sync is not None:
            keep = array_mod.load(blob)  # holds the allocation while import_sync is timed
            backend = keep.allocation.backend
            t5 = time.perf_counter()
            backend.import_sync(sync)
            steps["import_sync"].append(time.perf_counter() - t5)
            keep.close()
    return {k: statistics.median(v) * 1e6 for k, v in steps.items() if v}


def _cuda_core() -> Any:
    """The cuda.core module (``cuda.core`` in 1.x, ``cuda.core.experimental`` before)."""
    mod = importlib.import_module("cuda.core")
    if not hasattr(mod, "DeviceMemoryResource"):
        mod = importlib.import_module("cuda.core.experimental")
    return mod


# ---------------------------------------------------------------------------------------
# the parent side: methods


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
    pool.apply_async(_task_drop, (0.0,)).get(TASK_TIMEOUT)


def _drop_everywhere(pool: Pool, workers: int) -> None:
    """Run :func:`_task_drop` until every one of ``workers`` workers has run it."""
    seen: set[int] = set()
    for _ in range(50):
        pids = pool.map_async(_task_drop, [0.002] * workers, chunksize=1).get(TASK_TIMEOUT)
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
            core = _cuda_core()
            dev = core.Device(self.cfg.index)
            dev.set_current()
            largest = max(self.cfg.sizes)
            max_size = ((2 * largest + (256 << 20)) + (2 << 20) - 1) // (2 << 20) * (2 << 20)
            options = core.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=max_size)
            self._mr = core.DeviceMemoryResource(dev, options)
            self._stream = dev.create_stream()
        return self._mr, self._stream

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


def _sa_methods(cfg: Config, backend: str = "auto", prefix: str = "sharedarrays") -> list[Method]:
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
        Method(f"{prefix}-warm", _task_sharedarrays, new, _first, free, cold=False),
        Method(
            f"{prefix}-cold",
            _task_sharedarrays,
            new,
            _first,
            free,
            cold=True,
            after_cold=_drop_in,
        ),
    ]


def _floor_method() -> Method:
    return Method(
        "floor",
        _task_floor,
        lambda size: [FLOOR_ARG],
        _first,
        lambda box: box.clear(),
        cold=False,
    )


def _copy_method(cfg: Config, peers: Peers) -> Method:
    if cfg.is_cuda:
        cupy = peers.cupy()

        def new(size: int) -> list[Any]:
            return [cupy.ones(size // 4, cupy.float32)]

        def send(box: list[Any]) -> Any:
            return cupy.asnumpy(box[0])

        return Method("copy", _task_copy, new, send, lambda b: b.clear(), False, COPY_MAX_BYTES)
    return Method(
        "copy",
        _task_copy,
        lambda size: [np.ones(size // 4, np.float32)],
        _first,
        lambda b: b.clear(),
        cold=False,
    )


def _torch_methods(peers: Peers) -> list[Method]:
    torch = peers.torch()
    device = peers.cfg.device

    def new(size: int) -> list[Any]:
        return [torch.empty(size // 4, dtype=torch.float32, device=device)]

    def free(box: list[Any]) -> None:
        box.clear()
        torch.cuda.ipc_collect()  # else sent blocks pile up until torch's own limit

    return [
        Method("torch-warm", _task_torch, new, _first, free, cold=False),
        Method("torch-cold", _task_torch, new, _first, free, cold=True),
    ]


def _cuda_core_methods(peers: Peers) -> list[Method]:
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
        Method("cuda.core-warm", _task_cuda_core, new, send, free, cold=False),
        Method("cuda.core-cold", _task_cuda_core, new, send, free, cold=True),
    ]


def _shm_methods() -> list[Method]:
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
        Method("shm-warm", _task_shm, new, send, free, cold=False),
        Method("shm-cold", _task_shm, new, send, free, cold=True),
    ]


# ---------------------------------------------------------------------------------------
# measuring


def stats(samples_s: Sequence[float]) -> dict[str, Any]:
    """Median, p10 and p90 (milliseconds) and the samples themselves."""
    ms = [s * 1e3 for s in samples_s]
    ordered = sorted(ms)

    def pct(q: float) -> float:
        if len(ordered) == 1:
            return ordered[0]
        pos = q * (len(ordered) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {
        "median_ms": statistics.median(ms),
        "p10_ms": pct(0.10),
        "p90_ms": pct(0.90),
        "repeats": len(ms),
        "samples_ms": ms,
    }


def _log(msg: str) -> None:
    print(msg, flush=True)


def _time_case(
    pool: Pool, method: Method, size: int, read: bool, cfg: Config, workers: int = 1
) -> dict[str, Any]:
    """Warm up, then time ``repeats`` handoffs of one method at one size."""
    samples: list[float] = []
    box: list[Any] = [] if method.cold else method.new(size)
    started = time.perf_counter()
    warmup = cfg.warmup
    i = 0
    try:
        while len(samples) < cfg.repeats:
            if method.cold:
                box = method.new(size)
            if workers == 1:
                t0 = time.perf_counter()
                pool.apply_async(method.task, (method.send(box), read)).get(TASK_TIMEOUT)
                dt = time.perf_counter() - t0
            else:
                t0 = time.perf_counter()
                arg = method.send(box)
                pool.starmap_async(method.task, [(arg, read)] * workers, chunksize=1).get(
                    TASK_TIMEOUT
                )
                dt = time.perf_counter() - t0
            if method.cold:
                method.free(box)
                if method.after_cold is not None:
                    if workers == 1:
                        method.after_cold(pool)
                    else:
                        _drop_everywhere(pool, workers)
            if i == 1 and dt > cfg.case_seconds / 5:
                warmup = min(warmup, 1)  # slow cases (the copy path) warm up once
            if i >= warmup:
                samples.append(dt)
                if time.perf_counter() - started > cfg.case_seconds and len(samples) >= 3:
                    break
            i += 1
    finally:
        if box:
            method.free(box)
    return stats(samples)


@contextlib.contextmanager
def _pool(
    cfg: Config, workers: int = 1, memory_resource: Any = None, preload: str | None = None
) -> Iterator[Pool]:
    """A spawn Pool whose workers have started (CUDA and ``preload`` initialised)."""
    ctx = multiprocessing.get_context("spawn")
    pool = ctx.Pool(
        workers, initializer=_init_worker, initargs=(cfg.device, memory_resource, preload)
    )
    try:
        pool.starmap_async(_task_floor, [(FLOOR_ARG, False)] * workers, chunksize=1).get(
            TASK_TIMEOUT * 2
        )
        yield pool
    except BaseException:
        pool.terminate()
        pool.join()
        raise
    pool.close()
    pool.join()


class Run:
    """One benchmark run: results so far, written to JSON after every step."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.peers = Peers(cfg)
        self.data: dict[str, Any] = {
            "meta": environment(cfg),
            "config": asdict(cfg),
            "tasks": {
                "handoff": "receive the object and materialise the native array; no kernel",
                "read": "handoff plus a full sum of the array, synchronised",
            },
            "skipped": {},
            "notes": [],
            "pool_floor": {},
            "results": {},
        }

    # bookkeeping ------------------------------------------------------------------------
    def skip(self, what: str, why: str) -> None:
        self.data["skipped"][what] = why
        _log(f"  skipped {what}: {why}")

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        _log(f"  note: {text}")

    def save(self) -> None:
        if self.cfg.json_path:
            path = Path(self.cfg.json_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            tmp.replace(path)

    # method x size ----------------------------------------------------------------------
    def run_methods(self, group: str, methods: list[Method], pool: Pool) -> None:
        """Time each method at each size and task kind in one pool (and the pool's floor)."""
        small = min(self.cfg.sizes)
        self.data["pool_floor"][group] = _time_case(pool, _floor_method(), small, False, self.cfg)
        for m in methods:
            if m.name not in self.cfg.methods:
                continue
            out: dict[str, Any] = {"group": group}
            t_method = time.perf_counter()
            try:
                for task in self.cfg.tasks:
                    out[task] = {}
                    for size in self.cfg.sizes:
                        if m.max_size is not None and size > m.max_size:
                            continue
                        case = _time_case(pool, m, size, task == "read", self.cfg)
                        case["size"] = size
                        out[task][str(size)] = case
                        _log(
                            f"  {m.name:<18} {task:<8} {size_label(size):>5}  "
                            f"median {case['median_ms']:9.3f} ms  "
                            f"(p10 {case['p10_ms']:.3f}, p90 {case['p90_ms']:.3f}, "
                            f"n={case['repeats']})"
                        )
            except Exception as e:
                self.skip(m.name, f"failed: {type(e).__name__}: {e}")
                self.data.setdefault("errors", {})[m.name] = traceback.format_exc()
                if any(out.get(t) for t in self.cfg.tasks):
                    self.data["results"][m.name] = out  # keep what was measured
                raise _MethodFailed from e
            finally:
                self.peers.free_device_memory()
            self.data["results"][m.name] = out
            _log(f"  {m.name} done in {time.perf_counter() - t_method:.1f} s")
            self.save()
        if any(m.max_size is not None and max(self.cfg.sizes) > m.max_size for m in methods):
            names = [m.name for m in methods if m.max_size is not None]
            self.note(f"{', '.join(names)} measured up to {size_label(COPY_MAX_BYTES)} only")

    def group(
        self,
        name: str,
        make: Callable[[], list[Method]],
        memory_resource: Callable[[], Any] | None = None,
        cleanup: Callable[[], None] | None = None,
        preload: str | None = None,
    ) -> None:
        """Run a group of methods in a fresh one-worker pool; skip the group if it fails."""
        wanted = [m for m in self.cfg.methods if _family(m) in _families(name)]
        if not wanted:
            return
        _log(f"[{name}] {', '.join(wanted)}")
        try:
            methods = make()
        except Exception as e:
            for m in wanted:
                self.skip(m, f"not available: {type(e).__name__}: {e}")
            self.save()
            return
        try:
            mr = memory_resource() if memory_resource is not None else None
            attempt = 0
            while methods:
                # a failed method may leave its pool unusable: the rest get a fresh one
                label = name if attempt == 0 else f"{name}#{attempt}"
                try:
                    with _pool(self.cfg, 1, mr, preload) as pool:
                        self.run_methods(label, methods, pool)
                        pool.apply_async(_task_cleanup, (None,)).get(TASK_TIMEOUT)
                    methods = []
                except _MethodFailed:
                    done = set(self.data["results"]) | set(self.data["skipped"])
                    methods = [m for m in methods if m.name not in done]
                    attempt += 1
        except Exception as e:
            for m in wanted:
                if m not in self.data["results"] and m not in self.data["skipped"]:
                    self.skip(m, f"failed: {type(e).__name__}: {e}")
        finally:
            if cleanup is not None:
                with contextlib.suppress(Exception):
                    cleanup()
            self.peers.free_device_memory()
            self.save()

    # bandwidth --------------------------------------------------------------------------
    def bandwidth(self) -> None:
        """Copy-kernel bandwidth in the worker: shared arrays against plain ones."""
        import sharedarrays as sa

        nbytes = self.cfg.bandwidth_bytes
        _log(f"[bandwidth] copyto of {size_label(nbytes)} in the worker")
        try:
            x = sa.empty(nbytes // 4, "float32", device=self.cfg.device)
            y = sa.empty(nbytes // 4, "float32", device=self.cfg.device)
            with _pool(self.cfg) as pool:
                got = pool.apply_async(_task_bandwidth, (x, y, self.cfg.bandwidth_repeats)).get(
                    TASK_TIMEOUT * 2
                )
            x.close()
            y.close()
        except Exception as e:
            self.skip("bandwidth", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        finally:
            self.peers.free_device_memory()
        shared = statistics.median(got["shared_ms"])
        plain = statistics.median(got["plain_ms"])
        out = {
            "bytes": nbytes,
            "kernel": "cupy.copyto(y, x)" if self.cfg.is_cuda else "numpy.copyto(y, x)",
            "timer": "CUDA events" if self.cfg.is_cuda else "time.perf_counter",
            "shared_ms": got["shared_ms"],
            "plain_ms": got["plain_ms"],
            "shared_median_ms": shared,
            "plain_median_ms": plain,
            "shared_GBps": 2 * nbytes / (shared / 1e3) / 1e9,
            "plain_GBps": 2 * nbytes / (plain / 1e3) / 1e9,
            "ratio": plain / shared,
        }
        self.data["bandwidth"] = out
        _log(
            f"  shared {out['shared_GBps']:.1f} GB/s, plain {out['plain_GBps']:.1f} GB/s "
            f"(read+write), ratio {out['ratio']:.3f}"
        )
        self.save()

    # many small arrays ------------------------------------------------------------------
    def many(self) -> None:
        """``many_count`` arrays of ``many_bytes`` handed off in one task (a list)."""
        import sharedarrays as sa

        count, nbytes = self.cfg.many_count, self.cfg.many_bytes
        _log(f"[many] {count} arrays of {size_label(nbytes)} in one task")
        packed = True
        arrays: list[Any] = []
        try:
            t = time.perf_counter()
            try:
                empty: Callable[..., Any] = sa.empty  # pack= is new: not in every version
                arrays = [
                    empty(nbytes // 4, "float32", device=self.cfg.device, pack=True)
                    for _ in range(count)
                ]
            except TypeError:
                packed = False
                if self.cfg.is_cuda:
                    count = min(count, 1000)
                self.note(
                    f"sa.empty(pack=True) is not accepted yet: {count} arrays, one allocation each"
                )
                arrays = [
                    sa.empty(nbytes // 4, "float32", device=self.cfg.device) for _ in range(count)
                ]
            create_s = time.perf_counter() - t
            sizes: dict[str, int] = {}
            for a in arrays:
                sizes[a.allocation.id] = a.allocation.size
            memory = sum(sizes.values())
            payload = count * nbytes
            pickled = len(pickle.dumps(arrays))
            samples: list[float] = []
            first = 0.0
            with _pool(self.cfg) as pool:
                started = time.perf_counter()
                for i in range(self.cfg.repeats + 1):
                    t0 = time.perf_counter()
                    got = pool.apply_async(_task_many, (arrays,)).get(TASK_TIMEOUT * 2)
                    dt = time.perf_counter() - t0
                    if got != count:
                        raise RuntimeError(f"the worker saw {got} arrays, not {count}")
                    if i == 0:
                        first = dt
                    else:
                        samples.append(dt)
                        if time.perf_counter() - started > self.cfg.case_seconds and i >= 3:
                            break
                pool.apply_async(_task_cleanup, (None,)).get(TASK_TIMEOUT)
        except Exception as e:
            self.skip("many", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        finally:
            for a in arrays:
                a.close()
            arrays.clear()
            self.peers.free_device_memory()
        warm = stats(samples)
        out = {
            "count": count,
            "bytes_each": nbytes,
            "packed": packed,
            "allocations": len(sizes),
            "memory_bytes": memory,
            "payload_bytes": payload,
            "memory_ratio": memory / payload,
            "pickle_bytes": pickled,
            "create_s": create_s,
            "first_ms": first * 1e3,
            "first_arrays_per_s": count / first,
            "warm": warm,
            "arrays_per_s": count / (warm["median_ms"] / 1e3),
        }
        self.data["many"] = out
        _log(
            f"  {len(sizes)} allocations, {memory / 2**20:.1f} MiB for "
            f"{payload / 2**20:.1f} MiB of payload (x{out['memory_ratio']:.2f}); first handoff "
            f"{first * 1e3:.1f} ms ({out['first_arrays_per_s']:,.0f}/s), then median "
            f"{warm['median_ms']:.1f} ms ({out['arrays_per_s']:,.0f} arrays/s)"
        )
        self.save()

    # steps ------------------------------------------------------------------------------
    def steps(self) -> None:
        """Time the pieces of a warm sharedarrays handoff: pickling here, loading there."""
        import sharedarrays as sa

        _log("[steps] where a warm sharedarrays handoff spends its time")
        repeats = 200
        try:
            a = sa.empty(1 << 18, "float32", device=self.cfg.device)
            dumps = multiprocessing.reduction.ForkingPickler.dumps
            parent: dict[str, list[float]] = {"pickle_floor_arg": [], "pickle_array": []}
            for _ in range(repeats):
                t0 = time.perf_counter()
                dumps((_task_floor, (FLOOR_ARG, False)))
                t1 = time.perf_counter()
                dumps((_task_sharedarrays, (a, False)))
                parent["pickle_floor_arg"].append(t1 - t0)
                parent["pickle_array"].append(time.perf_counter() - t1)
            blob, sync = a.__reduce__()[1]
            with _pool(self.cfg) as pool:
                pool.apply_async(_task_sharedarrays, (a, False)).get(TASK_TIMEOUT)
                worker = pool.apply_async(_task_steps, (blob, sync, repeats)).get(TASK_TIMEOUT)
                same_size = b"x" * len(multiprocessing.reduction.ForkingPickler.dumps(a))
                pairs = {
                    "warm_minus_floor_us": _interleaved(pool, (a, False), self.cfg.pairs),
                    "control_minus_floor_us": _interleaved(
                        pool, (same_size, False), self.cfg.pairs, _task_floor
                    ),
                    "pairs": self.cfg.pairs,
                }
            a.close()
        except Exception as e:
            self.skip("steps", f"failed: {type(e).__name__}: {e}")
            self.save()
            return
        sides: dict[str, dict[str, float]] = {
            "parent_us": {k: statistics.median(v) * 1e6 for k, v in parent.items()},
            "worker_us": worker,
        }
        self.data["steps"] = {**sides, "payload_bytes": len(blob), "pairs": pairs}
        for side, values in sides.items():
            text = ", ".join(f"{k} {v:.1f}" for k, v in values.items())
            _log(f"  {side[:-3]} (median us): {text}")
        _log(
            f"  interleaved pairs ({pairs['pairs']}, 1 MiB): warm handoff - floor "
            f"{pairs['warm_minus_floor_us']:+.1f} us; control (bytes of the pickled array's "
            f"size, no array) - floor {pairs['control_minus_floor_us']:+.1f} us"
        )
        self.save()

    # fan-out ----------------------------------------------------------------------------
    def scaling(self) -> None:
        """One array handed to 1, 4, 16 workers at once: floor, warm and cold."""
        sizes = sorted({min(self.cfg.sizes), max(self.cfg.sizes)})
        out: dict[str, Any] = {}
        self.data["scaling"] = out
        methods = [_floor_method(), *_sa_methods(self.cfg)]
        for w in self.cfg.workers:
            _log(f"[scaling] {w} worker{'s' if w != 1 else ''}")
            row: dict[str, Any] = {}
            out[str(w)] = row
            try:
                with _pool(self.cfg, w) as pool:
                    for m in methods:
                        row[m.name] = {}
                        for size in sizes:
                            case = _time_case(pool, m, size, False, self.cfg, workers=w)
                            case["size"] = size
                            case["per_task_ms"] = case["median_ms"] / w
                            row[m.name][str(size)] = case
                            _log(
                                f"  {m.name:<18} {size_label(size):>5}  median "
                                f"{case['median_ms']:8.3f} ms for {w} tasks "
                                f"({case['per_task_ms']:.3f} ms per task)"
                            )
            except Exception as e:
                self.skip(f"scaling-{w}", f"failed: {type(e).__name__}: {e}")
            finally:
                self.peers.free_device_memory()
            self.save()

    # everything -------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        _raise_fd_limit()
        # cuda.core warns when the *default* start method is fork; every pool here is spawn
        warnings.filterwarnings("ignore", message="multiprocessing start method is 'fork'")
        where = self.data["meta"].get("gpu", {}).get("name", platform.machine())
        _log(
            f"sharedarrays bench on {cfg.device} ({where}): "
            f"sizes {', '.join(size_label(s) for s in cfg.sizes)}, {cfg.repeats} repeats after "
            f"{cfg.warmup} warm-up, tasks {', '.join(cfg.tasks)}"
        )
        self.group("base", lambda: [_floor_method(), *_sa_methods(cfg)])
        if cfg.is_cuda:
            self.group("sa.ipc", lambda: _sa_methods(cfg, "cuda-ipc", "sa.ipc"))
            self.group("sa.pool", lambda: _sa_methods(cfg, "cuda-pool", "sa.pool"))
            self.group("torch", lambda: _torch_methods(self.peers), preload="torch")
            self.group(
                "cuda.core",
                lambda: _cuda_core_methods(self.peers),
                memory_resource=lambda: self.peers.memory_resource()[0],
                cleanup=self.peers.close_memory_resource,
            )
        else:
            self.group("shm", _shm_methods)
        if "bandwidth" not in cfg.skip:
            self.bandwidth()
        if "many" not in cfg.skip:
            self.many()
        if "steps" not in cfg.skip:
            self.steps()
        if "scaling" not in cfg.skip:
            self.scaling()
        self.group("copy", lambda: [_copy_method(cfg, self.peers)])
        self.data["targets"] = evaluate_targets(self.data)
        self.data["meta"]["finished_utc"] = _utc_now()
        self.save()
        return self.data


class _MethodFailed(Exception):
    """A method failed mid-group; its pool may be unusable, so the rest get a fresh one."""


def _family(method: str) -> str:
    return method if method in ("floor", "copy") else method.rsplit("-", 1)[0]


def _families(group: str) -> tuple[str, ...]:
    return {"base": ("floor", "sharedarrays")}.get(group, (group,))


# ---------------------------------------------------------------------------------------
# environment


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _today() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpu_info(index: int) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={index}",
                "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        name, driver, memory = (s.strip() for s in out.split(",", 2))
        info.update(name=name, driver=driver, memory=memory, source="nvidia-smi")
    except Exception:
        try:
            from cuda.bindings import driver as cu

            cu.cuInit(0)
            _, dev = cu.cuDeviceGet(index)
            _, raw = cu.cuDeviceGetName(64, dev)
            _, version = cu.cuDriverGetVersion()
            info.update(
                name=raw.split(b"\0", 1)[0].decode(),
                driver_cuda_version=f"{version // 1000}.{version % 1000 // 10}",
                source="cuda.bindings",
            )
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
    return info


def environment(cfg: Config) -> dict[str, Any]:
    """Date (UTC), machine, GPU and package versions, for the JSON."""
    from sharedarrays import __version__

    meta: dict[str, Any] = {
        "date_utc": _utc_now(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "argv": sys.argv,
        "versions": {
            "sharedarrays": __version__,
            "numpy": np.__version__,
            "cupy": _version("cupy-cuda13x") or _version("cupy-cuda12x") or _version("cupy"),
            "torch": _version("torch"),
            "cuda-core": _version("cuda-core"),
            "cuda-bindings": _version("cuda-bindings"),
            "matplotlib": _version("matplotlib"),
        },
        "start_method": "spawn",
    }
    if cfg.is_cuda:
        meta["gpu"] = _gpu_info(cfg.index)
    return meta


def _device_slug(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    name = str(_gpu_info(int(device.split(":")[1])).get("name", "cuda"))
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"


# ---------------------------------------------------------------------------------------
# targets, table, plot


def _median(data: dict[str, Any], method: str, task: str, size: int) -> float | None:
    case = data.get("results", {}).get(method, {}).get(task, {}).get(str(size))
    return None if case is None else float(case["median_ms"])


def _sizes(data: dict[str, Any]) -> list[int]:
    return [int(s) for s in data["config"]["sizes"]]


def _interleaved(
    pool: Pool, args: tuple[Any, ...], pairs: int, task: Callable[..., Any] = _task_sharedarrays
) -> float:
    """Median over ``pairs`` of (``task(*args)`` - an empty task), the two timed back to back
    in the same pool, so that the drift of the pool's round trip cancels (us)."""
    diffs = []
    for _ in range(pairs):
        t0 = time.perf_counter()
        pool.apply_async(_task_floor, (FLOOR_ARG, False)).get(TASK_TIMEOUT)
        t1 = time.perf_counter()
        pool.apply_async(task, args).get(TASK_TIMEOUT)
        diffs.append((time.perf_counter() - t1) - (t1 - t0))
    return statistics.median(diffs) * 1e6


def evaluate_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """Check the issue's targets against one run's results.

    Every comparison uses the ``handoff`` task at each size; the floor is the ``floor``
    method, measured in the same pool as sharedarrays. Returns one row per target with
    ``status`` ``PASS``, ``MISS`` or ``n/a`` (not measured in this run) and the numbers.
    """
    rows: list[dict[str, Any]] = []
    sizes = _sizes(data)

    def row(name: str, ok: bool | None, measured: str) -> None:
        status = "n/a" if ok is None else ("PASS" if ok else "MISS")
        rows.append({"target": name, "status": status, "measured": measured})

    def per_size(method: str, other: str) -> list[tuple[int, float, float]]:
        out = []
        for s in sizes:
            a, b = _median(data, method, "handoff", s), _median(data, other, "handoff", s)
            if a is not None and b is not None:
                out.append((s, a, b))
        return out

    def over_floor(name: str, kind: str, limit: float) -> None:
        """The row of a target on ``sharedarrays-<kind>`` minus the floor, at its worst size."""
        measured = per_size(f"sharedarrays-{kind}", "floor")
        worst = max(measured, key=lambda r: r[1] - r[2]) if measured else None
        row(
            name,
            None if worst is None else worst[1] - worst[2] <= limit,
            "not measured"
            if worst is None
            else f"worst {worst[1] - worst[2]:+.3f} ms at {size_label(worst[0])} "
            f"({kind} {worst[1]:.3f}, floor {worst[2]:.3f})",
        )

    over_floor(
        f"warm overhead over floor <= {TARGETS['warm_overhead_ms']} ms at every size",
        "warm",
        TARGETS["warm_overhead_ms"],
    )
    pairs = (data.get("steps") or {}).get("pairs")
    limit_us = TARGETS["warm_overhead_ms"] * 1e3
    row(
        f"warm overhead over floor <= {TARGETS['warm_overhead_ms']} ms, interleaved pairs",
        None if not pairs else pairs["warm_minus_floor_us"] <= limit_us,
        "not measured"
        if not pairs
        else f"{pairs['warm_minus_floor_us']:+.1f} us at 1M, median of {pairs['pairs']} pairs "
        f"(control: {pairs['control_minus_floor_us']:+.1f} us)",
    )
    vs_torch = per_size("torch-warm", "sharedarrays-warm")
    low = min(vs_torch, key=lambda r: r[1] / r[2]) if vs_torch else None
    row(
        f"warm >= {TARGETS['warm_vs_torch']:g}x faster than torch warm",
        None if low is None else low[1] / low[2] >= TARGETS["warm_vs_torch"],
        "torch not measured"
        if low is None
        else f"lowest {low[1] / low[2]:.2f}x at {size_label(low[0])} "
        f"(torch {low[1]:.3f} ms, sharedarrays {low[2]:.3f} ms)",
    )
    over_floor(
        f"cold <= floor + {TARGETS['cold_overhead_ms']} ms at every size",
        "cold",
        TARGETS["cold_overhead_ms"],
    )
    gib = 1 << 30
    copy, sa_cold = (_median(data, m, "handoff", gib) for m in ("copy", "sharedarrays-cold"))
    sa_warm = _median(data, "sharedarrays-warm", "handoff", gib)
    row(
        f"1 GiB handoff >= {TARGETS['copy_ratio']:g}x faster than copy",
        None if copy is None or sa_cold is None else copy / sa_cold >= TARGETS["copy_ratio"],
        "1G not measured for both"
        if copy is None or sa_cold is None
        else f"cold {copy / sa_cold:,.0f}x (copy {copy:.1f} ms, cold {sa_cold:.3f} ms)"
        + (f"; warm {copy / sa_warm:,.0f}x" if sa_warm else ""),
    )
    bw = data.get("bandwidth")
    row(
        f"consumer bandwidth >= {TARGETS['bandwidth_ratio']}x plain",
        None if bw is None else bw["ratio"] >= TARGETS["bandwidth_ratio"],
        "not measured"
        if bw is None
        else f"{bw['ratio']:.3f}x ({bw['shared_GBps']:.0f} vs {bw['plain_GBps']:.0f} GB/s)",
    )
    many = data.get("many")
    row(
        f"{many['count'] if many else 10000} x {size_label(many['bytes_each']) if many else '4K'}: "
        f"memory <= {TARGETS['many_memory_ratio']}x payload",
        None if many is None else many["memory_ratio"] <= TARGETS["many_memory_ratio"],
        "not measured"
        if many is None
        else f"{many['memory_ratio']:.2f}x ({many['allocations']} allocations)",
    )
    row(
        f"small arrays: >= {TARGETS['many_arrays_per_s']:,.0f} arrays/s",
        None if many is None else many["arrays_per_s"] >= TARGETS["many_arrays_per_s"],
        "not measured"
        if many is None
        else f"{many['arrays_per_s']:,.0f}/s warm (first handoff "
        f"{many['first_arrays_per_s']:,.0f}/s)",
    )
    return rows


def format_table(data: dict[str, Any]) -> str:
    """The method x size table (median ms and ratio to the floor), per task, and targets."""
    sizes = _sizes(data)
    lines: list[str] = []
    meta = data["meta"]
    where = meta.get("gpu", {}).get("name") or f"{meta['machine']} ({meta['cpus']} CPUs)"
    lines.append(f"sharedarrays bench, {meta['date_utc']}, {meta['hostname']}, {where}")
    for task in data["config"]["tasks"]:
        lines.append("")
        lines.append(f"{task}: median ms (x floor)")
        head = f"{'method':<19}" + "".join(f"{size_label(s):>20}" for s in sizes)
        lines.append(head)
        for method in data["results"]:
            cells: list[str] = []
            for s in sizes:
                m = _median(data, method, task, s)
                f = _median(data, "floor", task, s)
                if m is None:
                    cells.append(f"{'-':>20}")
                elif f:
                    cells.append(f"{m:>11.3f} ({m / f:>5.1f}x)")
                else:
                    cells.append(f"{m:>20.3f}")
            lines.append(f"{method:<19}" + "".join(cells))
    if data.get("scaling"):
        lines.append("")
        lines.append("fan-out (handoff to every worker at once): median ms for all tasks")
    for w, row in data.get("scaling", {}).items():
        for method, by_size in row.items():
            text = ", ".join(
                f"{size_label(int(s))} {c['median_ms']:.3f}" for s, c in by_size.items()
            )
            lines.append(f"  {w:>2} workers  {method:<18} {text}")
    if data.get("skipped"):
        lines.append("")
        for what, why in data["skipped"].items():
            lines.append(f"skipped {what}: {why}")
    if data.get("targets"):
        lines.append("")
        lines.append("targets")
        for t in data["targets"]:
            lines.append(f"  {t['status']:<5} {t['target']}: {t['measured']}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str) -> None:
    """Time against size, log-log, one line per method, a panel per task (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(data["config"]["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 4.8), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for method, result in data["results"].items():
            cases = sorted(result.get(task, {}).values(), key=lambda c: c["size"])
            if not cases:
                continue
            xs = [c["size"] for c in cases]
            line = ax.plot(xs, [c["median_ms"] for c in cases], marker="o", label=method)[0]
            ax.fill_between(
                xs,
                [c["p10_ms"] for c in cases],
                [c["p90_ms"] for c in cases],
                color=line.get_color(),
                alpha=0.15,
                linewidth=0,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("array size (bytes)")
        ax.set_ylabel("median ms per task (p10-p90 shaded)")
        ax.set_title(task)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    meta = data["meta"]
    where = meta.get("gpu", {}).get("name") or f"{meta['machine']} host"
    fig.suptitle(f"sharedarrays bench: spawn Pool handoff, {where}, {meta['date_utc']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------
# entry points


def run(cfg: Config) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON and the plot.

    Returns
    -------
    dict
        Everything measured (what the JSON holds).
    """
    data = Run(cfg).run()
    print()
    print(format_table(data), flush=True)
    if cfg.plot_path:
        try:
            plot(data, cfg.plot_path)
            print(f"\nplot: {cfg.plot_path}")
        except Exception as e:  # a missing matplotlib must not lose the numbers
            print(f"\nno plot: {type(e).__name__}: {e}", file=sys.stderr)
    if cfg.json_path:
        print(f"json: {cfg.json_path}")
    return data


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of ``python -m sharedarrays bench`` once its options are parsed."""
    try:
        cfg = config_from_args(args)
    except argparse.ArgumentTypeError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``bench`` options (as :func:`add_arguments`) and run."""
    parser = argparse.ArgumentParser(prog="python -m sharedarrays bench")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
