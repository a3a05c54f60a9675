"""The live maps as ipywidgets ``VBox``es (this module alone imports ipywidgets)."""

from __future__ import annotations

from typing import Any

import ipywidgets as w

from sharedarrays.api.widgets.model import MAX_INTERVAL, MIN_INTERVAL, WIDGET_MIME, ReservationMap

__all__ = ["MemoryMapWidget", "NodeMapWidget"]


class _Box(w.VBox):  # type: ignore[misc]  # ipywidgets is untyped
    """The controls, ``extra`` rows and the HTML of ``shown`` (a MemoryMap or NodeView)."""

    def __init__(self, shown: Any, extra: tuple[Any, ...] = ()) -> None:
        self.refresh_button = w.Button(description="refresh", icon="refresh", tooltip="re-read now")
        self.auto_toggle = w.ToggleButton(value=False, description="auto-refresh", icon="clock-o")
        self.interval_text = w.BoundedFloatText(
            value=shown._interval,
            min=MIN_INTERVAL,
            max=MAX_INTERVAL,
            step=0.5,
            description="every (s)",
            layout=w.Layout(width="160px"),
        )
        self.status = w.Label(value="")
        self.html = w.HTML(value=shown.html())
        self.controls = w.HBox(
            [self.refresh_button, self.auto_toggle, self.interval_text, self.status]
        )
        super().__init__([self.controls, *extra, self.html])
        self._shown = shown
        self.refresh_button.on_click(lambda _: shown.refresh())
        self.auto_toggle.observe(lambda c: shown.start() if c["new"] else shown.stop(), "value")
        self.interval_text.observe(lambda c: setattr(shown, "_interval", float(c["new"])), "value")

    def refresh(self) -> Any:
        """Re-read and redraw (:meth:`MemoryMap.refresh <sharedarrays.MemoryMap.refresh>`)."""
        return self._shown.refresh()

    def start(self, interval: float | None = None) -> None:
        """Start auto-refreshing (:meth:`MemoryMap.start <sharedarrays.MemoryMap.start>`)."""
        self._shown.start(interval)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop auto-refreshing (:meth:`MemoryMap.stop <sharedarrays.MemoryMap.stop>`)."""
        self._shown.stop(timeout)

    @property
    def auto_refreshing(self) -> bool:
        """Whether the auto-refresh thread is running."""
        return bool(self._shown.auto_refreshing)

    def close(self) -> None:
        """Stop auto-refreshing and close this widget and its controls."""
        self._shown.stop()
        for part in self.controls.children + self.children:
            part.close()
        super().close()

    def view_data(self) -> dict[str, Any]:
        """The widget-view entry of display data (this widget live in a kernel)."""
        data: dict[str, Any] = super()._repr_mimebundle_()
        return {k: v for k, v in data.items() if k == WIDGET_MIME}

    def _repr_mimebundle_(
        self, include: Any = None, exclude: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        return dict(self._shown.mimebundle(include, exclude))

    def __repr__(self) -> str:
        return str(self._shown.text())


class MemoryMapWidget(_Box):
    """The memory map as an ipywidgets ``VBox`` (composes with ``HBox``, ``Tab``, ...):
    *refresh*, *auto-refresh*, the interval and the last update above the map's HTML. Made by
    :attr:`MemoryMap.widget <sharedarrays.MemoryMap.widget>`; the map is :attr:`memory_map`."""

    @property
    def memory_map(self) -> Any:
        """The :class:`~sharedarrays.MemoryMap` this widget shows."""
        return self._shown

    @property
    def maps(self) -> list[ReservationMap]:
        """The allocations as last read (see :meth:`refresh`)."""
        return self._shown.maps  # type: ignore[no-any-return]


class NodeMapWidget(_Box):
    """The node-wide map as an ipywidgets ``VBox``: the refresh controls and *free* (an id or
    name, freed as ``rm`` frees it, never dropping payloads in flight) above the table of a
    :class:`~sharedarrays.api.widgets.view.NodeView` (:attr:`node_view`)."""

    def __init__(self, view: Any) -> None:
        self.target = w.Text(placeholder="id or name", layout=w.Layout(width="220px"))
        self.free_button = w.Button(
            description="free", icon="trash", tooltip="free a parked or orphaned allocation"
        )
        super().__init__(view, (w.HBox([self.target, self.free_button]),))
        self.node_view = view
        self.free_button.on_click(
            lambda _: setattr(self.status, "value", view.free(self.target.value))
        )
