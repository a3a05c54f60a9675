"""Dask: shared arrays in distributed's ``"dask"`` serialization family (a payload to this
host, the data to another), and dask arrays over shared memory without copies (:func:`to_dask`,
:func:`from_dask`). Nothing here imports dask before it is called."""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import numpy as np

from sharedarrays.api.array import SharedDeviceArray
from sharedarrays.api.creation import empty, from_array
from sharedarrays.api.named import check_name, publish
from sharedarrays.backends.device import DeviceLike
from sharedarrays.process import STATE

__all__ = ["register", "registered", "same_node_transfer", "to_dask", "from_dask"]


def registered() -> bool:
    """Whether :func:`register` ran in this process."""
    return STATE.pools.dask


def register() -> None:
    """Register shared arrays with distributed's ``"dask"`` serialization family (once)."""
    if STATE.pools.dask:
        return
    from distributed.protocol import dask_deserialize, dask_serialize

    dask_serialize.register(SharedDeviceArray)(serialize)
    dask_deserialize.register(SharedDeviceArray)(deserialize)
    STATE.pools.dask = True


def same_node_transfer(context: dict[str, Any] | None) -> bool:
    """Whether a message written with distributed's ``context`` stays on this host."""
    if not context:
        return True
    sender = (context.get("sender") or {}).get("address")
    recipient = (context.get("recipient") or {}).get("address")
    if not isinstance(sender, str) or not isinstance(recipient, str):
        return True  # not a comm's context: the object stays in this process
    if sender.startswith("inproc://") and recipient.startswith("inproc://"):
        return True
    from distributed.comm.addressing import get_address_host

    try:
        return bool(get_address_host(sender) == get_address_host(recipient))
    except (ValueError, TypeError):
        return False


def serialize(
    a: SharedDeviceArray, context: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[Any]]:
    """distributed's ``dask_serialize``: the payload on one host, else the data (CuPy's
    ``"cuda"`` family on ``ucx://``)."""
    if same_node_transfer(context):
        return {"form": "payload"}, [pickle.dumps(a, protocol=5)]
    from distributed.protocol.serialize import serialize as dask_serialize_any

    recipient = ((context or {}).get("recipient") or {}).get("address", "")
    family = "cuda" if a.device.needs_context and str(recipient).startswith("ucx") else "dask"
    header, frames = dask_serialize_any(
        a.array, serializers=(family,), on_error="raise", context=context
    )
    return {"form": "data", "kind": a.device.kind, "data": header}, list(frames)


def deserialize(header: dict[str, Any], frames: list[Any]) -> SharedDeviceArray:
    """distributed's ``dask_deserialize``: the payload loaded, or the data in a new array."""
    if header.get("form") == "payload":
        a = pickle.loads(frames[0])
        if not isinstance(a, SharedDeviceArray):
            raise TypeError("a shared array's Dask message did not hold a shared array")
        return a
    from distributed.protocol.serialize import deserialize as dask_deserialize_any

    native = dask_deserialize_any(header["data"], frames)
    return from_array(native, device="cpu" if header.get("kind") == "cpu" else None)


def to_dask(a: SharedDeviceArray, chunks: Any = "auto", *, name: str | None = None) -> Any:
    """A :class:`dask.array.Array` whose chunks are the shared views ``a[block]`` (``a`` must
    stay open); ``chunks`` as for :func:`dask.array.from_array`, ``name`` the key prefix."""
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
    meta = a.array[(slice(0, 0),) * a.ndim] if a.ndim else a.array.reshape(1)[:0]
    return da.Array(graph, name, chunks, meta=meta)


class _Target:
    """What :func:`dask.array.store` writes into: ``out``, synchronised after each chunk."""

    def __init__(self, out: SharedDeviceArray) -> None:
        self.out = out
        self.shape, self.dtype, self.ndim = out.shape, out.dtype, out.ndim

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
    """Compute dask array ``x`` into a new shared array, each task writing its chunk in place
    (:func:`dask.array.store`, given ``compute``): nothing is gathered. ``device`` and
    ``backend`` as :func:`sharedarrays.empty`'s (default: a GPU for CuPy chunks); ``name``
    names the result once written. On an error the array is closed."""
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
