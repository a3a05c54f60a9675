"""Making new shared arrays: empty, zeros, ones, full, from_array."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike

from .allocation import Allocation
from .array import SharedDeviceArray, operator_index
from .backends import get_backend
from .device import Device, DeviceLike, parse_device

__all__ = ["empty", "zeros", "ones", "full", "from_array", "ShapeLike"]

ShapeLike = SupportsIndex | Sequence[SupportsIndex]


def _shape(shape: ShapeLike) -> tuple[int, ...]:
    items = shape if isinstance(shape, Sequence) else (shape,)
    if isinstance(shape, (str, bytes)):
        raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}")
    try:
        out = tuple(operator_index(n) for n in items)
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(n < 0 for n in out):
        raise ValueError(f"negative dimensions are not allowed: {out}")
    if len(out) > 64:
        raise ValueError(f"at most 64 dimensions, got {len(out)}")
    return out


def _dtype(dtype: DTypeLike) -> np.dtype[Any]:
    dt = np.dtype(dtype)
    if dt.kind not in "biufc" or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(
            f"dtype {dt} is not supported: shared arrays hold bool, integer, float or complex "
            "numbers (object, string, datetime and structured dtypes cannot be shared)"
        )
    return dt


def _contiguous_strides(shape: tuple[int, ...], itemsize: int, order: str) -> tuple[int, ...]:
    strides = [0] * len(shape)
    step = itemsize
    axes = range(len(shape) - 1, -1, -1) if order == "C" else range(len(shape))
    for ax in axes:
        strides[ax] = step
        step *= max(shape[ax], 1)
    return tuple(strides)


def _new(
    shape: ShapeLike, dtype: DTypeLike, device: Device, order: str, chunk_bytes: int | None
) -> SharedDeviceArray:
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', not {order!r}")
    shp = _shape(shape)
    dt = _dtype(dtype)
    n = 1
    for s in shp:
        n *= s
    backend = get_backend(device)
    alloc = Allocation.create(backend, n * dt.itemsize, chunk_bytes)
    return SharedDeviceArray(alloc, dt, shp, _contiguous_strides(shp, dt.itemsize, order), 0)


def empty(
    shape: ShapeLike,
    dtype: DTypeLike = "float64",
    *,
    device: DeviceLike = None,
    order: str = "C",
    chunk_bytes: int | None = None,
) -> SharedDeviceArray:
    """A new shared array whose contents are undefined.

    Parameters
    ----------
    shape : int or sequence of int
        Length of each axis.
    dtype : dtype-like, default "float64"
        A bool, integer, float or complex type.
    device : str, int or None
        ``None`` picks ``"cuda:0"`` when a CUDA device is usable, else ``"cpu"``; also
        ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``N``.
    order : {"C", "F"}
        Row-major or column-major layout.
    chunk_bytes : int, optional
        Largest chunk of the allocation (default 2 GiB, see
        :data:`sharedarrays.allocation.DEFAULT_CHUNK_BYTES`).

    Raises
    ------
    BackendUnavailable
        CUDA was asked for and cannot be used here; the message says why.
    TypeError, ValueError
        A bad shape, dtype, order or device.
    """
    return _new(shape, dtype, parse_device(device), order, chunk_bytes)


def zeros(
    shape: ShapeLike,
    dtype: DTypeLike = "float64",
    *,
    device: DeviceLike = None,
    order: str = "C",
    chunk_bytes: int | None = None,
) -> SharedDeviceArray:
    """A new shared array of zeros (parameters as :func:`empty`)."""
    a = _new(shape, dtype, parse_device(device), order, chunk_bytes)
    if not a.allocation.backend.zeroed:
        a.array.fill(0)
    return a


def ones(
    shape: ShapeLike,
    dtype: DTypeLike = "float64",
    *,
    device: DeviceLike = None,
    order: str = "C",
    chunk_bytes: int | None = None,
) -> SharedDeviceArray:
    """A new shared array of ones (parameters as :func:`empty`)."""
    a = _new(shape, dtype, parse_device(device), order, chunk_bytes)
    a.array.fill(1)
    return a


def full(
    shape: ShapeLike,
    fill_value: Any,
    dtype: DTypeLike | None = None,
    *,
    device: DeviceLike = None,
    order: str = "C",
    chunk_bytes: int | None = None,
) -> SharedDeviceArray:
    """A new shared array with every element set to ``fill_value``.

    ``dtype`` defaults to NumPy's type for ``fill_value``; other parameters as :func:`empty`.
    """
    if dtype is None:
        dtype = np.asarray(fill_value).dtype
    a = _new(shape, dtype, parse_device(device), order, chunk_bytes)
    a.array.fill(fill_value)
    return a


def _source_device(obj: Any) -> Device | None:
    """The CUDA device of a CuPy/torch/CAI/DLPack object, or None for host objects."""
    if hasattr(obj, "__dlpack_device__"):
        try:
            kind, index = obj.__dlpack_device__()
        except Exception:
            return None
        if int(kind) in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return Device("cuda", int(index))
        return None
    if hasattr(obj, "__cuda_array_interface__"):
        dev = getattr(obj, "device", None)
        index = getattr(dev, "id", getattr(dev, "index", 0))
        return Device("cuda", int(index or 0))
    return None


def from_array(
    obj: Any,
    *,
    device: DeviceLike = None,
    chunk_bytes: int | None = None,
) -> SharedDeviceArray:
    """A new shared array holding a copy of ``obj``.

    Parameters
    ----------
    obj : array-like
        A NumPy or CuPy array, a torch tensor, anything with ``__dlpack__``,
        ``__cuda_array_interface__`` or ``__array__``, or a nested sequence.
    device : str, int or None
        Where to put the copy. ``None``: the source's CUDA device if it is on one, otherwise
        as :func:`empty` decides.

    The copy keeps the source's layout when it is Fortran-contiguous, else C order.
    """
    dev = parse_device(device if device is not None else _source_device(obj))
    backend = get_backend(dev)
    src = backend.to_native(obj)
    order = "F" if src.flags.f_contiguous and not src.flags.c_contiguous else "C"
    a = _new(src.shape, src.dtype, dev, order, chunk_bytes)
    a.array[...] = src
    return a
