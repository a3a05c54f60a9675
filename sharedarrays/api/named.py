"""Named arrays, whose handles this user's keeper holds (as ``SharedMemory(name=...)``):
``sa.empty(n, name="x")``, ``sa.attach("x")`` in any process of the user, also after the
creator exited, ``sa.unlink("x")``; in a namespace per project (:func:`namespace`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sharedarrays.api import keeping
from sharedarrays.api.array import SharedDeviceArray, load
from sharedarrays.api.keeping import NAMESPACE_VARIABLE, PROJECT_MARKERS, namespace, shown, whose
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
from sharedarrays.process import STATE
from sharedarrays.protocol import keeper as keeper_protocol
from sharedarrays.protocol.payload import Payload
from sharedarrays.transport import keeper

__all__ = ["NAMESPACE_VARIABLE", "PROJECT_MARKERS", "NamedArray", "attach", "check_name"]
__all__ += ["list_named", "namespace", "publish", "qualify", "unlink"]


def check_name(name: object) -> str:
    """``name`` if it is a valid array name (TypeError, ValueError if not): a keeper name
    (:func:`sharedarrays.protocol.keeper.check_name`), or ``"/name"`` for a global one."""
    global_name = isinstance(name, str) and name.startswith("/") and name.count("/") == 1
    try:
        keeper_protocol.check_name(str(name)[1:] if global_name else name)
    except ValueError:
        raise ValueError(
            f"invalid array name {name!r}: use 1 to {keeper_protocol.MAX_NAME} characters from "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit ('ns/name' names it in "
            "namespace ns, '/name' a global name)"
        ) from None
    return str(name)


def qualify(name: str) -> str:
    """The keeper's name for ``name``: ``"namespace/name"``, or ``"name"`` for a global one."""
    space, slash, base = check_name(name).rpartition("/")
    if not slash:
        space = namespace() or ""
    return f"{space}/{base}" if space else base


@dataclass(frozen=True)
class NamedArray:
    """One array the keeper holds, as :func:`list_named` reports it: ``name`` and ``namespace``
    (``None`` for a parked array or a global name), allocation ``id``, ``size`` in bytes,
    ``creator`` pid, when the keeper got it (``created``), the ``pids`` that map it, ``linked``
    (False once unlinked, until the last holder lets go), ``allow_pids`` (``None``: any)."""

    name: str | None
    namespace: str | None
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

    @property
    def qualified(self) -> str | None:
        """The name that reaches it from any namespace (``"ns/name"``, ``"/name"``)."""
        return None if self.name is None else f"{self.namespace or ''}/{self.name}"


@dataclass(frozen=True)
class _Fd:
    """An fd received from the keeper, as :func:`sharedarrays.load` takes it."""

    fd: int

    def detach(self) -> int:
        return self.fd


def publish(a: SharedDeviceArray, name: str) -> None:
    """Give ``a``'s handles to the keeper under ``name`` (NameExists if taken)."""
    keeping.keep(a, qualify(name))


def attach(name: str) -> SharedDeviceArray:
    """A view of the named array ``name`` (``"name"`` in this namespace, ``"ns/name"`` in
    ``ns``, ``"/name"`` global), as created. Raises NameNotFound (naming where it is),
    KeeperError (no answer in time), PermissionDenied (``allow_pids``), ValueError, TypeError."""
    key, status, body, fds = _ask(name, keeper_protocol.Attach)
    held = None  # (the allocation held in the keeper for this process, once it is)
    try:
        keeper.raise_for(status, body, f"cannot attach {name!r}")
        doc, alloc_id = body.get("doc"), body.get("id")
        if type(doc) is not dict or type(alloc_id) is not str:
            raise KeeperError("the keeper sent an inconsistent reply")
        keeper.hold(alloc_id)
        held = alloc_id
        try:
            found = Payload.from_doc(doc)
        except PayloadError as e:
            raise KeeperError(f"the keeper sent an inconsistent reply: {e}") from None
        if found.alloc_id != alloc_id:
            raise KeeperError("the keeper sent an inconsistent reply")
        blob = found.to_bytes()
        carried, fds = tuple(_Fd(fd) for fd in fds), []  # load's to close from here on
        attached = load(blob, fds=carried)
    except BaseException:
        for fd in fds:
            os.close(fd)
        if held is not None:
            keeper.release(held)
        raise
    STATE.keeper.kept[attached.allocation] = key
    return attached


def _ask(name: str, request: Callable[[str], Any]) -> tuple[str, int, dict[str, Any], list[int]]:
    """``name``'s keeper key and a running keeper's reply to ``request(key)`` (NameNotFound
    naming where else it is)."""
    key = qualify(name)
    try:
        status, body, fds = keeper.request(request(key), start=False)
    except HandleUnavailable:
        raise NameNotFound(f"no array named {name!r}: no keeper runs for this user") from None
    if status != keeper_protocol.NOT_FOUND:
        return key, status, body, fds
    # not found: say where else it is
    space, _, base = key.rpartition("/")
    where = f"namespace {space!r}" if space else "the global namespace"
    if "/" not in name and space:
        where += f" ({whose()})"
    names = [e["name"] for e in _entries() if type(e.get("name")) is str and e.get("linked")]
    elsewhere = sorted({shown(n) for n in names if n.rpartition("/")[2] == base and n != key})
    if not elsewhere:
        raise NameNotFound(
            f"no array named {base!r} in {where}: none was made there, or it was unlinked "
            "(python -m sharedarrays ls --all-namespaces lists every namespace)"
        )
    first = elsewhere[0].rpartition("/")[0] or "/"
    raise NameNotFound(
        f"no array named {base!r} in {where}; it exists as "
        + " and ".join(repr(n) for n in elsewhere)
        + f": attach it by that name (sa.attach({elsewhere[0]!r})), or set "
        f"{NAMESPACE_VARIABLE}={first} to work in that namespace"
    )


def unlink(name: str) -> None:
    """Remove the name ``name`` (as :func:`attach` reads it); processes that map it keep it."""
    key, status, body, _ = _ask(name, keeper_protocol.Unlink)
    keeper.raise_for(status, body, f"cannot unlink {name!r}")
    for alloc in live_allocations():  # (what the memory map shows of it here)
        if STATE.keeper.kept.get(alloc) == key:
            del STATE.keeper.kept[alloc]


def list_named(parked: bool = False, all_namespaces: bool = False) -> list[NamedArray]:
    """The named arrays the keeper holds in this namespace (``all_namespaces``: in all);
    ``parked`` adds parked and unlinked ones still held. Starts no keeper."""
    here = None if all_namespaces else namespace()
    out = []
    for e in _entries():
        try:
            key, allow = e["name"], e.get("allow_pids")
            if key is not None and type(key) is not str:
                raise TypeError("a name is a str")
            space, _, name = ("", "", None) if key is None else key.rpartition("/")
            info = NamedArray(
                name=name,
                namespace=space or None,
                id=e["id"],
                shape=tuple(int(n) for n in e["shape"]),
                dtype=np.dtype(e["dtype"]),
                device=device_of(e["backend"], int(e["device"])),
                size=int(e["size"]),
                creator=int(e["creator"]),
                created=float(e["created"]),
                pids=tuple(int(p) for p in e["pids"]),
                linked=bool(e["linked"]),
                readonly=bool(e["readonly"]),
                allow_pids=None if allow is None else tuple(int(p) for p in allow),
            )
        except (KeyError, TypeError, ValueError, SharedArrayError):
            continue
        if info.name is not None and not all_namespaces and info.namespace != here:
            continue
        if parked or (info.name is not None and info.linked):
            out.append(info)
    return sorted(out, key=lambda i: (i.name is None, i.namespace or "", i.name or "", i.created))


def _entries() -> list[dict[str, Any]]:
    """What the keeper lists, in every namespace (nothing when none runs)."""
    try:
        status, body = keeper_protocol.list_pages(lambda req: keeper.request(req, start=False)[:2])
    except HandleUnavailable:
        return []
    keeper.raise_for(status, body, "cannot list the keeper's arrays")
    return [e for e in body.get("arrays", []) if type(e) is dict]
