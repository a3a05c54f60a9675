"""The creation keywords (:class:`CreationKeywords`), checked into :class:`CreationOptions`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, TypedDict

from sharedarrays.api.arraybase import operator_index
from sharedarrays.api.named import check_name
from sharedarrays.backends import Access
from sharedarrays.backends.device import Device, DeviceLike, parse_device
from sharedarrays.errors import OutOfMemory
from sharedarrays.process import PID_MAX_LIMIT
from sharedarrays.protocol.payload import MAX_SIZE

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["AccessList", "CreationKeywords", "CreationOptions"]

AccessList = Sequence[DeviceLike | tuple[DeviceLike, str]]
"""``access=``: devices (read-write), or ``(device, "rw" | "r")`` pairs."""


class CreationKeywords(TypedDict, total=False):
    """The keywords every creation function takes (``**options`` of :func:`~sharedarrays.empty`).

    Parameters
    ----------
    device : str, int, torch.device, cupy.cuda.Device or None
        ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``N`` or a :class:`~sharedarrays.Device`;
        ``None``: ``"cuda:0"`` when a CUDA device is usable, else ``"cpu"``.
    backend : str, default "auto"
        ``"cuda-vmm"`` (memory lives while any process holds it), ``"cuda-ipc"`` or
        ``"cuda-pool"`` (the creator must outlive every importer), or ``"host"``. ``"auto"``:
        host on the CPU, else the first the device supports (:func:`~sharedarrays.list_backends`).
    chunk_bytes : int, optional
        Largest chunk of the allocation (default: one chunk; a growable array's at most
        :data:`sharedarrays.memory.DEFAULT_CHUNK_BYTES`).
    pack : bool, optional
        Carve the array out of a shared 2 MiB slab (default up to
        :data:`~sharedarrays.memory.PACK_BYTES` where no keyword rules it out): one handle
        for many small arrays, but neighbours share the slab's secret.
    progress : bool, optional
        Show a tqdm bar while filling or copying (default: in a Jupyter kernel, from
        :data:`~sharedarrays.api.creation.PROGRESS_BYTES` on).
    name : str, optional
        Name the array in this user's keeper: any process of the user can
        :func:`~sharedarrays.attach` it, also after this one exited, until
        :func:`~sharedarrays.unlink`. 1 to 128 characters from ``A-Z a-z 0-9 . _ -``.
    allow_pids : iterable of int, optional
        Only these processes (and this one) may import the array; default: any of this user.
    readonly : bool, default False
        Importers get read-only mappings (a host memfd is sealed: it cannot grow).
    access : sequence, optional
        Other CUDA devices that may read and write (``"rw"``) or only read (``"r"``) the
        memory here, e.g. ``["cuda:1", ("cuda:2", "r")]``; cuda-vmm only.
    capacity : int, optional
        Bytes of address space to reserve: the array then grows and shrinks along axis 0
        without copying (:meth:`~sharedarrays.SharedDeviceArray.resize`), and moves to a new
        reservation past it. Growable arrays are C-ordered, never packed and never named.
    """

    device: DeviceLike
    backend: str
    chunk_bytes: int | None
    pack: bool | None
    progress: bool | None
    name: str | None
    allow_pids: Iterable[int] | None
    readonly: bool
    capacity: int | None
    access: AccessList | None


@dataclass(frozen=True)
class CreationOptions:
    """The creation keywords, checked (:meth:`from_keywords`): ``pack`` False where another
    keyword rules it out, ``peers`` the other CUDA devices' ordinals with their access."""

    device: Device
    backend: str = "auto"
    order: str = "C"
    chunk_bytes: int | None = None
    pack: bool | None = None
    progress: bool | None = None
    name: str | None = None
    allow_pids: frozenset[int] | None = None
    readonly: bool = False
    capacity: int | None = None
    peers: Mapping[int, Access] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def from_keywords(
        cls, *, order: str = "C", **keywords: Unpack[CreationKeywords]
    ) -> CreationOptions:
        """Check the keywords (BackendUnavailable, OutOfMemory for a capacity over 128 TiB,
        TypeError or ValueError for a bad keyword or combination)."""
        unknown = keywords.keys() - CreationKeywords.__annotations__
        if unknown:
            raise TypeError(f"unexpected keyword argument {sorted(unknown)[0]!r}")
        dev = parse_device(keywords.get("device"))
        pack, name, capacity = keywords.get("pack"), keywords.get("name"), keywords.get("capacity")
        if order not in ("C", "F"):
            raise ValueError(f"order must be 'C' or 'F', not {order!r}")
        if capacity is not None:
            capacity = operator_index(capacity)
            if capacity > MAX_SIZE:  # (OutOfMemory, as a reservation the system refuses)
                raise OutOfMemory(
                    f"capacity={capacity} is more address space than any process can reserve; "
                    f"at most {MAX_SIZE} bytes (128 TiB, what a payload may name)"
                )
            if pack:
                raise ValueError("pack=True and capacity cannot be combined: a slab cannot grow")
            if name is not None:
                raise ValueError(
                    "a named array cannot be growable (the keeper holds a fixed set of chunks); "
                    "leave out name= or capacity="
                )
            if order != "C":
                raise ValueError("a growable array grows along axis 0 and must be in C order")
            pack = False
        if name is not None:
            check_name(name)
        pids = keywords.get("allow_pids")
        allowed = None if pids is None else frozenset(operator_index(p) for p in pids)
        if allowed is not None and not all(0 < p <= PID_MAX_LIMIT for p in allowed):
            raise ValueError(
                f"allow_pids are process ids, from 1 to {PID_MAX_LIMIT}: got {sorted(allowed)}"
            )
        readonly = bool(keywords.get("readonly", False))
        if name is not None or allowed is not None or readonly:
            if pack:
                raise ValueError("pack=True cannot be combined with name, allow_pids or readonly")
            pack = False  # a slab's neighbours would share the name, the pid list or the secret
        peers = _peers(keywords.get("access"), dev)
        if peers:
            if pack:
                raise ValueError("pack=True cannot be combined with access= for other devices")
            pack = False  # a slab's neighbours would share the grant
        chunk_bytes = keywords.get("chunk_bytes")
        if pack and chunk_bytes is not None:
            raise ValueError("pack=True and chunk_bytes cannot be combined")
        return cls(
            device=dev,
            backend=keywords.get("backend", "auto"),
            order=order,
            chunk_bytes=chunk_bytes,
            pack=None if pack is None else bool(pack),
            progress=keywords.get("progress"),
            name=name,
            allow_pids=allowed,
            readonly=readonly,
            capacity=capacity,
            peers=MappingProxyType(peers),
        )


def _peers(access: AccessList | None, device: Device) -> dict[int, Access]:
    """The devices besides ``device`` that ``access=`` names, with their modes."""
    if access is None:
        return {}
    if isinstance(access, (str, bytes, Device, int)):
        raise TypeError("access= takes a list of devices, e.g. ['cuda:0', 'cuda:1']")
    peers: dict[int, Access] = {}
    for item in access:
        if isinstance(item, tuple) and len(item) != 2:
            raise ValueError(f"access= items are devices or (device, mode) pairs, not {item!r}")
        dev_like, mode = item if isinstance(item, tuple) else (item, "rw")
        if mode not in ("rw", "r"):
            raise ValueError(f"access mode must be 'rw' or 'r', not {mode!r}")
        dev = parse_device(dev_like)
        if dev.kind != device.kind:
            raise ValueError(
                f"{device} memory cannot be granted to {dev}: "
                + ("host memory is accessed by the cpu only" if not device.needs_context else
                   "access= lists CUDA devices")
            )  # fmt: skip
        if dev == device:
            if mode != "rw":
                raise ValueError(
                    f"{device} is the memory's own device and keeps read-write access in the "
                    "creating process; readonly=True makes importers read-only"
                )
            continue
        peers[dev.index] = "r" if mode == "r" else "rw"
    return peers
