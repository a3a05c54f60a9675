"""cProfile of the three handoff paths of the bench, in the parent and in a Pool worker.

    python benchmarks/profile_paths.py [--device cuda:0] [--count 10000] [--cold 200]
        [--warm 2000] [--top 22]

- **many**: ``count`` arrays of 4 KiB (packed, as the bench's ``many`` part) pickled in one
  message; the worker loads it, touches each ``.array`` and closes each (as ``task_many``):
  first (maps the slabs) and again (warm).
- **warm**: one 1 MiB array pickled ``warm`` times (one ``pickle.dumps`` each, as a Pool task
  does); the worker loads each message, touches ``.array`` and closes the view.
- **cold**: ``cold`` new 1 MiB arrays, one task each: the parent's first ``pickle.dumps`` of
  each, the worker's first load (which fetches the handles from this process's handle server)
  + ``.array`` + close.

Each part prints wall times and the top functions by own time and by cumulative time, for the
parent's pickling and the worker's loading separately. cProfile slows Python code more than
driver calls, so read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import pickle
import pstats
import time

_profile: cProfile.Profile | None = None


def _init(device: str) -> None:
    import sharedarrays  # noqa: F401

    if device.startswith("cuda"):
        import cupy

        cupy.zeros(1)


def _stats(profile: cProfile.Profile, top: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def _load_touch_close(blobs: list[bytes], profile: cProfile.Profile | None) -> float:
    t = time.perf_counter()
    if profile is not None:
        profile.enable()
    for blob in blobs:
        x = pickle.loads(blob)
        items = x if isinstance(x, list) else [x]
        natives = [a.array for a in items]
        del natives
        for a in items:
            a.close()
    if profile is not None:
        profile.disable()
    return time.perf_counter() - t


def task_profiled(blobs: list[bytes], top: int) -> tuple[float, str]:
    """Load each of ``blobs`` (touch, close) in a profiler: seconds and the profile's text."""
    profile = cProfile.Profile()
    seconds = _load_touch_close(blobs, profile)
    return seconds, _stats(profile, top)


def task_cumulative(blob: bytes) -> float:
    """One cold load in a profiler that lives across tasks (see :func:`task_report`)."""
    global _profile
    if _profile is None:
        _profile = cProfile.Profile()
    return _load_touch_close([blob], _profile)


def task_report(top: int) -> str:
    global _profile
    text = "" if _profile is None else _stats(_profile, top)
    _profile = None
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--cold", type=int, default=200)
    parser.add_argument("--warm", type=int, default=2000)
    parser.add_argument("--top", type=int, default=22)
    args = parser.parse_args()

    import sharedarrays as sa

    _init(args.device)
    with mp.get_context("spawn").Pool(1, initializer=_init, initargs=(args.device,)) as pool:
        pool.apply(_init, (args.device,))

        # many
        arrays = [sa.empty(1024, "float32", device=args.device) for _ in range(args.count)]
        profile = cProfile.Profile()
        t = time.perf_counter()
        profile.enable()
        blob = pickle.dumps(arrays)
        profile.disable()
        dumps = time.perf_counter() - t
        again = pickle.dumps(arrays)
        first, text = pool.apply(task_profiled, ([blob], args.top))
        second, text2 = pool.apply(task_profiled, ([again], args.top))
        print(f"== many: {args.count} x 4 KiB, message {len(blob):,} bytes")
        print(f"parent pickle.dumps {dumps * 1e3:.1f} ms (profiled)")
        print(
            f"worker load + .array + close: first {first * 1e3:.1f} ms, again "
            f"{second * 1e3:.1f} ms (profiled)"
        )
        print("-- parent pickle.dumps\n" + _stats(profile, args.top))
        print("-- worker, first load\n" + text)
        print("-- worker, again (warm)\n" + text2)
        del arrays

        # warm
        a = sa.empty(1 << 18, "float32", device=args.device)
        pool.apply(task_cumulative, (pickle.dumps(a),))
        pool.apply(task_report, (args.top,))
        profile = cProfile.Profile()
        blobs = []
        t = time.perf_counter()
        profile.enable()
        for _ in range(args.warm):
            blobs.append(pickle.dumps(a))
        profile.disable()
        dumps = time.perf_counter() - t
        first, text = pool.apply(task_profiled, (blobs, args.top))
        print(f"== warm: {args.warm} messages of one 1 MiB array")
        print(f"parent pickle.dumps {dumps / args.warm * 1e6:.1f} us each (profiled)")
        print(f"worker load + .array + close {first / args.warm * 1e6:.1f} us each (profiled)")
        print("-- parent pickle.dumps\n" + _stats(profile, args.top))
        print("-- worker\n" + text)

        # cold
        profile = cProfile.Profile()
        walls = []
        dumps = 0.0
        for _ in range(args.cold):
            b = sa.empty(1 << 18, "float32", device=args.device)
            t = time.perf_counter()
            profile.enable()
            blob = pickle.dumps(b)
            profile.disable()
            dumps += time.perf_counter() - t
            walls.append(pool.apply(task_cumulative, (blob,)))
            b.close()
        text = pool.apply(task_report, (args.top,))
        walls.sort()
        print(f"== cold: {args.cold} new 1 MiB arrays, one task each")
        print(f"parent first pickle.dumps {dumps / args.cold * 1e6:.1f} us each (profiled)")
        print(
            f"worker first load + .array + close: median {walls[len(walls) // 2] * 1e6:.1f} us "
            f"(profiled)"
        )
        print("-- parent pickle.dumps\n" + _stats(profile, args.top))
        print("-- worker\n" + text)


if __name__ == "__main__":
    main()
