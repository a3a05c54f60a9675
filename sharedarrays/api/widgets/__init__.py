"""Views of this process's shared allocations for Jupyter: the memory map.

``sa.show()`` (every live allocation) and ``a.show()`` (one array's allocation) return a
:class:`MemoryMap`; Jupyter displays it as a live ipywidgets view with refresh and
auto-refresh, and nbconvert, GitHub or a terminal as text, an HTML table and a PNG.

Importing this package needs neither ipywidgets nor matplotlib: they are imported only when
a live widget or a PNG is made. Only allocations' metadata is read, never array memory, so
the views work on the host and CUDA backends alike.
"""

from __future__ import annotations

from typing import Any

from sharedarrays.api.widgets.model import (
    ChunkBar,
    Gap,
    ReservationMap,
    ServedInfo,
    TableRow,
    ViewBracket,
    build_map,
    build_maps,
    table_rows,
    views_of,
)
from sharedarrays.api.widgets.render import render_html, render_png, render_text
from sharedarrays.api.widgets.view import MemoryMap, mimebundle

__all__ = [
    "show",
    "MemoryMap",
    "mimebundle",
    "ReservationMap",
    "ChunkBar",
    "Gap",
    "ViewBracket",
    "ServedInfo",
    "TableRow",
    "build_map",
    "build_maps",
    "table_rows",
    "views_of",
    "render_html",
    "render_png",
    "render_text",
]


def show(target: Any = None, *, interval: float = 2.0, auto_refresh: bool = False) -> MemoryMap:
    """The memory map of shared allocations in this process.

    Parameters
    ----------
    target : SharedDeviceArray, Allocation, a list of them, or None
        ``None`` (the default): every live allocation of this process.
    interval : float, default 2.0
        Seconds between automatic refreshes.
    auto_refresh : bool, default False
        Start refreshing automatically once displayed.

    Returns
    -------
    MemoryMap
        Displayed by Jupyter when it is a cell's last expression (or pass it to
        ``IPython.display.display``); its ``repr`` is a text summary.
    """
    return MemoryMap(target, interval=interval, auto_refresh=auto_refresh)
