"""Memory systems, one module (or folder) each, behind the :class:`~.base.Backend` protocol.

Each backend module declares itself with one :func:`~.registry.register` call; importing this
package imports the built-in ones (``host``, ``cuda/vmm``, ``cuda/ipc``, ``cuda/pool``,
``hip/vmm``, ``hip/pool`` and ``ascend/vmm``, which load no driver until used). A new memory
system is one module and one line in the import list below; a GPU vendor's VMM or pool IPC is
a table of its driver calls for :class:`~.vmm.VmmBackend` or :class:`~.pool.PoolBackend`,
which are written once for every vendor. ``get_backend(device)`` returns the
process-wide backend object of a device; backends are created on first use and live as long
as the process.
"""

from __future__ import annotations

from sharedarrays.backends import host as _host  # noqa: F401 - registers "host"
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
from sharedarrays.backends.cuda import ipc as _cuda_ipc  # noqa: F401 - registers "cuda-ipc"
from sharedarrays.backends.cuda import pool as _cuda_pool  # noqa: F401 - registers "cuda-pool"
from sharedarrays.backends.cuda import vmm as _cuda_vmm  # noqa: F401 - registers "cuda-vmm"
from sharedarrays.backends.hip import pool as _hip_pool  # noqa: F401 - registers "hip-pool"
from sharedarrays.backends.hip import vmm as _hip_vmm  # noqa: F401 - registers "hip-vmm"
from sharedarrays.backends.registry import (
    Registration,
    choose_backend,
    device_of,
    get_backend,
    handle_check,
    kind_unusable,
    list_backends,
    names,
    register,
    registration,
    registrations,
    why_unusable,
)

__all__ = [
    "Access",
    "Backend",
    "BorrowingBackend",
    "Chunk",
    "MappingBackend",
    "NativeView",
    "StreamBackend",
    "round_up",
    "Registration",
    "register",
    "registration",
    "registrations",
    "names",
    "device_of",
    "why_unusable",
    "kind_unusable",
    "handle_check",
    "choose_backend",
    "get_backend",
    "list_backends",
]

# after the GPUs: auto and sa.list_backends() take device kinds in registration order
from sharedarrays.backends.ascend import vmm as _ascend  # noqa: F401 - registers "ascend"
