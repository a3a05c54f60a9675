"""The memory map of this process's shared allocations, and of the whole node, for Jupyter:
a live :class:`~.live.MemoryMapWidget` in a kernel with ipywidgets 8 or later, else a
:class:`MemoryMap` shown as text, HTML and a PNG. Only allocations' metadata is read."""

from __future__ import annotations

from functools import partial
from typing import Any

from sharedarrays.api.widgets import view
from sharedarrays.api.widgets.model import build_map, build_maps, table_rows, views_of
from sharedarrays.api.widgets.render import render_html, render_png, render_text
from sharedarrays.api.widgets.view import MemoryMap, NodeView

__all__ = ["show", "MemoryMap", "NodeView", "build_map", "build_maps", "table_rows", "views_of"]
__all__ += ["render_html", "render_png", "render_text"]


def show(
    target: Any = None, *, interval: float = 2.0, auto_refresh: bool = False, scope: str = "process"
) -> Any:
    """The memory map of shared allocations in this process, or of the whole node.

    Parameters
    ----------
    target : SharedDeviceArray, Allocation, a list of them, or None
        What to show (``None``: every live allocation of this process).
    interval, auto_refresh
        Seconds between refreshes (0.2 to 3600), and whether to start refreshing once shown.
    scope : {"process", "node"}
        ``"node"`` (no ``target``): every allocation of this user on this node, who holds it
        and in which state (:mod:`sharedarrays.api.nodemap`), with a *free* action.

    Returns
    -------
    MemoryMapWidget or MemoryMap
        In a Jupyter kernel with ipywidgets 8 or later the live map, an ipywidgets ``VBox``
        (its ``memory_map`` is the :class:`MemoryMap`), elsewhere the :class:`MemoryMap`; for
        the node a ``VBox`` or a :class:`~sharedarrays.api.widgets.view.NodeView`. TypeError
        or ValueError for a wrong argument.
    """
    if scope not in ("process", "node"):
        raise ValueError(f"scope must be 'process' or 'node', not {scope!r}")
    if scope == "node" and target is not None:
        raise ValueError("show(scope='node') shows every allocation: give no target")
    cls = NodeView if scope == "node" else partial(MemoryMap, target)
    shown = cls(interval=interval, auto_refresh=auto_refresh)
    return shown.widget if view.in_kernel() else shown
