"""Dask: shared arrays travel through distributed's serialization as payloads on one node and
as data between nodes.

:func:`register` adds :class:`~sharedarrays.SharedDeviceArray` to distributed's own dispatch
(``distributed.protocol.dask_serialize`` / ``dask_deserialize``, the ``"dask"`` family that
every comm tries first). It is called for you: when ``import sharedarrays`` finds distributed
imported already, and otherwise the first time an array is pickled while distributed is
imported, by any pickler but multiprocessing's (distributed's own pickling is one: that
first message still carries the payload, as pickle does). Nothing here
imports dask unless the program did.

**The choice is made per transfer**, by the sender, from the comm's ``context`` that
distributed passes to the serializer (the sender's and the recipient's addresses):

- the two ends are on one host (the same address host, as ``Comm.same_host`` decides, or an
  ``inproc://`` comm, or no comm at all: spilling, ``distributed.protocol.serialize``
  without a context): the array travels as its **payload** (a pickle of a few hundred bytes:
  ``frames == [pickle.dumps(a)]``), and the receiver maps the same memory;
- otherwise as its **data**, through Dask's own serializers of the native array (NumPy's, or
  on a ``ucx://`` comm CuPy's ``"cuda"`` family, so UCX / NVLink carry device frames), and the
  receiver copies it into a new shared array of its own node (on the CPU when it came from
  host memory, on the receiver's current CUDA device when it came from one): an array of
  the same type, whose writes the sender does not see.

A payload that reaches a process on another node although the addresses matched (workers
of several users or containers behind one address) is refused there with
:class:`~sharedarrays.WrongNode` (the payload carries its node, see
:mod:`sharedarrays.node`): nothing is opened. Give such workers addresses of their own.

An array placed directly in a task (``client.submit(f, a)``, a ``sa.to_dask`` graph) does not
come here: distributed pickles it with the task, as its payload. On a worker of another node
the task then fails with :class:`~sharedarrays.WrongNode` when it uses the array, and the
worker stays (:mod:`sharedarrays.api.othernode`); scatter such an array first.
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from sharedarrays.api.array import SharedDeviceArray, reduce_hooks
from sharedarrays.api.creation import from_array

__all__ = ["install", "register", "registered", "same_node_transfer"]

_registered = False
PAYLOAD = "payload"
DATA = "data"


def registered() -> bool:
    """Whether :func:`register` ran in this process."""
    return _registered


def register() -> None:
    """Register shared arrays with distributed's ``"dask"`` serialization family (once)."""
    global _registered
    if _registered:
        return
    from distributed.protocol import dask_deserialize, dask_serialize

    dask_serialize.register(SharedDeviceArray)(serialize)
    dask_deserialize.register(SharedDeviceArray)(deserialize)
    _registered = True


_SERIALIZE = "distributed.protocol.serialize"


def install() -> None:
    """Register now if distributed is imported, else the first time an array is pickled
    (not by multiprocessing) after it is; it imports no dask. ``import sharedarrays`` does
    the same without importing this module (its hook imports it once distributed is
    imported)."""
    if _SERIALIZE in sys.modules:
        register()
    else:
        reduce_hooks[_SERIALIZE] = register


def same_node_transfer(context: dict[str, Any] | None) -> bool:
    """Whether a message written with distributed's ``context`` goes to this host.

    ``None`` (no comm: spilling to disk, a plain ``serialize``), an ``inproc://`` comm, or a
    sender and recipient whose addresses name the same host: ``True``.
    """
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
    """distributed's ``dask_serialize`` for a shared array: the payload on one host, the data
    between hosts (see the module's notes)."""
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
    """distributed's ``dask_deserialize`` for a shared array: load the payload (refused on
    another node with :class:`~sharedarrays.WrongNode`), or copy the data into a new shared
    array of this node."""
    if header.get("form") == PAYLOAD:
        a = pickle.loads(frames[0])
        if not isinstance(a, SharedDeviceArray):
            raise TypeError("a shared array's Dask message did not hold a shared array")
        return a
    from distributed.protocol.serialize import deserialize as dask_deserialize_any

    native = dask_deserialize_any(header["data"], frames)
    return from_array(native, device="cpu" if header.get("kind") == "cpu" else None)
