"""Helpers shared by the CUDA test modules (nothing CUDA is imported until a Spin is made)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
"""The repository's root (where ``sharedarrays`` is importable from)."""


def child_env() -> dict[str, str]:
    """The environment for a fresh interpreter that must import sharedarrays from here."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


_SPIN_SOURCE = r"""
extern "C" __global__ void spin_fill(float* out, unsigned long long n, float value,
                                     long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += step) {
        out[i] = value;
    }
}
"""


class Spin:
    """A kernel that busy-waits about ``seconds`` and then fills a float32 array."""

    def __init__(self) -> None:
        import cupy

        self.kernel = cupy.RawKernel(_SPIN_SOURCE, "spin_fill")
        probe = cupy.zeros(1, dtype=cupy.float32)
        self._launch(probe, 0.0, 1000)  # compile and load
        cupy.cuda.Device().synchronize()
        cycles = 200_000_000
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        self._launch(probe, 1.0, cycles)
        stop.record()
        stop.synchronize()
        self.cycles_per_second = cycles / (cupy.cuda.get_elapsed_time(start, stop) / 1e3)

    def _launch(self, arr: Any, value: float, cycles: int) -> None:
        import cupy

        self.kernel(
            (128,),
            (256,),
            (arr, cupy.uint64(arr.size), cupy.float32(value), cupy.int64(cycles)),
        )

    def __call__(self, arr: Any, value: float, seconds: float) -> None:
        self._launch(arr, value, int(seconds * self.cycles_per_second))
