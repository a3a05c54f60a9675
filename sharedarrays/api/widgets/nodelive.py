"""The node-wide memory map in Jupyter: ``sa.show(scope="node")``.

:class:`NodeView` is the map with a text and HTML display (no ipywidgets needed);
:func:`node_widget` makes the live ``NodeMapWidget``: *refresh*, *auto-refresh* and its
interval, and *free* (an id or name, as ``python -m sharedarrays rm`` frees it, never
dropping payloads in flight) above the table.
"""

from __future__ import annotations

from typing import Any

from sharedarrays.api import nodemap
from sharedarrays.api.widgets.nodeview import render_node_html, render_node_text
from sharedarrays.api.widgets.refresh import MAX_INTERVAL, MIN_INTERVAL
from sharedarrays.errors import SharedArrayError
from sharedarrays.settings import seconds

__all__ = ["NodeView", "node_widget"]


class NodeView:
    """The node-wide map as last read, displayed as text or HTML; ``timeout``: the seconds
    each process is given to answer."""

    def __init__(self, timeout: float = 1.0) -> None:
        self.timeout = timeout
        self.map = nodemap.node_map(timeout)

    def refresh(self) -> nodemap.NodeMap:
        """Ask every process again; the new map."""
        self.map = nodemap.node_map(self.timeout)
        return self.map

    def free(self, target: str) -> str:
        """Free what keeps ``target`` (an id, its start, or a name) although no view uses it
        (:func:`~sharedarrays.api.nodemap.free`, leaving payloads in flight); what happened."""
        try:
            row = nodemap.find(self.refresh(), target.strip())
            done = nodemap.free(row, confirm=None)
        except SharedArrayError as e:
            return str(e)
        self.refresh()
        return f"{row.alloc_id[:12]}: " + ("; ".join(done) or "nothing holds it any more")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {"text/plain": render_node_text(self.map), "text/html": render_node_html(self.map)}

    def __repr__(self) -> str:
        return render_node_text(self.map)


def node_widget(view: NodeView, interval: float = 2.0, auto_refresh: bool = False) -> Any:
    """The live widget of ``view`` (needs ipywidgets 8).

    Raises
    ------
    TypeError, ValueError
        ``interval`` is not a number of seconds from :data:`~.refresh.MIN_INTERVAL` to
        :data:`~.refresh.MAX_INTERVAL`.
    """
    interval = seconds(interval, "interval", MIN_INTERVAL, MAX_INTERVAL)
    from sharedarrays.api.widgets.live import NodeMapWidget

    return NodeMapWidget(view, interval, auto_refresh)
