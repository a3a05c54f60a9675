"""The CUDA VMM backend (``"cuda-vmm"``): :class:`~sharedarrays.backends.vmm.VmmBackend` on
CUDA's calls (:class:`CudaVmm`)."""

from __future__ import annotations

from typing import ClassVar

from sharedarrays.backends.cuda.device import CudaCalls, CudaDevice
from sharedarrays.backends.cuda.driver import peer_reason, why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend, VmmCalls


class CudaVmm(CudaCalls, VmmCalls):
    """CUDA's VMM calls (:class:`~sharedarrays.backends.vmm.VmmCalls`)."""

    vendor = "CUDA"
    whole_chunks = " (cuMemMap supports no offset into, and no part of, a device allocation)"
    not_an_allocation = frozenset(
        {
            "CUDA_ERROR_INVALID_VALUE",
            "CUDA_ERROR_INVALID_HANDLE",
            "CUDA_ERROR_NOT_SUPPORTED",
            "CUDA_ERROR_OPERATING_SYSTEM",
            "CUDA_ERROR_INVALID_DEVICE",
            "CUDA_ERROR_UNKNOWN",  # what driver 580 answers for a memfd or a closed fd
        }
    )
    invalid_value = "CUDA_ERROR_INVALID_VALUE"
    peer_reason = staticmethod(peer_reason)

    def location(self, handle: int) -> int | None:
        prop = self.call("MemGetAllocationPropertiesFromHandle", self.handle(handle))
        return int(prop.location.id)


class CudaVmmBackend(VmmBackend, CudaDevice):
    """Device memory of one CUDA device, shared through exported fds (``"cuda-vmm"``);
    peer devices may be given access (``cuDeviceCanAccessPeer``)."""

    name: ClassVar[str] = "cuda-vmm"
    peer_access: ClassVar[bool] = True
    calls = CudaVmm


register(Registration.of(CudaVmmBackend, "cuda", 0, lambda i: why_unusable(i, CudaVmmBackend.name)))
