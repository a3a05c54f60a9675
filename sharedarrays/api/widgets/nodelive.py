"""The node-wide memory map in Jupyter: ``sa.show(scope="node")``.

:class:`NodeView` is the map with a text and HTML display (no ipywidgets needed);
:func:`node_widget` makes the live ``NodeMapWidget``: *refresh*, *auto-refresh* and its
interval, and *free* (an id or name, as ``python -m sharedarrays rm`` frees it, never
dropping payloads in flight) above the table.
"""

from __future__ import annotations

import time
from typing import Any

from sharedarrays.api import nodemap
from sharedarrays.api.widgets.nodeview import render_node_html, render_node_text
from sharedarrays.api.widgets.refresh import (
    MAX_INTERVAL,
    MIN_INTERVAL,
    AutoRefresh,
    stop_on_rerun,
)
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
    import ipywidgets as w

    from sharedarrays.api.widgets.live import refresh_controls

    class NodeMapWidget(w.VBox):  # type: ignore[misc]  # ipywidgets is untyped
        """The node-wide map as an ipywidgets ``VBox`` (composes with other widgets)."""

        def __init__(self) -> None:
            self.node_view = view
            self.refresh_button, self.auto_toggle, self.interval_text = refresh_controls(interval)
            self.target = w.Text(placeholder="id or name", layout=w.Layout(width="220px"))
            self.free_button = w.Button(
                description="free", icon="trash", tooltip="free a parked or orphaned allocation"
            )
            self.status = w.Label(value="")
            self.html = w.HTML(value=render_node_html(view.map))
            controls = [self.refresh_button, self.auto_toggle, self.interval_text, self.status]
            super().__init__([w.HBox(controls), w.HBox([self.target, self.free_button]), self.html])
            self._refresher: AutoRefresh[NodeMapWidget] = AutoRefresh(
                "sharedarrays-node-map", _interval, _report
            )
            self.refresh_button.on_click(lambda _: self.refresh())
            self.free_button.on_click(lambda _: self._free())
            self.auto_toggle.observe(lambda c: self.start() if c["new"] else self.stop(), "value")
            stop_on_rerun(self)
            if auto_refresh:
                self.auto_toggle.value = True

        def refresh(self) -> nodemap.NodeMap:
            """Ask every process again and redraw."""
            picture = self.node_view.refresh()
            self.html.value = render_node_html(picture)
            self.status.value = time.strftime("updated %H:%M:%S")
            return picture

        def _free(self) -> None:
            self.status.value = self.node_view.free(self.target.value)
            self.html.value = render_node_html(self.node_view.map)

        @property
        def auto_refreshing(self) -> bool:
            """Whether the auto-refresh thread runs."""
            return self._refresher.running

        def start(self) -> None:
            """Refresh every ``interval_text`` seconds in a daemon thread (it holds this widget
            weakly, and ends when the widget is closed)."""
            stop_on_rerun(self)
            self._refresher.start(self)

        def stop(self, timeout: float | None = 5.0) -> None:
            """Stop auto-refreshing (and turn the *auto-refresh* toggle off)."""
            self._refresher.stop(timeout)
            self.auto_toggle.value = False

        def close(self) -> None:
            """Stop auto-refreshing and close the widget."""
            self.stop()
            super().close()

        def __repr__(self) -> str:
            return render_node_text(self.node_view.map)

    return NodeMapWidget()


def _interval(widget: Any) -> float | None:
    """Seconds to the node widget's next refresh; ``None`` once it is closed."""
    return None if widget.comm is None else float(widget.interval_text.value)


def _report(widget: Any, error: Exception) -> None:
    widget.status.value = f"refresh failed: {error}"
