"""Drawing the maps: this process's as text, HTML (SVG map, side table, provenance) and PNG; the
node's as text and HTML. Stable markers: ``div.sa-memory-map`` with ``data-`` ``allocations``,
``shown``, ``chunks``, ``views`` and ``rows``; chunk bars ``rect.sa-chunk``, rows ``tr.sa-row``."""

from __future__ import annotations

import html
import io
import time
from collections.abc import Sequence
from typing import Any

from sharedarrays.api.nodemap import STATES, Holder, NodeAllocation, NodeMap
from sharedarrays.api.widgets.model import ReservationMap, plural, table_rows
from sharedarrays.memory.info import format_bytes

PALETTE = tuple(  # chunk colours, by chunk index (cycled)
    "#4e79a7 #f28e2b #59a14f #b07aa1 #76b7b2 #edc948 #9c755f #e15759 #bab0ac #ff9da7".split()  # noqa: SIM905
)
MAX_DRAWN = 24  # allocations drawn and listed at most (a line says how many were left out)

_W, _PAD, _BAR_H, _LEVEL_H, _HEAD_H, _FOOT_H = 760, 12, 26, 15, 20, 30  # SVG sizes (px)
_LABEL_CHAR = 6.0  # the widest a character of a view's label (10 px sans-serif) is drawn
_CHAR = 7.0 / (_W - 2 * _PAD)  # the widest a character of a chunk's label, of the bar's width
_LOST = "lost to granularity (mapped beyond the views)"
_EMPTY = "no live shared allocations in this process"

_CSS = """
<style>
.sa-memory-map { font-family: sans-serif; font-size: 12px; color: #222; }
.sa-memory-map table { border-collapse: collapse; margin: 4px 0 8px 0; font-size: 12px; }
.sa-memory-map th, .sa-memory-map td { padding: 1px 8px; text-align: left;
  border-bottom: 1px solid #ddd; font-variant-numeric: tabular-nums; }
.sa-memory-map td.sa-num { text-align: right; font-family: monospace; }
.sa-memory-map h4 { margin: 6px 0 2px 0; font-size: 13px; }
</style>
"""

_DEFS = """<defs>
<pattern id="sa-hatch-gap" width="6" height="6" patternUnits="userSpaceOnUse"
 patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>
<line x1="0" y1="0" x2="0" y2="6" stroke="#aaa" stroke-width="2"/></pattern>
<pattern id="sa-hatch-lost" width="5" height="5" patternUnits="userSpaceOnUse"
 patternTransform="rotate(-45)"><line x1="0" y1="0" x2="0" y2="5" stroke="#c00"
 stroke-width="2"/></pattern>
</defs>"""


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _colour(chunk: int) -> str:
    return PALETTE[chunk % len(PALETTE)]


def _marks(m: ReservationMap) -> str:
    return "".join(f" [{mark}]" for mark in m.marks)


def _levels(m: ReservationMap) -> int:  # (the rows of view brackets above its bar)
    return max((v.level for v in m.views), default=-1) + 1


def render_text(maps: Sequence[ReservationMap]) -> str:
    """A plain-text summary: one line per allocation."""
    if not maps:
        return _EMPTY
    return "\n".join(
        f"{m.short_id}{_marks(m)} {m.backend} {m.device} {m.address:#x}+{format_bytes(m.size)} "
        f"{plural(len(m.chunks), 'chunk')}, {plural(len(m.views), 'view')}, "
        f"{format_bytes(m.lost)} lost to granularity, access {m.access_text}, "
        f"{m.origin_text}; {m.served_text}" + (f"; {m.packed_text}" if m.slab else "")
        for m in maps
    )


def _draw(m: ReservationMap, pen: Any) -> None:  # (pen: an _Svg or a _Png)
    a, size = m.address, max(m.size, 1)
    mapped = f", {format_bytes(m.mapped)} mapped" if m.mapped < m.size else ""
    pen.begin(_levels(m))
    head = (
        f"{m.short_id}{_marks(m)}  {m.backend} {m.device}  {format_bytes(m.size)} reserved{mapped}"
        f" in {plural(len(m.chunks), 'chunk')}  ·  {m.origin_text}"
    )
    pen.text(0, "head", head, fontweight="bold")
    pen.text(1, "head", f"access {m.access_text}", cls="sa-access")
    for v in m.views:  # level 0 nearest the bar
        tip = f"view {v.label}: {a + v.start:#x}-{a + v.stop:#x}"
        pen.bracket(v.start / size, v.stop / size, v.level, v.label, tip)
    for c in m.chunks:
        nbytes = format_bytes(c.size)
        tip = (
            f"mapping of chunk {c.chunk} at offset {c.start:#x}: {a + c.start:#x}-"
            f"{a + c.start + c.size:#x} ({nbytes}, fd {c.fd}, {c.access})"
        )
        labels = (f"chunk {c.chunk} · {nbytes}", f"{c.chunk}: {nbytes}")
        label = next((t for t in labels if c.size / size > _CHAR * (len(t) + 1)), "")
        pen.rect(c.start / size, c.size / size, "chunk", tip, c.chunk, label)
    for g in m.gaps:
        tip = f"unmapped: {a + g.start:#x}-{a + g.start + g.size:#x}"
        pen.rect(g.start / size, g.size / size, "unmapped", tip)
    if m.lost:
        tip = (
            f"lost to granularity: {format_bytes(m.lost)} mapped beyond the views "
            f"({a + m.used:#x}-{a + m.used + m.lost:#x})"
        )
        pen.rect(m.used / size, m.lost / size, "lost", tip)
    pen.text(0, "foot", f"{a:#x}", family="monospace")
    pen.text(1, "foot", f"{a + m.size:#x}", family="monospace")
    if m.lost:
        pen.text(0.5, "foot", f"{format_bytes(m.lost)} {_LOST}", color="#c00")
    elif m.slab:
        pen.text(0.5, "foot", m.packed_text, cls="sa-packed")


def _svg_text(x: float, y: float, text: str, attrs: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y}"{attrs}>{_e(text)}</text>'


class _Svg:
    """Draws reservations one under the other as SVG elements (``out``), ``y`` high."""

    _ANCHOR = ("", ' text-anchor="middle"', ' text-anchor="end"')
    _ATTRS = (("fontweight", "font-weight"), ("family", "font-family"), ("color", "fill"))
    _RECT = {
        "unmapped": 'class="sa-unmapped" fill="url(#sa-hatch-gap)" stroke="#999" '
        'stroke-dasharray="3,2"',
        "lost": 'class="sa-lost" fill="url(#sa-hatch-lost)" stroke="#c00"',
    }

    def __init__(self) -> None:
        self.out: list[str] = []
        self.y = 0

    def begin(self, levels: int) -> None:
        self.bar_y = self.y + _HEAD_H + levels * _LEVEL_H + 4
        self.rows = {"head": self.y + 14, "foot": self.bar_y + _BAR_H + 13}
        self.y = self.bar_y + _BAR_H + _FOOT_H

    @staticmethod
    def x(f: float) -> float:
        return _PAD + (_W - 2 * _PAD) * f

    def text(self, f: float, row: str, text: str, cls: str = "", **style: str) -> None:
        attrs = self._ANCHOR[int(f * 2)] + (f' class="{cls}"' if cls else "")
        attrs += "".join(f' {name}="{style[k]}"' for k, name in self._ATTRS if k in style)
        self.out.append(_svg_text(self.x(f), self.rows[row], text, attrs))

    def bracket(self, f1: float, f2: float, level: int, label: str, tip: str) -> None:
        top = self.bar_y - 4 - (level + 1) * _LEVEL_H + 9
        x1 = self.x(f1)
        x2 = max(self.x(f2), x1 + 2)
        # the label centred over its bracket, moved in where it would run off either edge
        half = len(label) * _LABEL_CHAR / 2
        mid = min(max((x1 + x2) / 2, _PAD + half), _W - _PAD - half)
        self.out.append(
            f'<g class="sa-view"><title>{_e(tip)}</title>'
            f'<path d="M{x1:.1f},{top + 5} V{top} H{x2:.1f} V{top + 5}" fill="none" '
            f'stroke="#333" stroke-width="1.5"/>'
            + _svg_text(mid, top - 2, label, ' text-anchor="middle" font-size="10"')
            + "</g>"
        )

    def rect(
        self, f: float, n: float, kind: str, tip: str, chunk: int = 0, label: str = ""
    ) -> None:
        chunk_attrs = f'class="sa-chunk" data-chunk="{chunk}" fill="{_colour(chunk)}" stroke="#fff"'
        width = max((_W - 2 * _PAD) * n, 2.0)
        self.out.append(
            f'<rect {self._RECT.get(kind, chunk_attrs)} x="{self.x(f):.1f}" y="{self.bar_y}" '
            f'width="{width:.1f}" height="{_BAR_H}"><title>{_e(tip)}</title></rect>'
        )
        if label:
            attrs = ' text-anchor="middle" fill="#fff" pointer-events="none"'
            self.out.append(_svg_text(self.x(f) + width / 2, self.bar_y + 17, label, attrs))


def render_html(maps: Sequence[ReservationMap], title: str = "shared memory map") -> str:
    """The SVG map, the side table and the provenance panel of the first :data:`MAX_DRAWN`."""
    shown = maps[:MAX_DRAWN]
    rows = table_rows(shown)
    attrs = (
        f'class="sa-memory-map" data-allocations="{len(maps)}" data-shown="{len(shown)}" '
        f'data-chunks="{sum(len(m.chunks) for m in shown)}" '
        f'data-views="{sum(len(m.views) for m in shown)}" data-rows="{len(rows)}"'
    )
    if not maps:
        return f"{_CSS}<div {attrs}><h4>{_e(title)}</h4><p>{_EMPTY}</p></div>"
    left_out = _e(
        f"… {plural(len(maps) - MAX_DRAWN, 'more allocation')} not shown (of {len(maps)})"
    )
    more = f'<p class="sa-more">{left_out}</p>' if len(maps) > len(shown) else ""
    pen = _Svg()
    for m in shown:
        _draw(m, pen)
    if more:
        pen.out.append(f'<text x="{_PAD}" y="{pen.y + 12}">{left_out}</text>')
        pen.y += 18
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{pen.y}" '
        f'viewBox="0 0 {_W} {pen.y}" font-family="sans-serif" font-size="12">'
        f"{_DEFS}{''.join(pen.out)}</svg>"
    )
    table = "".join(
        f'<tr class="sa-row" data-kind="{_e(r.kind)}"><td>{_e(r.alloc_id)}</td>'
        f"<td>{_e(r.kind)}</td><td class='sa-num'>{r.start:#x}</td>"
        f"<td class='sa-num'>{r.stop:#x}</td><td class='sa-num'>{_e(format_bytes(r.size))}</td>"
        f"<td>{_e(r.detail)}</td></tr>"
        for r in rows
    )
    provenance = []
    for m in shown:
        stamps = [(s.pid, time.strftime("%H:%M:%S", time.localtime(s.time))) for s in m.served]
        served = ", ".join(f"pid {pid} at {at}" for pid, at in stamps) or "no importer yet"
        marks = "".join(f"; {mark}" for mark in m.marks)
        provenance.append(
            f'<tr class="sa-provenance-row"><td>{_e(m.short_id)}</td><td>{_e(m.origin_text)}'
            f"{_e(marks)}</td><td>{_e(served)}</td></tr>"
        )
    return (
        f"{_CSS}<div {attrs}><h4>{_e(title)}</h4>{svg}<h4>addresses</h4>"
        '<table class="sa-table"><thead><tr><th>allocation</th><th>what</th><th>start</th>'
        "<th>end</th><th>size</th><th>detail</th></tr></thead>"
        f"<tbody>{table}</tbody></table>{more}<h4>exporters and importers</h4>"
        '<table class="sa-provenance"><thead><tr><th>allocation</th><th>exporter / importer</th>'
        "<th>handles served to importers</th></tr></thead>"
        f"<tbody>{''.join(provenance)}</tbody></table>{more}</div>"
    )


def render_png(maps: Sequence[ReservationMap], dpi: int = 100) -> bytes:
    """The memory map as the SVG draws it, as a PNG (matplotlib's Agg, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    drawn = list(maps[:MAX_DRAWN])
    total = sum(1.0 + 0.28 * _levels(m) for m in drawn) or 1.0
    fig = Figure(figsize=(9.0, 0.3 + 0.75 * total), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.96))
    ax.set(xlim=(-0.01, 1.01), ylim=(0, total))
    ax.axis("off")
    if not drawn:
        ax.text(0.5, 0.5, _EMPTY, ha="center")
    pen = _Png(ax, total)
    for m in drawn:
        _draw(m, pen)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class _Png:
    """Draws reservations one under the other on matplotlib axes, from ``y_top`` down."""

    _HA = ("left", "center", "right")
    _RECT: dict[str, dict[str, Any]] = {
        "unmapped": {"facecolor": "#f4f4f4", "edgecolor": "#999", "hatch": "//", "linestyle": "--"},
        "lost": {"facecolor": "none", "edgecolor": "#c00", "hatch": "xxx"},
    }

    def __init__(self, ax: Any, y_top: float) -> None:
        self.ax, self.y_top = ax, y_top

    def begin(self, levels: int) -> None:
        h = 1.0 + 0.28 * levels
        self.bar_y = self.y_top - h + 0.3
        self.rows = {"head": (self.y_top - 0.12, 8), "foot": (self.bar_y - 0.12, 7)}
        self.y_top -= h

    def text(self, f: float, row: str, text: str, cls: str = "", **style: str) -> None:
        y, size = self.rows[row]
        self.ax.text(f, y, text, fontsize=size, ha=self._HA[int(f * 2)], va="center", **style)

    def bracket(self, f1: float, f2: float, level: int, label: str, tip: str) -> None:
        top = self.bar_y + 0.36 + 0.28 * level
        f2 = max(f2, f1 + 0.002)
        self.ax.plot([f1, f1, f2, f2], [top, top + 0.07, top + 0.07, top], color="#333", lw=1)
        self.ax.text((f1 + f2) / 2, top + 0.14, label, fontsize=6.5, ha="center", va="center")

    def rect(
        self, f: float, n: float, kind: str, tip: str, chunk: int = 0, label: str = ""
    ) -> None:
        from matplotlib.patches import Rectangle

        style = self._RECT.get(kind, {"facecolor": _colour(chunk), "edgecolor": "white"})
        least = 0.0 if kind == "chunk" else 0.003
        self.ax.add_patch(Rectangle((f, self.bar_y), max(n, least), 0.3, **style))
        if label:
            ax, y = self.ax, self.bar_y + 0.15
            ax.text(f + n / 2, y, label, color="white", fontsize=7, ha="center", va="center")


# the node-wide table's (``top``, ``ls`` and ``show(scope="node")``)
COLUMNS = ("ID", "NAME", "STATE", "BACKEND", "DEVICE", "SIZE", "LOST", "EXPORTER", "HOLDERS", "AGE")

_STATE_COLOURS = ("#2e7d32", "#ef6c00", "#00838f", "#1565c0", "#6a1b9a", "#c62828")  # by STATES
_AGES = ((60, 1, ".0f", "s"), (3600, 60, ".0f", "m"), (86400, 3600, ".1f", "h"))


def _program(command: str) -> str:  # (the script or module it runs, else its program)
    words = command.split()
    if not words:
        return ""
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1][:24]
    if "-c" in words[:-1]:
        return "keeper" if "sharedarrays.keeper" in command else "python -c"
    word = next((w for w in words[1:] if not w.startswith("-")), words[0])
    return word.rsplit("/", 1)[-1][:24]


def _holder(h: Holder) -> str:
    extra = "p" if h.parked else (f"{h.views}v" if h.views > 0 else "")
    return f"{h.pid}{h.role[0].upper()}{extra}"  # (E exporter, I importer, K keeper)


def row_cells(row: NodeAllocation) -> tuple[str, ...]:
    """One allocation's cells, in :data:`COLUMNS` order."""
    _, unit_s, spec, unit = next((a for a in _AGES if row.age < a[0]), (0, 86400, ".1f", "d"))
    exporter = str(row.exporter_pid) if row.exporter_pid else "?"
    if not row.exporter_alive:
        exporter += " (gone)"
    elif row.exporter_command:
        exporter += f" {_program(row.exporter_command)}"
    return (
        row.alloc_id[:12],
        row.name or "-",
        row.state,
        row.backend,
        row.device,
        format_bytes(row.size),
        format_bytes(row.lost) if row.lost else "0",
        exporter,
        " ".join(_holder(h) for h in row.holders) or "-",
        f"{row.age / unit_s:{spec}}{unit}",
    )


def summary_lines(node: NodeMap) -> list[str]:
    """One line per device with what sharedarrays holds there, one about the processes."""
    lines = [
        f"{d.device}: {format_bytes(d.bytes)} in {plural(d.allocations, 'allocation')} "
        f"({format_bytes(d.lost)} lost to granularity)"
        for d in node.devices
    ] or ["no shared allocations"]
    silent = [p for p in node.processes if p.status != "ok"]
    note = ", ".join(f"pid {p.pid} ({_program(p.command) or '?'}) {p.status}" for p in silent)
    asked = len(node.processes)
    lines.append(
        f"{asked} process{'es' if asked != 1 else ''} asked, keeper: {node.keeper}"
        + (f"; {note}" if note else "")
    )
    return lines


def render_node_text(node: NodeMap) -> str:
    """The node-wide map as a fixed-width table (largest allocation first) under its summary;
    holders read ``<pid><role>`` (Exporter, Importer, Keeper), then ``Nv`` (N views) or ``p``."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(node.time))
    rows = [COLUMNS] + [row_cells(r) for r in node.allocations]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    table = [
        "  ".join(
            cell.rjust(w) if c in ("SIZE", "LOST", "AGE") else cell.ljust(w)
            for c, cell, w in zip(COLUMNS, r, widths)
        ).rstrip()
        for r in rows
    ]
    return "\n".join([f"sharedarrays on this node at {stamp}", *summary_lines(node), "", *table])


def render_node_html(node: NodeMap) -> str:
    """The node-wide map as an HTML table under its summary lines."""
    cell = "padding:2px 8px;font-family:monospace;white-space:nowrap"
    head = "".join(
        f"<th style='text-align:left;padding:2px 8px;white-space:nowrap'>{c}</th>" for c in COLUMNS
    )
    body = []
    for r in node.allocations:
        state = f";color:{_STATE_COLOURS[STATES.index(r.state)]};font-weight:bold"
        tds = "".join(
            f"<td style='{cell}{state if c == 'STATE' else ''}' title='{html.escape(r.alloc_id)}'>"
            f"{html.escape(text)}</td>"
            for c, text in zip(COLUMNS, row_cells(r))
        )
        body.append(f"<tr>{tds}</tr>")
    summary = "<br>".join(html.escape(line) for line in summary_lines(node))
    return (
        "<div class='sharedarrays-node-map'>"
        f"<div style='margin-bottom:4px'><b>sharedarrays on this node</b><br>{summary}</div>"
        f"<table style='border-collapse:collapse'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )
