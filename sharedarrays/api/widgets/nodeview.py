"""The node-wide map (:class:`~sharedarrays.api.nodemap.NodeMap`) as text and HTML: what
``python -m sharedarrays top`` prints and ``sa.show(scope="node")`` draws."""

from __future__ import annotations

import html
import time

from sharedarrays.api.nodemap import STATES, Holder, NodeAllocation, NodeMap
from sharedarrays.api.widgets.model import fmt_bytes, plural

__all__ = ["COLUMNS", "row_cells", "summary_lines", "render_node_text", "render_node_html"]

COLUMNS = ("ID", "NAME", "STATE", "BACKEND", "DEVICE", "SIZE", "LOST", "EXPORTER", "HOLDERS", "AGE")
"""The columns of the table (``top`` and ``ls`` alike)."""

_COLOURS = ("#2e7d32", "#ef6c00", "#00838f", "#1565c0", "#6a1b9a", "#c62828")
"""The colour of each of :data:`~sharedarrays.api.nodemap.STATES`, in order."""


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _program(command: str) -> str:
    """A short name for a command line: the script or module it runs, else its program."""
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
        fmt_bytes(row.size),
        fmt_bytes(row.lost) if row.lost else "0",
        exporter,
        " ".join(_holder(h) for h in row.holders) or "-",
        _age(row.age),
    )


def summary_lines(node: NodeMap) -> list[str]:
    """One line per device with what sharedarrays holds there, and one about the processes."""
    lines = [
        f"{d.device}: {fmt_bytes(d.bytes)} in {plural(d.allocations, 'allocation')} "
        f"({fmt_bytes(d.lost)} lost to granularity)"
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
    """The map as a fixed-width table under its summary lines (largest allocation first).

    Holders read ``<pid><role>``: ``E`` exporter, ``I`` importer, ``K`` keeper; then ``Nv``
    for N views using it there, or ``p`` for a mapping kept parked.
    """
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
    """The map as an HTML table under its summary lines."""
    cell = "padding:2px 8px;font-family:monospace;white-space:nowrap"
    head = "".join(
        f"<th style='text-align:left;padding:2px 8px;white-space:nowrap'>{c}</th>" for c in COLUMNS
    )
    body = []
    for r in node.allocations:
        state = f";color:{_COLOURS[STATES.index(r.state)]};font-weight:bold"
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
