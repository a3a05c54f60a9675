"""The HIP VMM backend (``"hip-vmm"``): :class:`~sharedarrays.backends.vmm.VmmBackend` on
HIP's calls. Tested on a simulated driver only (``tests/simulated/hip.py``)."""

from __future__ import annotations

from typing import ClassVar

from sharedarrays.backends.hip.device import HipDevice
from sharedarrays.backends.hip.runtime import why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend

KDL_ROCM = 10  # DLPack's device type of ROCm memory


class HipVmmBackend(VmmBackend, HipDevice):
    """Memory of one AMD GPU, shared through exported fds (``"hip-vmm"``); no peers yet."""

    name: ClassVar[str] = "hip-vmm"
    feature: ClassVar[str] = "vmm"
    peer_access: ClassVar[bool] = False


register(Registration.of(HipVmmBackend, "hip", 0, why_unusable))
