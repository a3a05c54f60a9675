"""Drawing the memory map: plain text, HTML (an SVG map, the side table, the provenance
panel) and a static PNG made with matplotlib.

The HTML's outer element has the CSS class ``sa-memory-map`` and the data attributes
``data-allocations``, ``data-shown``, ``data-chunks``, ``data-views`` and ``data-rows``; each
chunk bar is an SVG ``rect`` of class ``sa-chunk`` and each table row a ``tr`` of class
``sa-row`` (a stable marker for tests and scripts).
"""

from __future__ import annotations

import html
import io
import time
from collections.abc import Sequence
from typing import Any

from sharedarrays.api.widgets.model import ReservationMap, TableRow, fmt_bytes, plural, table_rows

__all__ = ["PALETTE", "render_text", "render_html", "render_png", "MAX_DRAWN"]

PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#9c755f",
    "#e15759",
    "#bab0ac",
    "#ff9da7",
)
"""Chunk colours, by chunk index (cycled)."""

MAX_DRAWN = 24
"""At most this many allocations are drawn and listed (a line says how many were left out)."""

_W = 760  # SVG width
_PAD = 12
_BAR_H = 26
_LEVEL_H = 15
_HEAD_H = 20
_FOOT_H = 30
_LABEL_CHAR = 6.0  # the widest a character of a view's label (10 px sans-serif) is drawn
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


def _chunk_label(index: int, size: int, width: float, per_char: float) -> str:
    """The longest chunk label that fits ``width`` (``per_char`` per character), or ''."""
    for label in (f"chunk {index} · {fmt_bytes(size)}", f"{index}: {fmt_bytes(size)}"):
        if width > per_char * (len(label) + 1):
            return label
    return ""


def _marks(m: ReservationMap) -> str:
    return "".join(f" [{mark}]" for mark in m.marks)


def _head(m: ReservationMap) -> str:
    """The title line of one reservation in the SVG and the PNG."""
    mapped = f", {fmt_bytes(m.mapped)} mapped" if 0 <= m.mapped < m.size else ""
    return (
        f"{m.short_id}{_marks(m)}  {m.backend} {m.device}  {fmt_bytes(m.size)} reserved{mapped}"
        f" in {plural(len(m.chunks), 'chunk')}  ·  {m.origin_text}"
    )


def render_text(maps: Sequence[ReservationMap]) -> str:
    """A plain-text summary: one line per allocation."""
    if not maps:
        return _EMPTY
    return "\n".join(
        f"{m.short_id}{_marks(m)} {m.backend} {m.device} {m.address:#x}+{fmt_bytes(m.size)} "
        f"{plural(len(m.chunks), 'chunk')}, {plural(len(m.views), 'view')}, "
        f"{fmt_bytes(m.lost)} lost to granularity, access {m.access_text}, "
        f"{m.origin_text}; {m.served_text}" + (f"; {m.packed_text}" if m.slab else "")
        for m in maps
    )


class _Scale:
    """Offsets and lengths of one reservation as SVG x positions and widths."""

    def __init__(self, size: int) -> None:
        self.width, self.size = _W - 2 * _PAD, max(size, 1)

    def x(self, off: int) -> float:
        return _PAD + self.width * off / self.size

    def w(self, n: int) -> float:
        return max(self.width * n / self.size, 2.0)


def _svg_text(x: float, y: float, text: str, attrs: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y}"{attrs}>{_e(text)}</text>'


def _svg_block(m: ReservationMap, y0: int) -> tuple[list[str], int]:
    """SVG elements of one reservation starting at height ``y0``, and the height used."""
    s = _Scale(m.size)
    out = [
        _svg_text(_PAD, y0 + 14, _head(m), ' font-weight="bold"'),
        _svg_text(
            _W - _PAD, y0 + 14, f"access {m.access_text}", ' text-anchor="end" class="sa-access"'
        ),
    ]
    levels = max((v.level for v in m.views), default=-1) + 1
    bar_y = y0 + _HEAD_H + levels * _LEVEL_H + 4
    for v in m.views:  # brackets, level 0 nearest the bar
        top = bar_y - 4 - (v.level + 1) * _LEVEL_H + 9
        x1 = s.x(v.start)
        x2 = max(s.x(v.stop), x1 + 2)
        tip = f"view {v.label}: {m.address + v.start:#x}-{m.address + v.stop:#x}"
        # the label centred over its bracket, moved in where it would run off either edge
        half = len(v.label) * _LABEL_CHAR / 2
        mid = min(max((x1 + x2) / 2, _PAD + half), _W - _PAD - half)
        out.append(
            f'<g class="sa-view"><title>{_e(tip)}</title>'
            f'<path d="M{x1:.1f},{top + 5} V{top} H{x2:.1f} V{top + 5}" fill="none" '
            f'stroke="#333" stroke-width="1.5"/>'
            + _svg_text(mid, top - 2, v.label, ' text-anchor="middle" font-size="10"')
            + "</g>"
        )
    out += _svg_bar(m, bar_y, s)
    foot = bar_y + _BAR_H + 13
    out.append(_svg_text(_PAD, foot, f"{m.address:#x}", ' font-family="monospace"'))
    end = f"{m.address + m.size:#x}"
    out.append(_svg_text(_W - _PAD, foot, end, ' text-anchor="end" font-family="monospace"'))
    if m.lost:
        lost = f"{fmt_bytes(m.lost)} {_LOST}"
        out.append(_svg_text(_W / 2, foot, lost, ' text-anchor="middle" fill="#c00"'))
    elif m.slab:
        out.append(
            _svg_text(_W / 2, foot, m.packed_text, ' text-anchor="middle" class="sa-packed"')
        )
    return out, bar_y + _BAR_H + _FOOT_H - y0


def _svg_rect(s: _Scale, start: int, size: int, y: int, attrs: str, tip: str) -> str:
    return (
        f'<rect {attrs} x="{s.x(start):.1f}" y="{y}" width="{s.w(size):.1f}" '
        f'height="{_BAR_H}"><title>{_e(tip)}</title></rect>'
    )


def _svg_bar(m: ReservationMap, bar_y: int, s: _Scale) -> list[str]:
    """A reservation's bar: its chunks, unmapped gaps and bytes lost, each with a tooltip."""
    a, out = m.address, []
    for c in m.chunks:
        tip = (
            f"mapping of chunk {c.chunk} at offset {c.start:#x}: {a + c.start:#x}-"
            f"{a + c.start + c.size:#x} ({fmt_bytes(c.size)}, fd {c.fd}, {c.access})"
        )
        colour = PALETTE[c.chunk % len(PALETTE)]
        attrs = f'class="sa-chunk" data-chunk="{c.chunk}" fill="{colour}" stroke="#fff"'
        out.append(_svg_rect(s, c.start, c.size, bar_y, attrs, tip))
        label = _chunk_label(c.chunk, c.size, s.w(c.size), 7.0)
        if label:
            middle = s.x(c.start) + s.w(c.size) / 2
            attrs = ' text-anchor="middle" fill="#fff" pointer-events="none"'
            out.append(_svg_text(middle, bar_y + 17, label, attrs))
    for g in m.gaps:
        tip = f"unmapped: {a + g.start:#x}-{a + g.start + g.size:#x}"
        attrs = 'class="sa-unmapped" fill="url(#sa-hatch-gap)" stroke="#999" stroke-dasharray="3,2"'
        out.append(_svg_rect(s, g.start, g.size, bar_y, attrs, tip))
    if m.lost:
        tip = (
            f"lost to granularity: {fmt_bytes(m.lost)} mapped beyond the views "
            f"({a + m.used:#x}-{a + m.used + m.lost:#x})"
        )
        attrs = 'class="sa-lost" fill="url(#sa-hatch-lost)" stroke="#c00"'
        out.append(_svg_rect(s, m.used, m.lost, bar_y, attrs, tip))
    return out


def _svg(maps: Sequence[ReservationMap]) -> str:
    parts: list[str] = []
    y = 0
    for m in maps[:MAX_DRAWN]:
        block, height = _svg_block(m, y)
        parts.extend(block)
        y += height
    if len(maps) > MAX_DRAWN:
        parts.append(f'<text x="{_PAD}" y="{y + 12}">{_e(_more(len(maps)))}</text>')
        y += 18
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{y}" '
        f'viewBox="0 0 {_W} {y}" font-family="sans-serif" font-size="12">'
        f"{_DEFS}{''.join(parts)}</svg>"
    )


def _more(total: int) -> str:
    """The line under a picture or table that shows :data:`MAX_DRAWN` of ``total``."""
    return f"… {plural(total - MAX_DRAWN, 'more allocation')} not shown (of {total})"


def _table(rows: Sequence[TableRow]) -> str:
    head = "".join(
        f"<th>{h}</th>" for h in ("allocation", "what", "start", "end", "size", "detail")
    )
    body = "".join(
        f'<tr class="sa-row" data-kind="{_e(r.kind)}"><td>{_e(r.alloc_id)}</td>'
        f"<td>{_e(r.kind)}</td><td class='sa-num'>{r.start:#x}</td>"
        f"<td class='sa-num'>{r.stop:#x}</td><td class='sa-num'>{_e(fmt_bytes(r.size))}</td>"
        f"<td>{_e(r.detail)}</td></tr>"
        for r in rows
    )
    return f'<table class="sa-table"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _provenance(maps: Sequence[ReservationMap]) -> str:
    body = []
    for m in maps:
        stamps = [(s.pid, time.strftime("%H:%M:%S", time.localtime(s.time))) for s in m.served]
        served = ", ".join(f"pid {pid} at {at}" for pid, at in stamps) or "no importer yet"
        marks = "".join(f"; {mark}" for mark in m.marks)
        body.append(
            f'<tr class="sa-provenance-row"><td>{_e(m.short_id)}</td><td>{_e(m.origin_text)}'
            f"{_e(marks)}</td><td>{_e(served)}</td></tr>"
        )
    return (
        '<table class="sa-provenance"><thead><tr><th>allocation</th><th>exporter / importer</th>'
        f"<th>handles served to importers</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def render_html(maps: Sequence[ReservationMap], title: str = "shared memory map") -> str:
    """The HTML view: the SVG map, the side table and the provenance panel (of at most
    :data:`MAX_DRAWN` allocations), in a ``div`` with the module's marker."""
    shown = maps[:MAX_DRAWN]
    rows = table_rows(shown)
    attrs = (
        f'class="sa-memory-map" data-allocations="{len(maps)}" data-shown="{len(shown)}" '
        f'data-chunks="{sum(len(m.chunks) for m in shown)}" '
        f'data-views="{sum(len(m.views) for m in shown)}" data-rows="{len(rows)}"'
    )
    if not maps:
        return f"{_CSS}<div {attrs}><h4>{_e(title)}</h4><p>{_EMPTY}</p></div>"
    more = f'<p class="sa-more">{_e(_more(len(maps)))}</p>' if len(maps) > len(shown) else ""
    return (
        f"{_CSS}<div {attrs}><h4>{_e(title)}</h4>{_svg(maps)}"
        f"<h4>addresses</h4>{_table(rows)}{more}<h4>exporters and importers</h4>"
        f"{_provenance(shown)}{more}</div>"
    )


def render_png(maps: Sequence[ReservationMap], dpi: int = 100) -> bytes:
    """A static PNG of the memory map, drawn with matplotlib (Agg, no pyplot state): one bar
    per reservation, scaled to its own length, as the SVG draws it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    drawn = list(maps[:MAX_DRAWN])
    heights = [1.0 + 0.28 * (max((v.level for v in m.views), default=-1) + 1) for m in drawn]
    total = sum(heights) or 1.0
    fig = Figure(figsize=(9.0, 0.3 + 0.75 * total), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.02, 0.02, 0.96, 0.96))
    ax.set_xlim(-0.01, 1.01)
    ax.set_ylim(0, total)
    ax.axis("off")
    if not drawn:
        ax.text(0.5, 0.5, _EMPTY, ha="center")
    y_top = total
    for m, h in zip(drawn, heights):
        _png_reservation(ax, m, y_top, h)
        y_top -= h
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _png_reservation(ax: Any, m: ReservationMap, y_top: float, h: float) -> None:
    """One reservation, ``h`` high below ``y_top``: its title line, bar and views."""
    size = max(m.size, 1)
    bar_y = y_top - h + 0.3
    ax.text(0, y_top - 0.12, _head(m), fontsize=8, fontweight="bold", va="center")
    ax.text(1, y_top - 0.12, f"access {m.access_text}", fontsize=8, ha="right", va="center")
    _png_bar(ax, m, bar_y, size)
    for v in m.views:
        top = bar_y + 0.36 + 0.28 * v.level
        x1, x2 = v.start / size, max(v.stop / size, v.start / size + 0.002)
        ax.plot([x1, x1, x2, x2], [top, top + 0.07, top + 0.07, top], color="#333", lw=1)
        ax.text((x1 + x2) / 2, top + 0.14, v.label, fontsize=6.5, ha="center", va="center")


def _png_bar(ax: Any, m: ReservationMap, bar_y: float, size: int) -> None:
    """A reservation's bar scaled to ``size``: chunks in colour, unmapped parts grey and
    hatched, bytes lost hatched red, and its start and end addresses."""
    from matplotlib.patches import Rectangle

    def rect(start: int, length: int, least: float, **style: Any) -> None:
        ax.add_patch(Rectangle((start / size, bar_y), max(length / size, least), 0.3, **style))

    def note(x: float, text: str, **style: Any) -> None:
        ax.text(x, bar_y - 0.12, text, fontsize=7, va="center", **style)

    for c in m.chunks:
        rect(c.start, c.size, 0.0, facecolor=PALETTE[c.chunk % len(PALETTE)], edgecolor="white")
        label = _chunk_label(c.chunk, c.size, c.size / size, 0.0095)
        if label:
            middle = (c.start + c.size / 2) / size
            ax.text(
                middle, bar_y + 0.15, label, color="white", fontsize=7, ha="center", va="center"
            )
    for g in m.gaps:
        rect(
            g.start,
            g.size,
            0.003,
            facecolor="#f4f4f4",
            edgecolor="#999",
            hatch="//",
            linestyle="--",
        )
    if m.lost:
        rect(m.used, m.lost, 0.003, facecolor="none", edgecolor="#c00", hatch="xxx")
        note(0.5, f"{fmt_bytes(m.lost)} {_LOST}", color="#c00", ha="center")
    elif m.slab:
        note(0.5, m.packed_text, ha="center")
    note(0, f"{m.address:#x}", family="monospace")
    note(1, f"{m.address + m.size:#x}", family="monospace", ha="right")
