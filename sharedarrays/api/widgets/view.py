"""MemoryMap: the memory map's data and refresh logic, its static mime bundle, and its live
ipywidgets view (:class:`~sharedarrays.api.widgets.live.MemoryMapWidget`).

ipywidgets and matplotlib are imported only when a widget or a PNG is actually made.
"""

from __future__ import annotations

import base64
import re
import threading
import time
import weakref
from typing import Any

from sharedarrays.api.widgets.cells import stop_on_rerun
from sharedarrays.api.widgets.model import ReservationMap, build_map, build_maps, targets
from sharedarrays.api.widgets.refresh import MAX_INTERVAL, MIN_INTERVAL, AutoRefresh
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
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _filter(bundle: dict[str, Any], include: Any, exclude: Any) -> dict[str, Any]:
    if include:
        bundle = {k: v for k, v in bundle.items() if k in include}
    if exclude:
        bundle = {k: v for k, v in bundle.items() if k not in exclude}
    return bundle


def _static_bundle(maps: list[ReservationMap], text: str, title: str) -> dict[str, Any]:
    bundle: dict[str, Any] = {"text/plain": text, "text/html": render_html(maps, title)}
    try:
        bundle["image/png"] = base64.b64encode(render_png(maps)).decode("ascii")
    except ImportError:  # matplotlib missing: the HTML still shows the map
        pass
    return bundle


class MemoryMap:
    """The memory map of shared allocations in this process, live in Jupyter.

    Shows each allocation's reservation as a bar over its address range: mapped chunks in
    colour with their sizes, unmapped parts grey, the bytes lost to granularity (mapped
    beyond the views) hatched red, the access per device, the live views as brackets; a
    table of exact addresses; and whether this process is each allocation's exporter or an
    importer, and to which importers its handles were served.

    In Jupyter with ipywidgets the view has a *refresh* button and an *auto-refresh* toggle
    with an interval (seconds); auto-refresh runs in a daemon thread that stops when the
    toggle is turned off, when :meth:`close` is called or the widget is closed, and when
    this object is garbage-collected. It never blocks the kernel.

    Elsewhere (nbconvert, GitHub, a terminal) it displays as text, an HTML table and a PNG.

    Parameters
    ----------
    target : SharedDeviceArray, Allocation, a list of them, or None
        What to show; ``None`` (the default) shows every live allocation of this process,
        re-read from the registry on each refresh. The map holds only weak references, so
        it never keeps memory mapped.
    interval : float, default 2.0
        Seconds between automatic refreshes, from 0.2 to 3600.
    auto_refresh : bool, default False
        Start refreshing automatically (only once the widget exists).
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

    # data -------------------------------------------------------------------------------
    def _read(self) -> list[ReservationMap]:
        if self._refs is None:
            return build_maps(None)
        out = []
        for ref, own in self._refs:
            alloc = ref()
            if alloc is not None and not alloc.released:
                out.append(build_map(alloc, own=own))
        return out

    def refresh(self) -> list[ReservationMap]:
        """Re-read the registry (or the chosen allocations) and redraw; returns the maps.

        A map of chosen arrays whose allocations are all released (the arrays were closed)
        has nothing more to show: its auto-refresh stops."""
        with self._lock:
            self.maps = self._read()
            self.updated = time.time()
            gone = self._refs is not None and not self.maps
            ui = self._ui
            if ui is not None:
                ui["html"].value = render_html(self.maps, self._title)
                ui["status"].value = f"updated {time.strftime('%H:%M:%S')}" + (
                    "; released: auto-refresh stopped" if gone and self.auto_refreshing else ""
                )
        if gone and self.auto_refreshing:
            self.stop()
        return self.maps

    def __repr__(self) -> str:
        return render_text(self.maps)

    # the live widget ----------------------------------------------------------------------
    @property
    def widget(self) -> Any:
        """The live view, a :class:`~sharedarrays.api.widgets.live.MemoryMapWidget` (an
        ipywidgets ``VBox``, made on first use; needs ipywidgets 8 or later)."""
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

    def start(self, interval: float | None = None) -> None:
        """Start refreshing every ``interval`` seconds in a daemon thread (it holds this map
        weakly: a map that is garbage-collected stops it)."""
        if interval is not None:
            self._interval = _interval_of(interval)
        stop_on_rerun(self)
        self._refresher.start(self)
        if self._ui is not None and not self._ui["auto"].value:
            self._ui["auto"].value = True

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop auto-refreshing (waits up to ``timeout`` seconds for the thread to end)."""
        self._refresher.stop(timeout)
        if self._ui is not None and self._ui["auto"].value:
            self._ui["auto"].value = False

    def close(self) -> None:
        """Stop auto-refreshing and close the widget (if one was made)."""
        self.stop()
        ui, self._ui = self._ui, None
        if ui is not None:
            ui["box"].close()  # and its controls

    # display ----------------------------------------------------------------------------
    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """text/plain, text/html and image/png; plus the live widget in a Jupyter kernel."""
        return self.mimebundle(include, exclude)

    def mimebundle(
        self, include: Any = None, exclude: Any = None, text: str | None = None
    ) -> dict[str, Any]:
        """The display data: the static views, and the live widget where it can be shown."""
        bundle = _static_bundle(self.maps, text or render_text(self.maps), self._title)
        if in_kernel() and widgets_available():
            bundle.update(self.widget.view_data())
        return _filter(bundle, include, exclude)


def _interval_of(value: object) -> float:
    """An auto-refresh interval, checked (:func:`~.refresh.seconds`)."""
    return seconds(value, "interval", MIN_INTERVAL, MAX_INTERVAL)


def _interval(view: MemoryMap) -> float | None:
    """Seconds to the next refresh of ``view``; ``None`` once its widget was closed from
    outside (the thread then ends)."""
    ui = view._ui
    if ui is not None and ui["box"].comm is None:
        return None
    return view._interval


def _report(view: MemoryMap, error: Exception) -> None:
    """Show an auto-refresh that failed in the widget's status (the thread goes on), as the
    node widget does."""
    ui = view._ui
    if ui is not None:
        ui["status"].value = f"refresh failed: {error}"


def live_or_static(memory_map: MemoryMap) -> Any:
    """What ``show()`` returns: in a Jupyter kernel with ipywidgets 8 or later the map's live
    widget (a real ``VBox``, which composes with other widgets), elsewhere the
    :class:`MemoryMap` itself (text, HTML and PNG)."""
    if in_kernel() and widgets_available():
        return memory_map.widget
    return memory_map
