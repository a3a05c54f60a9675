"""Command line: ``python -m sharedarrays demo | top | ls | rm | keeper | status``: ``top`` and
``ls`` show the node-wide map (:mod:`sharedarrays.api.nodemap`), ``rm`` unlinks names and frees
parked and orphaned allocations, ``keeper`` and ``status`` start and ask this user's keeper."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from sharedarrays.errors import HandleUnavailable, NameNotFound, SharedArrayError

__all__ = ["main", "parse_size"]

_BLOCK = 1 << 24  # elements filled or checked at a time
MAX_SECONDS = 86_400.0  # the longest --interval, --timeout or --idle (a day)
ENTER = "\x1b[?1049h\x1b[?25l"  # the alternate screen, no cursor
LEAVE = "\x1b[?25h\x1b[?1049l"  # the cursor and the screen the user had
CLEAR = "\x1b[H\x1b[2J"  # home, then clear the screen (before each refresh)

_NODE_KEYS = ("state", "backend", "lost", "holders", "exporter", "age", "kept", "in_flight")
_LS_COLUMNS = tuple(  # (heading, format spec)
    re.findall(
        r"(\w+):(\S*)",
        "NAME:<24 NAMESPACE:<20 SHAPE:<16 DTYPE:<8 DEVICE:<7 SIZE:>9 CREATOR:>8 CREATED:<19 "
        "PIDS:<12 STATE:<9 BACKEND:<8 LOST:>9 AGE:>5 HOLDERS:",
    )
)


def parse_size(text: str) -> int:
    """Parse ``"256M"``, ``"1G"``, ``"4096"`` (binary units) into bytes (``demo --size``)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 256M or 1G)")
    return int(float(m.group(1)) * (1 << 10 * " KMGT".index(m.group(2).upper() or " ")))


def seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0, at most :data:`MAX_SECONDS`."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= MAX_SECONDS:  # (False for nan)
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds above 0 and at most {MAX_SECONDS:g}, not {value:g}"
        )
    return value


# demo ---------------------------------------------------------------------------------------
def _sync(native: Any) -> None:
    if not isinstance(native, np.ndarray):
        __import__("cupy").cuda.get_current_stream().synchronize()


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


def _pattern(like: Any, start: int, stop: int) -> Any:  # (i % 1000, where ``like`` lives)
    xp = np if isinstance(like, np.ndarray) else __import__("cupy")
    return xp.arange(start, stop, dtype=xp.float32) % 1000


def _fill_pattern(native: Any, n: int, progress: bool) -> None:
    """Write ``i % 1000`` into a flat float32 array, with a progress bar if ``progress``."""
    from tqdm.auto import tqdm

    with tqdm(total=n * 4, unit="B", unit_scale=True, desc="fill", disable=not progress) as bar:
        for start in range(0, n, _BLOCK):
            stop = min(n, start + _BLOCK)
            native[start:stop] = _pattern(native, start, stop)
            bar.update((stop - start) * 4)
    _sync(native)


def _verify(native: Any, n: int) -> int:
    """Count elements that are not ``2 * (i % 1000) + 1``."""
    bad = 0
    for start in range(0, n, _BLOCK):
        stop = min(n, start + _BLOCK)
        bad += int((native[start:stop] != _pattern(native, start, stop) * 2 + 1).sum())
    return bad


def demo(size: int | None, workers: int, dev: Any, progress: bool) -> int:
    """Share a large array on ``dev`` with a Pool, transform it in place, verify."""
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
        pool.map(int, range(workers * 4))  # start the workers
        # warm them up (CUDA context, CuPy kernels) so that neither timed path pays it
        with sa.zeros((workers, 1024), "float32", device=dev) as warm:
            pool.map(_transform_shared, [warm[i] for i in range(workers)], chunksize=1)
        pool.starmap(_transform_copy, [(pickle.dumps(np.ones(8, np.float32)), on_cuda)] * workers)
        # time the empty tasks (int), the in-place path and the copy path
        clock = time.perf_counter
        t = clock()
        pool.map(int, range(workers))
        rows = [("empty tasks (floor)", clock() - t, 0)]
        t = clock()
        done = pool.map(_transform_shared, slices, chunksize=1)
        pickled = sum(len(pickle.dumps(s)) for s in slices)
        rows.append(("sharedarrays (in place)", clock() - t, pickled))
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
        bad += _verify(a.array, n)
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


# top, ls, rm, keeper, status ----------------------------------------------------------------
def _top(args: argparse.Namespace) -> int:
    """Redraw on the alternate screen of a terminal, else print each refresh; until Ctrl-C."""
    from sharedarrays.api import nodemap
    from sharedarrays.api.widgets.render import render_node_text

    screen = not (args.once or args.json) and sys.stdout.isatty()
    if screen:
        sys.stdout.write(ENTER)
    try:
        while True:
            picture = nodemap.node_map(args.timeout)
            checks = nodemap.cross_check(picture) if args.nvml else None
            if args.json:
                doc = picture.to_doc()
                if checks is not None:
                    doc["nvml"] = [asdict(c) for c in checks]
                print(json.dumps(doc, separators=(",", ":")))
                return 0
            text = render_node_text(picture)
            if checks is not None:
                text += f"\n\n{nodemap.render_text(checks)}"
            if args.once:
                print(text)
                return 0
            if screen:
                text = f"{CLEAR}{text}\n\n(every {args.interval:g} s; Ctrl-C to quit)\n"
            else:
                text += "\n\n"
            sys.stdout.write(text)
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # ``top | head``: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    finally:
        if screen:
            sys.stdout.write(LEAVE)
            sys.stdout.flush()


def _ls(args: argparse.Namespace) -> int:
    from sharedarrays.api import named, nodemap
    from sharedarrays.api.widgets.render import COLUMNS, row_cells
    from sharedarrays.memory.info import format_bytes

    try:
        rows = named.list_named(parked=args.all, all_namespaces=args.all_namespaces)
    except SharedArrayError as e:  # the keeper runs but is stopped, busy or another's
        print(f"ls: {e}", file=sys.stderr)
        return 1
    seen = {r.alloc_id: r for r in nodemap.node_map().allocations} if rows else {}
    if args.json:
        for r in rows:
            more = seen[r.id].to_doc() if r.id in seen else {}
            doc = {**vars(r), "dtype": r.dtype.str, "device": str(r.device)}  # (tuples: lists)
            del doc["allow_pids"]
            print(json.dumps({**doc, **{k: more[k] for k in _NODE_KEYS if k in more}}))
        return 0
    lines = [[name for name, _ in _LS_COLUMNS]]
    for r in rows:
        node = dict(zip(COLUMNS, row_cells(seen[r.id]))) if r.id in seen else {}
        lines.append(
            [
                (r.name or f"(parked {r.id[:8]})") + ("" if r.linked else " (unlinked)"),
                "-" if r.name is None else r.namespace or "/ (global)",
                str(r.shape),
                r.dtype.name,
                str(r.device),
                format_bytes(r.size),
                r.creator,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)),
                ",".join(map(str, r.pids)) or "-",
                *(node.get(c, "-") for c in ("STATE", "BACKEND", "LOST", "AGE", "HOLDERS")),
            ]
        )
    for cells in lines:
        print(" ".join(f"{cell:{spec}}" for cell, (_, spec) in zip(cells, _LS_COLUMNS)))
    return 0


def _ask(question: str) -> bool:
    """Ask on the terminal; no terminal (a script) is a no."""
    if not sys.stdin.isatty():
        print(f"{question} (not asked: no terminal; pass --yes)", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _rm(args: argparse.Namespace) -> int:
    """Unlink each name; free each id (or its start) of a parked or orphaned allocation."""
    from sharedarrays.api import named, nodemap

    status = 0
    for target in args.names:
        try:
            try:
                named.unlink(target)
                continue
            except (NameNotFound, ValueError, TypeError):
                if not re.fullmatch("[0-9a-f]{4,}", target):  # (not an id's start either)
                    raise
            row = nodemap.find(nodemap.node_map(), target)
            done = nodemap.free(row, (lambda _: True) if args.yes else _ask)
        except (SharedArrayError, ValueError, TypeError) as e:
            print(f"rm: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"{row.alloc_id}: " + ("; ".join(done) or "nothing holds it any more"))
        if done == [nodemap.LEFT_ALONE]:  # (nothing was freed: a script must see it)
            status = 1
    return status


def _keeper(args: argparse.Namespace) -> int:
    from sharedarrays.keeper.daemon import main as keeper_main
    from sharedarrays.transport import keeper

    if args.idle is not None:
        os.environ["SHAREDARRAYS_KEEPER_IDLE"] = str(args.idle)
    if not args.foreground:
        print(f"keeper running, pid {keeper.ensure_running()}")
        return 0
    rc = keeper_main()
    if rc == 3:
        print(f"a keeper is running already (pid {keeper.running_pid()})", file=sys.stderr)
    return rc


def _status(args: argparse.Namespace) -> int:
    from sharedarrays.protocol.keeper import Status
    from sharedarrays.transport import keeper

    try:
        status, body, _ = keeper.request(Status(), start=False)
    except HandleUnavailable as e:
        print(f"no keeper running ({e})")
        return 1
    except SharedArrayError as e:  # it runs, but is busy or stopped
        print(f"the keeper runs but cannot be asked: {e}")
        return 1
    keeper.raise_for(status, body, "status")
    for key, value in body.items():
        print(f"{key:<12} {value}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m sharedarrays`` and the ``sharedarrays`` script."""
    from sharedarrays.backends.device import parse_device

    parser = argparse.ArgumentParser(prog="python -m sharedarrays")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="share a large array with a Pool and transform it in place")
    d.add_argument("--size", type=parse_size, help="array size (default 1G on GPU, 256M on host)")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--device", default=None, help="auto (default), cpu, cuda or cuda:N")
    d.add_argument("--no-progress", action="store_true", help="no progress bar for the fill")
    top = sub.add_parser(
        "top", help="every shared allocation of this user on this node, who holds it, refreshing"
    )
    top.add_argument("--once", action="store_true", help="print the map once and exit")
    top.add_argument("--json", action="store_true", help="one JSON object (implies --once)")
    top.add_argument(
        "--interval", type=seconds, default=2.0, help="seconds between refreshes (default 2)"
    )
    top.add_argument(
        "--timeout", type=seconds, default=1.0, help="seconds each process is given to answer"
    )
    top.add_argument("--nvml", action="store_true", help="add the driver's per-process GPU memory")
    ls = sub.add_parser("ls", help="list this user's named arrays (of this namespace)")
    ls.add_argument("--all", action="store_true", help="also parked and unlinked arrays")
    ls.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="the names of every namespace, global ones included (not only this project's)",
    )
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    rm = sub.add_parser(
        "rm", help="unlink named arrays, free parked and orphaned allocations (by name or id)"
    )
    rm.add_argument("names", nargs="+", metavar="NAME|ID")
    rm.add_argument(
        "--yes", action="store_true", help="do not ask before dropping payloads in flight"
    )
    k = sub.add_parser("keeper", help="start this user's keeper (in the background)")
    k.add_argument("--foreground", action="store_true", help="run it in this process")
    k.add_argument(
        "--idle",
        type=seconds,
        help="seconds to wait holding nothing before exiting (above 0, at most a day)",
    )
    sub.add_parser("status", help="show this user's keeper")
    args = parser.parse_args(argv)
    if args.command != "demo":
        run = {"top": _top, "ls": _ls, "rm": _rm, "keeper": _keeper, "status": _status}
        return run[args.command](args)
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
