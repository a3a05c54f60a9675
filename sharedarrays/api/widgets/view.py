"""MemoryMap: the memory map's data, refresh and display; its live view is a
:class:`~sharedarrays.api.widgets.live.MemoryMapWidget`. ipywidgets and matplotlib are
imported only when a widget or a PNG is made."""

from __future__ import annotations

import base64
import re
import threading
import time
import weakref
from typing import Any

from sharedarrays.api.widgets.model import ReservationMap, build_map, build_maps, targets
from sharedarrays.api.widgets.refresh import (
    MAX_INTERVAL,
    MIN_INTERVAL,
    AutoRefresh,
    kernel_shell,
    stop_on_rerun,
)
from sharedarrays.api.widgets.render import render_html, render_png, render_text
from sharedarrays.memory import Allocation
from sharedarrays.settings import seconds

__all__ = ["MemoryMap", "live_or_static", "widgets_available", "in_kernel", "WIDGET_MIME"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def major_version(version: str) -> int:
    """The major number of a version string (``"10.0.1"`` -> 10; 0 when it has none)."""
    m = re.match(r"\s*v?(\d+)", version)
    return int(m.group(1)) if m else 0


def widgets_available() -> bool:
    """Whether ipywidgets 8 or later can be imported."""
    try:
        import ipywidgets
    except ImportError:
        return False
    return major_version(str(ipywidgets.__version__)) >= 8


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (where a live widget can be shown)."""
    return kernel_shell() is not None


class MemoryMap:
    """The memory map of shared allocations in this process, live in Jupyter.

    Each allocation's reservation is a bar over its address range: mapped chunks in colour,
    unmapped parts grey, bytes lost to granularity hatched red, the access per device and the
    live views as brackets; then a table of exact addresses, and who exported and imported
    it. In Jupyter with ipywidgets it has *refresh*, and *auto-refresh* in a daemon thread
    that ends with the toggle, :meth:`close`, the widget or this object; elsewhere it
    displays as text, HTML and a PNG.

    Parameters
    ----------
    target : SharedDeviceArray, Allocation, a list of them, or None
        What to show; ``None``: every live allocation of this process, re-read on each
        refresh. The map holds allocations weakly, so it never keeps memory mapped.
    interval : float, default 2.0
        Seconds between automatic refreshes, from 0.2 to 3600.
    auto_refresh : bool, default False
        Start refreshing automatically (once the widget exists).
    """

    def __init__(
        self, target: Any = None, *, interval: float = 2.0, auto_refresh: bool = False
    ) -> None:
        # (each allocation weakly, with the bytes of it a packed small array spans)
        self._refs: list[tuple[weakref.ref[Allocation], tuple[int, int] | None]] | None = None
        if target is not None:
            self._refs = [(weakref.ref(alloc), own) for alloc, own in targets(target)]
        self._title = "shared memory map" if target is None else "memory map"
        self._interval = _interval_of(interval)
        self._auto_start = auto_refresh
        self._lock = threading.Lock()
        self._refresher: AutoRefresh[MemoryMap] = AutoRefresh(
            "sharedarrays-memory-map", _interval, _report
        )
        self._ui: dict[str, Any] | None = None
        self.updated = 0.0
        self.maps: list[ReservationMap] = self._read()

    def _read(self) -> list[ReservationMap]:
        if self._refs is None:
            return build_maps(None)
        allocs = [(ref(), own) for ref, own in self._refs]
        return [build_map(a, own=own) for a, own in allocs if a is not None and not a.released]

    def refresh(self) -> list[ReservationMap]:
        """Re-read the allocations and redraw; the maps. Once every chosen allocation is
        released there is nothing more to show, and auto-refresh stops."""
        with self._lock:
            self.maps = self._read()
            self.updated = time.time()
            gone = self._refs is not None and not self.maps and self.auto_refreshing
            if self._ui is not None:
                self._ui["html"].value = render_html(self.maps, self._title)
                self._ui["status"].value = f"updated {time.strftime('%H:%M:%S')}" + (
                    "; released: auto-refresh stopped" if gone else ""
                )
        if gone:
            self.stop()
        return self.maps

    def __repr__(self) -> str:
        return render_text(self.maps)

    @property
    def widget(self) -> Any:
        """The live view, a :class:`~sharedarrays.api.widgets.live.MemoryMapWidget` (made on
        first use; needs ipywidgets 8 or later)."""
        if self._ui is None:
            from sharedarrays.api.widgets.live import MemoryMapWidget

            box = MemoryMapWidget(self, render_html(self.maps, self._title), self._interval)
            self._ui = {
                "box": box,
                "refresh": box.refresh_button,
                "auto": box.auto_toggle,
                "interval": box.interval_text,
                "status": box.status,
                "html": box.html,
            }
            box.refresh_button.on_click(lambda _b: self.refresh())
            box.auto_toggle.observe(self._on_toggle, names="value")
            box.interval_text.observe(self._on_interval, names="value")
            stop_on_rerun(self)
            if self._auto_start:
                box.auto_toggle.value = True
        return self._ui["box"]

    def _on_toggle(self, change: dict[str, Any]) -> None:
        if change["new"]:
            self.start()
        else:
            self.stop()

    def _on_interval(self, change: dict[str, Any]) -> None:
        self._interval = float(change["new"])

    @property
    def auto_refreshing(self) -> bool:
        """Whether the auto-refresh thread is running."""
        return self._refresher.running

    def _set_toggle(self, on: bool) -> None:
        if self._ui is not None and self._ui["auto"].value != on:
            self._ui["auto"].value = on

    def start(self, interval: float | None = None) -> None:
        """Start refreshing every ``interval`` seconds in a daemon thread (it holds this map
        weakly: a map that is garbage-collected stops it)."""
        if interval is not None:
            self._interval = _interval_of(interval)
        stop_on_rerun(self)
        self._refresher.start(self)
        self._set_toggle(True)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop auto-refreshing (waits up to ``timeout`` seconds for the thread to end)."""
        self._refresher.stop(timeout)
        self._set_toggle(False)

    def close(self) -> None:
        """Stop auto-refreshing and close the widget (if one was made)."""
        self.stop()
        ui, self._ui = self._ui, None
        if ui is not None:
            ui["box"].close()  # and its controls

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """text/plain, text/html and image/png; plus the live widget in a Jupyter kernel."""
        return self.mimebundle(include, exclude)

    def mimebundle(
        self, include: Any = None, exclude: Any = None, text: str | None = None
    ) -> dict[str, Any]:
        """The display data: the static views, and the live widget where it can be shown."""
        bundle: dict[str, Any] = {
            "text/plain": text or render_text(self.maps),
            "text/html": render_html(self.maps, self._title),
        }
        try:
            bundle["image/png"] = base64.b64encode(render_png(self.maps)).decode("ascii")
        except ImportError:  # matplotlib missing: the HTML still shows the map
            pass
        if in_kernel() and widgets_available():
            bundle.update(self.widget.view_data())
        return {
            k: v
            for k, v in bundle.items()
            if (not include or k in include) and (not exclude or k not in exclude)
        }


def _interval_of(value: object) -> float:
    return seconds(value, "interval", MIN_INTERVAL, MAX_INTERVAL)


def _interval(view: MemoryMap) -> float | None:
    """Seconds to the next refresh; ``None`` once the widget was closed from outside."""
    ui = view._ui
    return None if ui is not None and ui["box"].comm is None else view._interval


def _report(view: MemoryMap, error: Exception) -> None:
    """Show a failed auto-refresh in the widget's status (the thread goes on)."""
    if view._ui is not None:
        view._ui["status"].value = f"refresh failed: {error}"


def live_or_static(memory_map: MemoryMap) -> Any:
    """What ``show()`` returns: the map's live widget in a Jupyter kernel with ipywidgets 8
    or later, else the :class:`MemoryMap` itself."""
    return memory_map.widget if in_kernel() and widgets_available() else memory_map
