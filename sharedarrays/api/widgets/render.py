"""Drawing the memory map: plain text, HTML (an SVG map, the side table, the provenance
panel) and a static PNG made with matplotlib.

The HTML carries a stable marker for tests and scripts: its outer element has the CSS class
``sa-memory-map`` and the data attributes ``data-allocations``, ``data-chunks``,
``data-views`` and ``data-rows``; each chunk bar is an SVG ``rect`` of class ``sa-chunk`` and
each table row a ``tr`` of class ``sa-row``.
"""

from __future__ import annotations

import html
import io
import time
from collections.abc import Callable, Sequence
from typing import Any

from sharedarrays.api.widgets.model import ReservationMap, TableRow, fmt_bytes, table_rows

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
"""At most this many allocations are drawn, and listed in the table and the provenance panel
(the same ones; a line says how many more were left out)."""

_W = 760  # SVG width
_PAD = 12
_BAR_H = 26
_LEVEL_H = 15
_HEAD_H = 20
_FOOT_H = 30
_LABEL_CHAR = 6.0  # the widest a character of a view's label (10 px sans-serif) is drawn

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


def _stamp(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _chunk_label(index: int, size: int, width: float, per_char: float) -> str:
    """The longest chunk label that fits ``width`` (``per_char`` per character), or ''."""
    for label in (f"chunk {index} · {fmt_bytes(size)}", f"{index}: {fmt_bytes(size)}"):
        if width > per_char * (len(label) + 1):
            return label
    return ""


def render_text(maps: Sequence[ReservationMap]) -> str:
    """A plain-text summary: one line per allocation."""
    if not maps:
        return "no live shared allocations in this process"
    lines = []
    for m in maps:
        n = len(m.chunks)
        marks = "".join(f" [{mark}]" for mark in m.marks)
        lines.append(
            f"{m.short_id}{marks} {m.backend} {m.device} {m.address:#x}+{fmt_bytes(m.size)} "
            f"{n} chunk{'s' if n != 1 else ''}, {len(m.views)} view"
            f"{'s' if len(m.views) != 1 else ''}, {fmt_bytes(m.lost)} lost to granularity, "
            f"access {m.access_text}, "
            f"{m.origin_text}; {m.served_text}" + (f"; {m.packed_text}" if m.slab else "")
        )
    return "\n".join(lines)


def _svg_block(m: ReservationMap, y0: int) -> tuple[list[str], int]:
    """SVG elements of one reservation starting at height ``y0``; returns them and the
    height used."""
    width = _W - 2 * _PAD
    size = max(m.size, 1)

    def x(off: int) -> float:
        return _PAD + width * off / size

    def w(n: int) -> float:
        return max(width * n / size, 2.0)

    out = []
    access = m.access_text
    marks = "".join(f" [{mark}]" for mark in m.marks)
    head = (
        f"{m.short_id}{marks}  {m.backend} {m.device}  {fmt_bytes(m.size)} reserved"
        + (f", {fmt_bytes(m.mapped)} mapped" if 0 <= m.mapped < m.size else "")
        + f" in {len(m.chunks)} chunk{'s' if len(m.chunks) != 1 else ''}  ·  {m.origin_text}"
    )
    out.append(f'<text x="{_PAD}" y="{y0 + 14}" font-weight="bold">{_e(head)}</text>')
    out.append(
        f'<text x="{_W - _PAD}" y="{y0 + 14}" text-anchor="end" class="sa-access">'
        f"access {_e(access)}</text>"
    )
    levels = max((v.level for v in m.views), default=-1) + 1
    bar_y = y0 + _HEAD_H + levels * _LEVEL_H + 4
    # view brackets, level 0 nearest the bar
    for v in m.views:
        top = bar_y - 4 - (v.level + 1) * _LEVEL_H + 9
        x1, x2 = x(v.start), x(v.stop)
        x2 = max(x2, x1 + 2)
        tip = f"view {v.label}: {m.address + v.start:#x}-{m.address + v.stop:#x}"
        # the label centred over its bracket, moved in where it would run off either edge
        half = len(v.label) * _LABEL_CHAR / 2
        mid = min(max((x1 + x2) / 2, _PAD + half), _W - _PAD - half)
        out.append(
            f'<g class="sa-view"><title>{_e(tip)}</title>'
            f'<path d="M{x1:.1f},{top + 5} V{top} H{x2:.1f} V{top + 5}" fill="none" '
            f'stroke="#333" stroke-width="1.5"/>'
            f'<text x="{mid:.1f}" y="{top - 2}" text-anchor="middle" '
            f'font-size="10">{_e(v.label)}</text></g>'
        )
    out += _svg_bar(m, bar_y, x, w)
    foot = bar_y + _BAR_H + 13
    out.append(f'<text x="{_PAD}" y="{foot}" font-family="monospace">{m.address:#x}</text>')
    out.append(
        f'<text x="{_W - _PAD}" y="{foot}" text-anchor="end" font-family="monospace">'
        f"{m.address + m.size:#x}</text>"
    )
    if m.lost:
        out.append(
            f'<text x="{_W / 2:.0f}" y="{foot}" text-anchor="middle" fill="#c00">'
            f"{_e(fmt_bytes(m.lost))} lost to granularity (mapped beyond the views)</text>"
        )
    elif m.slab:
        out.append(
            f'<text x="{_W / 2:.0f}" y="{foot}" text-anchor="middle" class="sa-packed">'
            f"{_e(m.packed_text)}</text>"
        )
    return out, bar_y + _BAR_H + _FOOT_H - y0


def _svg_bar(
    m: ReservationMap, bar_y: int, x: Callable[[int], float], w: Callable[[int], float]
) -> list[str]:
    """SVG elements of a reservation's bar at height ``bar_y`` (``x``: an offset's
    position, ``w``: a length's width): its chunks, unmapped gaps and bytes lost to
    granularity, each with its tooltip."""
    out = []
    for c in m.chunks:
        colour = PALETTE[c.chunk % len(PALETTE)]
        tip = (
            f"mapping of chunk {c.chunk} at offset {c.start:#x}: "
            f"{m.address + c.start:#x}-{m.address + c.start + c.size:#x} "
            f"({fmt_bytes(c.size)}, fd {c.fd}, {c.access})"
        )
        out.append(
            f'<rect class="sa-chunk" data-chunk="{c.chunk}" x="{x(c.start):.1f}" y="{bar_y}" '
            f'width="{w(c.size):.1f}" height="{_BAR_H}" fill="{colour}" stroke="#fff">'
            f"<title>{_e(tip)}</title></rect>"
        )
        label = _chunk_label(c.chunk, c.size, w(c.size), 7.0)
        if label:
            out.append(
                f'<text x="{x(c.start) + w(c.size) / 2:.1f}" y="{bar_y + 17}" '
                f'text-anchor="middle" fill="#fff" pointer-events="none">{_e(label)}</text>'
            )
    for g in m.gaps:
        tip = f"unmapped: {m.address + g.start:#x}-{m.address + g.start + g.size:#x}"
        out.append(
            f'<rect class="sa-unmapped" x="{x(g.start):.1f}" y="{bar_y}" width="{w(g.size):.1f}" '
            f'height="{_BAR_H}" fill="url(#sa-hatch-gap)" stroke="#999" stroke-dasharray="3,2">'
            f"<title>{_e(tip)}</title></rect>"
        )
    if m.lost:
        tip = (
            f"lost to granularity: {fmt_bytes(m.lost)} mapped beyond the views "
            f"({m.address + m.used:#x}-{m.address + m.used + m.lost:#x})"
        )
        out.append(
            f'<rect class="sa-lost" x="{x(m.used):.1f}" y="{bar_y}" width="{w(m.lost):.1f}" '
            f'height="{_BAR_H}" fill="url(#sa-hatch-lost)" stroke="#c00">'
            f"<title>{_e(tip)}</title></rect>"
        )
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
    n = total - MAX_DRAWN
    return f"… {n} more allocation{'s' if n != 1 else ''} not shown (of {total})"


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
        served = ", ".join(f"pid {s.pid} at {_stamp(s.time)}" for s in m.served)
        served = served or "no importer yet"
        body.append(
            f'<tr class="sa-provenance-row"><td>{_e(m.short_id)}</td><td>{_e(m.origin_text)}'
            f"{_e(''.join(f'; {mark}' for mark in m.marks))}</td><td>{_e(served)}</td></tr>"
        )
    return (
        '<table class="sa-provenance"><thead><tr><th>allocation</th><th>exporter / importer</th>'
        f"<th>handles served to importers</th></tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


def render_html(maps: Sequence[ReservationMap], title: str = "shared memory map") -> str:
    """The HTML view: the SVG map, the side table and the provenance panel.

    The outer ``div`` has class ``sa-memory-map`` and ``data-allocations`` (all of them),
    ``data-shown`` (those drawn and listed: at most :data:`MAX_DRAWN`), ``data-chunks``,
    ``data-views`` and ``data-rows`` (of those shown) attributes (a stable marker).
    """
    shown = maps[:MAX_DRAWN]
    rows = table_rows(shown)
    n_chunks = sum(len(m.chunks) for m in shown)
    n_views = sum(len(m.views) for m in shown)
    attrs = (
        f'class="sa-memory-map" data-allocations="{len(maps)}" data-shown="{len(shown)}" '
        f'data-chunks="{n_chunks}" data-views="{n_views}" data-rows="{len(rows)}"'
    )
    more = f'<p class="sa-more">{_e(_more(len(maps)))}</p>' if len(maps) > len(shown) else ""
    if not maps:
        return (
            f"{_CSS}<div {attrs}><h4>{_e(title)}</h4>"
            "<p>no live shared allocations in this process</p></div>"
        )
    return (
        f"{_CSS}<div {attrs}><h4>{_e(title)}</h4>{_svg(maps)}"
        f"<h4>addresses</h4>{_table(rows)}{more}<h4>exporters and importers</h4>"
        f"{_provenance(shown)}{more}</div>"
    )


def render_png(maps: Sequence[ReservationMap], dpi: int = 100) -> bytes:
    """A static PNG of the memory map, drawn with matplotlib (Agg, no pyplot state).

    Each reservation is one horizontal bar scaled to its own length, with its start and end
    addresses at the ends; chunks in colour, unmapped parts grey and hatched, bytes lost to
    granularity hatched red, views as brackets above.
    """
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
        ax.text(0.5, 0.5, "no live shared allocations in this process", ha="center")
    y_top = total
    for m, h in zip(drawn, heights):
        _png_reservation(ax, m, y_top, h)
        y_top -= h
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _png_reservation(ax: Any, m: ReservationMap, y_top: float, h: float) -> None:
    """One reservation in :func:`render_png`, ``h`` high below ``y_top``: its title line,
    its bar and its views' brackets."""
    size = max(m.size, 1)
    bar_y = y_top - h + 0.3
    ax.text(
        0,
        y_top - 0.12,
        f"{m.short_id}{''.join(f' [{k}]' for k in m.marks)}  {m.backend} {m.device}  "
        f"{fmt_bytes(m.size)} in {len(m.chunks)} "
        f"chunk{'s' if len(m.chunks) != 1 else ''} · {m.origin_text}",
        fontsize=8,
        fontweight="bold",
        va="center",
    )
    ax.text(1, y_top - 0.12, f"access {m.access_text}", fontsize=8, ha="right", va="center")
    _png_bar(ax, m, bar_y, size)
    for v in m.views:
        top = bar_y + 0.36 + 0.28 * v.level
        x1, x2 = v.start / size, max(v.stop / size, v.start / size + 0.002)
        ax.plot([x1, x1, x2, x2], [top, top + 0.07, top + 0.07, top], color="#333", lw=1)
        ax.text((x1 + x2) / 2, top + 0.14, v.label, fontsize=6.5, ha="center", va="center")


def _png_bar(ax: Any, m: ReservationMap, bar_y: float, size: int) -> None:
    """A reservation's bar in :func:`render_png` (scaled to ``size``): its chunks in
    colour, unmapped parts grey and hatched, bytes lost to granularity hatched red, and its
    start and end addresses."""
    from matplotlib.patches import Rectangle

    for c in m.chunks:
        x0, w = c.start / size, c.size / size
        ax.add_patch(
            Rectangle(
                (x0, bar_y),
                w,
                0.3,
                facecolor=PALETTE[c.chunk % len(PALETTE)],
                edgecolor="white",
            )
        )
        label = _chunk_label(c.chunk, c.size, w, 0.0095)
        if label:
            ax.text(
                x0 + w / 2,
                bar_y + 0.15,
                label,
                color="white",
                fontsize=7,
                ha="center",
                va="center",
            )
    for g in m.gaps:
        ax.add_patch(
            Rectangle(
                (g.start / size, bar_y),
                max(g.size / size, 0.003),
                0.3,
                facecolor="#f4f4f4",
                edgecolor="#999",
                hatch="//",
                linestyle="--",
            )
        )
    if m.lost:
        ax.add_patch(
            Rectangle(
                (m.used / size, bar_y),
                max(m.lost / size, 0.003),
                0.3,
                facecolor="none",
                edgecolor="#c00",
                hatch="xxx",
            )
        )
        ax.text(
            0.5,
            bar_y - 0.12,
            f"{fmt_bytes(m.lost)} lost to granularity (mapped beyond the views)",
            color="#c00",
            fontsize=7,
            ha="center",
            va="center",
        )
    if m.slab and not m.lost:
        ax.text(0.5, bar_y - 0.12, m.packed_text, fontsize=7, ha="center", va="center")
    ax.text(0, bar_y - 0.12, f"{m.address:#x}", fontsize=7, family="monospace", va="center")
    ax.text(
        1,
        bar_y - 0.12,
        f"{m.address + m.size:#x}",
        fontsize=7,
        family="monospace",
        ha="right",
        va="center",
    )
