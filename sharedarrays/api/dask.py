"""Dask: shared arrays travel through distributed's serialization as payloads on one node and
as data between nodes.

:func:`register` adds :class:`~sharedarrays.SharedDeviceArray` to distributed's ``"dask"``
serialization family; ``import sharedarrays`` does it once distributed is imported. The
sender chooses per transfer from the comm's ``context``: on one host (same address host,
``inproc://``, or no comm) the array travels as its **payload** and the receiver maps the
same memory; otherwise as its **data** (NumPy's serializer, or CuPy's ``"cuda"`` family on
``ucx://``), copied into a new shared array on the receiver's node. A payload that reaches
another node anyway is refused with :class:`~sharedarrays.WrongNode`. An array placed
directly in a task travels pickled with the task (see :mod:`sharedarrays.api.othernode`).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from sharedarrays.api.array import SharedDeviceArray
from sharedarrays.api.creation import from_array
from sharedarrays.process import STATE

__all__ = ["install", "register", "registered", "same_node_transfer"]

PAYLOAD = "payload"
DATA = "data"


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


_SERIALIZE = "distributed.protocol.serialize"


def install() -> None:
    """Register now if distributed is imported, else the first time a view is pickled (not
    by multiprocessing) after it is; imports no dask."""
    if _SERIALIZE in sys.modules:
        register()
    else:
        STATE.pickling.reduce_hooks[_SERIALIZE] = register


def same_node_transfer(context: dict[str, Any] | None) -> bool:
    """Whether a message written with distributed's ``context`` goes to this host (also
    without a comm, or over ``inproc://``)."""
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
    """distributed's ``dask_serialize``: the payload on one host, the data between hosts."""
    if same_node_transfer(context):
        return {"form": PAYLOAD}, [pickle.dumps(a, protocol=5)]
    from distributed.protocol.serialize import serialize as dask_serialize_any

    native = a.array
    recipient = ((context or {}).get("recipient") or {}).get("address", "")
    family = "cuda" if a.device.needs_context and str(recipient).startswith("ucx") else "dask"
    header, frames = dask_serialize_any(
        native, serializers=(family,), on_error="raise", context=context
    )
    return {"form": DATA, "kind": a.device.kind, "data": header}, list(frames)


def deserialize(header: dict[str, Any], frames: list[Any]) -> SharedDeviceArray:
    """distributed's ``dask_deserialize``: load the payload, or copy the data into a new
    shared array."""
    if header.get("form") == PAYLOAD:
        a = pickle.loads(frames[0])
        if not isinstance(a, SharedDeviceArray):
            raise TypeError("a shared array's Dask message did not hold a shared array")
        return a
    from distributed.protocol.serialize import deserialize as dask_deserialize_any

    native = dask_deserialize_any(header["data"], frames)
    return from_array(native, device="cpu" if header.get("kind") == "cpu" else None)
