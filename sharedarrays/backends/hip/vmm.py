"""The HIP VMM backend (``"hip-vmm"``): :class:`~sharedarrays.backends.vmm.VmmBackend` on
:class:`HipVmm`, HIP's table of VMM calls (the twins of CUDA's, through hip-python). Tested on
a simulated driver only (``tests/simulated/hip.py``)."""

from __future__ import annotations

from typing import Any, ClassVar

from sharedarrays.backends.base import Access
from sharedarrays.backends.hip.device import HipDevice
from sharedarrays.backends.hip.runtime import check, export_fd, why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend

__all__ = ["HipVmmBackend", "HipVmm", "KDL_ROCM"]

KDL_ROCM = 10  # DLPack's device type of ROCm memory


class HipVmm:
    """HIP's VMM calls (:class:`~sharedarrays.backends.vmm.VmmCalls`)."""

    vendor = "HIP"
    whole_chunks = ""
    not_an_allocation = frozenset(
        {"hipErrorInvalidValue", "hipErrorInvalidHandle", "hipErrorNotSupported"}
    )
    invalid_value = "hipErrorInvalidValue"

    def __init__(self, backend: HipDevice) -> None:
        self._hip = hip = backend._hip
        self._fd_type = hip.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor
        prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        prop.location.id = backend.device.index
        # ROCm 7 renamed requestedHandleType to requestedHandleTypes
        plural = hasattr(prop, "requestedHandleTypes")
        setattr(prop, "requestedHandleTypes" if plural else "requestedHandleType", self._fd_type)
        self._prop = prop
        self._device = backend.device

    def granularity(self) -> int:
        hip = self._hip
        flag = hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended
        return int(
            check(
                hip.hipMemGetAllocationGranularity(self._prop, flag),
                "hipMemGetAllocationGranularity",
            )
        )

    def create(self, size: int) -> int:
        return int(
            check(
                self._hip.hipMemCreate(size, self._prop, 0),
                f"hipMemCreate({size} bytes on {self._device})",
            )
        )

    def export(self, handle: int) -> int:
        return export_fd(
            lambda out: self._hip.hipMemExportToShareableHandle(out, handle, self._fd_type, 0),
            "hipMemExportToShareableHandle(PosixFileDescriptor)",
        )

    def import_fd(self, fd: int) -> int:
        return int(
            check(
                self._hip.hipMemImportFromShareableHandle(fd, self._fd_type),
                "hipMemImportFromShareableHandle(PosixFileDescriptor)",
            )
        )

    def location(self, handle: int) -> int | None:
        return None  # (not asked of HIP)

    def release(self, handle: int) -> None:
        check(self._hip.hipMemRelease(handle), "hipMemRelease")

    def reserve(self, size: int, alignment: int) -> int:
        return int(
            check(
                self._hip.hipMemAddressReserve(size, alignment, 0, 0),
                f"hipMemAddressReserve({size} bytes)",
            )
        )

    def free(self, address: int, size: int) -> None:
        check(self._hip.hipMemAddressFree(address, size), "hipMemAddressFree")

    def map(self, address: int, size: int, handle: int) -> None:
        check(
            self._hip.hipMemMap(address, size, 0, handle, 0),
            f"hipMemMap({size} bytes at {address:#x})",
        )

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

    def set_access(self, address: int, size: int, descs: list[Any], access: Access) -> None:
        check(
            self._hip.hipMemSetAccess(address, size, descs, len(descs)),
            f"hipMemSetAccess({access!r}, {size} bytes at {address:#x})",
        )

    def unmap(self, address: int, size: int) -> None:
        check(self._hip.hipMemUnmap(address, size), f"hipMemUnmap({size} bytes at {address:#x})")

    def peer_reason(self, index: int, owner: int) -> str | None:
        return "HIP peers are not supported (yet)"  # (not asked: peer_access is False)


class HipVmmBackend(VmmBackend, HipDevice):
    """Memory of one AMD GPU, shared through exported fds (``"hip-vmm"``); no peers yet."""

    name: ClassVar[str] = "hip-vmm"
    feature: ClassVar[str] = "vmm"
    peer_access: ClassVar[bool] = False

    def table(self) -> HipVmm:
        return HipVmm(self)


register(Registration.of(HipVmmBackend, "hip", 0, why_unusable))
