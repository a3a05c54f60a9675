"""The CUDA VMM backend (``"cuda-vmm"``): :class:`~sharedarrays.backends.vmm.VmmBackend` on
:class:`CudaVmm`, CUDA's table of VMM calls (``cuMemCreate``, ``cuMemExportToShareableHandle``
to a POSIX fd, ``cuMemMap``, ``cuMemSetAccess`` for the device and its peers, ...)."""

from __future__ import annotations

from typing import Any, ClassVar

from sharedarrays.backends.base import Access
from sharedarrays.backends.cuda.device import CudaDevice
from sharedarrays.backends.cuda.driver import check, check_export, peer_reason, why_unusable
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend

__all__ = ["CudaVmmBackend", "CudaVmm"]


class CudaVmm:
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

    def __init__(self, backend: CudaDevice) -> None:
        self._backend = backend
        self._d = d = backend._d
        self._fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop = self._prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = backend.device.index
        prop.requestedHandleTypes = self._fd_type

    def granularity(self) -> int:
        d = self._d
        flag = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(
            check(
                d.cuMemGetAllocationGranularity(self._prop, flag), "cuMemGetAllocationGranularity"
            )
        )

    def create(self, size: int) -> int:
        return int(
            self._backend._check_allocation(
                self._d.cuMemCreate(size, self._prop, 0),
                f"cuMemCreate({size} bytes on {self._backend.device})",
                "a chunk of device memory",
                size,
            )
        )

    def export(self, handle: int) -> int:
        return int(
            check_export(
                self._d.cuMemExportToShareableHandle(self._handle(handle), self._fd_type, 0),
                "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
            )
        )

    def import_fd(self, fd: int) -> int:
        return int(
            check(
                self._d.cuMemImportFromShareableHandle(fd, self._fd_type),
                "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)",
            )
        )

    def location(self, handle: int) -> int | None:
        prop = check(
            self._d.cuMemGetAllocationPropertiesFromHandle(self._handle(handle)),
            "cuMemGetAllocationPropertiesFromHandle",
        )
        return int(prop.location.id)

    def release(self, handle: int) -> None:
        check(self._d.cuMemRelease(self._handle(handle)), "cuMemRelease")

    def reserve(self, size: int, alignment: int) -> int:
        return int(
            self._backend._check_allocation(
                self._d.cuMemAddressReserve(size, alignment, 0, 0),
                f"cuMemAddressReserve({size} bytes)",
                "a reservation of address space",
                size,
            )
        )

    def free(self, address: int, size: int) -> None:
        check(self._d.cuMemAddressFree(address, size), "cuMemAddressFree")

    def map(self, address: int, size: int, handle: int) -> None:
        check(
            self._d.cuMemMap(address, size, 0, self._handle(handle), 0),
            f"cuMemMap({size} bytes at {address:#x})",
        )

    def access(self, index: int, access: Access) -> Any:
        d = self._d
        flags = d.CUmemAccess_flags
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = index
        desc.flags = {
            "rw": flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            "r": flags.CU_MEM_ACCESS_FLAGS_PROT_READ,
            "none": flags.CU_MEM_ACCESS_FLAGS_PROT_NONE,
        }[access]
        return desc

    def set_access(self, address: int, size: int, descs: list[Any], access: Access) -> None:
        check(
            self._d.cuMemSetAccess(address, size, descs, len(descs)),
            f"cuMemSetAccess({access!r}, {size} bytes at {address:#x})",
        )

    def unmap(self, address: int, size: int) -> None:
        check(self._d.cuMemUnmap(address, size), f"cuMemUnmap({size} bytes at {address:#x})")

    def _handle(self, handle: int) -> Any:
        return self._d.CUmemGenericAllocationHandle(handle)


class CudaVmmBackend(VmmBackend, CudaDevice):
    """Device memory of one CUDA device, shared through exported fds (``"cuda-vmm"``);
    peer devices may be given access (``cuDeviceCanAccessPeer``)."""

    name: ClassVar[str] = "cuda-vmm"
    peer_access: ClassVar[bool] = True

    def table(self) -> CudaVmm:
        return CudaVmm(self)


register(Registration.of(CudaVmmBackend, "cuda", 0, lambda i: why_unusable(i, CudaVmmBackend.name)))
