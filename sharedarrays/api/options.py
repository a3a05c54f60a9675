"""The keywords of the creation functions, validated once: :class:`CreationOptions`.

:func:`~sharedarrays.empty`, :func:`~sharedarrays.zeros`, :func:`~sharedarrays.ones`,
:func:`~sharedarrays.full` and :func:`~sharedarrays.from_array` take the same keywords
(documented once, in :class:`CreationKeywords`). Each turns them into one frozen
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
    """The keywords every creation function takes (``**options`` of
    :func:`~sharedarrays.empty`, :func:`~sharedarrays.zeros`, :func:`~sharedarrays.full`,
    :func:`~sharedarrays.from_array`, ...), typed and documented once here; their defaults
    and checks are :meth:`CreationOptions.from_keywords`'s. ``order`` is each function's own
    (the ``*_like`` ones take it by position too, and :func:`~sharedarrays.from_array` keeps
    its source's).

    Parameters
    ----------
    device : str, int, torch.device, cupy.cuda.Device or None
        ``None`` picks ``"cuda:0"`` when a CUDA device is usable, else ``"cpu"``; also
        ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``N`` (a NumPy integer too), a
        :class:`~sharedarrays.Device`, a ``cupy.cuda.Device`` or a ``torch.device``.
    backend : str, default "auto"
        The memory system: ``"cuda-vmm"`` (CUDA virtual memory management, handles are fds;
        memory lives while any process holds it), ``"cuda-ipc"`` (``cudaMalloc`` memory
        shared by legacy CUDA IPC handles; the creating process must outlive every importer),
        ``"cuda-pool"`` (a stream-ordered memory pool exported once, arrays allocated on the
        current stream; the creating process must outlive every importer) or ``"host"``
        (for ``device="cpu"``). ``"auto"`` takes host on the CPU and, on a CUDA device, the
        first of cuda-vmm, cuda-ipc, cuda-pool that the device supports
        (:func:`sharedarrays.list_backends` says which can be used here, and why not).
    chunk_bytes : int, optional
        Largest chunk of the allocation. By default an array is one chunk (each chunk costs
        every importer an import and a map) and a growable array maps at most 2 GiB at a
        time (:data:`sharedarrays.memory.DEFAULT_CHUNK_BYTES`).
    pack : bool, optional
        Carve the array out of a shared 2 MiB *slab* allocation instead of giving it an
        allocation of its own. The default packs arrays of at most
        :data:`~sharedarrays.memory.PACK_BYTES` (64 KiB), so that many small arrays cost
        one chunk, one handle and one import between them rather than one granule (2 MiB on
        CUDA) each. Arrays packed together share a slab's secret: a process that can import
        one of them could map its neighbours too. Pass ``pack=False`` for an array that must
        be shared with nobody who should not see the others. Named, restricted
        (``allow_pids``), ``readonly`` and growable arrays, and those given ``chunk_bytes``
        or ``access``, are never packed.
    progress : bool, optional
        Show a tqdm.auto progress bar (a widget in Jupyter, text on stderr) while filling or
        copying (:func:`~sharedarrays.full`, :func:`~sharedarrays.from_array`, ...; nothing
        to show in :func:`~sharedarrays.empty`); ``None`` (the default) shows one only in a
        Jupyter kernel's own process, for arrays of at least
        :data:`~sharedarrays.api.creation.PROGRESS_BYTES`; never in a script or a worker
        unasked.
    name : str, optional
        Give the array this name in this user's keeper (started if needed): any process of
        the same user can then :func:`~sharedarrays.attach` it, also after this one exited,
        until :func:`~sharedarrays.unlink` removes the name. 1 to 128 characters from
        ``A-Z a-z 0-9 . _ -``. The name exists as soon as the memory does (before a fill).
    allow_pids : iterable of int, optional
        Only these processes (and this one) may import the array: others get
        :class:`~sharedarrays.PermissionDenied` from this process's handle server and from
        the keeper. Default: any process of this user that holds a payload (or the name).
    readonly : bool, default False
        Importers get read-only mappings (``PROT_READ`` on the host, a read-only
        ``cuMemSetAccess`` on CUDA) and read-only views; this process's views stay
        writable. On the host the kernel enforces it: once mapped here, the memory is sealed
        against every new write (``F_SEAL_FUTURE_WRITE``), so no other process can write it
        by any means, and the array cannot grow past its ``capacity``. On CUDA it is each
        importer's own access setting, which a process of the same user can change (see the
        user guide's security model).
    access : sequence, optional
        Other CUDA devices that may read and write (``"rw"``, the default) or only read
        (``"r"``) the memory in this process, over NVLink or PCIe, without copies, e.g.
        ``access=["cuda:0", "cuda:1"]`` or ``[("cuda:1", "r")]`` (the memory's own device is
        always read-write here). cuda-vmm only; see also
        :meth:`~sharedarrays.SharedDeviceArray.grant`. An importer whose current device is
        another one gets access for that device when it loads the array.
    capacity : int, optional
        Make a *growable* array: reserve this many bytes of address space up front (rounded
        up to the granularity) and back only what ``shape`` needs with chunks. The array
        then grows and shrinks along axis 0 without copying
        (:meth:`~sharedarrays.SharedDeviceArray.resize`,
        :meth:`~sharedarrays.SharedDeviceArray.append`; importers see the growth on their
        next load or :meth:`~sharedarrays.SharedDeviceArray.refresh`). Each growth maps a
        chunk at least as large as what is mapped already, at most ``chunk_bytes`` (see
        :func:`sharedarrays.memory.growth_sizes`). Growing past the capacity still works but
        moves the array to a new reservation (its address changes). Growable arrays are
        C-ordered, never packed and never named.
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
