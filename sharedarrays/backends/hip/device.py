"""The HIP backends (``hip-vmm``, ``hip-pool``): :class:`~..vmm.VmmBackend` and
:class:`~..pool.PoolBackend` on HIP's calls; tested on ``tests/simulated/hip.py`` only."""

from __future__ import annotations

import contextlib
import ctypes
import os
import types
from typing import Any, ClassVar

from sharedarrays.backends.base import DeviceBase, NativeView, VendorCalls, installed
from sharedarrays.backends.device import Device
from sharedarrays.backends.hip.runtime import HipError, check, load_hip, why_unusable
from sharedarrays.backends.host import host_native, to_numpy
from sharedarrays.backends.pool import POINTER_BYTES, PoolBackend
from sharedarrays.backends.registry import Registration, register
from sharedarrays.backends.vmm import VmmBackend

_ExportData = ctypes.c_ubyte * POINTER_BYTES


def _cupy_rocm() -> Any:  # CuPy's ROCm build where it is importable, else None
    if not installed("cupy"):
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy if getattr(cupy.cuda.runtime, "is_hip", False) else None


class HipCalls(VendorCalls):
    """HIP's table of VMM and pool calls (hip-python: export calls take their results'
    addresses; pool allocations on the null stream; export data as ctypes buffers)."""

    vendor = "HIP"
    prefix, type_prefix = "hip", "hipMem"
    fd_name = "PosixFileDescriptor"
    not_an_allocation = frozenset(
        {"hipErrorInvalidValue", "hipErrorInvalidHandle", "hipErrorNotSupported"}
    )
    invalid_value = "hipErrorInvalidValue"
    allocate_call = "MallocFromPoolAsync"
    free_call = "Free"
    enums = types.MappingProxyType(
        {
            "fd_type": "hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor",
            "pinned": "hipMemAllocationType.hipMemAllocationTypePinned",
            "on_device": "hipMemLocationType.hipMemLocationTypeDevice",
            "granularity": (
                "hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended"
            ),
            "rw": "hipMemAccessFlags.hipMemAccessFlagsProtReadWrite",
            "r": "hipMemAccessFlags.hipMemAccessFlagsProtRead",
            "none": "hipMemAccessFlags.hipMemAccessFlagsProtNone",
        }
    )
    _check = staticmethod(check)

    def export_fd(self, name: str, *args: Any) -> int:
        out = ctypes.c_int(-1)
        try:
            call = getattr(self._m, "hip" + name)
            check(call(ctypes.addressof(out), *args, self.fd_type, 0), f"hip{name}({self.fd_name})")
        except BaseException:
            if out.value >= 0:
                os.close(out.value)
            raise
        return out.value

    def stream(self) -> int:
        return 0  # the null stream

    def export_pointer(self, pointer: int) -> bytes:
        data = _ExportData()
        self.call("MemPoolExportPointer", data, pointer)
        return bytes(data)

    def import_pointer(self, pool: Any, data: bytes) -> int:
        return int(self.call("MemPoolImportPointer", pool, _ExportData.from_buffer_copy(data)))


class HipDevice(DeviceBase):
    """One AMD GPU (``Device("hip", N)``); native arrays are CuPy's (ROCm build), else NumPy
    views on an integrated device, else read-only NumPy copies (no write is lost)."""

    feature: ClassVar[str]  # what the backend needs of the device (``runtime.FEATURES``)
    peer_access: ClassVar[bool] = False
    calls = HipCalls

    def __init__(self, device: Device) -> None:
        self._take(device, "hip", "a HIP device", lambda i: why_unusable(i, self.feature))
        self._d = hip = load_hip()
        integrated = hip.hipDeviceAttribute_t.hipDeviceAttributeIntegrated
        with self.context():
            result = hip.hipDeviceGetAttribute(integrated, device.index)
            self._integrated = bool(check(result, "hipDeviceGetAttribute(Integrated)"))

    def context(self) -> contextlib.AbstractContextManager[None]:
        self._refuse_forked("HIP")
        check(self._d.hipSetDevice(self.device.index), f"hipSetDevice({self.device.index})")
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        with self.context():
            check(self._d.hipDeviceSynchronize(), "hipDeviceSynchronize")

    def mem_get_info(self) -> tuple[int, int]:
        with self.context():
            free, total = check(self._d.hipMemGetInfo(), "hipMemGetInfo")
        return int(free), int(total)

    def as_native(self, view: NativeView) -> Any:
        """A ``cupy.ndarray`` (ROCm build), else NumPy (:func:`.host.host_native`)."""
        cupy = _cupy_rocm()
        if cupy is not None:
            memory = cupy.cuda.UnownedMemory(view.address, view.size, view.owner, self.device.index)
            pointer = cupy.cuda.MemoryPointer(memory, view.offset)
            return cupy.ndarray(view.shape, dtype=view.dtype, memptr=pointer, strides=view.strides)

        def copy(dst: int, src: int, size: int) -> None:
            with self.context():
                check(self._d.hipMemcpyDtoH(dst, src, size), "hipMemcpyDtoH")

        return host_native(view, self._integrated, copy)

    def to_native(self, obj: Any) -> Any:
        cupy = _cupy_rocm()
        if cupy is None:
            return to_numpy(obj)
        with cupy.cuda.Device(self.device.index):
            return cupy.asarray(obj)

    def current_device(self) -> int:
        try:
            return int(check(self._d.hipGetDevice(), "hipGetDevice"))
        except HipError:
            return self.device.index


class HipVmmBackend(VmmBackend, HipDevice):
    """Memory of one AMD GPU, shared through exported fds (``"hip-vmm"``); no peers yet."""

    name: ClassVar[str] = "hip-vmm"
    feature: ClassVar[str] = "vmm"


class HipPoolBackend(PoolBackend, HipDevice):
    """Memory of one AMD GPU, shared through an exported pool (``"hip-pool"``)."""

    name: ClassVar[str] = "hip-pool"
    feature: ClassVar[str] = "pool"


register(Registration.of(HipPoolBackend, "hip", 1, lambda i: why_unusable(i, "pool")))
register(Registration.of(HipVmmBackend, "hip", 0, why_unusable))
