"""Named arrays and parked arrays: arrays whose handles this user's keeper holds.

Like :class:`multiprocessing.shared_memory.SharedMemory` with ``name=``, but for shared
arrays on a GPU or in host memory:

* ``sa.empty(shape, name="features")`` (and the other constructors) creates an array and
  gives its handles to the keeper under that name;
* ``sa.attach("features")`` maps it in any process of the same user on this host, also
  after its creator exited;
* ``sa.unlink("features")`` removes the name. The memory is freed once the last process that
  attached it (or created it) releases it, exits or dies.

A process *closes* its views (:meth:`SharedDeviceArray.close`); that never frees an array
other processes use, and never removes its name. *Unlinking* removes the name; it never takes
memory away from a process that maps it. Every name should be unlinked once: a named array
that nobody unlinks lives as long as the keeper.

``a.park()`` does the same for an unnamed array: the keeper holds its handles, so a payload
(``pickle.dumps(a)``) still loads after the exporter exited. ``a.unpark()`` (in any process
that holds a view of it) lets it go again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sharedarrays.api.array import SharedDeviceArray, load
from sharedarrays.backends.device import CPU, Device
from sharedarrays.errors import HandleUnavailable, KeeperError, NameNotFound, SharedArrayError
from sharedarrays.protocol import keeper as keeper_protocol
from sharedarrays.protocol.payload import MAGIC, TAG_BYTES, Payload
from sharedarrays.transport import keeper

__all__ = ["NamedArray", "attach", "list_named", "unlink", "publish", "park", "unpark"]


@dataclass(frozen=True)
class NamedArray:
    """One array the keeper holds, as :func:`list_named` reports it.

    Attributes
    ----------
    name : str or None
        Its name; ``None`` for a parked unnamed array.
    id : str
        The allocation id.
    shape : tuple of int
        The shape it was created with.
    dtype : numpy.dtype
        Element type.
    device : Device
        Where the memory lives.
    size : int
        Bytes held (the whole allocation, rounded up to the backend's granularity).
    creator : int
        Pid of the process that created (or parked) it; it may have exited.
    created : float
        When the keeper received it (``time.time()``).
    pids : tuple of int
        Processes that hold it now: the creator while it holds a view, and every process
        that attached or fetched it and has not released its mapping.
    linked : bool
        False once unlinked (it stays listed until the last holder releases it).
    readonly : bool
        Whether importers get read-only mappings.
    allow_pids : tuple of int or None
        The processes allowed to import it (besides the creator), or ``None`` for any
        process of this user.
    """

    name: str | None
    id: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    device: Device
    size: int
    creator: int
    created: float
    pids: tuple[int, ...]
    linked: bool
    readonly: bool
    allow_pids: tuple[int, ...] | None


class _Fd:
    """An fd received from the keeper, in the shape :func:`sharedarrays.load` takes."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


def _doc(a: SharedDeviceArray) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(a.payload().to_bytes()[len(MAGIC) + TAG_BYTES :])
    return doc


def _allow(pids: Iterable[int] | None) -> list[int] | None:
    if pids is None:
        return None
    out = sorted({int(p) for p in pids})
    if any(p <= 0 for p in out):
        raise ValueError(f"allow_pids must be positive process ids, got {out}")
    return out


def _keep(a: SharedDeviceArray, name: str | None) -> None:
    alloc = a.allocation
    if alloc.backend.exporter_owned:
        raise ValueError(
            f"a {alloc.backend.name} array cannot be named or parked: its memory lives only as "
            "long as the process that made it, and the keeper holds fds, not processes. Make "
            "it with backend='cuda-vmm' (the default where the device supports it)"
        )
    if alloc.growable:
        raise ValueError(
            "a growable array (capacity=) cannot be named or parked: the keeper holds a "
            "fixed set of chunks. Keep its creator running while others load it"
        )
    req = keeper_protocol.Keep(
        alloc.id, alloc.secret, name, alloc.chunk_sizes(), _doc(a), _allow(alloc.allow_pids)
    )
    if len(alloc.chunk_sizes()) > keeper_protocol.MAX_FDS:
        raise ValueError(
            f"the keeper holds arrays of at most {keeper_protocol.MAX_FDS} chunks; this one has "
            f"{len(alloc.chunk_sizes())} (pass a larger chunk_bytes)"
        )
    handles, temporary = alloc.handles_for_importers()  # read-only ones for readonly arrays
    try:
        status, body, fds = keeper.request(req, handles)
    finally:
        for fd in temporary:
            os.close(fd)
    for fd in fds:
        os.close(fd)
    what = f"cannot name the array {name!r}" if name else "cannot park the array"
    keeper.raise_for(status, body, what)
    keeper.hold(alloc.id)


def publish(a: SharedDeviceArray, name: str) -> None:
    """Give ``a``'s handles to the keeper under ``name`` (creation calls this).

    Raises
    ------
    NameExists
        The name is taken.
    """
    keeper_protocol.check_name(name)
    _keep(a, name)


def park(a: SharedDeviceArray) -> None:
    """Give ``a``'s handles to the keeper, so that its payloads load after this process
    exits. Idempotent. Undo with :func:`unpark`."""
    _keep(a, None)


def unpark(a: SharedDeviceArray) -> None:
    """Let the keeper drop a parked array (the memory returns once no process maps it).

    Raises
    ------
    NameNotFound
        The keeper does not hold it.
    """
    alloc = a.allocation
    try:
        status, body, _ = keeper.request(
            keeper_protocol.Unlink(alloc_id=alloc.id, secret=alloc.secret), start=False
        )
    except HandleUnavailable:
        raise NameNotFound(f"allocation {alloc.id} is not parked: no keeper runs") from None
    keeper.raise_for(status, body, f"cannot unpark allocation {alloc.id}")


def attach(name: str) -> SharedDeviceArray:
    """Map the named array ``name`` into this process and return a view of it.

    The view has the shape, dtype and layout the array was created with. It works in any
    process of the same OS user on this host, also after the creator exited. Attaching an
    array this process maps already returns a new view of the same mapping.

    Parameters
    ----------
    name : str
        The name given at creation (``sa.empty(..., name=...)``).

    Raises
    ------
    NameNotFound
        No array has that name (none was made, it was unlinked, or no keeper runs).
    KeeperError
        The keeper runs but did not answer in time (it is overloaded or stopped).
    PermissionDenied
        The array was created with ``allow_pids`` that do not include this process.
    ValueError, TypeError
        Not a valid name.
    """
    keeper_protocol.check_name(name)
    try:
        status, body, fds = keeper.request(keeper_protocol.Attach(name), start=False)
    except HandleUnavailable:
        raise NameNotFound(f"no array named {name!r}: no keeper runs for this user") from None
    try:
        keeper.raise_for(status, body, f"cannot attach {name!r}")
        doc, alloc_id = body.get("doc"), body.get("id")
        if type(doc) is not dict or type(alloc_id) is not str:
            raise KeeperError("the keeper sent an inconsistent reply")
        keeper.hold(alloc_id)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    try:
        blob = _reseal(doc)
        if Payload.from_bytes(blob).alloc_id != alloc_id:
            raise KeeperError("the keeper sent an inconsistent reply")
    except BaseException:
        for fd in fds:
            os.close(fd)
        keeper.release(alloc_id)
        raise
    try:
        return load(blob, fds=tuple(_Fd(fd) for fd in fds))
    except BaseException:
        keeper.release(alloc_id)
        raise


def _reseal(doc: dict[str, Any]) -> bytes:
    """The payload bytes of a document the keeper returned (validated on load)."""
    from sharedarrays.protocol.payload import _tag

    secret = doc.get("secret")
    if type(secret) is not str or len(secret) != 64:
        raise KeeperError("the keeper sent an inconsistent reply")
    try:
        key = bytes.fromhex(secret)
    except ValueError:
        raise KeeperError("the keeper sent an inconsistent reply") from None
    body = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + _tag(body, key) + body


def unlink(name: str) -> None:
    """Remove the name ``name``.

    The array can no longer be attached by name (nor its payloads fetched from the keeper).
    Processes that map it keep their mappings; the keeper closes its handles, and the memory
    is freed, once the last of them releases it, exits or dies. Like
    :meth:`multiprocessing.shared_memory.SharedMemory.unlink`, call it once per name, in
    any process.

    Raises
    ------
    NameNotFound
        No array has that name.
    KeeperError
        The keeper runs but did not answer in time (it is overloaded or stopped).
    """
    keeper_protocol.check_name(name)
    try:
        status, body, _ = keeper.request(keeper_protocol.Unlink(name), start=False)
    except HandleUnavailable:
        raise NameNotFound(f"no array named {name!r}: no keeper runs for this user") from None
    keeper.raise_for(status, body, f"cannot unlink {name!r}")


def list_named(parked: bool = False) -> list[NamedArray]:
    """The arrays this user's keeper holds, by name (starts no keeper).

    Parameters
    ----------
    parked : bool, default False
        Also list parked unnamed arrays and unlinked arrays that are still held.

    Raises
    ------
    KeeperError
        The keeper runs but did not answer in time (it is overloaded or stopped).
    """
    try:
        status, body, _ = keeper.request(keeper_protocol.List(), start=False)
    except HandleUnavailable:
        return []
    keeper.raise_for(status, body, "cannot list the keeper's arrays")
    out = []
    for e in body.get("arrays", []):
        try:
            info = _info(e)
        except (KeyError, TypeError, ValueError, SharedArrayError):
            continue
        if parked or (info.name is not None and info.linked):
            out.append(info)
    return sorted(out, key=lambda i: (i.name is None, i.name or "", i.created))


def _info(e: dict[str, Any]) -> NamedArray:
    device = CPU if e["backend"] == "host" else Device("cuda", int(e["device"]))
    allow = e.get("allow_pids")
    return NamedArray(
        name=e["name"],
        id=e["id"],
        shape=tuple(int(n) for n in e["shape"]),
        dtype=np.dtype(e["dtype"]),
        device=device,
        size=int(e["size"]),
        creator=int(e["creator"]),
        created=float(e["created"]),
        pids=tuple(int(p) for p in e["pids"]),
        linked=bool(e["linked"]),
        readonly=bool(e["readonly"]),
        allow_pids=None if allow is None else tuple(int(p) for p in allow),
    )
