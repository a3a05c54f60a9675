"""Cost of the driver calls on the warm handoff's path, one at a time, on a woken thread.

    python benchmarks/driver_calls.py [--rounds 201] [--device 0]

A warm handoff's exporter calls the driver from the Pool's task thread, which sleeps on a
queue between tasks. This times each call the way it runs there: a thread waits on a queue,
is woken, makes the call once (``time.perf_counter`` around it), and waits again; ``rounds``
times, median; then the same call in a tight loop (median of ``rounds`` calls). Calls:
``cuCtxGetCurrent``, ``cuStreamQuery`` (the legacy default stream, idle; after a kernel; a
created stream), ``cuEventRecord`` and ``cuEventQuery`` of an interprocess event, and CuPy's
own ``streamQuery`` for the binding's overhead. It changes no setting of the card.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=201)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()

    import cupy
    from cuda.bindings import driver as d

    cupy.cuda.Device(args.device).use()
    cupy.zeros(1)
    stream = cupy.cuda.Stream(non_blocking=True)
    flags = int(d.CUevent_flags.CU_EVENT_INTERPROCESS) | int(
        d.CUevent_flags.CU_EVENT_DISABLE_TIMING
    )
    ipc_event = d.cuEventCreate(flags)[1]
    plain_event = d.cuEventCreate(int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING))[1]
    x = cupy.zeros(1 << 10, dtype=cupy.float32)
    ctx = d.cuCtxGetCurrent()[1]

    def _kernel_then_query() -> Any:
        nonlocal x
        x += 1
        return d.cuStreamQuery(0)

    calls: dict[str, Callable[[], Any]] = {
        "cuCtxGetCurrent": lambda: d.cuCtxGetCurrent(),
        "cuStreamQuery(legacy, idle)": lambda: d.cuStreamQuery(0),
        "cuStreamQuery(created stream)": lambda: d.cuStreamQuery(stream.ptr),
        "cupy runtime.streamQuery(legacy)": lambda: cupy.cuda.runtime.streamQuery(0),
        "cuEventRecord(ipc, legacy)": lambda: d.cuEventRecord(ipc_event, 0),
        "cuEventQuery(ipc)": lambda: d.cuEventQuery(ipc_event),
        "cuEventRecord(plain, legacy)": lambda: d.cuEventRecord(plain_event, 0),
        "cuEventRecord(ipc, created stream)": lambda: d.cuEventRecord(ipc_event, stream.ptr),
        "x += 1 then cuStreamQuery(legacy)": _kernel_then_query,
    }
    print(f"driver calls, device {args.device}, {args.rounds} rounds, median us")
    print(f"{'call':<38}{'woken thread':>14}{'tight loop':>12}")
    for name, call in calls.items():
        woken: list[float] = []
        todo: queue.Queue[bool] = queue.Queue()
        done: queue.Queue[float] = queue.Queue()

        def worker(
            call: Callable[[], Any] = call,
            todo: queue.Queue[bool] = todo,
            done: queue.Queue[float] = done,
        ) -> None:
            d.cuCtxSetCurrent(ctx)
            while todo.get():
                t = time.perf_counter()
                call()
                done.put(time.perf_counter() - t)

        th = threading.Thread(target=worker)
        th.start()
        for _ in range(args.rounds):
            todo.put(True)
            woken.append(done.get())
            time.sleep(0.0002)
        todo.put(False)
        th.join()
        cupy.cuda.Device().synchronize()
        tight: list[float] = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            call()
            tight.append(time.perf_counter() - t)
        cupy.cuda.Device().synchronize()
        print(
            f"{name:<38}{statistics.median(woken) * 1e6:>14.1f}"
            f"{statistics.median(tight) * 1e6:>12.1f}"
        )


if __name__ == "__main__":
    main()
