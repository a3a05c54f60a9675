"""DLPack exporters over mapped memory, for consumers with no other way in (torch_npu), made
of ctypes-dlpack's structs (the ``ascend`` extra)."""

from __future__ import annotations

import ctypes
import types
from typing import Any

import numpy as np

from sharedarrays.backends.base import NativeView
from sharedarrays.errors import BackendUnavailable

KDL_CPU = 1  # kDLCPU
KDL_ROCM = 10  # kDLROCM
KDL_EXT_DEV = 12  # kDLExtDev: PyTorch's PrivateUse1 devices, such as torch_npu's npu
KDL_ASCEND = 21  # kDLAscend (after DLPack 1.3); torch_npu reports and takes kDLExtDev

# DLDataTypeCode, by NumPy's dtype kind
_CODES = types.MappingProxyType({"i": 0, "u": 1, "f": 2, "c": 5, "b": 6})


def is_npu_dlpack(obj: object, device_type: int) -> bool:
    """Whether an object whose ``__dlpack_device__`` gave ``device_type`` is Ascend memory."""
    if device_type == KDL_ASCEND:
        return True
    kind = getattr(getattr(obj, "device", None), "type", None)
    return device_type == KDL_EXT_DEV and kind == "npu"


def dl_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    """``dtype`` as DLPack's ``(code, bits, lanes)``; ``TypeError`` where DLPack has none."""
    code = _CODES.get(dtype.kind)
    if code is None or not dtype.isnative:
        raise TypeError(f"DLPack cannot describe dtype {dtype}")
    return code, dtype.itemsize * 8, 1


def dlpack_view(view: NativeView, device_type: int, device_id: int) -> Any:
    """A one-shot DLPack exporter (``ctypes_dlpack.DLPackArray``) of ``view``, given by its
    first element's address (torch_npu ignores ``byte_offset``); ``view.owner`` is kept until
    the consumer frees its array. ``BackendUnavailable`` without ``ctypes-dlpack``."""
    address, _, offset, owner, dtype, shape, strides, readonly, _ = view
    code, bits, lanes = dl_dtype(dtype)
    if any(s % dtype.itemsize for s in strides):
        raise ValueError(f"strides {strides} are not multiples of the item size {dtype.itemsize}")
    try:
        import ctypes_dlpack as dl
    except ImportError as exc:
        raise BackendUnavailable(
            "making a DLPack capsule needs the ctypes-dlpack package: "
            "pip install 'sharedarrays[ascend]'"
        ) from exc
    ndim = len(shape)
    dims = (ctypes.c_int64 * max(ndim, 1))(*shape)
    steps = (ctypes.c_int64 * max(ndim, 1))(*(s // dtype.itemsize for s in strides))
    managed = dl.DLManagedTensorVersioned()
    managed.version.major, managed.version.minor = 1, 0
    managed.flags = dl.DLPACK_FLAG_BITMASK_READ_ONLY if readonly else 0
    tensor = managed.dl_tensor
    tensor.data = (address + offset) or None
    tensor.device.device_type = device_type
    tensor.device.device_id = device_id
    tensor.ndim = ndim
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = code, bits, lanes
    tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(steps, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    return dl.DLPackArray(ctypes.pointer(managed), keepalive=(managed, dims, steps, owner))
