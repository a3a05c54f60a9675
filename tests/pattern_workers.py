"""What the pattern matrix's worker processes run (importable by name; importing it
registers the ``host-pointer`` test backend in spawned children too)."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pointer_backend  # noqa: F401 - registers host-pointer

import sharedarrays as sa

N = 1 << 16
"""Elements of the arrays the patterns hand around (int64: 512 KiB, never packed)."""


def device_of(backend: str) -> str:
    """The device a memory system's arrays live on in these tests."""
    return "cuda:0" if backend.startswith("cuda") else "cpu"


def make(args: tuple[str, int]) -> sa.SharedDeviceArray:
    """A new array of ``N`` copies of ``value``, made in this (worker) process."""
    backend, value = args
    device = device_of(backend)
    return sa.full((N,), value, dtype="int64", device=device, backend=backend, pack=False)


def make_small(value: int) -> sa.SharedDeviceArray:
    """A new small (packed) array made in this process."""
    return sa.full(4, value, dtype="int64", device="cpu")


def write_and_view(a: sa.SharedDeviceArray) -> sa.SharedDeviceArray:
    """Write into the parent's array and return a view of it."""
    a.array[1:3] = 7
    return a[1:3]


def produce(out: Any, backend: str, value: int) -> None:
    """A Process that puts (Queue) or sends (Pipe connection) a new array, then exits."""
    a = make((backend, value))
    if hasattr(out, "put"):
        out.put(a)
    else:
        out.send(a)


def pass_on(a: sa.SharedDeviceArray, method: str, out: Any) -> None:
    """A process hands the parent's array, and one it made, on to a process of its own,
    which writes to both; it sends its own array back (and exits before it is read)."""
    b = make((a.backend, 0))
    p = mp.get_context(method).Process(target=write_both, args=(a, b))
    p.start()
    p.join(60)
    out.put((p.exitcode, b))


def write_both(a: sa.SharedDeviceArray, b: sa.SharedDeviceArray) -> None:
    a.array[0] = 42
    b.array[0] = 43
    a.allocation.backend.synchronize()  # (CUDA: the writes are done before this exits)


def first(a: sa.SharedDeviceArray) -> int:
    return int(np.asarray(a.get())[0])


class Unloadable:
    """A result that pickles in the worker and fails to load in the parent, as a result
    whose memory is gone does."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _gone, ()


def _gone() -> None:
    raise sa.HandleUnavailable("this result's memory is gone")


def unloadable(_: object = None) -> Unloadable:
    return Unloadable()


def stdlib_tries(kind: str, backend: str, tries: int) -> None:
    """Run ``tries`` fresh standard-library pools that return new arrays from workers, and
    print one JSON line per try (``ok``, or the error), then ``done``.

    ``pool``: ``multiprocessing.Pool`` under forkserver, ``imap_unordered`` then
    ``apply_async``; ``executor``: ``ProcessPoolExecutor`` under spawn, ``map``. (Run as a
    child script with a time limit, so that a hang is a failed try, not a hung test.)
    """
    import json
    import time
    from concurrent.futures import ProcessPoolExecutor

    tasks = [(backend, i) for i in range(8)]
    for t in range(tries):
        start = time.monotonic()
        try:
            if kind == "pool":
                with mp.get_context("forkserver").Pool(2) as pool:
                    got = list(pool.imap_unordered(make, tasks))
                    got.append(pool.apply_async(make, ((backend, 9),)).get(60))
                expected = [*range(8), 9]
            else:
                with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn")) as ex:
                    got = list(ex.map(make, tasks, timeout=60))
                expected = list(range(8))
            values = sorted(int(a.get()[0]) for a in got)
            ok = values == sorted(expected) and all(
                int(a.get()[-1]) == int(a.get()[0]) for a in got
            )
            outcome = "ok" if ok else f"wrong values {values}"
            for a in got:
                a.close()
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        print(
            json.dumps({"try": t, "outcome": outcome, "seconds": time.monotonic() - start}),
            flush=True,
        )
    print(json.dumps({"done": tries}), flush=True)


if __name__ == "__main__":
    import sys

    stdlib_tries(sys.argv[1], sys.argv[2], int(sys.argv[3]))
