"""Which cuda-pool allocation sizes another process can import, on this machine.

    python3 benchmarks/probe_pool_import.py [SIZES_GIB ...]   # default 1 2 3 4 6 8

For each size the parent makes one ``sa.empty(..., backend="cuda-pool")`` array and a fresh
``spawn`` child loads it (``cuMemPoolImportFromShareableHandle`` +
``cuMemPoolImportPointer``) and reads its last element. A child that crashes (a negative exit
status is the signal, -11 a segmentation fault) or does not answer within 60 s marks the size
as failing.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import pickle
import sys
import time


def _child(blob: bytes, conn: object) -> None:
    faulthandler.enable()
    import sharedarrays as sa  # noqa: F401

    a = pickle.loads(blob)
    value = float(a.array[-1:].get()[0])
    conn.send(value)  # type: ignore[attr-defined]


def probe(gib: float) -> str:
    import sharedarrays as sa

    n = int(gib * (1 << 30)) // 4
    a = sa.empty(n, "float32", device="cuda:0", backend="cuda-pool", pack=False)
    a.array[-1:] = 7.0
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    p = ctx.Process(target=_child, args=(pickle.dumps(a), child_end))
    start = time.perf_counter()
    p.start()
    child_end.close()  # so that a crashed child is seen at once
    ok = parent.poll(60)
    try:
        answer = parent.recv() if ok else None
    except EOFError:
        answer = None
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join()
    a.close()
    took = time.perf_counter() - start
    if answer == 7.0:
        return f"ok ({took:.2f} s)"
    return f"FAILED: exit status {p.exitcode}, answer {answer!r} ({took:.2f} s)"


def main(argv: list[str]) -> int:
    sizes = [float(x) for x in argv] or [1, 2, 3, 4, 6, 8]
    for gib in sizes:
        print(f"cuda-pool {gib:g} GiB: {probe(gib)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
