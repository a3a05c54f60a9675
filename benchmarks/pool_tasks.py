"""Tiny-task throughput of sa.Pool against multiprocessing.Pool (spawn, 2 workers):
apply_async of N trivial tasks, and map of N items with chunksize 1; best of 3.

Usage: python benchmarks/pool_tasks.py TREE (a checkout whose sharedarrays is measured; run
it alternately for two trees to compare them)."""

import multiprocessing as mp
import sys
import time
from operator import abs as task

sys.path.insert(0, sys.argv[1])
import sharedarrays as sa

assert sa.__file__.startswith(sys.argv[1]), sa.__file__


def run(pool, n):
    best_apply = best_map = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        [r.get() for r in [pool.apply_async(task, (-i,)) for i in range(n)]]
        best_apply = min(best_apply, time.perf_counter() - t)
        t = time.perf_counter()
        pool.map(task, range(n), chunksize=1)
        best_map = min(best_map, time.perf_counter() - t)
    return n / best_apply, n / best_map


if __name__ == "__main__":
    n = 3000
    with mp.get_context("spawn").Pool(2) as p:
        p.map(task, range(10))
        std = run(p, n)
    with sa.Pool(2) as p:
        p.map(task, range(10))
        mine = run(p, n)
    print(
        f"{sys.argv[1]}: multiprocessing.Pool apply {std[0]:,.0f}/s map {std[1]:,.0f}/s; "
        f"sa.Pool apply {mine[0]:,.0f}/s map {mine[1]:,.0f}/s; ratio {mine[0] / std[0]:.2f} / {mine[1] / std[1]:.2f}"
    )
