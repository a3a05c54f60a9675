"""The CUDA VMM backend (``"cuda-vmm"``): :class:`~sharedarrays.backends.vmm.VmmBackend` on
CUDA's calls."""

from __future__ import annotations

from typing import ClassVar

from sharedarrays.backends.cuda.device import CudaDevice
from sharedarrays.backends.cuda.driver import peer_reason, why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend


class CudaVmmBackend(VmmBackend, CudaDevice):
    """Device memory of one CUDA device, shared through exported fds (``"cuda-vmm"``);
    peer devices may be given access (``cuDeviceCanAccessPeer``)."""

    name: ClassVar[str] = "cuda-vmm"
    peer_access: ClassVar[bool] = True
    _peer_reason = staticmethod(peer_reason)


register(Registration.of(CudaVmmBackend, "cuda", 0, lambda i: why_unusable(i, CudaVmmBackend.name)))
