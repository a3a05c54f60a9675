"""The HIP VMM backend (``"hip-vmm"``): :class:`~sharedarrays.backends.vmm.VmmBackend` on
:class:`HipVmm`, HIP's VMM calls (the twins of CUDA's, through hip-python). Tested on a
simulated driver only (``tests/simulated/hip.py``)."""

from __future__ import annotations

from typing import Any, ClassVar

from sharedarrays.backends.base import Access
from sharedarrays.backends.hip.device import HipCalls, HipDevice
from sharedarrays.backends.hip.runtime import why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend, VmmCalls

__all__ = ["HipVmmBackend", "HipVmm", "KDL_ROCM"]

KDL_ROCM = 10  # DLPack's device type of ROCm memory


class HipVmm(HipCalls, VmmCalls):
    """HIP's VMM calls (:class:`~sharedarrays.backends.vmm.VmmCalls`)."""

    vendor = "HIP"
    not_an_allocation = frozenset(
        {"hipErrorInvalidValue", "hipErrorInvalidHandle", "hipErrorNotSupported"}
    )
    invalid_value = "hipErrorInvalidValue"

    def __init__(self, backend: HipDevice) -> None:
        super().__init__(backend)
        hip = self._hip
        prop = self.prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        prop.location.id = backend.device.index
        # ROCm 7 renamed requestedHandleType to requestedHandleTypes
        plural = hasattr(prop, "requestedHandleTypes")
        setattr(prop, "requestedHandleTypes" if plural else "requestedHandleType", self.fd_type)
        flags = hip.hipMemAllocationGranularity_flags
        self.granularity_flag = flags.hipMemAllocationGranularityRecommended

    def access(self, index: int, access: Access) -> Any:
        hip = self._hip
        flags = hip.hipMemAccessFlags
        desc = hip.hipMemAccessDesc()
        desc.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        desc.location.id = index
        desc.flags = {
            "rw": flags.hipMemAccessFlagsProtReadWrite,
            "r": flags.hipMemAccessFlagsProtRead,
            "none": flags.hipMemAccessFlagsProtNone,
        }[access]
        return desc

    def peer_reason(self, index: int, owner: int) -> str | None:
        return "HIP peers are not supported (yet)"  # (not asked: peer_access is False)


class HipVmmBackend(VmmBackend, HipDevice):
    """Memory of one AMD GPU, shared through exported fds (``"hip-vmm"``); no peers yet."""

    name: ClassVar[str] = "hip-vmm"
    feature: ClassVar[str] = "vmm"
    peer_access: ClassVar[bool] = False
    calls = HipVmm


register(Registration.of(HipVmmBackend, "hip", 0, why_unusable))
