"""The HIP VMM backend (``"hip-vmm"``): :class:`~sharedarrays.backends.vmm.VmmBackend` on
HIP's calls (:class:`HipVmm`). Tested on a simulated driver only (``tests/simulated/hip.py``)."""

from __future__ import annotations

from typing import ClassVar

from sharedarrays.backends.hip.device import HipCalls, HipDevice
from sharedarrays.backends.hip.runtime import why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend, VmmCalls

KDL_ROCM = 10  # DLPack's device type of ROCm memory


class HipVmm(HipCalls, VmmCalls):
    """HIP's VMM calls (:class:`~sharedarrays.backends.vmm.VmmCalls`)."""

    vendor = "HIP"
    not_an_allocation = frozenset(
        {"hipErrorInvalidValue", "hipErrorInvalidHandle", "hipErrorNotSupported"}
    )
    invalid_value = "hipErrorInvalidValue"


class HipVmmBackend(VmmBackend, HipDevice):
    """Memory of one AMD GPU, shared through exported fds (``"hip-vmm"``); no peers yet."""

    name: ClassVar[str] = "hip-vmm"
    feature: ClassVar[str] = "vmm"
    peer_access: ClassVar[bool] = False
    calls = HipVmm


register(Registration.of(HipVmmBackend, "hip", 0, why_unusable))
