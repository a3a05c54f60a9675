"""Interleaved A/B of a warm host handoff between two trees of the library, in pairs.

    python benchmarks/ab_trees.py [--pairs 1000] [--size 1M] [--case warm|cold|results|pool|full]
        [--device cpu|cuda:0] [--growable] [--burst N] [--env-b NAME=VALUE ...] TREE_A TREE_B
    python benchmarks/ab_trees.py [options] --off natives|parts|decoded|memset|takefds TREE

``--off`` measures what one cache of the warm path buys: tree B is a copy of TREE with that
cache switched off (one line of it replaced, see :data:`OFF`).

A TREE is a folder holding a ``sharedarrays`` package (e.g. ``git archive REV sharedarrays |
tar -x -C DIR``, or a worktree). Each tree gets a side process (``PYTHONPATH=TREE``) with a
1 MiB array (host, or ``--device``'s) and a spawned worker. A round on a side: the side
pickles the array with multiprocessing's ``ForkingPickler`` (warm: it was pickled before;
cold: a new one each round, as the bench's cold part does), sends the bytes through a pipe,
and the worker loads them, takes ``.array`` and closes the view. Pairs alternate the
order (A then B, B then A), so both trees meet the same machine state and each order is
half the pairs. Printed: the median of each part per tree (``pickle``: the side's dump;
``load``: the worker's load, ``.array`` and ``close``; ``round``: the whole round trip, pipe
included), per order and overall, and the median of the paired differences B - A: per
order, overall, and order-balanced (the mean of the two orders'). Run it again with the
trees swapped to cancel which side process is A (an A/A run shows that bias).
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

PARTS = ("pickle", "load", "round")
POOL_WORKERS, POOL_TASKS = 4, 16  # the pool case: an sa.Pool's workers, and tasks per round
OFF = {  # cache: (file, its line, the line that switches it off)
    "natives": (
        "memory/lease.py",
        "last = natives.pop(key, None)",
        "last = natives.pop(key, None) and None",
    ),
    "parts": (
        "importing.py",
        "if blob is not None and fds is None and not alloc.growable:",
        "if False:",
    ),
    "decoded": (
        "protocol/payload.py",
        "known: Payload | None = STATE.pickling.decoded.get(data)",
        "known: Payload | None = None",
    ),
    "memset": (  # (not a cache: sa.full's driver memset; --case full)
        "api/creation.py",
        'fill = getattr(alloc.backend, "fill", None)',
        "fill = None",
    ),
    "takefds": (  # (not a cache: a first load takes the chunk fds, else asks for them)
        "importing.py",
        "taken = take_fds(p.pid, [*fds.chunks, fds.table])",
        "taken = None",
    ),
}


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, 5).dump(obj)
    return buf.getvalue()


def _worker(conn: Any) -> None:
    while True:
        blob = conn.recv_bytes()
        if not blob:
            return
        t0 = time.perf_counter_ns()
        x = pickle.loads(blob)
        x.array  # noqa: B018 - the native array is what the handoff is for
        x.close()
        conn.send_bytes(str(time.perf_counter_ns() - t0).encode())


def _maker(conn: Any, size: int, device: str) -> None:
    """The ``results`` case's worker: a new array for each request, returned pickled."""
    import sharedarrays as sa

    while conn.recv_bytes():
        t0 = time.perf_counter_ns()
        blob = _dumps(sa.empty(size, dtype="uint8", device=device, pack=False))
        conn.send_bytes(str(time.perf_counter_ns() - t0).encode())
        conn.send_bytes(blob)


def _pooled(spec: tuple[int, str]) -> Any:
    """The ``pool`` case's task: a new array, returned through the Pool."""
    import sharedarrays as sa

    return sa.empty(spec[0], dtype="uint8", device=spec[1], pack=False)


def _side(size: int, case: str, device: str, growable: bool, burst: int = 1) -> None:
    import sharedarrays as sa

    def new() -> Any:
        return sa.empty(size, dtype="uint8", device=device, pack=False)

    a = sa.empty(size, dtype="uint8", device=device, capacity=2 * size if growable else None)
    fresh = [new()] if case == "cold" else []  # (the cold case's next array, made untimed)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    pool = worker = None
    if case == "pool":
        pool = sa.Pool(POOL_WORKERS)
    elif case == "results":
        worker = ctx.Process(target=_maker, args=(theirs, size, device), daemon=True)
    elif case in ("warm", "cold"):
        worker = ctx.Process(target=_worker, args=(theirs,), daemon=True)
    if worker is not None:
        worker.start()

    def one() -> str:
        x = fresh[0] if fresh else a
        t0 = time.perf_counter_ns()
        if pool is not None:  # (16 new arrays returned, each read, closed; per round)
            for _ in range(burst):
                for x in pool.imap_unordered(_pooled, [(size, device)] * POOL_TASKS):
                    x.array[0].item()
                    x.close()
                    del x
            return f"0 0 {(time.perf_counter_ns() - t0) // burst}"
        if case == "full":  # (a new float32 array of ones, made here, read, closed)
            x = sa.full(size // 4, 1.0, "float32", device=device, pack=False)
            x.array[-1].item()
            x.close()
            del x
            dt = time.perf_counter_ns() - t0
            return f"0 {dt} {dt}"
        if case == "results":  # (parts: the worker's make + pickle, the load here, all)
            mine.send_bytes(b"r")
            made = int(mine.recv_bytes())
            blob = mine.recv_bytes()
            t1 = time.perf_counter_ns()
            x = pickle.loads(blob)
            x.array[0].item()  # (read it)
            x.close()
            del x
            t2 = time.perf_counter_ns()
            return f"{made} {t2 - t1} {t2 - t0}"
        blob = _dumps(x)
        t1 = time.perf_counter_ns()
        mine.send_bytes(blob)
        load = int(mine.recv_bytes())
        t2 = time.perf_counter_ns()
        if fresh:  # (cold: closed, and the next one made, outside the round's time)
            x.close()
            fresh[0] = new()
        return f"{t1 - t0} {load} {t2 - t0}"

    for _ in range(50):  # warm: the payload cached, the worker's mapping kept
        one()
    print("ready", sa.__file__, flush=True)
    for line in sys.stdin:
        if line.strip() != "r":
            break
        print(one(), flush=True)
    if worker is not None:
        mine.send_bytes(b"")
        worker.join(10)
    if pool is not None:
        pool.terminate()
    for x in [a, *fresh]:
        x.close()


def _without(tree: str, cache: str) -> str:
    """A copy of ``tree`` with ``cache`` switched off (:data:`OFF`), in a temporary folder."""
    path, line, off = OFF[cache]
    copy = os.path.join(tempfile.mkdtemp(prefix=f"ab-{cache}-off-"), "tree")
    shutil.copytree(tree, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = os.path.join(copy, "sharedarrays", path)
    with open(target) as f:
        text = f.read()
    if text.count(line) != 1:
        raise SystemExit(f"{path}: the line {line!r} is not there once; update OFF")
    with open(target, "w") as f:
        f.write(text.replace(line, off))
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="TREE_A TREE_B, or one TREE with --off")
    parser.add_argument("--off", choices=sorted(OFF), help="B: TREE with this cache off")
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument(
        "--case",
        choices=("warm", "cold", "results", "pool", "full"),
        default="warm",
        help="warm: a worker loads the side's array again; cold: a new array each round, "
        "which the worker never saw (SHAREDARRAYS_CACHE_BYTES=0: no memory reused); results: "
        "a worker returns a new array each round, which the side loads, reads and closes; "
        "pool: an sa.Pool(4) "
        "returns 16 new arrays a round (only the round is timed); full: the side makes a "
        "new float32 array of ones (sa.full) and reads it",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=1,
        help="pool: rounds a side runs back to back per turn (their mean is its sample), as "
        "a program returning results all along does; 1: the other side's round in between",
    )
    parser.add_argument("--device", default="cpu", help="the arrays' device (cpu, cuda:0)")
    parser.add_argument("--growable", action="store_true", help="warm: a growable array")
    parser.add_argument(
        "--env-b", action="append", default=[], metavar="NAME=VALUE", help="set for B only"
    )
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if len(args.trees) != (1 if args.off else 2):
        parser.error("give TREE_A TREE_B, or one TREE with --off")
    if args.off:
        args.trees.append(_without(args.trees[0], args.off))
    sides = []
    for tree in args.trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        if args.case == "cold":
            env["SHAREDARRAYS_CACHE_BYTES"] = "0"
        if sides:
            env.update(item.split("=", 1) for item in args.env_b)
        p = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--side",
                "--size",
                str(args.size),
                "--case",
                args.case,
                "--device",
                args.device,
                "--burst",
                str(args.burst),
                *(["--growable"] if args.growable else []),
                "x",
                "x",
            ],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
        )
        assert p.stdout is not None
        print(f"{'AB'[len(sides)]}: {p.stdout.readline().strip()}")
        sides.append(p)

    def round_on(i: int) -> list[float]:
        p = sides[i]
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write("r\n")
        p.stdin.flush()
        return [int(v) / 1000 for v in p.stdout.readline().split()]

    got: dict[tuple[int, int], list[list[float]]] = {(s, o): [] for s in (0, 1) for o in (0, 1)}
    for n in range(args.pairs):
        order = (0, 1) if n % 2 == 0 else (1, 0)
        for s in order:
            got[(s, n % 2)].append(round_on(s))
    for p in sides:
        assert p.stdin is not None
        p.stdin.write("q\n")
        p.stdin.flush()
        p.wait(30)

    def med(rows: list[list[float]], k: int) -> float:
        return statistics.median(r[k] for r in rows)

    print(
        f"{args.pairs} interleaved pairs, {args.case}, {args.size:,} bytes, {args.device} (medians, us)"
    )
    if args.case == "results":
        print("(parts: pickle = the worker's new array and its pickle; load = load, read, close)")
    print(f"{'':<22}" + "".join(f"{p:>10}" for p in PARTS))
    for o, label in ((0, "A first"), (1, "B first")):
        for s in (0, 1):
            cells = "".join(f"{med(got[(s, o)], k):>10.2f}" for k in range(len(PARTS)))
            print(f"{'AB'[s]} ({label})".ljust(22) + cells)
    for s in (0, 1):
        rows = got[(s, 0)] + got[(s, 1)]
        cells = "".join(f"{med(rows, k):>10.2f}" for k in range(len(PARTS)))
        print(f"{'AB'[s]} (all)".ljust(22) + cells)
    for o, label in ((0, "A first"), (1, "B first"), (None, "all")):
        orders = (0, 1) if o is None else (o,)
        pairs = [(a, b) for oo in orders for a, b in zip(got[(0, oo)], got[(1, oo)])]
        cells = "".join(
            f"{statistics.median(b[k] - a[k] for a, b in pairs):>+10.2f}" for k in range(len(PARTS))
        )
        print(f"B - A ({label})".ljust(22) + cells)
    # the second round of a pair runs slower here (each order's B - A has a sign of its own):
    # the mean of the two orders' medians cancels that, as swapping the trees cancels which
    # side process is A
    by_order = [
        [statistics.median(b[k] - a[k] for a, b in zip(got[(0, o)], got[(1, o)])) for o in (0, 1)]
        for k in range(len(PARTS))
    ]
    cells = "".join(f"{(d[0] + d[1]) / 2:>+10.2f}" for d in by_order)
    print("B - A (order-balanced)".ljust(22) + cells)


if __name__ == "__main__":
    if "--side" in sys.argv:
        keys = ("--size", "--case", "--device", "--burst")
        opt = {k: sys.argv[sys.argv.index(k) + 1] for k in keys}
        growable = "--growable" in sys.argv
        _side(int(opt["--size"]), opt["--case"], opt["--device"], growable, int(opt["--burst"]))
    else:
        main()
