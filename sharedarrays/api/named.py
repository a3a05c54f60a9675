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
that holds a view of it) lets it go again. Both names and parking hand the handles over
through :mod:`sharedarrays.api.keeping`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from sharedarrays.api import keeping
from sharedarrays.api.array import SharedDeviceArray, load
from sharedarrays.backends import device_of
from sharedarrays.backends.device import Device
from sharedarrays.errors import (
    HandleUnavailable,
    KeeperError,
    NameNotFound,
    PayloadError,
    SharedArrayError,
)
from sharedarrays.memory import live_allocations
from sharedarrays.protocol import keeper as keeper_protocol
from sharedarrays.protocol.payload import Payload
from sharedarrays.transport import keeper

__all__ = ["NamedArray", "attach", "list_named", "unlink", "publish"]


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


def publish(a: SharedDeviceArray, name: str) -> None:
    """Give ``a``'s handles to the keeper under ``name`` (creation calls this, with a name
    :class:`~sharedarrays.api.options.CreationOptions` has checked).

    Raises
    ------
    NameExists
        The name is taken.
    """
    keeping.keep(a, name)


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
        try:
            found = Payload.from_doc(doc)
        except PayloadError as e:
            raise KeeperError(f"the keeper sent an inconsistent reply: {e}") from None
        if found.alloc_id != alloc_id:
            raise KeeperError("the keeper sent an inconsistent reply")
        blob = found.to_bytes()
    except BaseException:
        for fd in fds:
            os.close(fd)
        keeper.release(alloc_id)
        raise
    try:
        attached = load(blob, fds=tuple(_Fd(fd) for fd in fds))
    except BaseException:
        keeper.release(alloc_id)
        raise
    attached.allocation.in_keeper = True
    attached.allocation.keeper_name = name
    return attached


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
    for alloc in live_allocations():  # (what the memory map shows of it here)
        if alloc.keeper_name == name:
            alloc.keeper_name = None
            alloc.in_keeper = False


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

    def ask(req: keeper_protocol.List) -> tuple[int, dict[str, Any]]:
        status, body, _ = keeper.request(req, start=False)
        return status, body

    try:
        status, body = keeper_protocol.list_pages(ask)
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
    device = device_of(e["backend"], int(e["device"]))
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
