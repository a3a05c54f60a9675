"""Share an array that already exists on a CUDA device, without copying: :func:`share`
(the ``cudaMalloc`` allocation holding it, exported whole by CUDA IPC, plus its offset)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

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
    obj: Any, *, readonly: bool = False, allow_pids: Iterable[int] | None = None
) -> SharedDeviceArray:
    """Share a CuPy array or a torch CUDA tensor with other processes, without copying: a
    :class:`SharedDeviceArray` over ``obj``'s own memory (backend ``"cuda-ipc"``).

    Parameters
    ----------
    obj : cupy.ndarray, torch.Tensor or CUDA array
        Device memory from ``cudaMalloc`` (CuPy's and PyTorch's default allocators), or
        anything with ``__cuda_array_interface__`` or CUDA ``__dlpack__`` over it. A tensor
        that requires grad is shared as its data; a SharedDeviceArray is returned as it is.
    readonly : bool
        Importers get read-only views (not enforced by CUDA IPC).
    allow_pids : iterable of int, optional
        Only these processes (besides this one) may import it.

    Raises
    ------
    NotShareable
        Host memory, or device memory CUDA IPC cannot export (async pools, managed memory,
        ``expandable_segments``): :func:`from_array` copies it instead.
    BackendUnavailable
        The ``cuda-ipc`` backend cannot be used here.

    Notes
    -----
    Importers open the whole ``cudaMalloc`` allocation holding ``obj`` (maybe other arrays
    of a pool) and read only its range. ``obj`` is kept alive while this process holds the
    shared array or an importer has it open; importers must release it before this process
    exits. Finish writes on other streams than the current one before sending it.
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
    backend = cast(BorrowingBackend, get_backend(device, BACKEND))
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
        return from_array(view, device=device, backend=BACKEND)
    pointer = int(view.__cuda_array_interface__["data"][0])
    chunk, offset = backend.borrow_chunk(pointer, owner=(obj, view))
    alloc = Allocation.borrow(backend, chunk)
    alloc.export_readonly = options.readonly
    alloc.allow_pids = options.allow_pids
    return SharedDeviceArray(alloc, view.dtype, view.shape, view.strides, offset)
