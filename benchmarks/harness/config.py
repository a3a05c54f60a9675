"""What one run measures: sizes, device, methods, tasks and parts, from the command line."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.environment import device_slug
from harness.sizes import parse_size
from sharedarrays.backends.device import parse_name

__all__ = [
    "TASKS",
    "GPU_METHODS",
    "HOST_METHODS",
    "PARTS",
    "ROUND_FAMILIES",
    "COPY_MAX_BYTES",
    "TASK_TIMEOUT",
    "Config",
    "add_arguments",
    "config_from_args",
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

PARTS = ("table", "warm", "cold", "many", "results", "bandwidth", "steps", "scaling", "dask")
"""The bench's parts (``--skip`` and ``--only`` take these names): ``table`` is the method x
size table, ``warm`` and ``cold`` are the interleaved rounds over the floor, ``many`` the
small arrays, ``results`` new arrays returned by workers, ``dask`` a same-node Dask transfer
(:mod:`harness.dask`)."""

RESULTS_SIZES = {"cuda": (1 << 20, 64 << 20, 1 << 30), "cpu": (1 << 20, 64 << 20)}
"""Sizes of the ``results`` part: what each of its tasks returns."""
RESULTS_TASKS = 16
"""Tasks per timed round of the ``results`` part (each returns one new array)."""
RESULTS_WORKERS = 4
"""Spawn workers of the ``results`` part."""

ROUND_FAMILIES = {
    "cuda": ("sharedarrays", "sa.ipc", "sa.pool", "torch", "cuda.core"),
    "cpu": ("sharedarrays", "shm"),
}
"""The method families of the warm and cold rounds, per device kind (``--methods`` filters)."""

COPY_MAX_BYTES = 1 << 30
"""The copy path runs up to this size only (about 5 s per GiB on an H200)."""

DEFAULT_SIZES = {"cuda": "1M,64M,1G,8G,32G", "cpu": "1M,64M,256M"}
QUICK_SIZES = {"cuda": "1M,64M", "cpu": "1M,16M"}
DEFAULT_WARM_SIZES = {"cuda": "1M,1G", "cpu": "1M,16M"}
DEFAULT_COLD_SIZES = {"cuda": "1M,1G,32G", "cpu": "1M,16M"}
QUICK_ROUND_SIZES = {"cuda": "1M", "cpu": "1M"}
DEFAULT_DASK_SIZES = {"cuda": "1M,1G,8G", "cpu": "1M,1G,8G"}
QUICK_DASK_SIZES = {"cuda": "1M,16M", "cpu": "1M,16M"}
DEFAULT_BANDWIDTH = {"cuda": "4G", "cpu": "256M"}
QUICK_BANDWIDTH = {"cuda": "256M", "cpu": "16M"}
TASK_TIMEOUT = float(os.environ.get("SHAREDARRAYS_BENCH_TIMEOUT", "120"))
"""Seconds one task may take before its method is abandoned (a dead worker never answers);
``SHAREDARRAYS_BENCH_TIMEOUT`` overrides it. ``SHAREDARRAYS_BENCH_DEBUG=1`` makes every
worker dump its threads' stacks to stderr every 20 s (to see where a task hangs)."""


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
    rounds : int
        Interleaved rounds of the ``warm`` and ``cold`` parts (``--rounds``): each round
        times the floor and every method once, in a balanced order (``bench.rounds``).
    round_seconds : float
        A size of the ``warm`` or ``cold`` part stops early (with at least 3 rounds) once its
        rounds took this long.
    warm_sizes, cold_sizes : list of int
        Sizes of the ``warm`` and ``cold`` parts (a cold size that does not fit in the free
        memory is skipped, with the reason, when the run reaches it).
    only : list of str
        Parts of :data:`PARTS` to run, all others skipped (empty: all); the method x size
        table runs only when ``table`` is among them.
    dask_sizes : list of int
        Sizes of the ``dask`` part (a size that does not fit in the free memory is skipped).
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
    rounds: int = 301
    round_seconds: float = 120.0
    warm_sizes: list[int] = field(default_factory=lambda: [1 << 20, 1 << 30])
    cold_sizes: list[int] = field(default_factory=lambda: [1 << 20, 1 << 30, 32 << 30])
    only: list[str] = field(default_factory=list)
    dask_sizes: list[int] = field(default_factory=lambda: [1 << 20, 1 << 30, 8 << 30])
    case_seconds: float = 10.0
    quick: bool = False
    json_path: str | None = None
    plot_path: str | None = None

    @property
    def is_cuda(self) -> bool:
        """Whether the run is on a CUDA device."""
        return parse_name(self.device).is_cuda

    @property
    def runs_measurements(self) -> bool:
        """Whether the measurement run (the method x size table and the parts besides
        ``dask``) is needed: some part of it is not skipped."""
        return any(p not in self.skip for p in PARTS if p != "dask")

    @property
    def index(self) -> int:
        """The CUDA device ordinal (0 on cpu)."""
        return int(self.device.split(":")[1]) if ":" in self.device else 0


RESULTS = Path(__file__).resolve().parents[1] / "results"
"""Where ``--full`` writes: ``benchmarks/results`` of this checkout, one JSON and one PNG per
machine kind (the date is in the JSON)."""

MAX_WORKERS, MAX_WORKERS_PER_CPU = 64, 8
"""The most workers ``--workers`` may ask for: 64, or 8 per CPU of the machine."""


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
    p.add_argument("--only", default="", help=f"run only these parts: {', '.join(PARTS)}")
    p.add_argument(
        "--dask-sizes",
        default=None,
        help="sizes of the dask part (default 1M,1G,8G where memory allows; 1M,16M --quick)",
    )
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
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds of the warm and cold parts (default 301, 31 with --quick)",
    )
    p.add_argument(
        "--round-seconds",
        type=float,
        default=120.0,
        help="a size of the warm or cold part stops early (>= 3 rounds) after this long",
    )
    p.add_argument(
        "--warm-sizes",
        default=None,
        help="sizes of the warm rounds (default 1M,1G on GPU, 1M,16M on host)",
    )
    p.add_argument(
        "--cold-sizes",
        default=None,
        help="sizes of the cold rounds (default 1M,1G,32G on GPU where memory allows, "
        "1M,16M on host)",
    )
    p.add_argument("--quick", action="store_true", help="fewer, smaller sizes (a smoke test)")
    p.add_argument(
        "--full",
        action="store_true",
        help="the committed defaults; writes benchmarks/results/<machine>.json and .png "
        "(<machine>: cpu or the GPU's name, e.g. nvidia-h200), replacing the last ones",
    )


def _resolve_device(text: str) -> str:
    if text in ("cpu", "host"):
        return "cpu"
    from sharedarrays.backends import kind_unusable

    if text == "auto":
        return "cuda:0" if kind_unusable("cuda") is None else "cpu"
    from sharedarrays.backends.device import parse_device
    from sharedarrays.errors import SharedArrayError

    try:
        dev = parse_device(text)
    except (ValueError, SharedArrayError) as e:
        raise argparse.ArgumentTypeError(f"--device {text}: {e}") from None
    return str(dev) if dev.is_cuda else "cpu"


def _seconds(value: float, option: str) -> float:
    """``value`` if it is a finite number of seconds above 0 (``nan`` passes comparisons)."""
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{option} must be a finite number of seconds above 0")
    return value


def _writable(path: str | None, option: str) -> str | None:
    """``path`` if a file can be made there (said before the run, not after it)."""
    if path is not None:
        folder = Path(path).resolve().parent
        if Path(path).is_dir():
            raise argparse.ArgumentTypeError(f"{option} {path}: a folder, not a file name")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"{option} {path}: {folder} is not a writable folder")
    return path


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


def _parse_sizes(text: str) -> list[int]:
    sizes = sorted({parse_size(s) for s in text.split(",") if s.strip()})
    if not sizes or sizes[0] < 4:
        raise argparse.ArgumentTypeError("sizes must be at least 4 bytes")
    return sizes


def _parse_workers(text: str) -> list[int]:
    most = max(MAX_WORKERS, MAX_WORKERS_PER_CPU * (os.cpu_count() or 1))
    try:
        workers = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        workers = []
    if not workers or any(not 1 <= w <= most for w in workers):
        raise argparse.ArgumentTypeError(
            f"--workers takes worker counts between 1 and {most} (comma-separated)"
        )
    return workers


def config_from_args(args: argparse.Namespace) -> Config:
    """Turn parsed ``bench`` options into a :class:`Config`.

    Raises
    ------
    argparse.ArgumentTypeError
        A bad size, method, task or worker count.
    """
    device = _resolve_device(args.device)
    kind = "cuda" if parse_name(device).is_cuda else "cpu"
    sizes_text = args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES)[kind]
    sizes = _parse_sizes(sizes_text)
    quick_rounds = QUICK_ROUND_SIZES[kind] if args.quick else None
    warm_sizes = _parse_sizes(args.warm_sizes or quick_rounds or DEFAULT_WARM_SIZES[kind])
    cold_sizes = _parse_sizes(args.cold_sizes or quick_rounds or DEFAULT_COLD_SIZES[kind])
    rounds = args.rounds if args.rounds is not None else (31 if args.quick else 301)
    if rounds < 1:
        raise argparse.ArgumentTypeError("--rounds must be >= 1")
    _seconds(args.round_seconds, "--round-seconds")
    _seconds(args.case_seconds, "--case-seconds")
    if args.repeats < 1 or args.warmup < 0:
        raise argparse.ArgumentTypeError("--repeats must be >= 1 and --warmup >= 0")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks or any(t not in TASKS for t in tasks):
        raise argparse.ArgumentTypeError(f"--tasks takes {', '.join(TASKS)}")
    workers = _parse_workers("1,4" if args.quick and args.workers == "1,4,16" else args.workers)
    skip = [s.strip() for s in args.skip.split(",") if s.strip()]
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if any(s not in PARTS for s in skip + only):
        raise argparse.ArgumentTypeError(f"--skip and --only take {', '.join(PARTS)}")
    if only:
        skip = [p for p in PARTS if p not in only]
    dask_text = args.dask_sizes or (QUICK_DASK_SIZES if args.quick else DEFAULT_DASK_SIZES)[kind]
    dask_sizes = sorted({parse_size(s) for s in dask_text.split(",") if s.strip()})
    if not dask_sizes or dask_sizes[0] < 8:
        raise argparse.ArgumentTypeError("--dask-sizes must be at least 8 bytes")
    available = GPU_METHODS if kind == "cuda" else HOST_METHODS
    bandwidth = args.bandwidth_size
    if bandwidth is None:
        bandwidth = parse_size((QUICK_BANDWIDTH if args.quick else DEFAULT_BANDWIDTH)[kind])
    many = args.many if args.many is not None else (1000 if args.quick else 10000)
    if many < 1 or args.many_size < 1 or bandwidth < 1:
        raise argparse.ArgumentTypeError(
            "--many, --many-size and --bandwidth-size must be at least 1"
        )
    json_path = _writable(args.json, "--json")
    plot_path = _writable(args.plot, "--plot")
    if args.full:
        stem = RESULTS / device_slug(device)
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
        only=only,
        dask_sizes=dask_sizes,
        many_count=many,
        rounds=rounds,
        round_seconds=args.round_seconds,
        warm_sizes=warm_sizes,
        cold_sizes=cold_sizes,
        many_bytes=args.many_size,
        bandwidth_bytes=bandwidth,
        case_seconds=args.case_seconds,
        quick=args.quick,
        json_path=json_path,
        plot_path=plot_path,
    )
