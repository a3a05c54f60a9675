"""The CUDA memory-pool backend (``"cuda-pool"``): :class:`~..pool.PoolBackend` on CUDA's calls."""

from __future__ import annotations

from typing import ClassVar

from sharedarrays.backends.cuda.device import CudaDevice
from sharedarrays.backends.cuda.driver import why_unusable
from sharedarrays.backends.pool import PoolBackend
from sharedarrays.backends.registry import Registration, register
from sharedarrays.settings import env_number

MAX_BYTES = 4 << 30
"""Largest cuda-pool allocation (``SHAREDARRAYS_POOL_MAX_BYTES`` overrides it): importing
5.25 GiB or more segfaults in ``cuMemPoolImportPointer`` (driver 580, H200)."""


def max_bytes() -> int:
    """The largest cuda-pool allocation allowed here (:data:`MAX_BYTES`)."""
    return env_number("SHAREDARRAYS_POOL_MAX_BYTES", MAX_BYTES, 1)


def _too_large(size: int) -> str | None:
    limit = max_bytes()
    if size <= limit:
        return None
    return (
        f"a cuda-pool allocation of {size} bytes is larger than {limit} "
        "(SHAREDARRAYS_POOL_MAX_BYTES): importing pool allocations above about 5 GiB crashes "
        "the importing process inside cuMemPoolImportPointer (driver 580, H200). Use "
        "backend='cuda-vmm' or 'cuda-ipc' for large arrays"
    )


class CudaPoolBackend(PoolBackend, CudaDevice):
    """Stream-ordered memory of one CUDA device, shared through an exported pool; allocated
    on the current stream, at most :func:`max_bytes`."""

    name: ClassVar[str] = "cuda-pool"
    values_refused: ClassVar[str | None] = (
        "the driver refuses stream memory operations on pool memory imported by another "
        "process (cuStreamWaitValue64 answers CUDA_ERROR_INVALID_VALUE, seen on an H200 with "
        "driver 580). Put the counter in a cuda-vmm or cuda-ipc array: sa.zeros(1, 'uint64', "
        "backend='cuda-vmm')"
    )
    _too_large = staticmethod(_too_large)


register(Registration.of(CudaPoolBackend, "cuda", 2, lambda i: why_unusable(i, "cuda-pool")))
