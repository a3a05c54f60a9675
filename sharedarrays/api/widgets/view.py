"""The maps Jupyter shows: :class:`MemoryMap` (this process's allocations) and :class:`NodeView`
(the node's), refreshed by hand or by a thread; their live widgets are in
:mod:`~sharedarrays.api.widgets.live`. A cell run again stops the auto-refresh it started."""

from __future__ import annotations

import base64
import contextlib
import re
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from sharedarrays.api import nodemap
from sharedarrays.api.widgets import model, render
from sharedarrays.api.widgets.model import WIDGET_MIME  # noqa: F401 (re-exported)
from sharedarrays.errors import SharedArrayError, thread_error
from sharedarrays.memory import Allocation
from sharedarrays.process import STATE
from sharedarrays.settings import seconds


def widgets_available() -> bool:
    """Whether ipywidgets 8 or later can be imported."""
    try:
        import ipywidgets
    except ImportError:
        return False
    major = re.match(r"\s*v?(\d+)", str(ipywidgets.__version__))
    return major is not None and int(major.group(1)) >= 8


def kernel_shell() -> Any:
    """The IPython shell of the Jupyter kernel this process is, or ``None``."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None


def in_kernel() -> bool:
    """Whether a live widget can be shown: in a Jupyter kernel, with ipywidgets 8 or later."""
    return kernel_shell() is not None and widgets_available()


def current_cell() -> str | None:
    """The id of the cell the kernel runs now (JupyterLab's and Notebook 7's ``cellId``)."""
    try:
        parent = kernel_shell().kernel.get_parent("shell")
        cell = parent["metadata"].get("cellId")
    except Exception:  # no kernel or request, or an ipykernel without get_parent (before 6)
        return None
    ok = isinstance(cell, str) and cell and parent.get("msg_type") == "execute_request"
    return cell if ok else None


def stop_on_rerun(view: Any) -> None:
    """Call ``view.stop()`` when the cell running now runs again."""
    cell, shell = current_cell(), kernel_shell()
    if cell is None or shell is None:
        return
    if shell not in STATE.views.shells:
        shell.events.register("pre_run_cell", _on_cell)
        STATE.views.shells.append(shell)
    STATE.views.cells.setdefault(cell, weakref.WeakSet()).add(view)


def _on_cell(info: Any = None) -> None:  # (the shell's pre_run_cell hook)
    cell = getattr(info, "cell_id", None) or current_cell()
    for view in list(STATE.views.cells.pop(cell, ())) if cell else []:
        with contextlib.suppress(Exception):  # (a hook must never fail the user's cell)
            view.stop()


class _Shown:
    """What both maps share: the data last read, refreshing, display and a live widget."""

    _name, _widget = "sharedarrays-map", ""  # (the thread's name, the widget's class)

    def __init__(self, interval: float, auto_refresh: bool) -> None:
        self._interval = seconds(interval, "interval", model.MIN_INTERVAL, model.MAX_INTERVAL)
        self._auto_start = auto_refresh
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._box: Any = None
        self.updated = 0.0

    _read: Callable[[], Any]  # (re-reads and keeps what it read)
    text: Callable[[], str]
    html: Callable[[], str]

    def _gone(self) -> bool:  # (nothing more to show: auto-refresh stops)
        return False

    def refresh(self) -> Any:
        """Re-read and redraw; return what was read. A map whose chosen allocations are all
        released stops auto-refreshing."""
        with self._lock:
            data = self._read()
            self.updated = time.time()
            gone = self._gone() and self.auto_refreshing
            if self._box is not None:
                self._box.html.value = self.html()
                self._box.status.value = time.strftime("updated %H:%M:%S") + (
                    "; released: auto-refresh stopped" if gone else ""
                )
        if gone:
            self.stop()
        return data

    def __repr__(self) -> str:
        return self.text()

    @property
    def widget(self) -> Any:
        """The live :class:`~sharedarrays.api.widgets.live.MemoryMapWidget` (ipywidgets 8+)."""
        if self._box is None:
            from sharedarrays.api.widgets import live

            self._box = getattr(live, self._widget)(self)
            stop_on_rerun(self)
            if self._auto_start:
                self._box.auto_toggle.value = True
        return self._box

    @property
    def auto_refreshing(self) -> bool:
        """Whether the auto-refresh thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, interval: float | None = None) -> None:
        """Refresh every ``interval`` s in a daemon thread holding the map weakly;
        ThreadUnavailable if no thread can start."""
        if interval is not None:
            self._interval = seconds(interval, "interval", model.MIN_INTERVAL, model.MAX_INTERVAL)
        stop_on_rerun(self)
        if not self.auto_refreshing:
            self._stop = stop = threading.Event()
            args = (weakref.ref(self), stop)
            thread = threading.Thread(target=_loop, args=args, name=self._name, daemon=True)
            try:
                thread.start()
            except RuntimeError as e:
                raise thread_error(f"cannot start the refresh thread {self._name!r}", e) from None
            if self._finalizer is not None:
                self._finalizer.detach()
            self._finalizer, self._thread = weakref.finalize(self, stop.set), thread
        if self._box is not None:  # (a trait set to the value it has sends no event)
            self._box.auto_toggle.value = True

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop auto-refreshing; wait up to ``timeout`` s for the thread (unless in it)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if self._box is not None:
            self._box.auto_toggle.value = False

    def close(self) -> None:
        """Stop auto-refreshing and close the widget (if one was made)."""
        self.stop()
        box, self._box = self._box, None
        if box is not None:
            box.close()  # and its controls

    def _static(self) -> dict[str, Any]:
        return {"text/plain": self.text(), "text/html": self.html()}

    def mimebundle(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The display data: text, HTML (and a PNG), and the live widget in a kernel."""
        bundle = self._static()
        if in_kernel():
            bundle.update(self.widget.view_data())
        keep = [k for k in bundle if (not include or k in include) and k not in (exclude or ())]
        return {k: bundle[k] for k in keep}

    _repr_mimebundle_ = mimebundle


class MemoryMap(_Shown):
    """The memory map of shared allocations in this process: a bar over each allocation's
    addresses (chunks in colour, unmapped grey, bytes lost to granularity red, views as
    brackets), tables of its addresses and of who exported and imported it; live in Jupyter.

    ``target`` as :func:`~sharedarrays.show` takes it, held weakly (``None``: every live
    allocation, re-read on each refresh); ``interval`` and ``auto_refresh`` as there too.
    """

    _name, _widget = "sharedarrays-memory-map", "MemoryMapWidget"

    def __init__(
        self, target: Any = None, *, interval: float = 2.0, auto_refresh: bool = False
    ) -> None:
        super().__init__(interval, auto_refresh)
        self._refs: list[tuple[weakref.ref[Allocation], tuple[int, int] | None]] | None = None
        if target is not None:
            self._refs = [(weakref.ref(alloc), own) for alloc, own in model.targets(target)]
        self.maps: list[model.ReservationMap] = self._read()

    def _read(self) -> list[model.ReservationMap]:
        if self._refs is None:
            self.maps = model.build_maps(None)
        else:
            allocs = [(ref(), own) for ref, own in self._refs]
            self.maps = [model.build_map(a, own=own) for a, own in allocs if a and not a.released]
        return self.maps

    def _gone(self) -> bool:  # (every chosen allocation released)
        return self._refs is not None and not self.maps

    def text(self) -> str:
        return render.render_text(self.maps)

    def html(self) -> str:
        title = "shared memory map" if self._refs is None else "memory map"
        return render.render_html(self.maps, title)

    def _static(self) -> dict[str, Any]:
        bundle = super()._static()
        with contextlib.suppress(ImportError):  # (no matplotlib: the HTML still shows the map)
            bundle["image/png"] = base64.b64encode(render.render_png(self.maps)).decode("ascii")
        return bundle


class NodeView(_Shown):
    """The node-wide map as last read (``map``); ``timeout``: seconds each process has to
    answer."""

    _name, _widget = "sharedarrays-node-map", "NodeMapWidget"

    def __init__(
        self, timeout: float = 1.0, *, interval: float = 2.0, auto_refresh: bool = False
    ) -> None:
        super().__init__(interval, auto_refresh)
        self.timeout = timeout
        self.map = self._read()

    def _read(self) -> nodemap.NodeMap:
        self.map = nodemap.node_map(self.timeout)
        return self.map

    def text(self) -> str:
        return render.render_node_text(self.map)

    def html(self) -> str:
        return render.render_node_html(self.map)

    def free(self, target: str) -> str:
        """Free ``target`` (an id, its start, or a name) as :func:`~sharedarrays.api.nodemap.free`
        does, leaving payloads in flight; return what happened."""
        try:
            row = nodemap.find(self.refresh(), target.strip())
            done = nodemap.free(row, confirm=None)
        except SharedArrayError as e:
            return str(e)
        self.refresh()
        return f"{row.alloc_id[:12]}: " + ("; ".join(done) or "nothing holds it any more")


def _loop(ref: weakref.ref[_Shown], stop: threading.Event) -> None:
    """Refresh until stopped, the map collected (held only to refresh) or its widget closed."""
    while True:
        view = ref()
        box = None if view is None else view._box
        closed = box is not None and box.comm is None
        seconds = None if view is None or closed else view._interval
        del view, box
        if seconds is None or stop.wait(seconds):
            return
        view = ref()
        if view is None:
            return
        try:
            view.refresh()
        except Exception as e:  # a refresh must never kill the kernel's thread
            if view._box is not None:
                view._box.status.value = f"refresh failed: {e}"
        del view
