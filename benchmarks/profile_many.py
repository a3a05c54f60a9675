"""Where the time of a warm load of many small arrays goes in a worker (issue 16's open question).

    python benchmarks/profile_many.py [--device cuda:0] [--count 10000] [--no-gc]

The parent makes ``count`` arrays of 4 KiB (packed), pickles the list twice, and a fresh
interpreter loads both messages: the first load maps the allocations (cold), the second finds
them mapped (warm). It prints the two times, the time of each ``pickle.dumps`` in the parent,
and the top functions of a cProfile of the first load. Run it with ``PYTHONPATH`` pointing at
two versions of the package to compare them.
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import time

CHILD = r"""
import cProfile, gc, io, pickle, pstats, sys, time
import sharedarrays as sa
if sys.argv[1].startswith("cuda"):
    import cupy
    cupy.zeros(1)
if sys.argv[2] == "no-gc":
    gc.disable()
data = sys.stdin.buffer.read()
n = int.from_bytes(data[:8], "little")
first, second = data[8 : 8 + n], data[8 + n :]
profile = cProfile.Profile()
t = time.perf_counter(); profile.enable(); x = pickle.loads(first); profile.disable()
t1 = time.perf_counter() - t
t = time.perf_counter(); y = pickle.loads(second); t2 = time.perf_counter() - t
print(f"first load {t1 * 1e3:.1f} ms (profiled), second (warm) {t2 * 1e3:.1f} ms")
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(16)
print(out.getvalue())
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--no-gc", action="store_true", help="the loading process disables gc")
    args = parser.parse_args()

    import sharedarrays as sa

    arrays = [sa.empty(1024, "float32", device=args.device, pack=True) for _ in range(args.count)]
    t = time.perf_counter()
    first = pickle.dumps(arrays)
    d1 = time.perf_counter() - t
    t = time.perf_counter()
    second = pickle.dumps(arrays)
    d2 = time.perf_counter() - t
    print(f"dumps {d1 * 1e3:.1f} ms, then {d2 * 1e3:.1f} ms")
    mode = "no-gc" if args.no_gc else "gc"
    blob = len(first).to_bytes(8, "little") + first + second
    r = subprocess.run(
        [sys.executable, "-c", CHILD, args.device, mode],
        input=blob,
        capture_output=True,
        timeout=600,
    )
    print(r.stdout.decode(), r.stderr.decode()[-2000:])
    return r.returncode


if __name__ == "__main__":
    sys.exit(main())
