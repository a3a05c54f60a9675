"""What the HIP backends share: one AMD GPU, its runtime calls, arrays and ordering.

:class:`HipDevice` is the base of ``hip-vmm`` (:mod:`.vmm`) and ``hip-pool`` (:mod:`.pool`):
making the device current, synchronising, and wrapping device memory as the native array.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ClassVar

import numpy as np

from sharedarrays.backends.base import NativeView, installed
from sharedarrays.backends.device import Device
from sharedarrays.backends.hip.runtime import (
    HipError,
    check,
    load_hip,
    why_unusable,
)
from sharedarrays.backends.host import host_copy, host_view
from sharedarrays.errors import BackendUnavailable

__all__ = ["HipDevice", "FORK_REASON"]

FORK_REASON = (
    "this backend object was inherited through fork, and HIP cannot be used in such a "
    "child; start worker processes with the 'spawn' or 'forkserver' start method"
)


def _cupy_rocm() -> Any:
    """CuPy's ROCm build where it is importable, else ``None``."""
    if not installed("cupy"):
        return None
    try:
        import cupy
    except ImportError:
        return None
    return cupy if getattr(cupy.cuda.runtime, "is_hip", False) else None


class HipDevice:
    """One AMD GPU, as the HIP backends use it.

    Parameters
    ----------
    device : Device
        A HIP device (``Device("hip", N)``).

    Raises
    ------
    BackendUnavailable
        :func:`~sharedarrays.backends.hip.runtime.why_unusable` gave a reason for the
        backend's :attr:`feature`.

    Notes
    -----
    The native array is a ``cupy.ndarray`` where CuPy's ROCm build is importable; else, on an
    integrated device (an APU, ``hipDeviceAttributeIntegrated``), whose memory the CPU
    addresses, a NumPy view; else a read-only NumPy copy (so that a write cannot be lost).
    Pickling orders by ``hipDeviceSynchronize`` (no interprocess events yet).
    """

    name: ClassVar[str]
    feature: ClassVar[str]
    """What the backend needs of the device (a key of ``runtime.FEATURES``)."""

    def __init__(self, device: Device) -> None:
        if device.kind != "hip":
            raise BackendUnavailable(f"the {self.name} backend needs a HIP device, not {device}")
        why = why_unusable(device.index, self.feature)
        if why is not None:
            raise BackendUnavailable(f"cannot use {device}: {why}")
        self.device: Device = device
        self._pid = os.getpid()
        self._hip = hip = load_hip()
        with self.context():
            self._integrated = bool(
                check(
                    hip.hipDeviceGetAttribute(
                        hip.hipDeviceAttribute_t.hipDeviceAttributeIntegrated, device.index
                    ),
                    "hipDeviceGetAttribute(Integrated)",
                )
            )

    @property
    def granularity(self) -> int:
        """Chunk sizes are multiples of this many bytes (each backend says)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def context(self) -> contextlib.AbstractContextManager[None]:
        """Make this device current (``hipSetDevice``) for the calls that follow (in a
        ``with`` block, as CUDA's context)."""
        if self._forked():
            raise BackendUnavailable(f"cannot use {self.device}: {FORK_REASON}")
        check(self._hip.hipSetDevice(self.device.index), f"hipSetDevice({self.device.index})")
        return contextlib.nullcontext()

    def _check_size(self, size: int, what: str) -> None:
        if size <= 0 or size % self.granularity:
            raise ValueError(
                f"{what} must be a positive multiple of the granularity "
                f"({self.granularity} bytes), got {size}"
            )

    def synchronize(self) -> None:
        """Wait for all work queued on this device (``hipDeviceSynchronize``)."""
        with self.context():
            check(self._hip.hipDeviceSynchronize(), "hipDeviceSynchronize")

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total memory of the device in bytes (``hipMemGetInfo``)."""
        with self.context():
            free, total = check(self._hip.hipMemGetInfo(), "hipMemGetInfo")
        return int(free), int(total)

    def as_native(self, view: NativeView) -> Any:
        """A ``cupy.ndarray`` (CuPy's ROCm build; DLPack device ``kDLROCM``), else a NumPy
        view on an integrated device, else a read-only NumPy copy (``hipMemcpyDtoH``; the
        whole mapped range is copied, then viewed with the view's layout)."""
        cupy = _cupy_rocm()
        if cupy is not None:
            memory = cupy.cuda.UnownedMemory(view.address, view.size, view.owner, self.device.index)
            pointer = cupy.cuda.MemoryPointer(memory, view.offset)
            return cupy.ndarray(view.shape, dtype=view.dtype, memptr=pointer, strides=view.strides)
        if self._integrated:
            return host_view(view)
        buffer = np.empty(view.size, dtype=np.uint8)
        with self.context():
            check(
                self._hip.hipMemcpyDtoH(buffer.ctypes.data, view.address, view.size),
                "hipMemcpyDtoH",
            )
        return host_copy(buffer, view)

    def to_native(self, obj: Any) -> Any:
        """``obj`` as this backend's native array type (may copy): CuPy where it is the
        native type, else NumPy (a torch tensor through ``.cpu()``, a CuPy array through
        ``.get()``)."""
        cupy = _cupy_rocm()
        if cupy is not None:
            with cupy.cuda.Device(self.device.index):
                return cupy.asarray(obj)
        if isinstance(obj, np.ndarray):
            return obj
        cpu = getattr(obj, "cpu", None)
        if callable(cpu) and hasattr(obj, "numpy"):
            return np.asarray(cpu().detach().numpy())
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
