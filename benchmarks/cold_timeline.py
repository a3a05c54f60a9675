"""One cold handoff as a time line: when each step starts and ends, in both processes.

    python benchmarks/cold_timeline.py [--device cpu|cuda:0] [--size 1M] [--handoffs 300]

A new array is handed to a one-worker spawn Pool (``Pool.apply`` of the bench's own
``task_sharedarrays``: ``.array``, then ``close``) ``--handoffs`` times, each followed by
its close and the worker's drop of its parked mapping (not timed). A few of the library's
functions on the cold path are wrapped to note the time on entry and exit
(``time.perf_counter``, the one monotonic clock of the machine, so that the parent's, its
handle server thread's and the worker's notes fall on one line): in the parent the message
part (the first pickling of the allocation) and the handle server's answer
(``HandleServer._request``, with ``_send_handles`` and ``send_fds`` inside it); in the
worker the part's import, the load, the handle request (and, within it, when the reply is
readable and when it is received), the mapping and the task. Printed: the median time of
each note after the parent's call, over the handoffs whose notes came in the usual order
(the first 20 left out), and the step since the note before.

What ``cold_trace.py`` (the sum of each function's time) does not show, this does: the
waits between the processes (a thread or a process woken) and the steps that no function
of the library holds.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import select
import statistics
import time
from typing import Any

import sharedarrays as sa
from sharedarrays.bench import worker as bench_worker
from sharedarrays.bench.sizes import parse_size

_notes: list[tuple[str, float]] = []


def _note(label: str) -> None:
    _notes.append((label, time.perf_counter()))


def _wrap(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def noted(*args: Any, **kwargs: Any) -> Any:
        _note(f"{label} >")
        try:
            return fn(*args, **kwargs)
        finally:
            _note(f"{label} <")

    setattr(owner, name, noted)


def _wrap_parent() -> None:
    from sharedarrays.api import message
    from sharedarrays.transport import server

    _wrap(message, "message_part", "parent message_part")
    _wrap(server.HandleServer, "_request", "server _request")
    _wrap(server.HandleServer, "_send_handles", "server _send_handles")
    _wrap(server, "send_fds", "server send_fds")


def _wrap_worker() -> None:
    from sharedarrays import importing
    from sharedarrays.api import message
    from sharedarrays.transport import client

    _wrap(message, "import_part", "worker import_part")
    _wrap(importing, "load_payload", "worker load_payload")
    _wrap(client, "fetch_handles", "worker fetch_handles")
    _wrap(importing, "_map", "worker _map")
    receive = client.recv_into

    def recv_into(sock: Any, *args: Any) -> Any:
        select.select([sock], [], [], 10.0)
        _note("worker reply readable")
        got = receive(sock, *args)
        _note("worker reply received")
        return got

    client.recv_into = recv_into


def task(a: Any, read: bool) -> float:
    _note("worker task >")
    value = bench_worker.task_sharedarrays(a, read)
    _note("worker task <")
    return value


def take_notes(_: object) -> list[tuple[str, float]]:
    got = list(_notes)
    _notes.clear()
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="1M")
    ap.add_argument("--handoffs", type=int, default=300)
    args = ap.parse_args()
    size = parse_size(args.size)
    _wrap_parent()
    ctx = mp.get_context("spawn")
    lines = []
    with ctx.Pool(1, initializer=_wrap_worker) as pool:
        pool.apply(bench_worker.task_drop, (0.1,))
        for _ in range(args.handoffs):
            a = sa.empty(size // 4, "float32", device=args.device)
            if args.device == "cpu":
                a.array[...] = 1
            _notes.clear()
            pool.apply(take_notes, (None,))
            _note("parent apply >")
            pool.apply(task, (a, False))
            _note("parent apply <")
            notes = sorted(_notes + pool.apply(take_notes, (None,)), key=lambda n: n[1])
            a.close()
            pool.apply(bench_worker.task_drop, (0.0,))
            start = notes[0][1]
            lines.append([(label, (t - start) * 1e6) for label, t in notes])
    usual = [label for label, _ in lines[-1]]
    kept = [line for line in lines[20:] if [label for label, _ in line] == usual]
    print(
        f"cold handoff of {args.size} on {args.device}: {len(kept)} of {len(lines) - 20} "
        "handoffs in the usual order; median us after the parent's call (step since the note "
        "before)"
    )
    before = 0.0
    for i, label in enumerate(usual):
        at = statistics.median(line[i][1] for line in kept)
        print(f"  {label:<28} {at:8.1f}  (+{at - before:6.1f})")
        before = at


if __name__ == "__main__":
    main()
