"""Command line: ``python -m sharedarrays demo | top | ls | rm | keeper | status``.

The benchmark is a script of the repository: ``python benchmarks/bench.py``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["main", "parse_size"]

_BLOCK = 1 << 24  # elements filled or checked at a time


def parse_size(text: str) -> int:
    """Parse ``"256M"``, ``"1G"``, ``"4096"`` (binary units) into bytes (``demo --size``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 256M or 1G)")
    return int(float(m.group(1)) * (1 << 10 * " KMGT".index(m.group(2).upper() or " ")))


def _xp(native: Any) -> Any:
    return np if isinstance(native, np.ndarray) else __import__("cupy")


def _sync(native: Any) -> None:
    if not isinstance(native, np.ndarray):
        _xp(native).cuda.get_current_stream().synchronize()


def _transform_shared(view: Any) -> int:
    """Worker task: transform a shared slice in place (x -> 2x + 1)."""
    x = view.array
    x *= 2
    x += 1
    _sync(x)
    return int(view.size)


def _transform_copy(data: bytes, on_cuda: bool) -> bytes:
    """Worker task of the copy path: unpickle a host copy, transform it, send it back."""
    x = pickle.loads(data)
    g = __import__("cupy").asarray(x) if on_cuda else x
    g *= 2
    g += 1
    return pickle.dumps(g.get() if on_cuda else g, protocol=pickle.HIGHEST_PROTOCOL)


def _noop(_: object) -> None:
    return None


def _pattern(xp: Any, start: int, stop: int) -> Any:
    return xp.arange(start, stop, dtype=xp.float32) % 1000


def _fill_pattern(native: Any, n: int, progress: bool) -> None:
    """Write ``i % 1000`` into a flat float32 array, with a progress bar if ``progress``."""
    from tqdm.auto import tqdm

    with tqdm(total=n * 4, unit="B", unit_scale=True, desc="fill", disable=not progress) as bar:
        for start in range(0, n, _BLOCK):
            stop = min(n, start + _BLOCK)
            native[start:stop] = _pattern(_xp(native), start, stop)
            bar.update((stop - start) * 4)
    _sync(native)


def _verify(native: Any, n: int) -> int:
    """Count elements that are not ``2 * (i % 1000) + 1``."""
    bad = 0
    for start in range(0, n, _BLOCK):
        stop = min(n, start + _BLOCK)
        bad += int((native[start:stop] != _pattern(_xp(native), start, stop) * 2 + 1).sum())
    return bad


def _race(pool: Any, a: Any, slices: list[Any], on_cuda: bool) -> tuple[list[Any], int]:
    """Time the empty tasks, the in-place path and the copy path; the rows and bad elements."""
    n, clock = a.size, time.perf_counter
    t = clock()
    pool.map(_noop, range(len(slices)))
    rows = [("empty tasks (floor)", clock() - t, 0)]
    t = clock()
    done = pool.map(_transform_shared, slices, chunksize=1)
    rows.append(("sharedarrays (in place)", clock() - t, sum(len(pickle.dumps(s)) for s in slices)))
    assert sum(done) == n
    bad = _verify(a.array, n)
    _fill_pattern(a.array, n, False)  # (the same fill again: its bar was shown once)
    t = clock()
    blobs = [pickle.dumps(s.get(), protocol=pickle.HIGHEST_PROTOCOL) for s in slices]
    results = pool.starmap(_transform_copy, [(b, on_cuda) for b in blobs], chunksize=1)
    for s, r in zip(slices, results):
        s[...] = pickle.loads(r)
    _sync(a.array)
    rows.append(("plain copy (pickle)", clock() - t, 2 * sum(map(len, blobs))))
    return rows, bad + _verify(a.array, n)


def demo(size: int | None, workers: int, dev: Any, progress: bool) -> int:
    """The main job: share a large array with a Pool, transform it in place, verify (on
    ``dev``, a Device; ``None``: the default)."""
    import sharedarrays as sa

    with sa.empty(1, "float32", device=dev) as probe:
        on_cuda = probe.device.is_cuda
    if size is None:
        size = (1 << 30) if on_cuda else (256 << 20)
    n = max(workers, size // 4)
    where = dev or ("cuda:0" if on_cuda else "cpu")
    print(f"sharedarrays demo: {n * 4 / 2**20:.0f} MiB float32 on {where}, {workers} spawn workers")
    a = sa.empty(n, "float32", device=dev)
    _fill_pattern(a.array, n, progress)
    bounds = np.linspace(0, n, workers + 1).astype(int)
    slices = [a[int(bounds[i]) : int(bounds[i + 1])] for i in range(workers)]
    method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    with mp.get_context(method).Pool(workers) as pool:
        pool.map(_noop, range(workers * 4))  # start the workers
        # warm them up (CUDA context, CuPy kernels) so that neither timed path pays it
        with sa.zeros((workers, 1024), "float32", device=dev) as warm:
            pool.map(_transform_shared, [warm[i] for i in range(workers)], chunksize=1)
        pool.starmap(_transform_copy, [(pickle.dumps(np.ones(8, np.float32)), on_cuda)] * workers)
        rows, bad = _race(pool, a, slices, on_cuda)
    print(f"\n{'method':<26}{'time':>12}{'bytes pickled':>16}")
    for name, sec, nbytes in rows:
        print(f"{name:<26}{sec * 1e3:>9.2f} ms{nbytes:>16,}")
    print(f"\n{a.allocation.describe()}")
    for s in slices:
        s.close()
    a.close()
    if bad:
        print(f"\nFAILED: {bad} elements differ from the expected values", file=sys.stderr)
        return 1
    print("\nall elements verified")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m sharedarrays`` and the ``sharedarrays`` script."""
    from sharedarrays import keeper_cli, top_cli
    from sharedarrays.backends.device import parse_device
    from sharedarrays.errors import SharedArrayError

    parser = argparse.ArgumentParser(prog="python -m sharedarrays")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="share a large array with a Pool and transform it in place")
    d.add_argument(
        "--size", type=parse_size, default=None, help="array size (default 1G on GPU, 256M on host)"
    )
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--device", default=None, help="auto (default), cpu, cuda or cuda:N")
    d.add_argument("--no-progress", action="store_true", help="no progress bar for the fill")
    keeper_cli.add_parsers(sub)
    top_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "top":
        return top_cli.run(args)
    if args.command in keeper_cli.COMMANDS:
        return keeper_cli.run(args)
    if args.workers < 1:
        d.error("--workers must be at least 1")
    try:
        dev = None
        if args.device not in (None, "auto"):
            try:
                dev = parse_device(args.device)
            except SharedArrayError:  # (no such device here: said below)
                raise
            except (TypeError, ValueError) as e:  # (not a device's name)
                d.error(f"--device: {e}")
        return demo(args.size, args.workers, dev, not args.no_progress)
    except SharedArrayError as e:  # (no device, not enough memory: said, not a traceback)
        print(f"demo: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
