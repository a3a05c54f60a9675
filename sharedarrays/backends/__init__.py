"""Memory systems behind the :class:`~.base.Backend` protocol, one module or folder each,
registered when imported here (none loads a driver until used)."""

from __future__ import annotations

from sharedarrays.backends import host as _host  # noqa: F401 - registers "host"
from sharedarrays.backends import registry as _registry
from sharedarrays.backends.base import (
    Access,
    Backend,
    BorrowingBackend,
    Chunk,
    MappingBackend,
    NativeView,
    StreamBackend,
    round_up,
)
from sharedarrays.backends.cuda import device as _cuda  # noqa: F401 - registers "cuda-vmm"
from sharedarrays.backends.cuda import ipc as _cuda_ipc  # noqa: F401 - registers "cuda-ipc"
from sharedarrays.backends.cuda import pool as _cuda_pool  # noqa: F401 - registers "cuda-pool"
from sharedarrays.backends.hip import device as _hip  # noqa: F401 - registers "hip-*"
from sharedarrays.backends.registry import *  # noqa: F403

__all__ = [
    "Access",
    "Backend",
    "BorrowingBackend",
    "Chunk",
    "MappingBackend",
    "NativeView",
    "StreamBackend",
    "round_up",
    *_registry.__all__,
]

# after the GPUs: auto and sa.list_backends() take device kinds in registration order
from sharedarrays.backends.ascend import vmm as _ascend  # noqa: F401 - registers "ascend"
