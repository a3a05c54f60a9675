"""Making new shared arrays: empty, zeros, ones, full, their ``*_like`` forms, from_array
and asarray; and sharing a CUDA array that already exists without a copy (:func:`share`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, SupportsIndex, cast

import numpy as np
from numpy.typing import DTypeLike

from sharedarrays.api.array import SharedDeviceArray
from sharedarrays.api.arraybase import assignable, operator_index, shareable_dtype
from sharedarrays.api.named import publish
from sharedarrays.api.options import CreationKeywords, CreationOptions
from sharedarrays.backends import BorrowingBackend, choose_backend, get_backend
from sharedarrays.backends.device import CPU, Device, DeviceLike, parse_device
from sharedarrays.backends.dlpack import KDL_ROCM, is_npu_dlpack
from sharedarrays.errors import NotShareable, SharedArrayError
from sharedarrays.memory import PACK_BYTES, Allocation, pack_into_slab
from sharedarrays.protocol.payload import contiguous_strides

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like"]
__all__ += ["full_like", "from_array", "asarray", "share", "ShapeLike", "PROGRESS_BYTES"]

ShapeLike = SupportsIndex | Sequence[SupportsIndex]
P = ParamSpec("P")

PROGRESS_BYTES = 256 << 20
"""Fills and copies from this many bytes on show a progress bar in a Jupyter kernel itself."""

_BLOCK_BYTES = 64 << 20
_DLPACK_KINDS = {2: "cuda", 13: "cuda", KDL_ROCM: "hip"}  # kDLCUDA, kDLCUDAManaged, kDLROCM


def _shape(shape: ShapeLike) -> tuple[int, ...]:
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError
        out = tuple(operator_index(n) for n in (shape if isinstance(shape, Sequence) else [shape]))
    except TypeError:
        raise TypeError(f"shape must be an int or a sequence of ints, not {shape!r}") from None
    if any(n < 0 for n in out):
        raise ValueError(f"negative dimensions are not allowed: {out}")
    if len(out) > 64:
        raise ValueError(f"at most 64 dimensions, got {len(out)}")
    return out


def show_progress(progress: bool | None, nbytes: int) -> bool:
    """Whether a fill or copy of ``nbytes`` shows a bar (``None``: from :data:`PROGRESS_BYTES`
    on, in a Jupyter kernel itself, never a process it started)."""
    if progress is not None:
        return progress
    if nbytes < PROGRESS_BYTES or multiprocessing.parent_process() is not None:
        return False
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def _blocks(a: SharedDeviceArray, progress: bool | None, desc: str) -> Iterator[Any]:
    """``(native, key)``: the whole array at once, or blocks along axis 0 under a bar."""
    native = a.array
    if a.ndim == 0 or a.nbytes == 0 or not show_progress(progress, a.nbytes):
        yield native, ...
        return
    from tqdm.auto import tqdm

    # in a worker, a thread lock: tqdm's default holds a named semaphore that a terminated
    # pool worker leaves to the resource tracker ("leaked semaphore objects" at exit)
    if multiprocessing.parent_process() is not None and not hasattr(tqdm, "_lock"):
        tqdm.set_lock(threading.RLock())
    row = max(a.nbytes // max(a.shape[0], 1), 1)
    step = max(_BLOCK_BYTES // row, 1)
    with tqdm(total=a.nbytes, unit="B", unit_scale=True, desc=desc) as bar:
        for start in range(0, a.shape[0], step):
            stop = min(a.shape[0], start + step)
            yield native, slice(start, stop)
            bar.update((stop - start) * row)


def _new(shape: ShapeLike, dtype: DTypeLike, options: CreationOptions) -> SharedDeviceArray:
    """The new array; checks what depends on its shape, dtype and memory system."""
    shp = _shape(shape)
    dt = shareable_dtype(dtype, "keep such data in a NumPy array")
    capacity, name = options.capacity, options.name
    backend = get_backend(options.device, choose_backend(options.device, options.backend))
    if backend.exporter_owned and name is not None:
        raise ValueError(
            f"a named array must outlive its creator, and {backend.name} memory lives only as "
            "long as the process that made it; use backend='cuda-vmm' (or 'auto') for name="
        )
    nbytes = math.prod(shp) * dt.itemsize
    pack = options.pack
    if capacity is not None and (not shp or capacity < nbytes):
        raise ValueError(
            f"capacity={capacity} bytes does not hold the {nbytes} bytes of shape {shp}"
            if shp
            else "a growable array has at least one axis; a 0-d array cannot grow"
        )
    if pack or (pack is None and options.chunk_bytes is None and nbytes <= PACK_BYTES):
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
            publish(a, name)
        except BaseException:  # (let the memory go now, not with the traceback's frames)
            a.close()
            raise
    return a


def _fill(a: SharedDeviceArray, value: Any, progress: bool | None) -> SharedDeviceArray:
    """``a`` with every element set to ``value`` (no work for zeros in fresh memory)."""
    alloc = a.allocation  # (memfd reads zero; a slab's room is never reused, its memory may be)
    if not (alloc.backend.zeroed and not alloc.reused and np.ndim(value) == 0 and value == 0):
        fill = getattr(alloc.backend, "fill", None)  # (a driver memset, where one does it)
        for native, key in _blocks(a, progress, "fill"):
            if fill is None or not fill(native[key], value):
                native[key] = value
    return a


def _filled(
    value: int, make: Callable[P, SharedDeviceArray], name: str
) -> Callable[P, SharedDeviceArray]:
    """``make`` then :func:`_fill` with ``value``, under ``make``'s signature."""

    @functools.wraps(make)
    def filled(*args: P.args, **kwargs: P.kwargs) -> SharedDeviceArray:
        progress: Any = kwargs.get("progress")  # (keyword-only, as CreationKeywords say)
        return _fill(make(*args, **kwargs), value, progress)

    filled.__name__ = filled.__qualname__ = name
    what, of = name.split("_")[0], make.__name__
    filled.__doc__ = f"A new shared array of {what} (parameters as :func:`{of}`)."
    return filled


def empty(
    shape: ShapeLike,
    dtype: DTypeLike = "float64",
    *,
    order: str = "C",
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array whose contents are undefined.

    ``shape``, ``dtype`` (bool, integer, float or complex) and ``order`` as in NumPy;
    ``**options`` are the :class:`~sharedarrays.api.options.CreationKeywords`. Raises
    BackendUnavailable, OutOfMemory, PeerAccessUnavailable, NameExists, TypeError, ValueError.
    """
    return _new(shape, dtype, CreationOptions.from_keywords(order=order, **options))


zeros = _filled(0, empty, "zeros")
ones = _filled(1, empty, "ones")


def full(
    shape: ShapeLike,
    fill_value: Any,
    dtype: DTypeLike | None = None,
    *,
    order: str = "C",
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array with every element ``fill_value`` (parameters as :func:`empty`)."""
    checked = CreationOptions.from_keywords(order=order, **options)
    if dtype is None:
        dtype = np.asarray(fill_value).dtype
    return _fill(_new(shape, dtype, checked), fill_value, checked.progress)


def _source_device(obj: Any) -> Device | None:
    """The accelerator device of a CuPy/torch/CAI/DLPack object; None on the host."""
    if hasattr(obj, "__dlpack_device__"):
        try:
            kind, index = map(int, obj.__dlpack_device__())
        except Exception:
            return None
        name = _DLPACK_KINDS.get(kind) or ("npu" if is_npu_dlpack(obj, kind) else None)
        return None if name is None else Device(name, index)
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
    """A new shared array holding a copy of ``obj`` (a NumPy or CuPy array, a torch tensor,
    anything with ``__dlpack__``, ``__cuda_array_interface__`` or ``__array__``, a nested
    sequence), Fortran-ordered if ``obj`` is. ``device`` defaults to ``obj``'s accelerator, if
    any; ``dtype`` converts as in ``numpy.array``; ``copy=False`` (NumPy 2's "never copy")
    returns a SharedDeviceArray that already has the dtype and device asked for, else raises
    ValueError. Other keywords as :func:`empty`.
    """
    if copy is not None and not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"copy must be True, False or None, not {type(copy).__name__}")
    device = options.get("device")
    if copy is False:
        name = options.get("backend", "auto")
        if isinstance(obj, SharedDeviceArray) and _reusable(obj, dtype, device, name):
            return obj
        raise ValueError(
            "from_array(copy=False): memory that already exists cannot become shared without "
            "a copy; pass copy=None (the default) to copy it into new shared memory. Sharing "
            "a CuPy array or a torch CUDA tensor in place is what sa.share(x) is for"
        )
    if device is None:  # (a dict of the caller's own: its **options)
        options["device"] = _source_device(obj)
    checked = CreationOptions.from_keywords(**options)
    backend = get_backend(checked.device, choose_backend(checked.device, checked.backend))
    src = backend.to_native(obj)
    if src.flags.f_contiguous and not src.flags.c_contiguous and checked.capacity is None:
        checked = dataclasses.replace(checked, order="F")  # keep a Fortran source's layout
    a = _new(src.shape, src.dtype if dtype is None else dtype, checked)
    for native, key in _blocks(a, checked.progress, "copy"):
        native[key] = assignable(native, src[key])
    return a


def _reusable(
    a: SharedDeviceArray, dtype: DTypeLike | None, device: DeviceLike, backend: str
) -> bool:
    """Whether ``a`` is what asking for ``dtype``, ``device`` and ``backend`` gives."""
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
    """``obj`` itself when it is a :class:`SharedDeviceArray` of that dtype, device and
    backend (default: ``obj``'s), else a new copy as :func:`from_array` makes it."""
    if isinstance(obj, SharedDeviceArray):
        if _reusable(obj, dtype, device, backend):
            return obj
        if device is None:
            device = obj.device
    return from_array(obj, dtype=dtype, device=device, backend=backend, progress=progress)


def _like(
    obj: Any,
    dtype: DTypeLike | None,
    order: str,
    shape: ShapeLike | None,
    options: CreationKeywords,
) -> tuple[ShapeLike, DTypeLike, CreationOptions]:
    """The shape, dtype and options of a new array like ``obj`` (never reading its values);
    ``order="K"`` or ``"A"`` keeps a Fortran layout unless ``shape`` changes the ndim."""
    if order not in ("C", "F", "A", "K"):
        raise ValueError(f"order must be 'C', 'F', 'A' or 'K', not {order!r}")
    if isinstance(obj, SharedDeviceArray):
        like_shape, like_dtype, strides, device = obj.shape, obj.dtype, obj.strides, obj.device
    else:
        device = _source_device(obj) or CPU
        info = getattr(obj, "__cuda_array_interface__", None)
        if info is None:
            info = getattr(obj, "__array_interface__", None)
        if isinstance(info, dict) and "shape" in info and "typestr" in info:
            like_shape = tuple(int(n) for n in info["shape"])
            like_dtype = np.dtype(info["typestr"])
            strides = tuple(info.get("strides") or ())  # (none: C-contiguous)
        else:
            host = np.asarray(obj)
            like_shape, like_dtype, strides = host.shape, host.dtype, host.strides
    if order in ("A", "K"):
        size = like_dtype.itemsize
        fortran = (
            len(like_shape) > 1
            and strides == contiguous_strides(like_shape, size, "F")
            and strides != contiguous_strides(like_shape, size)
        )
        same_ndim = shape is None or len(_shape(shape)) == len(like_shape)
        growable = options.get("capacity") is not None  # grows along axis 0: C order
        order = "F" if fortran and same_ndim and not growable else "C"
    if options.get("device") is None:  # (a dict of the caller's own: its **options)
        options["device"] = device
    checked = CreationOptions.from_keywords(order=order, **options)
    new_dtype = like_dtype if dtype is None else dtype
    return tuple(like_shape) if shape is None else shape, new_dtype, checked


def empty_like(
    obj: Any,
    dtype: DTypeLike | None = None,
    order: str = "K",
    *,
    shape: ShapeLike | None = None,
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array of ``obj``'s shape, dtype, layout and device, contents undefined;
    ``order="K"`` or ``"A"`` keeps a Fortran layout. Other keywords as :func:`empty`."""
    return _new(*_like(obj, dtype, order, shape, options))


zeros_like = _filled(0, empty_like, "zeros_like")
ones_like = _filled(1, empty_like, "ones_like")


def full_like(
    obj: Any,
    fill_value: Any,
    dtype: DTypeLike | None = None,
    order: str = "K",
    *,
    shape: ShapeLike | None = None,
    **options: Unpack[CreationKeywords],
) -> SharedDeviceArray:
    """A new shared array like ``obj`` (as :func:`empty_like`), every element ``fill_value``."""
    new_shape, new_dtype, checked = _like(obj, dtype, order, shape, options)
    return _fill(_new(new_shape, new_dtype, checked), fill_value, checked.progress)


def share(
    obj: Any, *, readonly: bool = False, allow_pids: Iterable[int] | None = None
) -> SharedDeviceArray:
    """A :class:`SharedDeviceArray` over the CUDA memory of ``obj`` (a CuPy array, a torch
    tensor, anything with ``__cuda_array_interface__`` or ``__dlpack__``), without copying,
    by CUDA IPC (``"cuda-ipc"``); a tensor's data, a SharedDeviceArray as it is.
    ``readonly``: importers get read-only views (not enforced by CUDA IPC); ``allow_pids``:
    only these processes (and this one) may import it.

    Importers open the whole allocation holding ``obj`` and must release it before this
    process exits; finish writes on other streams before sending it. NotShareable for host
    memory or memory CUDA IPC cannot export (async pools, managed memory,
    ``expandable_segments``: :func:`from_array` copies it); BackendUnavailable without IPC.
    """
    if isinstance(obj, SharedDeviceArray):
        return obj
    device = _source_device(obj)
    if device is None:
        raise NotShareable(
            f"sa.share shares CUDA memory that already exists (a CuPy array, a torch CUDA "
            f"tensor); a {type(obj).__module__}.{type(obj).__qualname__} is not on a CUDA "
            "device, and host memory of one process cannot become shared in place. "
            "sa.from_array(x) copies it into new shared memory"
        )
    options = CreationOptions.from_keywords(
        device=device, backend="cuda-ipc", allow_pids=allow_pids, readonly=readonly
    )
    if getattr(obj, "requires_grad", False) and callable(getattr(obj, "detach", None)):
        obj = obj.detach()
    backend = cast(BorrowingBackend, get_backend(device, "cuda-ipc"))
    try:
        view = backend.to_native(obj)  # (never a copy)
    except SharedArrayError:
        raise
    except Exception as exc:  # CuPy's own refusal of what is not device memory
        raise NotShareable(
            f"{type(obj).__qualname__} does not describe CUDA memory this process can see "
            f"({type(exc).__name__}: {exc}); sa.from_array(x) copies what can be read"
        ) from exc
    if view.size == 0:  # no memory to share: an empty shared array is the same thing
        return from_array(view, device=device, backend="cuda-ipc")
    pointer = int(view.__cuda_array_interface__["data"][0])
    chunk, offset = backend.borrow_chunk(pointer, owner=(obj, view))
    alloc = Allocation.borrow(backend, chunk)
    alloc.export_readonly = options.readonly
    alloc.allow_pids = options.allow_pids
    return SharedDeviceArray(alloc, view.dtype, view.shape, view.strides, offset)
