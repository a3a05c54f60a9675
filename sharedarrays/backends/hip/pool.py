"""The HIP memory-pool backend (``"hip-pool"``): :class:`~sharedarrays.backends.pool.PoolBackend`
on HIP's calls. Tested on a simulated driver only (``tests/simulated/hip.py``)."""

from __future__ import annotations

from typing import ClassVar

from sharedarrays.backends.hip.device import HipDevice
from sharedarrays.backends.hip.runtime import why_unusable
from sharedarrays.backends.pool import PoolBackend
from sharedarrays.backends.registry import Registration, register


class HipPoolBackend(PoolBackend, HipDevice):
    """Memory of one AMD GPU, shared through an exported pool (``"hip-pool"``)."""

    name: ClassVar[str] = "hip-pool"
    feature: ClassVar[str] = "pool"
    peer_access: ClassVar[bool] = False


register(
    Registration.of(HipPoolBackend, "hip", 1, lambda i: why_unusable(i, HipPoolBackend.feature))
)
