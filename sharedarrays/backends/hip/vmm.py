"""The HIP VMM backend: AMD GPU memory shared through POSIX file descriptors (``"hip-vmm"``).

HIP's virtual memory management API (the twin of CUDA's), called through hip-python
(see :mod:`~sharedarrays.backends.hip.runtime`):

=========== =================================================================
reservation ``hipMemAddressReserve`` (aligned to the granularity)
chunk       ``hipMemCreate`` (pinned memory of this device, requested handle type
            ``hipMemHandleTypePosixFileDescriptor``), exported once with
            ``hipMemExportToShareableHandle``; the fd is kept for the chunk's life
mapping     ``hipMemMap`` (whole chunks)
access      ``hipMemSetAccess`` for the owning device
handle      the exported fd; an importer turns it back into a chunk with
            ``hipMemImportFromShareableHandle`` and keeps it too, so it can serve it on
release     ``hipMemUnmap``, ``hipMemRelease``, ``hipMemAddressFree``
=========== =================================================================

The memory lives while any process holds a handle, an fd or a mapping of it (as on
cuda-vmm). Tested on a simulated driver only (``tests/simulated/hip.py``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from sharedarrays.backends.base import Access, Chunk
from sharedarrays.backends.device import Device
from sharedarrays.backends.hip.runtime import (
    HipError,
    as_host_array,
    check,
    load_hip,
    why_unusable,
)
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import BackendUnavailable, PayloadError

__all__ = ["HipVmmBackend", "KDL_ROCM"]

KDL_ROCM = 10
"""DLPack's device type of ROCm memory (``kDLROCM``)."""

# What hipMemImportFromShareableHandle answers for an fd that is no exported allocation.
_NOT_AN_ALLOCATION = frozenset(
    {"hipErrorInvalidValue", "hipErrorInvalidHandle", "hipErrorNotSupported"}
)

FORK_REASON = (
    "this backend object was inherited through fork, and HIP cannot be used in such a "
    "child; start worker processes with the 'spawn' or 'forkserver' start method"
)


def _cupy_rocm() -> Any:
    """CuPy's ROCm build where it is importable, else ``None``."""
    try:
        if importlib.util.find_spec("cupy") is None:
            return None
        import cupy
    except (ImportError, ValueError):
        return None
    return cupy if getattr(cupy.cuda.runtime, "is_hip", False) else None


class HipVmmBackend:
    """Memory of one AMD GPU, shared through exported fds (``"hip-vmm"``).

    Parameters
    ----------
    device : Device
        A HIP device (``Device("hip", N)``).

    Raises
    ------
    BackendUnavailable
        :func:`~sharedarrays.backends.hip.runtime.why_unusable` gave a reason.

    Notes
    -----
    The native array is a ``cupy.ndarray`` where CuPy's ROCm build is importable; else, on an
    integrated device (an APU, ``hipDeviceAttributeIntegrated``), whose memory the CPU
    addresses, a NumPy view; else a read-only NumPy copy (so that a write cannot be lost).
    Pickling orders by ``hipDeviceSynchronize`` (no interprocess events yet).
    """

    name: ClassVar[str] = "hip-vmm"
    zeroed: ClassVar[bool] = False  # hipMemCreate does not clear memory
    maps: ClassVar[bool] = True
    exporter_owned: ClassVar[bool] = False
    peer_access: ClassVar[bool] = False

    def __init__(self, device: Device) -> None:
        if device.kind != "hip":
            raise BackendUnavailable(f"the {self.name} backend needs a HIP device, not {device}")
        why = why_unusable(device.index)
        if why is not None:
            raise BackendUnavailable(f"cannot use {device}: {why}")
        self.device: Device = device
        self._pid = os.getpid()
        self._hip = hip = load_hip()
        self._fd_type = hip.hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor
        prop = hip.hipMemAllocationProp()
        prop.type = hip.hipMemAllocationType.hipMemAllocationTypePinned
        prop.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        prop.location.id = device.index
        # ROCm 7 renamed requestedHandleType to requestedHandleTypes
        field = "requestedHandleType"
        if hasattr(prop, "requestedHandleTypes"):
            field = "requestedHandleTypes"
        setattr(prop, field, self._fd_type)
        self._prop = prop
        with self._on_device():
            self._granularity = int(
                check(
                    hip.hipMemGetAllocationGranularity(
                        prop,
                        hip.hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended,
                    ),
                    "hipMemGetAllocationGranularity",
                )
            )
            self._integrated = bool(
                check(
                    hip.hipDeviceGetAttribute(
                        hip.hipDeviceAttribute_t.hipDeviceAttributeIntegrated, device.index
                    ),
                    "hipDeviceGetAttribute(Integrated)",
                )
            )
        self._access = {a: self._desc(a) for a in ("rw", "r", "none")}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    @property
    def granularity(self) -> int:
        """The recommended allocation granularity of this device."""
        return self._granularity

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _on_device(self) -> Any:
        """Make this device current (``hipSetDevice``) for the calls that follow."""
        if self._forked():
            raise BackendUnavailable(f"cannot use {self.device}: {FORK_REASON}")
        check(self._hip.hipSetDevice(self.device.index), f"hipSetDevice({self.device.index})")
        return _Nothing()

    def _desc(self, access: Access) -> Any:
        hip = self._hip
        flags = hip.hipMemAccessFlags
        desc = hip.hipMemAccessDesc()
        desc.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        desc.location.id = self.device.index
        desc.flags = {
            "rw": flags.hipMemAccessFlagsProtReadWrite,
            "r": flags.hipMemAccessFlagsProtRead,
            "none": flags.hipMemAccessFlagsProtNone,
        }[access]
        return desc

    def _check_size(self, size: int, what: str) -> None:
        if size <= 0 or size % self._granularity:
            raise ValueError(
                f"{what} must be a positive multiple of the granularity "
                f"({self._granularity} bytes), got {size}"
            )

    # chunks -----------------------------------------------------------------------------
    def check_memory(self, nbytes: int) -> None:
        """Nothing to check beforehand: ``hipMemCreate`` takes the memory at once, and fails
        with :class:`~sharedarrays.backends.hip.runtime.HipOutOfMemory`."""

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes of device memory and export its fd (once)."""
        self._check_size(size, "a chunk size")
        hip = self._hip
        with self._on_device():
            handle = check(
                hip.hipMemCreate(size, self._prop, 0),
                f"hipMemCreate({size} bytes on {self.device})",
            )
            out = ctypes.c_int(-1)
            try:
                check(
                    hip.hipMemExportToShareableHandle(
                        ctypes.addressof(out), handle, self._fd_type, 0
                    ),
                    "hipMemExportToShareableHandle(PosixFileDescriptor)",
                )
                fd = out.value
                os.set_inheritable(fd, False)
            except BaseException:
                if out.value >= 0:
                    os.close(out.value)
                hip.hipMemRelease(handle)
                raise
        return Chunk(size=size, handle=int(handle), fd=fd)

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Nothing to seal: a HIP chunk's size is fixed and its fd carries no access mode;
        read-only is each importer's own ``hipMemSetAccess``."""
        return False

    def reopen_readonly(self, fd: int) -> int | None:
        """HIP's shareable fds carry no access mode."""
        return None

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from an fd exported by :meth:`create_chunk` (in any process).

        Takes ownership of ``fd``. A payload that claims more than the chunk holds fails in
        :meth:`map`.

        Raises
        ------
        PayloadError
            ``size`` is not a multiple of the granularity, or the fd is not an exported HIP
            allocation.
        """
        hip = self._hip
        try:
            if size <= 0 or size % self._granularity:
                raise PayloadError(
                    f"chunk size {size} is not a positive multiple of {self.device}'s "
                    f"granularity ({self._granularity} bytes)"
                )
            with self._on_device():
                try:
                    handle = check(
                        hip.hipMemImportFromShareableHandle(fd, self._fd_type),
                        "hipMemImportFromShareableHandle(PosixFileDescriptor)",
                    )
                except HipError as exc:
                    if exc.error_name in _NOT_AN_ALLOCATION:
                        raise PayloadError(
                            f"the handle is not an exported HIP allocation: {exc}"
                        ) from exc
                    raise
        except BaseException:
            os.close(fd)
            raise
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass
        return Chunk(size=size, handle=int(handle), fd=fd, imported=True)

    def release_chunk(self, chunk: Chunk) -> None:
        """Release this process's handle of the chunk and close its fd. Idempotent."""
        handle, fd = chunk.handle, chunk.fd
        if handle < 0 and fd < 0:
            return
        chunk.handle = chunk.fd = -1
        try:
            if handle >= 0 and not self._forked():
                check(self._hip.hipMemRelease(handle), "hipMemRelease")
        finally:
            if fd >= 0:
                os.close(fd)

    # address space ----------------------------------------------------------------------
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of device address space, aligned to the granularity."""
        self._check_size(size, "a reservation size")
        with self._on_device():
            ptr = check(
                self._hip.hipMemAddressReserve(size, self._granularity, 0, 0),
                f"hipMemAddressReserve({size} bytes)",
            )
        return int(ptr)

    def free_reservation(self, address: int, size: int) -> None:
        """Give back a reservation (a no-op in a forked child)."""
        if not self._forked():
            check(self._hip.hipMemAddressFree(address, size), "hipMemAddressFree")

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map the whole of ``chunk`` at ``address`` (whole chunks only, as on CUDA)."""
        self._check_size(size, "a mapping size")
        if chunk_offset != 0 or size != chunk.size:
            raise ValueError(
                f"HIP maps whole chunks only: asked for {size} bytes from offset "
                f"{chunk_offset} of a chunk of {chunk.size} bytes"
            )
        if chunk.handle < 0:
            raise ValueError("the chunk was released")
        with self._on_device():
            try:
                check(
                    self._hip.hipMemMap(address, size, 0, chunk.handle, 0),
                    f"hipMemMap({size} bytes at {address:#x})",
                )
            except HipError as exc:
                if exc.error_name == "hipErrorInvalidValue":
                    raise PayloadError(
                        f"{exc}; the chunk may be smaller than its payload says"
                    ) from exc
                raise

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """Set this device's access to a mapped range with ``hipMemSetAccess``; lowering it
        waits first for queued work. Peer devices are not supported (yet)."""
        desc = self._access.get(access)
        if desc is None:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        if any(index != self.device.index for index in peers or {}):
            raise ValueError(f"{self.name} grants no peer devices: access= takes {self.device}")
        if access != "rw":
            self.synchronize()
        with self._on_device():
            check(
                self._hip.hipMemSetAccess(address, size, [desc], 1),
                f"hipMemSetAccess({access!r}, {size} bytes at {address:#x})",
            )

    def unmap(self, address: int, size: int) -> None:
        """Wait for queued work, then unmap the range (a no-op in a forked child)."""
        if self._forked():
            return
        self.synchronize()
        check(self._hip.hipMemUnmap(address, size), f"hipMemUnmap({size} bytes at {address:#x})")

    def synchronize(self) -> None:
        """Wait for all work queued on this device (``hipDeviceSynchronize``)."""
        with self._on_device():
            check(self._hip.hipDeviceSynchronize(), "hipDeviceSynchronize")

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total memory of the device in bytes (``hipMemGetInfo``)."""
        with self._on_device():
            free, total = check(self._hip.hipMemGetInfo(), "hipMemGetInfo")
        return int(free), int(total)

    # arrays -----------------------------------------------------------------------------
    def as_native(
        self,
        address: int,
        size: int,
        offset: int,
        owner: object,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        readonly: bool,
        device_index: int | None = None,
    ) -> Any:
        """A ``cupy.ndarray`` (CuPy's ROCm build; DLPack device ``kDLROCM``), else a NumPy
        view on an integrated device, else a read-only NumPy copy (``hipMemcpyDtoH``)."""
        cupy = _cupy_rocm()
        if cupy is not None:
            memory = cupy.cuda.UnownedMemory(address, size, owner, self.device.index)
            pointer = cupy.cuda.MemoryPointer(memory, offset)
            return cupy.ndarray(shape, dtype=dtype, memptr=pointer, strides=strides)
        if self._integrated:
            return as_host_array(address + offset, owner, dtype, shape, strides, readonly)
        return self._copy_out(address, size, offset, dtype, shape, strides)

    def _copy_out(
        self,
        address: int,
        size: int,
        offset: int,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...],
    ) -> np.ndarray[Any, Any]:
        """A read-only NumPy copy of a view of the mapped range (the whole range is copied,
        then viewed with the view's layout)."""
        buffer = np.empty(size, dtype=np.uint8)
        with self._on_device():
            check(self._hip.hipMemcpyDtoH(buffer.ctypes.data, address, size), "hipMemcpyDtoH")
        view = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset, strides=strides)
        copy: np.ndarray[Any, Any] = view.copy()
        copy.flags.writeable = False
        return copy

    def to_native(self, obj: Any) -> Any:
        """``obj`` as this backend's native array type (may copy): CuPy where it is the
        native type, else NumPy."""
        cupy = _cupy_rocm()
        if cupy is not None:
            with cupy.cuda.Device(self.device.index):
                return cupy.asarray(obj)
        get = getattr(obj, "get", None)
        if callable(get) and not isinstance(obj, np.ndarray):
            return np.asarray(get())
        return np.asarray(obj)

    def current_device(self) -> int:
        """The HIP device this process works on now (``hipGetDevice``)."""
        try:
            return int(check(self._hip.hipGetDevice(), "hipGetDevice"))
        except HipError:
            return self.device.index

    # ordering ---------------------------------------------------------------------------
    def export_sync(self) -> bytes | None:
        """Wait for the device's queued work now (no interprocess events yet): nothing for
        an importer to wait for."""
        self.synchronize()
        return None

    def export_fence(self) -> object | None:
        """See :meth:`export_sync`: the device is synchronised when an array is pickled."""
        self.synchronize()
        return None

    def import_sync(self, token: bytes) -> None:
        """Nothing to wait for (see :meth:`export_sync`)."""


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


register(
    Registration(
        name=HipVmmBackend.name,
        kind="hip",
        factory=HipVmmBackend,
        preference=0,
        maps=HipVmmBackend.maps,
        exporter_owned=HipVmmBackend.exporter_owned,
        why_unusable=why_unusable,
    )
)
