"""The memory map as plain data from allocations' metadata (never their memory): one
:class:`ReservationMap` per allocation, the side table's rows, and the widgets' constants."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from sharedarrays.api.keeping import local_name
from sharedarrays.api.views import ArrayView, is_view, live_views
from sharedarrays.memory import Allocation, Served, live_allocations
from sharedarrays.memory.info import format_bytes
from sharedarrays.process import STATE, running
from sharedarrays.protocol.payload import view_extent

Span = tuple[int, int]
MIN_INTERVAL, MAX_INTERVAL = 0.2, 3600.0  # the auto-refresh interval's bounds (s)
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"  # a live widget's display data


def plural(n: int, word: str) -> str:
    """``"1 chunk"``, ``"2 chunks"``."""
    return f"{n} {word}{'s' if n != 1 else ''}"


class ChunkBar(NamedTuple):
    """One mapping of one chunk: ``size`` bytes at ``start`` bytes into the reservation."""

    chunk: int
    start: int
    size: int
    chunk_offset: int
    fd: int
    access: str


class Gap(NamedTuple):
    """A part of the reservation that nothing is mapped at."""

    start: int
    size: int


class ViewBracket(NamedTuple):
    """The bytes ``[start, stop)`` a live view touches, drawn in row ``level`` (0: nearest)."""

    start: int
    stop: int
    label: str
    level: int


@dataclass(frozen=True)
class ReservationMap:
    """What the memory map shows of one allocation here: ``size`` reserved, ``mapped`` from its
    start, ``used`` up to the end of the last view, ``lost`` mapped beyond it; read-only access
    is a promise only unless ``access_enforced``; a ``slab`` packs small arrays, ``own`` is one
    packed array's span of it (``neighbours``: the other views)."""

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
    served: tuple[Served, ...]
    mapped: int
    lifetime: str
    holders: tuple[int, ...]
    export_readonly: bool
    access_enforced: bool
    exporter_alive: bool
    in_keeper: bool
    name: str | None
    parked: bool
    slab: bool
    own: Span | None
    neighbours: int

    @property
    def packed_text(self) -> str:  # (a slab's: what it holds, or one packed array's part)
        if not self.slab:
            return ""
        if self.own is None:
            return f"a slab of packed small arrays: {len(self.views)} views in it"
        start, stop = self.own
        return (
            f"packed: this array's {format_bytes(stop - start)} at offset {start:#x} of a "
            f"{format_bytes(self.size)} slab shared with "
            f"{plural(self.neighbours, 'other small array view')}"
        )

    @property
    def marks(self) -> tuple[str, ...]:  # (what holds it besides views)
        named = f'named "{self.name}"' if self.name is not None else None
        keeper = "parked in the keeper" if self.in_keeper and named is None else None
        parked = "parked mapping, no view" if self.parked else None
        return tuple(m for m in (named, keeper, parked) if m)

    @property
    def importers_note(self) -> str:  # (this process's read-only export)
        return " (importers: r)" if self.export_readonly and self.created_here else ""

    @property
    def access_text(self) -> str:  # (e.g. "cpu: rw (importers: r)")
        text = ", ".join(f"{d}: {a}" for d, a in self.access.items()) + self.importers_note
        if not self.access_enforced and "r" in self.access.values():
            text += " (not enforced)"
        return text

    @property
    def short_id(self) -> str:  # (its first 8 hex digits)
        return self.alloc_id[:8]

    @property
    def origin_text(self) -> str:  # (exporter, or importer of whose, since when; its lifetime)
        stamp = time.strftime("%H:%M:%S", time.localtime(self.origin_time))
        owned = self.lifetime == "exporter"
        if self.created_here:
            held = ", ".join(map(str, self.holders)) or "nobody"
            return f"exporter: this process, since {stamp}" + (
                f"; exporter-owned: must outlive its importers (held by {held})" if owned else ""
            )
        text = f"importer of pid {self.origin_pid}'s allocation"
        if not self.exporter_alive:
            text += ", whose exporter exited" + ("; the keeper holds it" if self.in_keeper else "")
        text += f", since {stamp}"
        if owned:
            text += f"; lives only while its exporter, pid {self.origin_pid}, does"
        return text

    @property
    def served_text(self) -> str:
        pids = sorted({s.pid for s in self.served})
        if not pids:
            return "served to no importer yet"
        return f"served to {plural(len(pids), 'importer')}: pid {', '.join(map(str, pids))}"


class TableRow(NamedTuple):
    """One row of the side table: what, where (absolute addresses) and how big."""

    alloc_id: str
    kind: str
    start: int
    stop: int
    detail: str

    @property
    def size(self) -> int:
        return self.stop - self.start


def views_of(allocation: Allocation) -> list[ArrayView]:
    """The open views of ``allocation`` in this process, by offset then size (largest first)."""
    out = []
    for v in live_views():
        try:
            if not v.closed and v.allocation is allocation:
                out.append(v)
        except Exception:  # closed meanwhile
            continue
    return sorted(out, key=lambda v: (v.offset, -v.nbytes))


def _levels(spans: Sequence[Span]) -> list[int]:
    """Give each span ``[start, stop)`` the lowest level no earlier overlapping span has."""
    ends: list[int] = []  # per level, the stop of the last span placed there
    levels = []
    for start, stop in spans:
        level = next((i for i, end in enumerate(ends) if start >= end), len(ends))
        ends[level : level + 1] = [max(stop, start + 1)]  # (a new level: appended)
        levels.append(level)
    return levels


def _view_label(v: ArrayView) -> str:
    step, contiguous = v.itemsize, True
    for n, stride in reversed(list(zip(v.shape, v.strides))):
        contiguous = contiguous and (n <= 1 or stride == step)
        step *= n
    shape = "×".join(str(n) for n in v.shape) or "scalar"
    strided = "" if contiguous else " (strided)"
    return f"{shape} {v.dtype}{strided}" + (" read-only" if v.readonly else "")


def _span(v: ArrayView) -> Span:  # (the bytes of its allocation v touches)
    low, high = view_extent(v.itemsize, v.shape, v.strides)
    return v.offset + low, v.offset + high


def build_map(
    allocation: Allocation, views: Iterable[ArrayView] | None = None, own: Span | None = None
) -> ReservationMap:
    """One allocation's map: ``views`` as brackets (default: its open views here); ``own``: a
    packed array's bytes ``[start, stop)`` of a slab, whose views alone are drawn."""
    vs = views_of(allocation) if views is None else [v for v in views if not v.closed]
    slab, neighbours = allocation in STATE.memory.packed, 0
    if slab and own is not None:  # (its own views: packed arrays never overlap)
        mine = [v for v in vs if _span(v)[0] < own[1] and own[0] < _span(v)[1]]
        neighbours, vs = len(vs) - len(mine), mine
    else:
        own = None
    capacity = allocation.capacity  # reserved bytes
    fds = {c.index: c.fd for c in allocation.chunks}
    bars = tuple(
        ChunkBar(m.chunk, m.offset, m.size, m.chunk_offset, fds.get(m.chunk, -1), str(m.access))
        for m in sorted(allocation.mappings, key=lambda m: m.offset)
    )
    gaps, pos = [], 0
    for start, stop in [*((b.start, b.start + b.size) for b in bars), (capacity, capacity)]:
        if start > pos:  # (the reservation's end closes the last gap)
            gaps.append(Gap(pos, start - pos))
        pos = max(pos, stop)
    spans = sorted(((*_span(v), _view_label(v)) for v in vs), key=lambda s: (s[0], s[0] - s[1]))
    levels = _levels([(s[0], s[1]) for s in spans])
    brackets = tuple(ViewBracket(*s, level) for s, level in zip(spans, levels))
    used = min(max((b.stop for b in brackets), default=allocation.size), allocation.size)
    if slab:  # (its room is the small arrays', those to come too: none of it is lost)
        used = allocation.size
    keeper_name, origin = STATE.keeper.kept.get(allocation), allocation.origin
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
        access={str(d): str(a) for d, a in allocation.access_by_device.items()},  # and peers
        created_here=origin.created_here,
        origin_pid=origin.pid,
        origin_time=origin.time,
        served=allocation.served,
        mapped=allocation.size,
        lifetime=allocation.lifetime,
        holders=tuple(allocation.holders),
        export_readonly=allocation.export_readonly,
        access_enforced=allocation.backend.maps,
        exporter_alive=origin.created_here or running(origin.pid),
        in_keeper=allocation in STATE.keeper.kept,
        name=None if keeper_name is None else local_name(keeper_name),
        parked=allocation.parked,
        slab=slab,
        own=own,
        neighbours=neighbours,
    )


def build_maps(target: Any = None) -> list[ReservationMap]:
    """The maps of ``target`` (see :func:`targets`); ``None``: every live allocation here."""
    if target is None:
        return [build_map(a) for a in live_allocations()]
    return [build_map(alloc, own=own) for alloc, own in targets(target)]


def targets(target: Any) -> list[tuple[Allocation, Span | None]]:
    """Each allocation ``target`` (a view, an allocation, or a list of them) names, once, with a
    packed view's span of it (else ``None``); TypeError for anything else."""
    out: dict[tuple[str, Span | None], Allocation] = {}
    for item in target if isinstance(target, (list, tuple)) else [target]:
        alloc = item.allocation if is_view(item) else item
        if not isinstance(alloc, Allocation):
            raise TypeError(
                f"expected a SharedDeviceArray or an Allocation, not {type(item).__name__}"
            )
        own = _span(item) if is_view(item) and alloc in STATE.memory.packed else None
        out.setdefault((alloc.id, own), alloc)
    return [(alloc, own) for (_, own), alloc in out.items()]


def table_rows(maps: Sequence[ReservationMap]) -> list[TableRow]:
    """The side table's rows (absolute addresses): reservation, mappings, gaps, lost, views."""
    return [
        TableRow(m.short_id, kind, m.address + start, m.address + stop, detail)
        for m in maps
        for kind, start, stop, detail in _table_parts(m)
    ]


def _table_parts(m: ReservationMap) -> Iterator[tuple[str, int, int, str]]:
    marks = "".join(f", {mark}" for mark in m.marks)
    granularity = format_bytes(m.granularity)
    yield "reservation", 0, m.size, f"{m.backend} {m.device}, granularity {granularity}{marks}"
    for c in m.chunks:
        yield (
            f"mapping of chunk {c.chunk}",
            c.start,
            c.start + c.size,
            f"at offset {c.start:#x}, chunk bytes {c.chunk_offset:#x}-"
            f"{c.chunk_offset + c.size:#x}, fd {c.fd}, {m.device}: {c.access}{m.importers_note}",
        )
    for g in m.gaps:
        free = "free capacity" if g.start >= m.mapped else ""
        yield "unmapped", g.start, g.start + g.size, free
    if m.lost:  # (up to the mapped end: a growable array's free capacity is unmapped)
        yield "lost to granularity", m.used, m.used + m.lost, "mapped beyond the views"
    if m.own is not None:
        yield "packed array", *m.own, m.packed_text
    for v in m.views:
        yield "view", v.start, v.stop, v.label
