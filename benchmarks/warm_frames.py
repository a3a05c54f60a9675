"""The Python frames and C calls of one warm handoff, in each process.

    python benchmarks/warm_frames.py [--device cpu|cuda:0] [--list]

In a handoff every step runs cold (a process or thread woken from a pipe or a queue), and
each Python call costs 1-2 us there on the H200, against well under 1 us in a loop
(docs/performance.md): what a warm handoff costs follows how many calls it makes. This
counts them with ``sys.setprofile``: the parent's ``ForkingPickler`` dump of a 1 MiB array
it already pickled before (a warm message), and a spawned process's ``pickle.loads`` of that
message, ``.array`` and ``close()``, after it loaded the same message a few times (so its
mapping is warm). ``--list`` prints every call in order.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import pickle
import sys
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any


def _dumps(obj: object) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf, 5).dump(obj)
    return buf.getvalue()


def calls_of(fn: Callable[[], object]) -> list[str]:
    """Every Python frame (``file:function``) and C call (``  C name``) ``fn()`` makes."""
    calls: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            calls.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")
        elif event == "c_call":
            calls.append(f"  C {getattr(arg, '__qualname__', arg)}")

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[:-1]  # (the last is sys.setprofile itself)


def _worker(blob: bytes, device: str, out: Any) -> None:
    if device.startswith("cuda"):
        import cupy

        cupy.zeros(1)

    def handoff() -> None:
        x = pickle.loads(blob)
        x.array  # noqa: B018 - the native array is what the handoff is for
        x.close()

    for _ in range(5):
        handoff()
    out.put(calls_of(handoff)[1:])  # (not handoff's own frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--list", action="store_true", help="print every call in order")
    args = parser.parse_args()

    import sharedarrays as sa

    a = sa.empty(1 << 20, dtype="uint8", device=args.device)
    for _ in range(3):
        _dumps(a)
    parent = calls_of(lambda: _dumps(a))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_worker, args=(_dumps(a), args.device, queue))
    child.start()
    worker = queue.get(timeout=120)
    child.join(30)
    a.close()
    for side, calls in (("parent (dump)", parent), ("worker (load, .array, close)", worker)):
        frames = [c for c in calls if not c.startswith("  C ")]
        print(f"{side}: {len(frames)} Python frames, {len(calls) - len(frames)} C calls")
        if args.list:
            print("\n".join(f"  {c}" for c in calls))


if __name__ == "__main__":
    main()
