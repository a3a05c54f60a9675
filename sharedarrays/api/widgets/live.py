"""The live views as ipywidgets ``VBox``es: :class:`MemoryMapWidget` and
:class:`NodeMapWidget`. This module imports ipywidgets; the others import it only when a
widget is made."""

from __future__ import annotations

import time
from typing import Any, Protocol

import ipywidgets as w

from sharedarrays.api import nodemap
from sharedarrays.api.widgets.model import ReservationMap
from sharedarrays.api.widgets.nodeview import render_node_html, render_node_text
from sharedarrays.api.widgets.refresh import MAX_INTERVAL, MIN_INTERVAL, AutoRefresh, stop_on_rerun
from sharedarrays.api.widgets.render import render_text

__all__ = ["MemoryMapWidget", "NodeMapWidget", "Controller", "refresh_controls"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class Controller(Protocol):
    """What the widget shows and drives: a :class:`~sharedarrays.MemoryMap`."""

    maps: list[ReservationMap]

    @property
    def auto_refreshing(self) -> bool: ...
    def refresh(self) -> list[ReservationMap]: ...
    def start(self, interval: float | None = None) -> None: ...
    def stop(self, timeout: float | None = 5.0) -> None: ...
    def mimebundle(self, include: Any = None, exclude: Any = None) -> dict[str, Any]: ...


def refresh_controls(interval: float) -> tuple[Any, Any, Any]:
    """A live view's *refresh* button, *auto-refresh* toggle (off) and interval in seconds."""
    return (
        w.Button(description="refresh", icon="refresh", tooltip="re-read now"),
        w.ToggleButton(value=False, description="auto-refresh", icon="clock-o"),
        w.BoundedFloatText(
            value=interval,
            min=MIN_INTERVAL,
            max=MAX_INTERVAL,
            step=0.5,
            description="every (s)",
            layout=w.Layout(width="160px"),
        ),
    )


class MemoryMapWidget(w.VBox):  # type: ignore[misc]  # ipywidgets is untyped
    """The memory map as an ipywidgets ``VBox``: *refresh*, *auto-refresh*, the interval and
    the time of the last update above the map's HTML.

    It composes with other widgets (``VBox``, ``HBox``, ``Tab``, ...). Made by
    :attr:`MemoryMap.widget <sharedarrays.MemoryMap.widget>`, which wires the controls; its
    :class:`~sharedarrays.MemoryMap` is :attr:`memory_map`.
    """

    def __init__(self, memory_map: Controller, html: str, interval: float) -> None:
        self.refresh_button, self.auto_toggle, self.interval_text = refresh_controls(interval)
        self.status = w.Label(value="")
        self.html = w.HTML(value=html)
        self.controls = w.HBox(
            [self.refresh_button, self.auto_toggle, self.interval_text, self.status]
        )
        super().__init__([self.controls, self.html])
        self.memory_map = memory_map

    @property
    def maps(self) -> list[ReservationMap]:
        """The allocations as last read (see :meth:`refresh`)."""
        return self.memory_map.maps

    def refresh(self) -> list[ReservationMap]:
        """Re-read and redraw (:meth:`MemoryMap.refresh <sharedarrays.MemoryMap.refresh>`)."""
        return self.memory_map.refresh()

    def start(self, interval: float | None = None) -> None:
        """Start auto-refreshing (:meth:`MemoryMap.start <sharedarrays.MemoryMap.start>`)."""
        self.memory_map.start(interval)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop auto-refreshing (:meth:`MemoryMap.stop <sharedarrays.MemoryMap.stop>`)."""
        self.memory_map.stop(timeout)

    @property
    def auto_refreshing(self) -> bool:
        """Whether the auto-refresh thread is running."""
        return self.memory_map.auto_refreshing

    def close(self) -> None:
        """Stop auto-refreshing and close this widget and its controls."""
        self.memory_map.stop()
        controls = (self.refresh_button, self.auto_toggle, self.interval_text, self.status)
        for part in (*controls, self.html, self.controls):
            part.close()
        super().close()

    def view_data(self) -> dict[str, Any]:
        """The widget-view mime entry that shows this widget live in a kernel's frontend."""
        data: dict[str, Any] = super()._repr_mimebundle_()
        return {k: v for k, v in data.items() if k == WIDGET_MIME}

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        """The map's display data: text, HTML and PNG, and the live view in a kernel."""
        return self.memory_map.mimebundle(include, exclude)

    def __repr__(self) -> str:
        return render_text(self.memory_map.maps)


class NodeMapWidget(w.VBox):  # type: ignore[misc]  # ipywidgets is untyped
    """The node-wide map as an ipywidgets ``VBox``: the refresh controls and *free* (an id or
    name) above the table of a :class:`~sharedarrays.api.widgets.nodelive.NodeView`."""

    def __init__(self, view: Any, interval: float, auto_refresh: bool = False) -> None:
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
            "sharedarrays-node-map", _node_interval, _node_report
        )
        self.refresh_button.on_click(lambda _: self.refresh())
        self.free_button.on_click(lambda _: self._free())
        self.auto_toggle.observe(lambda c: self.start() if c["new"] else self.stop(), "value")
        stop_on_rerun(self)
        if auto_refresh:
            self.auto_toggle.value = True

    def refresh(self) -> nodemap.NodeMap:
        """Ask every process again and redraw."""
        picture: nodemap.NodeMap = self.node_view.refresh()
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


def _node_interval(widget: NodeMapWidget) -> float | None:
    """Seconds to the node widget's next refresh; ``None`` once it is closed."""
    return None if widget.comm is None else float(widget.interval_text.value)


def _node_report(widget: NodeMapWidget, error: Exception) -> None:
    widget.status.value = f"refresh failed: {error}"
