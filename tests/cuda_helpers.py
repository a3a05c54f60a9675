"""GPU test helpers shared by the CUDA test modules (imported only where CUDA is usable)."""

from __future__ import annotations

from typing import Any

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
