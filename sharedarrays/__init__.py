"""sharedarrays: share GPU (and host) arrays between processes without copying. Make one with
:func:`empty`, :func:`from_array` and the like (or :func:`share` a CuPy array or torch tensor)
and pickle it to other processes: every process maps the same memory."""

from __future__ import annotations

import importlib as _importlib
import sys as _sys
import typing as _typing
from types import MappingProxyType as _MappingProxyType

from sharedarrays.api import clients as _clients
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
    share,
    zeros,
    zeros_like,
)
from sharedarrays.api.named import NamedArray, attach, list_named, unlink
from sharedarrays.backends import list_backends
from sharedarrays.backends.cuda import driver as _cuda_driver  # noqa: F401 - installs the fork-after-CUDA hook
from sharedarrays.backends.device import Device
from sharedarrays.errors import *  # noqa: F403 - every error is an attribute, few in __all__
from sharedarrays.errors import (
    BackendUnavailable,
    NameNotFound,
    OutOfMemory,
    SharedArrayError,
    WorkerLost,
)
from sharedarrays.errors import DriverError as DriverError
from sharedarrays.process import STATE as _STATE
from sharedarrays.settings import check_environment as _check_environment

# imported on first use (__getattr__); type checkers and IDEs see them here
if _typing.TYPE_CHECKING:
    from sharedarrays.api.dask import from_dask, to_dask
    from sharedarrays.api.nodemap import node_map
    from sharedarrays.api.pool import ExecutorBroken as ExecutorBroken
    from sharedarrays.api.pool import ForkAfterCudaError as ForkAfterCudaError
    from sharedarrays.api.pool import Pool, ProcessPoolExecutor
    from sharedarrays.api.semaphore import ExternalSemaphore, Timeline
    from sharedarrays.api.widgets import MemoryMap, show
    from sharedarrays.backends.cuda.sync import no_sync
    from sharedarrays.memory import Allocation as Allocation
    from sharedarrays.memory import live_allocations as live_allocations

__version__ = "0.1.0"

# creating and sharing arrays
__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "full_like"]
__all__ += ["from_array", "asarray", "share"]
__all__ += ["SharedDeviceArray", "load", "synchronize", "no_sync"]  # the array
__all__ += ["attach", "list_named", "unlink", "NamedArray"]  # named arrays
__all__ += ["Pool", "ProcessPoolExecutor"]  # processes
__all__ += ["show", "MemoryMap", "node_map"]  # seeing memory
__all__ += ["Device", "list_backends"]  # devices and memory systems
__all__ += ["to_dask", "from_dask", "Timeline", "ExternalSemaphore"]  # Dask, ordering
# errors (the others: sharedarrays.errors, and attributes of the package)
__all__ += ["SharedArrayError", "BackendUnavailable", "OutOfMemory", "NameNotFound", "WorkerLost"]

_LAZY = _MappingProxyType(
    {
        name: f"sharedarrays.{module}"
        for module, names in {
            "api.pool": ("Pool", "ProcessPoolExecutor", "ExecutorBroken", "ForkAfterCudaError"),
            "api.widgets": ("show", "MemoryMap"),
            "api.nodemap": ("node_map",),
            "api.dask": ("to_dask", "from_dask"),
            "api.semaphore": ("Timeline", "ExternalSemaphore"),
            "backends.cuda.sync": ("no_sync",),
            "memory": ("Allocation", "live_allocations"),  # internals, kept as attributes
        }.items()
        for name in names
    }
)
"""Names imported on first use: ``{name: the module that defines it}``."""


if not _typing.TYPE_CHECKING:  # (type checkers see the names above, and no catch-all for others)

    def __getattr__(name: str) -> _typing.Any:
        """A name of :data:`_LAZY`: imported from its module, then kept here (PEP 562)."""
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(_importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_DISTRIBUTED = "distributed.protocol.serialize"


def _register_with_distributed() -> None:
    from sharedarrays.api import dask

    dask.register()


# Dask: register with distributed now if imported, else when a view is first pickled after
if _DISTRIBUTED in _sys.modules:
    _register_with_distributed()
else:
    _STATE.pickling.reduce_hooks.setdefault(_DISTRIBUTED, _register_with_distributed)
_clients.install()  # registers with torch's default_collate once it is imported (no torch)

_check_environment()  # (a bad SHAREDARRAYS_* number: ValueError here, not where it is read)
