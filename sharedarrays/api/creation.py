"""Making new shared arrays: empty, zeros, ones, full, their ``*_like`` forms, from_array
and asarray."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike

from sharedarrays.api.array import SharedDeviceArray, assignable, operator_index
from sharedarrays.api.arraybase import shareable_dtype
from sharedarrays.api.options import CreationKeywords, CreationOptions
from sharedarrays.backends import choose_backend, get_backend
from sharedarrays.backends.ascend.vmm import is_npu_dlpack
from sharedarrays.backends.device import CPU, Device, DeviceLike, parse_device
from sharedarrays.backends.hip.vmm import KDL_ROCM
from sharedarrays.memory import PACK_BYTES, Allocation, pack_into_slab
from sharedarrays.protocol.payload import contiguous_strides

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "empty",
    "zeros",
    "ones",
    "full",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "from_array",
    "asarray",
    "ShapeLike",
    "PROGRESS_BYTES",
]

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


PROGRESS_BYTES = 256 << 20
"""Fills and copies of at least this many bytes show a progress bar unasked, in a Jupyter
kernel's own process only (see :func:`show_progress`)."""

_BLOCK_BYTES = 64 << 20


def in_notebook_kernel() -> bool:
    """Whether this process is a Jupyter kernel itself, not a process it started.

    Only there does a bar show unasked: as a widget in the notebook, where it fills no
    script's stderr and no worker's output.
    """
    if multiprocessing.parent_process() is not None:  # a worker, also one forked from a kernel
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def show_progress(progress: bool | None, nbytes: int) -> bool:
    """Whether a fill or copy of ``nbytes`` shows a bar: as ``progress`` says, and for
    ``None`` only for :data:`PROGRESS_BYTES` or more in a Jupyter kernel's own process."""
    if progress is not None:
        return progress
    return nbytes >= PROGRESS_BYTES and in_notebook_kernel()


def _blocks(a: SharedDeviceArray, progress: bool | None, desc: str) -> Any:
    """Yield ``(native, slice)`` blocks along the first axis, with a tqdm.auto bar where
    :func:`show_progress` says so."""
    native = a.array
    if a.ndim == 0 or a.nbytes == 0:
        yield native, ...
        return
    row = max(a.nbytes // max(a.shape[0], 1), 1)
    step = max(_BLOCK_BYTES // row, 1)
    shown = show_progress(progress, a.nbytes)  # (else no tqdm at all: see _progress_bar)
    with _progress_bar(a.nbytes, desc) if shown else contextlib.nullcontext() as bar:
        for start in range(0, a.shape[0], step):
            stop = min(a.shape[0], start + step)
            yield native, slice(start, stop)
            if bar is not None:
                bar.update((stop - start) * row)


def _progress_bar(nbytes: int, desc: str) -> Any:
    """A tqdm.auto bar over ``nbytes``.

    In a process that multiprocessing started, tqdm gets a thread lock first: its default
    lock holds a named semaphore, which a pool worker ended by the pool's ``terminate``
    leaves to the resource tracker ("leaked semaphore objects" at exit).
    """
    from tqdm.auto import tqdm

    if multiprocessing.parent_process() is not None and not hasattr(tqdm, "_lock"):
        tqdm.set_lock(threading.RLock())
    return tqdm(total=nbytes, unit="B", unit_scale=True, desc=desc)


def _fill(a: SharedDeviceArray, value: Any, progress: bool | None) -> None:
    if not show_progress(progress, a.nbytes):  # (one kernel: the blocks are for the bar)
        a.array[...] = value
        return
    for native, key in _blocks(a, progress, "fill"):
        native[key] = value


def _new(shape: ShapeLike, dtype: DTypeLike, options: CreationOptions) -> SharedDeviceArray:
    """Make the array: what depends on its shape, dtype and memory system is checked here."""
    from sharedarrays.api import named

    shp = _shape(shape)
    dt = shareable_dtype(dtype, "keep such data in a NumPy array")
    device, capacity, name = options.device, options.capacity, options.name
    backend = get_backend(device, choose_backend(device, options.backend))
    if backend.exporter_owned and name is not None:
        raise ValueError(
            f"a named array must outlive its creator, and {backend.name} memory lives only as "
            "long as the process that made it; use backend='cuda-vmm' (or 'auto') for name="
        )
    nbytes = math.prod(shp) * dt.itemsize
    pack = options.pack
    if pack is None:
        pack = options.chunk_bytes is None and nbytes <= PACK_BYTES
    if capacity is not None and (not shp or capacity < nbytes):
        raise ValueError(
            f"capacity={capacity} bytes does not hold the {nbytes} bytes of shape {shp}"
            if shp
            else "a growable array has at least one axis; a 0-d array cannot grow"
        )
    if pack:
        alloc, offset = pack_into_slab(backend, nbytes)
    else:
        alloc = Allocation.create(
            backend, nbytes, options.chunk_bytes, capacity, options.peers, options.readonly
        )
        offset = 0
        alloc.allow_pids = options.allow_pids
    strides = contiguous_strides(shp, dt.itemsize, options.order)
    a = SharedDeviceArray(alloc, dt, shp, strides, offset)
    if name is not None:
        try:
            named.publish(a, name)
        except BaseException:  # (not named: the new memory is let go now, not when the
            a.close()  # traceback that holds this frame goes)
            raise
    return a


def _full(
    shape: ShapeLike, fill_value: Any, dtype: DTypeLike | None, options: CreationOptions
) -> SharedDeviceArray:
    if dtype is None:
        dtype = np.asarray(fill_value).dtype
    a = _new(shape, dtype, options)
    alloc = a.allocation  # (memfd reads zero; a slab's room is never reused, its memory may be)
    fresh_memory_reads_zero = alloc.backend.zeroed and not alloc.reused
    if not (fresh_memory_reads_zero and np.ndim(fill_value) == 0 and fill_value == 0):
        _fill(a, fill_value, options.progress)
    return a


def empty(
    shape: ShapeLike,
    dtype: DTypeLike = "float64",
    *,
    order: str = "C",
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array whose contents are undefined.

    Parameters
    ----------
    shape : int or sequence of int
        Length of each axis.
    dtype : dtype-like, default "float64"
        A bool, integer, float or complex type.
    order : {"C", "F"}
        Row-major or column-major layout.
    **options
        The keywords of every creation function (``device``, ``backend``, ``chunk_bytes``,
        ``pack``, ``progress``, ``name``, ``allow_pids``, ``readonly``, ``access``,
        ``capacity``), documented once in
        :class:`~sharedarrays.api.options.CreationKeywords`.

    Raises
    ------
    BackendUnavailable
        CUDA (or the backend asked for) cannot be used here; the message says why.
    OutOfMemory
        A host array larger than the memory available (see the user guide), or a capacity
        larger than the address space this process can reserve.
    PeerAccessUnavailable
        A device in ``access`` cannot reach the memory (``cuDeviceCanAccessPeer`` is 0).
    NameExists
        ``name`` is taken (the new memory is released again).
    TypeError, ValueError
        A bad shape, dtype, order, device, name, allow_pids (process ids) or capacity
        (at most 128 TiB).
    """
    return _new(shape, dtype, CreationOptions.from_keywords(order=order, **options))


def zeros(
    shape: ShapeLike,
    dtype: DTypeLike = "float64",
    *,
    order: str = "C",
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array of zeros (parameters as :func:`empty`)."""
    return _full(shape, 0, dtype, CreationOptions.from_keywords(order=order, **options))


def ones(
    shape: ShapeLike,
    dtype: DTypeLike = "float64",
    *,
    order: str = "C",
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array of ones (parameters as :func:`empty`)."""
    return _full(shape, 1, dtype, CreationOptions.from_keywords(order=order, **options))


def full(
    shape: ShapeLike,
    fill_value: Any,
    dtype: DTypeLike | None = None,
    *,
    order: str = "C",
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array with every element set to ``fill_value``.

    ``dtype`` defaults to NumPy's type for ``fill_value``; other parameters as :func:`empty`
    (``progress``: a tqdm.auto bar while filling, a widget in Jupyter, text on stderr).
    """
    return _full(shape, fill_value, dtype, CreationOptions.from_keywords(order=order, **options))


def _source_device(obj: Any) -> Device | None:
    """The accelerator device of a CuPy/torch/CAI/DLPack object (CUDA, ROCm: ``hip``,
    Ascend: ``npu``), or None for host objects."""
    if hasattr(obj, "__dlpack_device__"):
        try:
            kind, index = obj.__dlpack_device__()
        except Exception:
            return None
        if int(kind) in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return Device("cuda", int(index))
        if int(kind) == KDL_ROCM:
            return Device("hip", int(index))
        if is_npu_dlpack(obj, int(kind)):
            return Device("npu", int(index))
        return None
    if hasattr(obj, "__cuda_array_interface__"):
        dev = getattr(obj, "device", None)
        index = getattr(dev, "id", getattr(dev, "index", 0))
        return Device("cuda", int(index or 0))
    return None


def from_array(
    obj: Any,
    *,
    dtype: DTypeLike | None = None,
    copy: bool | None = None,
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array holding a copy of ``obj``.

    The copy keeps the source's layout when it is Fortran-contiguous, else C order.
    Parameters not listed here are as :func:`empty`.

    Parameters
    ----------
    obj : array-like
        A NumPy or CuPy array, a torch tensor, anything with ``__dlpack__``,
        ``__cuda_array_interface__`` or ``__array__``, or a nested sequence.
    dtype : dtype-like, optional
        The copy's element type (converted as ``numpy.array(obj, dtype=...)`` would);
        default: the source's.
    copy : bool, optional
        ``None`` (the default) and ``True`` copy ``obj`` into new shared memory. ``False``
        means "never copy" as in NumPy 2: only a :class:`SharedDeviceArray` that already has
        the dtype and device asked for is returned as it is; any other ``obj`` raises
        ValueError, since memory that exists cannot become shared without a copy.
    device : str, int, torch.device, cupy.cuda.Device or None
        Where to put the copy. ``None``: the source's accelerator device if it is on one,
        otherwise as :func:`empty` decides. (``progress`` as :func:`full`; with
        ``capacity`` the copy is growable and in C order.)

    Raises
    ------
    ValueError
        ``copy=False`` for what is not already such a shared array.
    """
    if copy is not None and not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"copy must be True, False or None, not {type(copy).__name__}")
    device = options.get("device")
    if copy is False:
        backend = options.get("backend", "auto")
        if isinstance(obj, SharedDeviceArray) and _reusable(obj, dtype, device, backend):
            return obj
        raise ValueError(
            "from_array(copy=False): memory that already exists cannot become shared without "
            "a copy; pass copy=None (the default) to copy it into new shared memory. Sharing "
            "a CuPy array or a torch CUDA tensor in place is what sa.share(x) is for"
        )
    if device is None:  # (a dict of the caller's own: its **options)
        options["device"] = _source_device(obj)
    return _copy(obj, dtype, CreationOptions.from_keywords(**options))


def _copy(obj: Any, dtype: DTypeLike | None, options: CreationOptions) -> SharedDeviceArray:
    """New shared memory holding ``obj`` (as ``dtype``), made as ``options`` say."""
    src = get_backend(options.device, choose_backend(options.device, options.backend)).to_native(
        obj
    )
    if src.flags.f_contiguous and not src.flags.c_contiguous and options.capacity is None:
        options = dataclasses.replace(options, order="F")  # keep a Fortran source's layout
    a = _new(src.shape, src.dtype if dtype is None else dtype, options)
    for native, key in _blocks(a, options.progress, "copy"):
        native[key] = assignable(native, src[key])
    return a


def _reusable(
    a: SharedDeviceArray, dtype: DTypeLike | None, device: DeviceLike, backend: str
) -> bool:
    """Whether ``a`` is already what asking for ``dtype``, ``device`` and ``backend`` gives."""
    return (
        (dtype is None or np.dtype(dtype) == a.dtype)
        and (device is None or parse_device(device) == a.device)
        and backend in ("auto", a.backend)
    )


def asarray(
    obj: Any,
    dtype: DTypeLike | None = None,
    device: DeviceLike = None,
    *,
    backend: str = "auto",
    progress: bool | None = None,
) -> SharedDeviceArray:
    """``obj`` as a shared array: ``obj`` itself when it is a :class:`SharedDeviceArray` of
    that dtype and device (and backend), else a new shared copy (as :func:`from_array`).

    For the other keywords of a new shared array (``name``, ``readonly``, ...) use
    :func:`from_array`, which always copies.

    Parameters
    ----------
    obj : array-like
        A SharedDeviceArray, or anything :func:`from_array` takes. A NumPy or CuPy array is
        always copied, even one made from a shared array's :attr:`~SharedDeviceArray.array`.
    dtype : dtype-like, optional
        The element type; default: ``obj``'s.
    device : str, int, torch.device, cupy.cuda.Device or None
        The device; default: ``obj``'s when it is a SharedDeviceArray, else as
        :func:`from_array` decides.
    backend : str, default "auto"
        The memory system (as :func:`empty`); ``"auto"`` accepts the one ``obj`` has.
    progress : bool, optional
        Show a progress bar while copying (as :func:`full`).
    """
    if isinstance(obj, SharedDeviceArray):
        if _reusable(obj, dtype, device, backend):
            return obj
        if device is None:
            device = obj.device
    return from_array(obj, dtype=dtype, device=device, backend=backend, progress=progress)


def _like_layout(obj: Any) -> tuple[tuple[int, ...], np.dtype[Any], bool, Device]:
    """Shape, dtype, whether Fortran-ordered (and not C), and device of ``obj``, read from
    its array interface where it has one (no copy, no device memory read)."""
    if isinstance(obj, SharedDeviceArray):
        shape, dtype, strides, device = obj.shape, obj.dtype, obj.strides, obj.device
    else:
        device = _source_device(obj) or CPU
        info = getattr(obj, "__cuda_array_interface__", None)
        if info is None:
            info = getattr(obj, "__array_interface__", None)
        if isinstance(info, dict) and "shape" in info and "typestr" in info:
            shape = tuple(int(n) for n in info["shape"])
            dtype = np.dtype(info["typestr"])
            raw = info.get("strides")
            strides = contiguous_strides(shape, dtype.itemsize) if raw is None else tuple(raw)
        else:
            host = np.asarray(obj)
            shape, dtype, strides = host.shape, host.dtype, host.strides
    fortran = (
        len(shape) > 1
        and strides == contiguous_strides(shape, dtype.itemsize, "F")
        and strides != contiguous_strides(shape, dtype.itemsize)
    )
    return tuple(shape), dtype, fortran, device


def _like(
    obj: Any,
    dtype: DTypeLike | None,
    order: str,
    shape: ShapeLike | None,
    options: CreationKeywords,
) -> tuple[ShapeLike, DTypeLike, CreationOptions]:
    """The shape, dtype and options of a new array like ``obj`` (NumPy's ``*_like`` rules:
    ``order="K"`` or ``"A"`` keeps a Fortran layout, unless ``shape`` changes the number of
    axes; ``device`` defaults to ``obj``'s)."""
    like_shape, like_dtype, fortran, like_device = _like_layout(obj)
    if order not in ("C", "F", "A", "K"):
        raise ValueError(f"order must be 'C', 'F', 'A' or 'K', not {order!r}")
    new_shape: ShapeLike = like_shape if shape is None else shape
    if order in ("A", "K"):
        same_ndim = shape is None or len(_shape(shape)) == len(like_shape)
        growable = options.get("capacity") is not None  # grows along axis 0: C order
        order = "F" if fortran and same_ndim and not growable else "C"
    if options.get("device") is None:  # (a dict of the caller's own: its **options)
        options["device"] = like_device
    checked = CreationOptions.from_keywords(order=order, **options)
    return new_shape, like_dtype if dtype is None else dtype, checked


def empty_like(
    obj: Any,
    dtype: DTypeLike | None = None,
    order: str = "K",
    *,
    shape: ShapeLike | None = None,
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array of ``obj``'s shape, dtype, layout and device, its contents
    undefined. Parameters not listed here are as :func:`empty`.

    Parameters
    ----------
    obj : array-like
        A NumPy or CuPy array, a :class:`SharedDeviceArray`, or anything with
        ``__cuda_array_interface__`` or ``__array__``. Only its shape, dtype, layout and
        device are read, never its values.
    dtype : dtype-like, optional
        Default: ``obj``'s.
    order : {"K", "A", "C", "F"}, default "K"
        ``"K"`` and ``"A"`` keep ``obj``'s layout (Fortran when it is Fortran-contiguous,
        else C); ``"C"`` and ``"F"`` as :func:`empty`.
    shape : int or sequence of int, optional
        Default: ``obj``'s.
    device : str, int, torch.device, cupy.cuda.Device or None
        Default: ``obj``'s device (a CuPy array's CUDA device; ``"cpu"`` for a NumPy array).
    """
    new_shape, new_dtype, checked = _like(obj, dtype, order, shape, options)
    return _new(new_shape, new_dtype, checked)


def zeros_like(
    obj: Any,
    dtype: DTypeLike | None = None,
    order: str = "K",
    *,
    shape: ShapeLike | None = None,
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array of zeros like ``obj`` (parameters as :func:`empty_like`)."""
    return full_like(obj, 0, dtype, order, shape=shape, **options)


def ones_like(
    obj: Any,
    dtype: DTypeLike | None = None,
    order: str = "K",
    *,
    shape: ShapeLike | None = None,
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array of ones like ``obj`` (parameters as :func:`empty_like`)."""
    return full_like(obj, 1, dtype, order, shape=shape, **options)


def full_like(
    obj: Any,
    fill_value: Any,
    dtype: DTypeLike | None = None,
    order: str = "K",
    *,
    shape: ShapeLike | None = None,
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array like ``obj`` with every element set to ``fill_value``, of
    ``obj``'s dtype unless ``dtype`` is given, as in NumPy (parameters as :func:`empty_like`)."""
    new_shape, new_dtype, checked = _like(obj, dtype, order, shape, options)
    return _full(new_shape, fill_value, new_dtype, checked)
