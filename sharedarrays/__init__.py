"""sharedarrays: share GPU (and host) arrays between processes without copying.

Create an array with :func:`empty`, :func:`zeros`, :func:`ones`, :func:`full`, their
``*_like`` forms, :func:`from_array` or :func:`asarray` (or share a CuPy array or torch
tensor in place with :func:`share`); pass it to other processes by
pickling it (multiprocessing does that for you). Every process maps the same memory.
"""

from __future__ import annotations

from sharedarrays.api import clients as _clients
from sharedarrays.api import dask as _dask
from sharedarrays.api.array import SharedDeviceArray, load, synchronize
from sharedarrays.api.creation import (
    asarray,
    empty,
    empty_like,
    from_array,
    full,
    full_like,
    ones,
    ones_like,
    zeros,
    zeros_like,
)
from sharedarrays.api.daskarray import from_dask, to_dask
from sharedarrays.api.named import NamedArray, attach, list_named, unlink
from sharedarrays.api.nodemap import node_map
from sharedarrays.api.pool import ExecutorBroken, ForkAfterCudaError, Pool, ProcessPoolExecutor
from sharedarrays.api.semaphore import ExternalSemaphore, Timeline
from sharedarrays.api.sharing import share
from sharedarrays.api.widgets import MemoryMap, show
from sharedarrays.backends import list_backends
from sharedarrays.backends.cuda import driver as _cuda_driver  # noqa: F401 - installs the fork-after-CUDA hook
from sharedarrays.backends.cuda.sync import no_sync
from sharedarrays.backends.device import Device
from sharedarrays.errors import (
    BackendUnavailable,
    ClosedArrayError,
    DriverError,
    HandleUnavailable,
    InUse,
    KeeperError,
    MisalignedView,
    NameExists,
    NameNotFound,
    NotShareable,
    OutOfMemory,
    PayloadError,
    PeerAccessUnavailable,
    PermissionDenied,
    ResizeRefused,
    SharedArrayError,
    TaskExited,
    TaskNotLoaded,
    ThreadUnavailable,
    WaitTimeout,
    WorkerLost,
    WrongNode,
)
from sharedarrays.memory import Allocation, live_allocations
from sharedarrays.settings import check_environment as _check_environment

__version__ = "0.1.0"

__all__ = [
    "Allocation",
    "BackendUnavailable",
    "ClosedArrayError",
    "DriverError",
    "Device",
    "ExternalSemaphore",
    "HandleUnavailable",
    "InUse",
    "KeeperError",
    "MisalignedView",
    "NameExists",
    "NameNotFound",
    "NamedArray",
    "NotShareable",
    "OutOfMemory",
    "TaskExited",
    "TaskNotLoaded",
    "ThreadUnavailable",
    "WaitTimeout",
    "WorkerLost",
    "WrongNode",
    "PayloadError",
    "PeerAccessUnavailable",
    "PermissionDenied",
    "ResizeRefused",
    "SharedArrayError",
    "SharedDeviceArray",
    "Timeline",
    "asarray",
    "attach",
    "list_backends",
    "empty",
    "empty_like",
    "from_array",
    "from_dask",
    "to_dask",
    "full",
    "full_like",
    "list_named",
    "node_map",
    "live_allocations",
    "load",
    "no_sync",
    "MemoryMap",
    "Pool",
    "ForkAfterCudaError",
    "ExecutorBroken",
    "ProcessPoolExecutor",
    "share",
    "show",
    "ones",
    "ones_like",
    "synchronize",
    "unlink",
    "zeros",
    "zeros_like",
]

_dask.install()  # registers with distributed once it is imported (imports no dask)
_clients.install()  # registers with torch's default_collate once it is imported (no torch)

_check_environment()  # (a bad SHAREDARRAYS_* number: ValueError here, not where it is read)
