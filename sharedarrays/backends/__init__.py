"""Memory systems, one module each, behind the :class:`~.base.Backend` protocol.

``get_backend(device)`` returns the process-wide backend object of a device; backends are
created on first use and live as long as the process.
"""

from __future__ import annotations

import threading

from ..device import Device
from ..errors import BackendUnavailable
from .base import Access, Backend, Chunk, round_up

__all__ = [
    "Access",
    "Backend",
    "Chunk",
    "round_up",
    "get_backend",
    "cuda_usable",
    "backends",
    "BACKEND_NAMES",
]

BACKEND_NAMES = ("host", "cuda-vmm")

_lock = threading.Lock()
_backends: dict[tuple[str, Device], Backend] = {}


def cuda_usable(index: int | None = None) -> str | None:
    """Say why CUDA cannot be used here, or return ``None`` when it can.

    Parameters
    ----------
    index : int, optional
        Also check that this device ordinal exists.
    """
    from . import cuda_vmm

    return cuda_vmm.why_unusable(index)


def backends() -> dict[str, str | None]:
    """Every memory system sharedarrays knows, and why each unusable one cannot be used here.

    Returns
    -------
    dict
        Backend name -> ``None`` when it can be used in this process, else the reason.

    Examples
    --------
    >>> sharedarrays.backends()  # doctest: +SKIP
    {'host': None, 'cuda-vmm': 'no NVIDIA driver: libcuda could not be loaded (...)'}
    """
    return {"host": None, "cuda-vmm": cuda_usable(0)}


def get_backend(device: Device, name: str | None = None) -> Backend:
    """Return the backend for ``device`` (the CUDA VMM backend for CUDA, host for cpu).

    Raises
    ------
    BackendUnavailable
        The backend cannot run in this process; the message says why.
    """
    if name is None:
        name = "cuda-vmm" if device.is_cuda else "host"
    key = (name, device)
    backend = _backends.get(key)
    if backend is not None:
        return backend
    with _lock:
        backend = _backends.get(key)
        if backend is None:
            if name == "host":
                if device.is_cuda:
                    raise BackendUnavailable("the host backend only serves device 'cpu'")
                from .host import HostBackend

                backend = HostBackend()
            elif name == "cuda-vmm":
                if not device.is_cuda:
                    raise BackendUnavailable("the cuda-vmm backend needs a CUDA device")
                from .cuda_vmm import CudaVmmBackend

                backend = CudaVmmBackend(device)
            else:
                raise BackendUnavailable(
                    f"unknown backend {name!r}; available names: {', '.join(BACKEND_NAMES)}"
                )
            _backends[key] = backend
    return backend
