"""What CuPy's ``ndarray`` constructor costs per array over existing device memory, by the
way it is called (``CudaDevice.native_view`` makes one per ``.array``).

    python benchmarks/cupy_constructor.py

10,000 arrays of 4 KiB at consecutive offsets of one allocation, each way timed as a list
comprehension (median of 9); prints microseconds per array. Needs CuPy and a CUDA device.
"""

from __future__ import annotations

import statistics
import time

import cupy
import numpy as np

n = 10000
f4 = np.dtype("float32")
mem = cupy.cuda.alloc(4096 * n).mem
base = cupy.cuda.MemoryPointer(mem, 0)
offs = [i * 4096 for i in range(n)]
nd = cupy.ndarray
s4 = (4,)
sh = (1024,)
fs, fc = f4.str, f4.char
cases = {
    "A keywords + strides (before)": lambda: [
        nd(sh, dtype=f4, memptr=base + o, strides=s4) for o in offs
    ],
    "P1 pos dtype": lambda: [nd(sh, f4, base + o) for o in offs],
    "P2 pos dtype.str": lambda: [nd(sh, fs, base + o) for o in offs],
    "P3 pos dtype.char": lambda: [nd(sh, fc, base + o) for o in offs],
    "P4 pos dtype +strides": lambda: [nd(sh, f4, base + o, s4) for o in offs],
    "P5 pos str +strides": lambda: [nd(sh, fs, base + o, s4) for o in offs],
    "P6 kw dtype no strides": lambda: [nd(sh, dtype=f4, memptr=base + o) for o in offs],
}
for f in cases.values():
    f()
res = {}
for _ in range(9):
    for k, f in cases.items():
        t = time.perf_counter()
        x = f()
        res.setdefault(k, []).append(time.perf_counter() - t)
        del x
for k, v in res.items():
    print(f"{k:<26} {statistics.median(v) / n * 1e6:.2f} us per array")
