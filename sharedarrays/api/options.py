"""The keywords of the creation functions, validated once: :class:`CreationOptions`.

:func:`~sharedarrays.empty`, :func:`~sharedarrays.zeros`, :func:`~sharedarrays.ones`,
:func:`~sharedarrays.full` and :func:`~sharedarrays.from_array` take the same keywords
(documented once, in :func:`~sharedarrays.empty`). Each turns them into one frozen
:class:`CreationOptions` with :meth:`CreationOptions.from_keywords`, which checks every keyword
and every combination of keywords, and hands the record down. What depends on the array
itself (its shape and dtype: the size a ``capacity`` must hold, whether a small array is
packed) or on the memory system chosen (whether a ``name`` can outlive its creator) is
checked when the array is made (:mod:`sharedarrays.api.creation`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypedDict

from sharedarrays.api.array import operator_index
from sharedarrays.api.named import check_name
from sharedarrays.backends import Access
from sharedarrays.backends.device import Device, DeviceLike, parse_device
from sharedarrays.errors import OutOfMemory
from sharedarrays.process import PID_MAX_LIMIT
from sharedarrays.protocol.payload import MAX_SIZE

__all__ = ["AccessList", "CreationKeywords", "CreationOptions"]

AccessList = Sequence[DeviceLike | tuple[DeviceLike, str]]
"""``access=``: devices (read-write), or ``(device, "rw" | "r")`` pairs."""


class CreationKeywords(TypedDict, total=False):
    """The keywords every creation function takes (``**options``), typed once: what each
    means is documented in :func:`~sharedarrays.empty`, their defaults and checks are
    :meth:`CreationOptions.from_keywords`'s. ``order`` is each function's own (the
    ``*_like`` ones take it by position too, and :func:`~sharedarrays.from_array` keeps its
    source's)."""

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
    """How to make a new shared array: the creation functions' keywords, validated.

    Make one with :meth:`from_keywords`, which checks them; the meaning of each keyword is
    documented in :func:`~sharedarrays.empty`.

    Attributes
    ----------
    device : Device
        The device of the memory (``device=`` parsed).
    backend : str
        The memory system asked for (``"auto"`` or a backend's name); it is chosen for the
        device when the array is made.
    order : {"C", "F"}
        The layout.
    chunk_bytes : int or None
        The largest chunk, or None for the default.
    pack : bool or None
        True: carve the array out of a slab; False: an allocation of its own (asked for, or
        ruled out by ``name``, ``allow_pids``, ``readonly``, ``capacity`` or ``access``);
        None: pack when the array is small enough and ``chunk_bytes`` is not given.
    progress : bool or None
        Progress bar of a fill or copy (None: for large arrays in a Jupyter kernel only).
    name : str or None
        The array's name in the keeper (a valid name).
    allow_pids : frozenset of int or None
        The process ids that may import the array, or None for any.
    readonly : bool
        Whether importers get read-only mappings.
    capacity : int or None
        Bytes to reserve for a growable array (at most what a payload may name).
    peers : Mapping[int, Access]
        Other CUDA devices (by ordinal) granted access in this process (``access=``),
        without the memory's own device.
    """

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
        cls,
        *,
        device: DeviceLike = None,
        backend: str = "auto",
        order: str = "C",
        chunk_bytes: int | None = None,
        pack: bool | None = None,
        progress: bool | None = None,
        name: str | None = None,
        allow_pids: Iterable[int] | None = None,
        readonly: bool = False,
        capacity: int | None = None,
        access: AccessList | None = None,
    ) -> CreationOptions:
        """Check the creation keywords (as :func:`~sharedarrays.empty` takes them).

        Raises
        ------
        BackendUnavailable
            CUDA was asked for explicitly and cannot be used here.
        OutOfMemory
            A capacity over 128 TiB (no process can reserve it).
        TypeError, ValueError
            A bad device, order, name, allow_pids (process ids), capacity or access, or
            keywords that cannot be combined (``pack=True`` with what rules
            packing out, ``capacity`` with ``name`` or ``order="F"``).
        """
        dev = parse_device(device)
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
        allowed = None if allow_pids is None else frozenset(operator_index(p) for p in allow_pids)
        if allowed is not None and not all(0 < p <= PID_MAX_LIMIT for p in allowed):
            raise ValueError(
                f"allow_pids are process ids, from 1 to {PID_MAX_LIMIT}: got {sorted(allowed)}"
            )
        if name is not None or allowed is not None or readonly:
            if pack:
                raise ValueError("pack=True cannot be combined with name, allow_pids or readonly")
            pack = False  # a slab's neighbours would share the name, the pid list or the secret
        peers = _peers(access, dev)
        if peers:
            if pack:
                raise ValueError("pack=True cannot be combined with access= for other devices")
            pack = False  # a slab's neighbours would share the grant
        if pack and chunk_bytes is not None:
            raise ValueError("pack=True and chunk_bytes cannot be combined")
        return cls(
            device=dev,
            backend=backend,
            order=order,
            chunk_bytes=chunk_bytes,
            pack=None if pack is None else bool(pack),
            progress=progress,
            name=name,
            allow_pids=allowed,
            readonly=bool(readonly),
            capacity=capacity,
            peers=MappingProxyType(peers),
        )


def _peers(access: AccessList | None, device: Device) -> dict[int, Access]:
    """The peer devices ``access=`` names (besides ``device``), with their access."""
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
