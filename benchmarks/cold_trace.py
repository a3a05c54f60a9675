"""Where a cold handoff's time goes, function by function, in both processes.

    python benchmarks/cold_trace.py [--device cpu|cuda:0] [--sizes 1M,1G] [--pairs 41]

A cold handoff (a new array, pickled to a one-worker spawn Pool whose worker has never
mapped it) is timed against an empty task, alternately, as ``profile_cold.py`` does (the
teardown of each array waited for). The library's functions on the cold path are wrapped
to add up their wall time (``warm_split.py``'s tracer: a few us of overhead per call), in
the worker (the load: decode, the handle request, the mapping, the view, ``.array``) and in
the parent (the first pickling, and the handle server's answer in its thread). Printed:
the medians per cold handoff, in microseconds, of each function (nested functions are
inside their callers' figures), and of the handoff over the empty task.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from warm_split import _taken, _trace

import sharedarrays as sa
from sharedarrays.bench.sizes import parse_size, size_label
from sharedarrays.transport import notices

WORKER = (
    "sharedarrays.api.array:_rebuild_view",
    "sharedarrays.api.message:import_part",
    "sharedarrays.protocol.payload:Payload.from_bytes",
    "sharedarrays.api.message:ReceivedPart.find",
    "sharedarrays.importing:load_payload",
    "sharedarrays.importing:_mapped",
    "sharedarrays.importing:_check_node",
    "sharedarrays.importing:resolve",
    "sharedarrays.importing:from_exporter",
    "sharedarrays.transport.client:fetch_handles",
    "sharedarrays.transport.client:_fetch",
    "sharedarrays.transport.client:_connect",
    "sharedarrays.transport.handles:server_address",
    "sharedarrays.importing:_map",
    "sharedarrays.memory.allocation:Allocation.import_",
    "sharedarrays.memory.allocation:Allocation._build",
    "sharedarrays.backends.cuda.vmm:CudaVmmBackend.import_chunk",
    "sharedarrays.backends.cuda.vmm:CudaVmmBackend.reserve",
    "sharedarrays.backends.cuda.vmm:CudaVmmBackend.map",
    "sharedarrays.backends.cuda.vmm:CudaVmmBackend.set_access",
    "sharedarrays.backends.host:HostBackend.import_chunk",
    "sharedarrays.backends.host:HostBackend.reserve",
    "sharedarrays.backends.host:HostBackend.map",
    "sharedarrays.api.message:ReceivedPart.lease",
    "sharedarrays.api.array:SharedDeviceArray.array",
    "sharedarrays.memory.allocation:Allocation.native_base",
    "sharedarrays.backends.cuda.device:CudaDevice.native_memory",
    "sharedarrays.backends.host:HostBackend.native_memory",
    "sharedarrays.memory.allocation:Allocation.native_view",
    "sharedarrays.api.array:SharedDeviceArray.close",
    "sharedarrays.memory.allocation:Allocation._unlease",
)
PARENT = (
    "sharedarrays.api.message:message_part",
    "sharedarrays.api.message:allocation_bytes",
    "sharedarrays.api.message:allocation_payload",
    "sharedarrays.protocol.payload:Payload.to_bytes",
    "sharedarrays.transport.handles:server_address",
    "sharedarrays.backends.cuda.device:CudaDevice.export_fence",
    "sharedarrays.api.message:MessagePart.__reduce__",
    "sharedarrays.transport.server:HandleServer._request",
    "sharedarrays.transport.server:HandleServer._send_handles",
)


def init(device: str) -> None:
    _trace(WORKER)
    if device.startswith("cuda"):
        import cupy

        cupy.cuda.Device(int(device.split(":")[1])).use()
        float(cupy.arange(4, dtype=cupy.float32).sum())


def noop(_: object) -> dict[str, tuple[float, int]]:
    return _taken()


def touch_close(a: Any) -> dict[str, tuple[float, int]]:
    x = a.array
    del x
    a.close()
    return _taken()


def settle(_: object = None) -> int:
    deadline = time.monotonic() + 5
    while notices.pending_notices() and time.monotonic() < deadline:
        time.sleep(0.0002)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", default="1M,1G")
    parser.add_argument("--pairs", type=int, default=41)
    args = parser.parse_args()
    device = args.device
    _trace(PARENT)
    ctx = mp.get_context("spawn")
    with ctx.Pool(1, initializer=init, initargs=(device,)) as pool:
        pool.apply(noop, (0,))
        for label in args.sizes.split(","):
            size = parse_size(label)
            rounds: list[dict[str, float]] = []
            for i in range(args.pairs + 3):
                a = sa.empty(size // 4, "float32", device=device, pack=False)
                _taken()
                t0 = time.perf_counter()
                pool.apply(noop, (1,))
                t1 = time.perf_counter()
                worker = pool.apply(touch_close, (a,))
                t2 = time.perf_counter()
                parent = _taken()
                a.close()
                pool.apply(settle)
                settle()
                time.sleep(0.002)
                if i < 3:  # (lead-in)
                    continue
                row = {"handoff - empty task": (t2 - t1 - (t1 - t0)) * 1e6}
                row.update({f"worker {k}": v[0] * 1e6 for k, v in worker.items()})
                row.update({f"parent {k}": v[0] * 1e6 for k, v in parent.items()})
                rounds.append(row)
            names = sorted({k for r in rounds for k in r}, key=lambda k: (k.split()[0], k))
            print(f"\n{size_label(size)} ({len(rounds)} pairs), median us per cold handoff")
            for name in ["handoff - empty task", *[n for n in names if n[0] != "h"]]:
                values = [r.get(name, 0.0) for r in rounds]
                print(f"  {name:62s} {statistics.median(values):9.1f}")


if __name__ == "__main__":
    main()
