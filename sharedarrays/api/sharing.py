"""Share an array that already exists on a CUDA device, without copying: :func:`share`.

CuPy's default memory pool and PyTorch's caching allocator take their memory with
``cuMemAlloc`` (``cudaMalloc``); CUDA IPC exports such an allocation as a whole
(``cuIpcGetMemHandle`` of its start), so the shared array is the allocation that holds the
array plus the array's offset in it, on the ``cuda-ipc`` backend. The memory keeps belonging
to its library: the shared array holds the CuPy array or torch tensor, and lets go of it when
it is released here and every process it served has closed it (the lifetime of an
exporter-owned backend, see the user guide).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sharedarrays.api.array import SharedDeviceArray
from sharedarrays.api.creation import _source_device, from_array
from sharedarrays.api.options import CreationOptions
from sharedarrays.backends import BorrowingBackend, get_backend
from sharedarrays.errors import NotShareable, SharedArrayError
from sharedarrays.memory import Allocation

__all__ = ["share"]

BACKEND = "cuda-ipc"
"""The memory system of shared arrays made by :func:`share`."""


def share(
    obj: Any,
    *,
    readonly: bool = False,
    allow_pids: Iterable[int] | None = None,
) -> SharedDeviceArray:
    """Share a CuPy array or a torch CUDA tensor with other processes, without copying.

    The result is a :class:`SharedDeviceArray` over ``obj``'s own memory: writes through
    either are seen by both and by every process the array is passed to. It pickles like any
    shared array (backend ``"cuda-ipc"``).

    Parameters
    ----------
    obj : cupy.ndarray, torch.Tensor or CUDA array
        Device memory allocated with ``cudaMalloc`` / ``cuMemAlloc``: CuPy's default memory
        pool, PyTorch's default caching allocator, or anything with
        ``__cuda_array_interface__`` or CUDA ``__dlpack__`` over such memory. A
        :class:`SharedDeviceArray` is returned as it is. A torch tensor that requires grad
        is shared as its data (``tensor.detach()``): gradients are not shared.
    readonly : bool
        Importers get the array read-only (CUDA IPC cannot enforce it in the device's memory:
        the importer's arrays refuse writes).
    allow_pids : iterable of int, optional
        Only these processes (besides this one) may import it.

    Returns
    -------
    SharedDeviceArray
        A view of ``obj``'s memory, with ``obj``'s shape, strides and dtype.

    Raises
    ------
    NotShareable
        ``obj`` is host memory (a NumPy array, a CPU tensor), or device memory that CUDA IPC
        cannot export (CuPy's ``MemoryAsyncPool``, managed memory, PyTorch with
        ``expandable_segments``); the message says why. :func:`from_array` copies such an
        array into new shared memory instead.
    BackendUnavailable
        The ``cuda-ipc`` backend cannot be used here (the reason is in the message).

    Notes
    -----
    The importer opens the whole ``cudaMalloc`` allocation that holds ``obj`` (a pool may
    have placed other arrays of this process in it) and reads only ``obj``'s range. The memory
    stays allocated while this process holds the shared array or any process it served still
    has it open: ``obj`` (and with it the allocation) is kept alive until then, even if the
    caller drops it. The processes that import it must release it before this process exits;
    at exit it waits for them a while (see the cuda-ipc lifetime in the user guide).

    Writes made on a CuPy or torch stream other than the current one must be finished (for
    example ``stream.synchronize()``) before the array is sent; the array's messages order
    the sender's current stream before the receiver's reads.

    Examples
    --------
    >>> x = cupy.arange(10.0)                                 # doctest: +SKIP
    >>> a = sa.share(x)                                       # doctest: +SKIP
    >>> with sa.Pool(2) as pool:                              # doctest: +SKIP
    ...     pool.map(double_in_place, [a[:5], a[5:]])
    >>> x                                                     # doctest: +SKIP
    array([ 0.,  2.,  4., ...])
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
        device=device, backend=BACKEND, allow_pids=allow_pids, readonly=readonly
    )
    if getattr(obj, "requires_grad", False) and callable(getattr(obj, "detach", None)):
        obj = obj.detach()
    backend = get_backend(device, BACKEND)
    if not isinstance(backend, BorrowingBackend):  # pragma: no cover - cuda-ipc borrows
        raise NotShareable(f"the {BACKEND} backend cannot share existing memory")
    try:
        view = backend.to_native(obj)  # on obj's own device: a view, never a copy
    except SharedArrayError:
        raise
    except Exception as exc:  # CuPy's own refusal of what is not device memory
        raise NotShareable(
            f"{type(obj).__qualname__} does not describe CUDA memory this process can see "
            f"({type(exc).__name__}: {exc}); sa.from_array(x) copies what can be read"
        ) from exc
    if view.size == 0:  # no memory to share: an empty shared array is the same thing
        return from_array(view, device=device, backend=BACKEND)
    pointer = int(view.__cuda_array_interface__["data"][0])
    chunk, offset = backend.borrow_chunk(pointer, owner=(obj, view))
    alloc = Allocation.borrow(backend, chunk)
    alloc.export_readonly = options.readonly
    alloc.allow_pids = options.allow_pids
    return SharedDeviceArray(alloc, view.dtype, view.shape, view.strides, offset)
