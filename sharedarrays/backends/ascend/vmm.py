"""The Ascend backend (``"ascend"``), a pointer backend: a chunk is ``aclrtMallocPhysical``
memory mapped here and exported as a ``uint64`` shareable handle whose pid trust list admits
each importer (:meth:`AscendBackend.admit`). Tested on ``tests/simulated/ascend.py`` only."""

from __future__ import annotations

import ctypes
import importlib
import os
import struct
import threading
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, cast

import numpy as np

from sharedarrays.backends.ascend import runtime as rt
from sharedarrays.backends.ascend.runtime import AclError, check, load_acl, why_unusable
from sharedarrays.backends.base import Chunk, DeviceBase, NativeView, installed
from sharedarrays.backends.device import Device
from sharedarrays.backends.dlpack import KDL_EXT_DEV, dl_dtype, dlpack_view
from sharedarrays.backends.host import host_native, to_numpy
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import (
    BackendUnavailable,
    HandleUnavailable,
    PayloadError,
    PermissionDenied,
)

EXPORT_BYTES = 8  # a chunk's export: the uint64 shareable handle, little-endian


def torch_npu_from_dlpack() -> Callable[[Any], Any] | None:
    """``torch.utils.dlpack.from_dlpack`` made to take ``kDLExtDev`` capsules by importing
    torch_npu, else ``None``."""
    if not installed("torch_npu"):
        return None
    try:
        importlib.import_module("torch_npu")
        dlpack = importlib.import_module("torch.utils.dlpack")
    except ImportError:
        return None
    return cast("Callable[[Any], Any]", dlpack.from_dlpack)


def _torch_layout(dtype: np.dtype[Any], strides: tuple[int, ...]) -> bool:
    """Whether a torch tensor can have this layout."""
    try:
        dl_dtype(dtype)
    except TypeError:
        return False
    return all(s >= 0 and s % dtype.itemsize == 0 for s in strides)


class AscendBackend(DeviceBase):
    """Memory of one Ascend NPU (``Device("npu", N)``). Native arrays are torch tensors where
    torch_npu is importable (through DLPack; untested on hardware), else NumPy views where the
    CPU addresses the memory (the simulated driver), else read-only NumPy copies."""

    name: ClassVar[str] = "ascend"
    zeroed: ClassVar[bool] = False  # aclrtMallocPhysical does not clear memory
    maps: ClassVar[bool] = False
    exporter_owned: ClassVar[bool] = True
    peer_access: ClassVar[bool] = False
    granularity: int  # the recommended one: 2 MiB huge pages

    def __init__(self, device: Device) -> None:
        self._take(device, "npu", "an NPU device", why_unusable)
        self._acl = load_acl()
        self._lock = threading.Lock()
        self._admitted: dict[int, set[int]] = {}  # shareable handle -> pids on its trust list
        prop = self._prop = rt.PhysicalMemProp()
        prop.handleType = rt.ACL_MEM_HANDLE_TYPE_NONE
        prop.allocationType = rt.ACL_MEM_ALLOCATION_TYPE_PINNED
        prop.memAttr = rt.ACL_HBM_MEM_HUGE
        prop.location.type = rt.ACL_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        self._on_device()
        args = (ctypes.pointer(prop), rt.ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        self.granularity = self._out(ctypes.c_size_t, "aclrtMemGetAllocationGranularity", *args)
        # whether the CPU addresses mapped NPU memory: never for libascendcl; a stand-in
        # module says so with SHAREDARRAYS_CPU_ADDRESSABLE = True
        addressable = getattr(self._acl, "SHAREDARRAYS_CPU_ADDRESSABLE", False)
        self._cpu_addressable = bool(addressable) if rt.module_name() else False

    def _call(self, name: str, *args: Any, what: str = "") -> None:
        check(getattr(self._acl, name)(*args), name + what)

    def _out(self, ctype: Any, name: str, *args: Any, first: bool = False, what: str = "") -> int:
        """What call ``name`` writes to its out-parameter (its last, or ``first``)."""
        out = ctype(0)
        pointer = ctypes.pointer(out)
        self._call(name, *((pointer, *args) if first else (*args, pointer)), what=what)
        return int(out.value or 0)

    def _on_device(self) -> None:  # for the calling thread
        self._refuse_forked("CANN")
        self._call("aclrtSetDevice", self.device.index, what=f"({self.device.index})")

    def _map(self, handle: int, size: int) -> int:  # in a new reservation
        what = f"({size} bytes)"
        args = (size, 0, None, 0)
        address = self._out(ctypes.c_void_p, "aclrtReserveMemAddress", *args, first=True, what=what)
        try:
            self._call("aclrtMapMem", address, size, 0, handle, 0, what=what)
        except BaseException:
            self._acl.aclrtReleaseMemAddress(address)
            raise
        return address

    def _unmap(self, address: int) -> None:
        try:
            self._call("aclrtUnmapMem", address, what=f"({address:#x})")
        finally:
            self._call("aclrtReleaseMemAddress", address, what=f"({address:#x})")

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes, map them here, and export the shareable handle."""
        self._check_size(size, "a chunk size")
        self._on_device()
        args = (size, ctypes.pointer(self._prop), 0)
        what = f"({size} bytes on {self.device})"
        handle = self._out(ctypes.c_void_p, "aclrtMallocPhysical", *args, first=True, what=what)
        address = 0
        try:
            address = self._map(handle, size)
            kind = (rt.ACL_MEM_HANDLE_TYPE_NONE, rt.ACL_RT_VMM_EXPORT_FLAG_DEFAULT)
            shareable = self._out(ctypes.c_uint64, "aclrtMemExportToShareableHandle", handle, *kind)
        except BaseException:
            if address:
                self._unmap(address)
            self._acl.aclrtFreePhysical(handle)
            raise
        export = struct.pack("<Q", shareable)
        return Chunk(size=size, handle=handle, fd=-1, address=address, export=export)

    def admit(self, chunk: Chunk, pid: int) -> None:
        """Put ``pid`` on the trust list of ``chunk`` (exported here) before it is served."""
        if chunk.imported or pid == os.getpid():
            return
        (shareable,) = struct.unpack("<Q", chunk.export)
        with self._lock:
            admitted = self._admitted.setdefault(shareable, set())
            if pid in admitted:
                return
            self._on_device()
            pids = (ctypes.c_int32 * 1)(pid)
            what = f"(pid {pid})"
            self._call("aclrtMemSetPidToShareableHandle", shareable, pids, 1, what=what)
            admitted.add(pid)

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import and map another process's chunk (``PermissionDenied``: not on its trust
        list; ``HandleUnavailable``: its exporter freed it or exited)."""
        if fd >= 0:
            os.close(fd)  # CANN sends no fds
        if len(export) != EXPORT_BYTES:
            raise PayloadError(f"an ascend handle is {EXPORT_BYTES} bytes, not {len(export)}")
        self._check_size(size, "the payload's chunk size", PayloadError)
        (shareable,) = struct.unpack("<Q", export)
        self._on_device()
        try:
            args = (shareable, self.device.index)
            handle = self._out(ctypes.c_void_p, "aclrtMemImportFromShareableHandle", *args)
        except AclError as exc:
            if exc.code == rt.ACL_ERROR_RT_NO_PERMISSION:
                raise PermissionDenied(
                    f"{exc}: this process (pid {os.getpid()}) is not on the trust list of the "
                    "Ascend allocation; its exporter adds a process when it serves it, so "
                    "import arrays through sharedarrays (pickling), not by their raw handle"
                ) from exc
            if exc.code in (rt.ACL_ERROR_RT_INVALID_HANDLE, rt.ACL_ERROR_RT_PARAM_INVALID):
                raise HandleUnavailable(
                    f"{exc}: the memory of this Ascend allocation is gone (its exporter freed "
                    "it or exited)"
                ) from exc
            raise
        try:
            address = self._map(handle, size)
        except BaseException as exc:
            self._acl.aclrtFreePhysical(handle)
            if isinstance(exc, AclError) and exc.call.startswith("aclrtMapMem"):
                raise PayloadError(
                    f"{exc}; the chunk may be smaller than its payload says"
                ) from exc
            raise
        return Chunk(size=size, handle=handle, fd=-1, address=address, export=export, imported=True)

    def release_chunk(self, chunk: Chunk) -> None:
        """Wait for queued work, unmap the chunk and free this process's handle of it."""
        handle, address = chunk.handle, chunk.address
        if handle < 0:
            return
        chunk.handle, chunk.address = -1, 0
        if self._forked():
            return
        if not chunk.imported and len(chunk.export) == EXPORT_BYTES:
            with self._lock:
                self._admitted.pop(struct.unpack("<Q", chunk.export)[0], None)
        self.synchronize()
        try:
            if address:
                self._unmap(address)
        finally:
            self._call("aclrtFreePhysical", handle)

    def synchronize(self) -> None:
        self._on_device()
        self._call("aclrtSynchronizeDevice")

    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._on_device()
        pointers = (ctypes.pointer(free), ctypes.pointer(total))
        self._call("aclrtGetMemInfo", 1, *pointers, what="(ACL_HBM_MEM)")
        return int(free.value), int(total.value)

    def as_native(self, view: NativeView) -> Any:
        """A torch tensor through a ``kDLExtDev`` capsule where torch_npu is importable, else
        (also for read-only views and layouts torch cannot have) NumPy."""
        if not view.readonly and _torch_layout(view.dtype, view.strides):
            consume = torch_npu_from_dlpack()
            if consume is not None:
                try:
                    exporter = dlpack_view(view, KDL_EXT_DEV, self.device.index)
                except BackendUnavailable as exc:
                    warnings.warn(f"{exc}; giving NumPy arrays meanwhile", stacklevel=2)
                else:
                    return consume(exporter)

        def copy(dst: int, src: int, n: int) -> None:
            self._on_device()
            args = (dst, n, src, n, rt.ACL_MEMCPY_DEVICE_TO_HOST)
            self._call("aclrtMemcpy", *args, what="(device to host)")

        return host_native(view, self._cpu_addressable, copy)

    to_native = staticmethod(to_numpy)

    def current_device(self) -> int:
        try:
            return self._out(ctypes.c_int32, "aclrtGetDevice")
        except AclError:
            return self.device.index


register(Registration.of(AscendBackend, "npu", 0, why_unusable))
