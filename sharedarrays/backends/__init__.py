"""Memory systems, one module each, behind the :class:`~.base.Backend` protocol.

``get_backend(device)`` returns the process-wide backend object of a device; backends are
created on first use and live as long as the process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sharedarrays.backends.base import Access, Backend, Chunk, MappingBackend, round_up
from sharedarrays.backends.device import Device, parse_device
from sharedarrays.errors import BackendUnavailable

__all__ = [
    "Access",
    "Backend",
    "Chunk",
    "MappingBackend",
    "round_up",
    "get_backend",
    "choose_backend",
    "factories",
    "cuda_usable",
    "current_cuda_device",
    "backends",
    "BACKEND_NAMES",
]

BACKEND_NAMES = ("host", "cuda-vmm", "cuda-ipc", "cuda-pool")
"""Every memory system sharedarrays knows."""

_lock = threading.Lock()
_backends: dict[tuple[str, Device], Backend] = {}


def _make_host(device: Device) -> Backend:
    if device.is_cuda:
        raise BackendUnavailable(
            f"the host backend only serves device 'cpu', not {device}; for a CUDA device use "
            "backend='auto', 'cuda-vmm', 'cuda-ipc' or 'cuda-pool'"
        )
    from sharedarrays.backends.host import HostBackend

    return HostBackend()


def _make_cuda(name: str) -> Callable[[Device], Backend]:
    def make(device: Device) -> Backend:
        if not device.is_cuda:
            why = cuda_usable(0, name)
            because = f", and CUDA cannot be used here: {why}" if why else ""
            raise BackendUnavailable(
                f"the {name} backend needs a CUDA device (device='cuda:N'), not {device}{because}"
            )
        if name == "cuda-vmm":
            from sharedarrays.backends.cuda.vmm import CudaVmmBackend

            return CudaVmmBackend(device)
        if name == "cuda-ipc":
            from sharedarrays.backends.cuda.ipc import CudaIpcBackend

            return CudaIpcBackend(device)
        from sharedarrays.backends.cuda.pool import CudaPoolBackend

        return CudaPoolBackend(device)

    return make


factories: dict[str, Callable[[Device], Backend]] = {
    "host": _make_host,
    "cuda-vmm": _make_cuda("cuda-vmm"),
    "cuda-ipc": _make_cuda("cuda-ipc"),
    "cuda-pool": _make_cuda("cuda-pool"),
}
"""Backend name -> constructor for a device (tests may add a backend here)."""


def cuda_usable(index: int | None = None, backend: str = "any") -> str | None:
    """Say why CUDA cannot be used here, or return ``None`` when it can.

    Parameters
    ----------
    index : int, optional
        Also check that this device ordinal exists.
    backend : str
        ``"cuda-vmm"``, ``"cuda-ipc"`` or ``"cuda-pool"``; ``"any"`` (default): whether at
        least one of them can (the reason given is cuda-vmm's otherwise).
    """
    from sharedarrays.backends.cuda import driver as cuda_driver

    if backend != "any":
        return cuda_driver.why_unusable(index, backend)
    reasons = [cuda_driver.why_unusable(index, name) for name in cuda_driver.CUDA_BACKENDS]
    return None if None in reasons else reasons[0]


def current_cuda_device(default: int) -> int:
    """The CUDA device this process works on (CuPy's or PyTorch's current one), else
    ``default``; see :func:`~sharedarrays.backends.cuda.driver.current_device_index`."""
    from sharedarrays.backends.cuda import driver as cuda_driver

    return cuda_driver.current_device_index(default)


def backends(device: str | int | Device | None = None) -> dict[str, str | None]:
    """Every memory system sharedarrays knows, and why each unusable one cannot be used here.

    Parameters
    ----------
    device : str, int or Device, optional
        The CUDA device to check the CUDA backends on (default ``cuda:0``).

    Returns
    -------
    dict
        Backend name -> ``None`` when it can be used in this process, else the reason.

    Examples
    --------
    >>> sharedarrays.backends()  # doctest: +SKIP
    {'host': None, 'cuda-vmm': 'no NVIDIA driver: ...', 'cuda-ipc': '...', 'cuda-pool': '...'}
    """
    index = 0
    if device is not None:
        try:
            dev = parse_device(device)
        except BackendUnavailable as exc:  # CUDA unusable, or that device does not exist
            return {"host": None} | {name: str(exc) for name in BACKEND_NAMES[1:]}
        if not dev.is_cuda:
            raise ValueError(f"backends(device=...) takes a CUDA device, not {dev}")
        index = dev.index
    return {"host": None} | {name: cuda_usable(index, name) for name in BACKEND_NAMES[1:]}


def choose_backend(device: Device, name: str = "auto") -> str:
    """The backend ``name`` (``"auto"`` or a name of :data:`BACKEND_NAMES`) means on ``device``.

    ``"auto"`` is ``host`` on ``cpu``; on a CUDA device the first of cuda-vmm, cuda-ipc,
    cuda-pool that the device supports here.

    Raises
    ------
    ValueError
        An unknown name.
    BackendUnavailable
        ``"auto"`` on a CUDA device none of the CUDA backends can use (the reasons are named).
    """
    if name != "auto":
        if name not in factories:
            raise ValueError(
                f"unknown backend {name!r}; choose 'auto' or one of {', '.join(factories)}"
            )
        return name
    if not device.is_cuda:
        return "host"
    reasons = {n: cuda_usable(device.index, n) for n in BACKEND_NAMES[1:]}
    for n, why in reasons.items():
        if why is None:
            return n
    detail = "; ".join(f"{n}: {why}" for n, why in reasons.items())
    raise BackendUnavailable(f"no CUDA backend can use {device} here ({detail})")


def get_backend(device: Device, name: str | None = None) -> Backend:
    """Return the process-wide backend ``name`` for ``device`` (default: what ``"auto"``
    chooses, see :func:`choose_backend`).

    Raises
    ------
    BackendUnavailable
        The backend cannot run in this process; the message says why.
    """
    if name is None:
        name = choose_backend(device)
    key = (name, device)
    backend = _backends.get(key)
    if backend is not None:
        return backend
    with _lock:
        backend = _backends.get(key)
        if backend is None:
            factory = factories.get(name)
            if factory is None:
                raise BackendUnavailable(
                    f"unknown backend {name!r}; available names: {', '.join(factories)}"
                )
            backend = factory(device)
            _backends[key] = backend
    return backend
