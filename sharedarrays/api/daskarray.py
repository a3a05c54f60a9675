"""dask.array over shared memory: :func:`to_dask` (chunks that are shared views) and
:func:`from_dask` (compute into one new shared allocation, each task writing its chunk in
place). dask is imported when they are called, never by ``import sharedarrays``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sharedarrays.api.array import SharedDeviceArray
from sharedarrays.api.creation import empty
from sharedarrays.api.named import check_name, publish
from sharedarrays.backends.device import DeviceLike

__all__ = ["to_dask", "from_dask"]


def _meta(a: SharedDeviceArray) -> Any:
    """An empty native array of ``a``'s kind and dtype (a NumPy or a CuPy one)."""
    return a.array[(slice(0, 0),) * a.ndim] if a.ndim else a.array.reshape(1)[:0]


def to_dask(a: SharedDeviceArray, chunks: Any = "auto", *, name: str | None = None) -> Any:
    """A :class:`dask.array.Array` whose chunks are shared views ``a[block]`` (no copy): a
    task on the same node reads the shared memory itself.

    Parameters
    ----------
    a : SharedDeviceArray
        The array; it must stay open while the dask array is computed.
    chunks : int, tuple, str
        As for :func:`dask.array.from_array` (``"auto"`` by default).
    name : str, optional
        The dask key prefix; default: one made from the allocation and the view.

    Returns
    -------
    dask.array.Array
    """
    import itertools

    import dask.array as da
    from dask.array.core import normalize_chunks, slices_from_chunks

    if not isinstance(a, SharedDeviceArray):
        raise TypeError(f"to_dask takes a SharedDeviceArray, not {type(a).__name__}")
    if name is None:
        layout = "-".join(str(n) for n in (*a.shape, *a.strides))
        name = f"shared-{a.allocation.id}-{a.offset}-{a.dtype.str}-{layout}"
    # (not dask.array.from_array: it copies whatever has a copy() method)
    chunks = normalize_chunks(chunks, a.shape, dtype=a.dtype)
    blocks = itertools.product(*(range(len(c)) for c in chunks))
    graph = {(name, *index): a[slices] for index, slices in zip(blocks, slices_from_chunks(chunks))}
    return da.Array(graph, name, chunks, meta=_meta(a))


class _Target:
    """What :func:`dask.array.store` writes into: the shared array, synchronised before the
    task reports its chunk done."""

    def __init__(self, out: SharedDeviceArray) -> None:
        self.out = out
        self.shape = out.shape
        self.dtype = out.dtype
        self.ndim = out.ndim

    def __setitem__(self, key: Any, value: Any) -> None:
        self.out[key] = value
        self.out.synchronize()


# creation keywords from_dask refuses (the others go to dask.array.store, which ignores them)
_NOT_FOR_STORE = frozenset(
    {"shape", "dtype", "order", "chunk_bytes", "pack", "allow_pids", "readonly"}
    | {"capacity", "access", "progress", "copy"}
)


def from_dask(
    x: Any,
    *,
    device: DeviceLike = None,
    backend: str = "auto",
    name: str | None = None,
    **compute: Any,
) -> SharedDeviceArray:
    """Compute a dask array into a new shared array, each task writing its chunk in place
    (:func:`dask.array.store`): on one node nothing is gathered.

    Parameters
    ----------
    x : dask.array.Array
        The array to compute.
    device : str, int, torch.device, cupy.cuda.Device or None
        Where to put the result; default: a GPU when ``x``'s chunks are CuPy arrays.
    backend : str
        The memory system (as :func:`sharedarrays.empty`).
    name : str, optional
        Name the result once every chunk is written (never seen half made).
    **compute
        Passed to :func:`dask.array.store`; other creation keywords are a TypeError.

    Returns
    -------
    SharedDeviceArray
        The result, written by the tasks; on an error it is closed and the error raised.
    """
    import dask.array as da

    if not isinstance(x, da.Array):
        raise TypeError(f"from_dask takes a dask.array.Array, not {type(x).__name__}")
    if any(np.isnan(n) for n in x.shape):
        raise ValueError(
            "from_dask needs a dask array of known shape (call x.compute_chunk_sizes() first)"
        )
    refused = sorted(_NOT_FOR_STORE & compute.keys())
    if refused:
        raise TypeError(
            f"from_dask does not take {', '.join(refused)}: it makes the array with device=, "
            "backend= and name=, and passes its other keywords to dask.array.store"
        )
    if name is not None:
        check_name(name)  # (before the computation)
    if device is None and type(x._meta).__module__.partition(".")[0] == "cupy":
        device = "cuda"
    out = empty(
        x.shape, dtype=x.dtype, device=device, backend=backend, pack=False if name else None
    )
    try:
        da.store(x, _Target(out), lock=False, **compute)
        if name is not None:
            publish(out, name)  # (once written: an attacher never sees it half made)
    except BaseException:
        out.close()
        raise
    return out
