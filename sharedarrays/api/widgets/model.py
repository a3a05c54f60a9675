"""The memory map as plain data, computed from allocations' metadata only.

Everything the widgets draw comes from here: one :class:`ReservationMap` per allocation (its
chunk bars, unmapped gaps, bytes lost to granularity, access, the views over it, its exporter and
the importers it was served to) and the rows of the side table. Nothing here imports ipywidgets or
matplotlib, and nothing reads or writes array memory, so it works for host and CUDA alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sharedarrays.api.namespaces import local_name
from sharedarrays.api.views import ArrayView, is_view, live_views
from sharedarrays.memory import Allocation, live_allocations
from sharedarrays.process import running
from sharedarrays.protocol.payload import view_extent

__all__ = [
    "ChunkBar",
    "Gap",
    "ViewBracket",
    "ServedInfo",
    "ReservationMap",
    "TableRow",
    "views_of",
    "build_map",
    "build_maps",
    "targets",
    "table_rows",
    "fmt_bytes",
]


def fmt_bytes(n: int) -> str:
    """Bytes as a short human-readable size (binary units): ``"4 KiB"``, ``"1.5 MiB"``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ChunkBar:
    """One mapping of one chunk: ``size`` bytes at ``start`` bytes into the reservation."""

    chunk: int
    start: int
    size: int
    chunk_offset: int
    fd: int
    access: str


@dataclass(frozen=True)
class Gap:
    """A part of the reservation that nothing is mapped at."""

    start: int
    size: int


@dataclass(frozen=True)
class ViewBracket:
    """The bytes ``[start, stop)`` of the reservation that one live view touches.

    ``level`` is the row the bracket is drawn in, so that overlapping views do not overlap
    on screen (0 is nearest the bar).
    """

    start: int
    stop: int
    label: str
    level: int


@dataclass(frozen=True)
class ServedInfo:
    """One time this process served the allocation's handles to process ``pid``."""

    pid: int
    time: float


@dataclass(frozen=True)
class ReservationMap:
    """Everything the memory map shows about one allocation in this process.

    Attributes
    ----------
    alloc_id : str
        The allocation id (the same in every process).
    backend, device : str
        Memory system and device, e.g. ``"host"`` and ``"cpu"``.
    granularity : int
        The backend's granularity in bytes.
    address, size : int
        Start and length of this process's reservation (a growable array's capacity).
    chunks : tuple of ChunkBar
        The mapped chunks, in address order.
    gaps : tuple of Gap
        Reserved ranges with nothing mapped (a growable array's free capacity is the last).
    views : tuple of ViewBracket
        The live views of the allocation in this process.
    used : int
        One past the highest byte any live view touches (the mapped size when no view is
        known).
    lost : int
        Bytes lost to granularity: mapped beyond ``used``, what rounding up to the
        granularity (and a growable array's chunk ahead) costs (``top``'s LOST).
    access : dict of str to str
        Access per device, ``"rw"``, ``"r"`` or ``"none"``.
    created_here : bool
        This process is its exporter (made it), or an importer (mapped it from a payload).
    origin_pid : int
        The exporter: this process, or the one an importer mapped it from.
    origin_time : float
        When it was made or imported here.
    served : tuple of ServedInfo
        The importers this process served its handles to.
    """

    alloc_id: str
    backend: str
    device: str
    granularity: int
    address: int
    size: int
    chunks: tuple[ChunkBar, ...]
    gaps: tuple[Gap, ...]
    views: tuple[ViewBracket, ...]
    used: int
    lost: int
    access: dict[str, str]
    created_here: bool
    origin_pid: int
    origin_time: float
    served: tuple[ServedInfo, ...]
    mapped: int = -1
    """Bytes mapped from the reservation's start (``size`` unless growable; -1: unknown)."""
    lifetime: str = "any holder"
    """Who keeps the memory alive: ``"any holder"`` or ``"exporter"`` (cuda-ipc, cuda-pool:
    the creating process must outlive every importer); see ``Allocation.lifetime``."""
    holders: tuple[int, ...] = ()
    """Exporter-owned memory made here: the processes that still hold it."""
    export_readonly: bool = False
    """Made here with ``readonly=True``: importers map it read-only (this process rw)."""
    access_enforced: bool = True
    """Whether the memory system enforces the access (``mprotect``, ``cuMemSetAccess``);
    False for pointer handles (cuda-ipc, cuda-pool), where read-only is a promise."""
    exporter_alive: bool = True
    """Whether the exporter still runs (a pid check when the map is read; True here)."""
    in_keeper: bool = False
    """The keeper holds its handles, as this process knows (``Allocation.in_keeper``)."""
    name: str | None = None
    """Its name in the keeper, as this process knows it (``Allocation.keeper_name``)."""
    parked: bool = False
    """An importer keeps it mapped with no view, for the next handoff (a parked mapping)."""
    slab: bool = False
    """A slab that small arrays are packed into (``pack=``): no byte of it is lost to
    granularity, its room is theirs."""
    own: tuple[int, int] | None = None
    """The map of one packed array: the bytes ``[start, stop)`` of the slab that it spans
    (only its views are drawn)."""
    neighbours: int = 0
    """The map of one packed array: the other small arrays' views in its slab, not drawn."""

    @property
    def packed_text(self) -> str:
        """For a slab: ``"packed: this array's 800 B of a 2 MiB slab shared with 3 other
        views"``, or ``"a slab of small arrays: 1.5 KiB used by 4 views"``; else ``""``."""
        if not self.slab:
            return ""
        if self.own is None:
            return f"a slab of packed small arrays: {len(self.views)} views in it"
        start, stop = self.own
        many = "s" if self.neighbours != 1 else ""
        return (
            f"packed: this array's {fmt_bytes(stop - start)} at offset {start:#x} of a "
            f"{fmt_bytes(self.size)} slab shared with {self.neighbours} other small "
            f"array view{many}"
        )

    @property
    def marks(self) -> tuple[str, ...]:
        """What holds it besides views: ``'named "features"'``, ``"parked in the keeper"``
        (``a.park()``), ``"parked mapping, no view"`` (an importer keeps it mapped)."""
        out = []
        if self.name is not None:
            out.append(f'named "{self.name}"')
        elif self.in_keeper:
            out.append("parked in the keeper")
        if self.parked:
            out.append("parked mapping, no view")
        return tuple(out)

    @property
    def importers_note(self) -> str:
        """``" (importers: r)"`` for this process's read-only export, else ``""``."""
        return " (importers: r)" if self.export_readonly and self.created_here else ""

    @property
    def access_text(self) -> str:
        """This process's access per device, e.g. ``"cpu: r"``, ``"cpu: rw (importers: r)"``
        for a read-only export, ``"cuda:0: r (not enforced)"`` where the memory system cannot
        map it read-only."""
        text = ", ".join(f"{d}: {a}" for d, a in self.access.items()) + self.importers_note
        if not self.access_enforced and "r" in self.access.values():
            text += " (not enforced)"
        return text

    @property
    def short_id(self) -> str:
        """The first 8 hex digits of the id."""
        return self.alloc_id[:8]

    @property
    def origin_text(self) -> str:
        """``"exporter: this process, since 12:00:01"`` or ``"importer of pid 123's
        allocation, since 12:00:01"``."""
        stamp = time.strftime("%H:%M:%S", time.localtime(self.origin_time))
        if self.created_here:
            text = f"exporter: this process, since {stamp}"
            if self.lifetime == "exporter":
                held = ", ".join(map(str, self.holders)) or "nobody"
                text += f"; exporter-owned: must outlive its importers (held by {held})"
            return text
        text = f"importer of pid {self.origin_pid}'s allocation"
        if not self.exporter_alive:
            text += ", whose exporter exited" + ("; the keeper holds it" if self.in_keeper else "")
        text += f", since {stamp}"
        if self.lifetime == "exporter":
            text += f"; lives only while its exporter, pid {self.origin_pid}, does"
        return text

    @property
    def served_text(self) -> str:
        """``"served to 2 importers: pid 123, 456"`` or ``"served to no importer yet"``."""
        pids = sorted({s.pid for s in self.served})
        if not pids:
            return "served to no importer yet"
        many = "s" if len(pids) != 1 else ""
        return f"served to {len(pids)} importer{many}: pid {', '.join(map(str, pids))}"


@dataclass(frozen=True)
class TableRow:
    """One row of the side table: what, where (absolute addresses) and how big."""

    alloc_id: str
    kind: str
    start: int
    stop: int
    detail: str

    @property
    def size(self) -> int:
        """``stop - start`` in bytes."""
        return self.stop - self.start


def views_of(allocation: Allocation) -> list[ArrayView]:
    """The open views of ``allocation`` in this process, by offset then size."""
    out = []
    for v in live_views():
        if v.closed:
            continue
        try:
            if v.allocation is allocation:
                out.append(v)
        except Exception:  # closed meanwhile
            continue
    return sorted(out, key=lambda v: (v.offset, -v.nbytes))


def _levels(spans: Sequence[tuple[int, int]]) -> list[int]:
    """Give each span ``[start, stop)`` the lowest level no earlier overlapping span has."""
    ends: list[int] = []  # per level, the stop of the last span placed there
    levels = []
    for start, stop in spans:
        for level, end in enumerate(ends):
            if start >= end:
                ends[level] = max(stop, start + 1)
                levels.append(level)
                break
        else:
            ends.append(max(stop, start + 1))
            levels.append(len(ends) - 1)
    return levels


def _view_label(v: ArrayView) -> str:
    shape = "×".join(str(n) for n in v.shape) or "scalar"
    step = v.itemsize
    contiguous = True
    for n, stride in reversed(list(zip(v.shape, v.strides))):
        if n > 1 and stride != step:
            contiguous = False
        step *= n
    label = f"{shape} {v.dtype}" + ("" if contiguous else " (strided)")
    return label + (" read-only" if v.readonly else "")


def _span(v: ArrayView) -> tuple[int, int]:
    """The bytes ``[start, stop)`` of its allocation that view ``v`` touches."""
    low, high = view_extent(v.itemsize, v.shape, v.strides)
    return v.offset + low, v.offset + high


def build_map(
    allocation: Allocation,
    views: Iterable[ArrayView] | None = None,
    own: tuple[int, int] | None = None,
) -> ReservationMap:
    """Describe one allocation for the memory map.

    Parameters
    ----------
    allocation : Allocation
        The allocation; only its metadata is read.
    views : iterable of SharedDeviceArray, optional
        The views to draw as brackets; default: every open view of it in this process.
    own : tuple of int, optional
        The map of one array packed in a slab: the bytes ``[start, stop)`` of the slab it
        spans. Only the views within them are drawn; the others are counted as neighbours.
    """
    vs = views_of(allocation) if views is None else [v for v in views if not v.closed]
    slab = bool(getattr(allocation, "slab", False))
    neighbours = 0
    if slab and own is not None:
        # (the array's own views, and those that overlap its bytes: packed arrays never do)
        mine = [v for v in vs if _span(v)[0] < own[1] and own[0] < _span(v)[1]]
        neighbours, vs = len(vs) - len(mine), mine
    else:
        own = None
    keeper_name = getattr(allocation, "keeper_name", None)
    fds = {c.index: c.fd for c in allocation.chunks}
    bars = tuple(
        ChunkBar(m.chunk, m.offset, m.size, m.chunk_offset, fds.get(m.chunk, -1), str(m.access))
        for m in sorted(allocation.mappings, key=lambda m: m.offset)
    )
    gaps = []
    pos = 0
    for b in bars:
        if b.start > pos:
            gaps.append(Gap(pos, b.start - pos))
        pos = max(pos, b.start + b.size)
    capacity = int(getattr(allocation, "capacity", allocation.size))  # reserved bytes
    if pos < capacity:
        gaps.append(Gap(pos, capacity - pos))

    spans = []
    for v in vs:
        spans.append((*_span(v), _view_label(v)))
    spans.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    levels = _levels([(s[0], s[1]) for s in spans])
    brackets = tuple(ViewBracket(s[0], s[1], s[2], lv) for s, lv in zip(spans, levels))
    used = max((b.stop for b in brackets), default=allocation.size)
    used = min(used, allocation.size)
    if slab:  # (its room is the small arrays', those to come too: none of it is lost)
        used = allocation.size

    by_device = getattr(allocation, "access_by_device", None)
    if by_device is not None:  # every device that may touch it here: own and peers
        access = {str(d): str(a) for d, a in by_device.items()}
    else:
        access = {str(allocation.device): str(getattr(allocation, "access", "rw"))}
    origin = allocation.origin
    return ReservationMap(
        alloc_id=allocation.id,
        backend=allocation.backend.name,
        device=str(allocation.device),
        granularity=int(allocation.backend.granularity),
        address=allocation.address,
        size=capacity,
        chunks=bars,
        gaps=tuple(gaps),
        views=brackets,
        used=used,
        lost=allocation.size - used,
        access=access,
        created_here=origin.created_here,
        origin_pid=origin.pid,
        origin_time=origin.time,
        served=tuple(ServedInfo(s.pid, s.time) for s in allocation.served),
        mapped=allocation.size,
        lifetime=str(getattr(allocation, "lifetime", "any holder")),
        holders=tuple(getattr(allocation, "holders", ())),
        export_readonly=bool(getattr(allocation, "export_readonly", False)),
        access_enforced=bool(getattr(allocation.backend, "maps", True)),
        exporter_alive=origin.created_here or running(origin.pid),
        in_keeper=bool(getattr(allocation, "in_keeper", False)),
        name=None if keeper_name is None else local_name(keeper_name),
        parked=bool(getattr(allocation, "parked", False)),
        slab=slab,
        own=own,
        neighbours=neighbours,
    )


def build_maps(target: Any = None) -> list[ReservationMap]:
    """The maps to show for ``target``.

    Parameters
    ----------
    target : SharedDeviceArray, Allocation, sequence of them, or None
        ``None``: every live allocation in this process (re-read on every call). A view:
        its allocation, with every open view of it (of a small array packed in a slab:
        the slab, with the views within the array's bytes). An allocation: itself.
    """
    if target is None:
        return [build_map(a) for a in live_allocations()]
    return [build_map(alloc, own=own) for alloc, own in targets(target)]


def targets(target: Any) -> list[tuple[Allocation, tuple[int, int] | None]]:
    """The allocations ``target`` (a view, an allocation, or a sequence of them) names, each
    once, with the bytes of it a packed small array spans (``None`` for the others).

    Raises
    ------
    TypeError
        Something else.
    """
    items = target if isinstance(target, (list, tuple)) else [target]
    out: list[tuple[Allocation, tuple[int, int] | None]] = []
    seen: set[tuple[str, tuple[int, int] | None]] = set()
    for item in items:
        alloc = item.allocation if is_view(item) else item
        if not isinstance(alloc, Allocation):
            raise TypeError(
                f"expected a SharedDeviceArray or an Allocation, not {type(item).__name__}"
            )
        own = _span(item) if is_view(item) and alloc.slab else None
        if (alloc.id, own) not in seen:
            seen.add((alloc.id, own))
            out.append((alloc, own))
    return out


def table_rows(maps: Sequence[ReservationMap]) -> list[TableRow]:
    """The side table: per allocation its reservation, each mapping (``"mapping of chunk
    N"``: where in the reservation, which bytes of the chunk), each unmapped gap, the bytes
    lost to granularity (if any) and each view, with absolute addresses."""
    rows = []
    for m in maps:
        a = m.address
        rows.append(
            TableRow(
                m.short_id,
                "reservation",
                a,
                a + m.size,
                f"{m.backend} {m.device}, granularity {fmt_bytes(m.granularity)}"
                + "".join(f", {mark}" for mark in m.marks),
            )
        )
        for c in m.chunks:
            rows.append(
                TableRow(
                    m.short_id,
                    f"mapping of chunk {c.chunk}",
                    a + c.start,
                    a + c.start + c.size,
                    f"at offset {c.start:#x}, chunk bytes {c.chunk_offset:#x}-"
                    f"{c.chunk_offset + c.size:#x}, fd {c.fd}, {m.device}: {c.access}"
                    + m.importers_note,
                )
            )
        for g in m.gaps:
            free = "free capacity" if g.start >= m.mapped >= 0 else ""
            rows.append(TableRow(m.short_id, "unmapped", a + g.start, a + g.start + g.size, free))
        if m.lost:  # (up to the mapped end: a growable array's free capacity is unmapped)
            rows.append(
                TableRow(
                    m.short_id,
                    "lost to granularity",
                    a + m.used,
                    a + m.used + m.lost,
                    "mapped beyond the views",
                )
            )
        if m.own is not None:
            start, stop = m.own
            rows.append(TableRow(m.short_id, "packed array", a + start, a + stop, m.packed_text))
        for v in m.views:
            rows.append(TableRow(m.short_id, "view", a + v.start, a + v.stop, v.label))
    return rows
