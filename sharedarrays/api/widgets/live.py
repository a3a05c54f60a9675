"""MemoryMapWidget: the live memory map as an ipywidgets ``VBox`` (this module imports
ipywidgets; :mod:`~sharedarrays.api.widgets.view` imports it only when a widget is made)."""

from __future__ import annotations

from typing import Any, Protocol

import ipywidgets as w

from sharedarrays.api.widgets.model import ReservationMap
from sharedarrays.api.widgets.refresh import MAX_INTERVAL, MIN_INTERVAL
from sharedarrays.api.widgets.render import render_text

__all__ = ["MemoryMapWidget", "Controller", "refresh_controls"]

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
