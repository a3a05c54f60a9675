"""DLPack exporters over mapped memory, for consumers that have no other way in (torch_npu).

:func:`dlpack_view` describes memory at an address (device type, pointer, shape, strides,
dtype) as a one-shot object with ``__dlpack__`` and ``__dlpack_device__``, which any DLPack
consumer takes without copying (``torch.utils.dlpack.from_dlpack``, ``np.from_dlpack``).

The structs and the capsule are `ctypes-dlpack <https://pypi.org/project/ctypes-dlpack/>`_'s
(the ``ascend`` extra): its ``DLPackArray`` makes the capsule (versioned, or the legacy
``dltensor`` one for a consumer that asks for no version, as torch_npu does), and its
``keepalive`` holds our objects until the consumer calls the tensor's deleter. What this
module adds is the ``DLManagedTensorVersioned`` itself: it is a ctypes object held, with its
shape and strides arrays and ``owner``, by that ``keepalive``, so it lives exactly as long as
the consumer's array (or, never consumed, until the exporter or its capsule is collected).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from sharedarrays.errors import BackendUnavailable

__all__ = ["KDL_CPU", "KDL_EXT_DEV", "dl_dtype", "dlpack_view"]

KDL_CPU = 1
"""DLPack's device type of host memory (``kDLCPU``)."""

KDL_EXT_DEV = 12
"""DLPack's extension device type (``kDLExtDev``): PyTorch's ``PrivateUse1`` devices, such as
torch_npu's ``npu``, are exchanged under it."""

# DLDataTypeCode, by NumPy's dtype kind
_CODES = {"i": 0, "u": 1, "f": 2, "c": 5, "b": 6}


def dl_dtype(dtype: np.dtype[Any]) -> tuple[int, int, int]:
    """``dtype`` as DLPack's ``(code, bits, lanes)``.

    Raises
    ------
    TypeError
        DLPack has no code for ``dtype`` (structured, object, string, datetime), or it is
        not in this machine's byte order.
    """
    code = _CODES.get(dtype.kind)
    if code is None or not dtype.isnative:
        raise TypeError(f"DLPack cannot describe dtype {dtype}")
    return code, dtype.itemsize * 8, 1


def dlpack_view(
    address: int,
    dtype: np.dtype[Any],
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    device_type: int,
    device_id: int,
    owner: object,
    readonly: bool = False,
) -> Any:
    """A one-shot DLPack exporter of the memory at ``address`` (no copy).

    Parameters
    ----------
    address : int
        The first element's address (``byte_offset`` is 0: some consumers, torch_npu's
        among them, ignore it).
    dtype, shape, strides
        The layout, as NumPy's (``strides`` in bytes, each a multiple of the item size).
    device_type, device_id : int
        The DLPack device (:data:`KDL_CPU`, :data:`KDL_EXT_DEV`, ...).
    owner : object
        Kept alive until the consumer frees its array (the tensor's deleter), or until the
        exporter (or the capsule it made) is collected unconsumed; released then.
    readonly : bool
        Set DLPack's read-only flag (seen by consumers of versioned capsules only).

    Returns
    -------
    ctypes_dlpack.DLPackArray
        Pass it to ``from_dlpack`` once.

    Raises
    ------
    TypeError
        See :func:`dl_dtype`.
    ValueError
        A stride is no multiple of the item size.
    BackendUnavailable
        ``ctypes-dlpack`` is not installed.
    """
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
    tensor.data = address or None
    tensor.device.device_type = device_type
    tensor.device.device_id = device_id
    tensor.ndim = ndim
    tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes = code, bits, lanes
    tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = ctypes.cast(steps, ctypes.POINTER(ctypes.c_int64))
    tensor.byte_offset = 0
    # no deleter of our own: ctypes-dlpack's keepalive deleter releases what the struct
    # points into (and the struct itself) when the consumer is done
    return dl.DLPackArray(ctypes.pointer(managed), keepalive=(managed, dims, steps, owner))
