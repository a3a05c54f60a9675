"""Views of this process's shared allocations for Jupyter: the memory map.

``sa.show()`` (every live allocation) and ``a.show()`` (one array's allocation) return, in a
Jupyter kernel with ipywidgets 8 or later, a live :class:`~.live.MemoryMapWidget` (an
ipywidgets ``VBox`` with refresh and auto-refresh, which composes with other widgets), and
elsewhere a :class:`MemoryMap`, which nbconvert, GitHub or a terminal show as text, an HTML
table and a PNG.

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
from sharedarrays.api.widgets.refresh import MAX_INTERVAL, MIN_INTERVAL
from sharedarrays.api.widgets.render import render_html, render_png, render_text
from sharedarrays.api.widgets.view import (
    MemoryMap,
    in_kernel,
    live_or_static,
    widgets_available,
)
from sharedarrays.settings import seconds

__all__ = [
    "show",
    "MemoryMap",
    "live_or_static",
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


def show(
    target: Any = None,
    *,
    interval: float = 2.0,
    auto_refresh: bool = False,
    scope: str = "process",
) -> Any:
    """The memory map of shared allocations in this process, or of the whole node.

    Parameters
    ----------
    scope : {"process", "node"}, default "process"
        ``"node"``: every allocation of this user on this node, who holds it and in which
        state (:mod:`sharedarrays.api.nodemap`), with a *free* action for parked and orphaned
        ones; ``target`` must then be ``None``. In a kernel with ipywidgets 8 a live
        ``VBox`` (refresh, auto-refresh), elsewhere a
        :class:`~sharedarrays.api.widgets.nodelive.NodeView` (text and HTML).
    target : SharedDeviceArray, Allocation, a list of them, or None
        ``None`` (the default): every live allocation of this process.
    interval : float, default 2.0
        Seconds between automatic refreshes, from 0.2 to 3600.
    auto_refresh : bool, default False
        Start refreshing automatically once displayed.

    Returns
    -------
    MemoryMapWidget or MemoryMap
        In a Jupyter kernel with ipywidgets 8 or later, the live map: a
        :class:`~sharedarrays.api.widgets.live.MemoryMapWidget`, a real ipywidgets ``VBox``
        that composes in ``VBox``, ``HBox``, ``Tab`` and the like (its :class:`MemoryMap` is
        its ``memory_map``). Elsewhere the :class:`MemoryMap`. Both are displayed by Jupyter
        when they are a cell's last expression, both have ``maps``, ``refresh``, ``start``,
        ``stop`` and ``close``, and the ``repr`` of both is a text summary.

    Raises
    ------
    TypeError
        ``target`` is not an array or an allocation, or ``interval`` is not a number.
    ValueError
        ``interval`` is out of range (``0`` would refresh without pause), a target is given
        with ``scope="node"``, or ``scope`` is neither.
    """
    seconds(interval, "interval", MIN_INTERVAL, MAX_INTERVAL)
    if scope == "node":
        if target is not None:
            raise ValueError("show(scope='node') shows every allocation: give no target")
        from sharedarrays.api.widgets.nodelive import NodeView, node_widget

        view = NodeView()
        if in_kernel() and widgets_available():
            return node_widget(view, interval, auto_refresh)
        return view
    if scope != "process":
        raise ValueError(f"scope must be 'process' or 'node', not {scope!r}")
    return live_or_static(MemoryMap(target, interval=interval, auto_refresh=auto_refresh))
