"""Live views' auto-refresh: a daemon thread per view, which ends when the view is collected
or stopped, and stops when the notebook cell that made the view runs again.

A cell run again replaces its output, but the kernel still holds its widgets, whose threads
would go on. The frontend names each request's cell (``cellId`` in its metadata; JupyterLab
and Notebook 7 send it): :func:`stop_on_rerun` remembers the cell running now, and the
shell's ``pre_run_cell`` hook stops that cell's views when it runs again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from sharedarrays.errors import thread_error
from sharedarrays.process import STATE

__all__ = ["AutoRefresh", "MIN_INTERVAL", "MAX_INTERVAL", "current_cell", "stop_on_rerun"]

MIN_INTERVAL = 0.2
"""The shortest auto-refresh interval in seconds (what the widgets' *every (s)* allows)."""
MAX_INTERVAL = 3600.0
"""The longest auto-refresh interval in seconds."""
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
"""The mime type of a live widget's view in a kernel's display data."""


class _Refreshable(Protocol):
    def refresh(self) -> Any: ...


_V = TypeVar("_V", bound=_Refreshable)


class AutoRefresh(Generic[_V]):
    """Calls a view's ``refresh()`` every few seconds in a daemon thread named ``name``.

    The thread holds the view weakly: a view that is garbage-collected stops it, as does
    :meth:`stop`. ``interval(view)`` gives the seconds to the next refresh, read anew each
    time (``None`` ends the thread); a refresh that raises does not end it, and
    ``on_error(view, exception)`` is told.
    """

    def __init__(
        self,
        name: str,
        interval: Callable[[_V], float | None],
        on_error: Callable[[_V, Exception], None] | None = None,
    ) -> None:
        self._name = name
        self._interval = interval
        self._on_error = on_error
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None

    @property
    def running(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, view: _V) -> None:
        """Start refreshing ``view`` (nothing happens while it already runs).

        Raises
        ------
        ThreadUnavailable
            No thread can start in this process now.
        """
        if self.running:
            return
        self._stop = threading.Event()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._finalizer = weakref.finalize(view, self._stop.set)
        self._thread = threading.Thread(
            target=_loop,
            args=(weakref.ref(view), self._stop, self._interval, self._on_error),
            name=self._name,
            daemon=True,
        )
        try:
            self._thread.start()
        except RuntimeError as e:  # nothing left waiting for the view
            self._finalizer.detach()
            self._finalizer = self._thread = None
            raise thread_error(f"cannot start the refresh thread {self._name!r}", e) from None

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop refreshing; wait up to ``timeout`` seconds for the thread (unless called
        from it)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None


def _loop(
    ref: weakref.ref[_V],
    stop: threading.Event,
    interval: Callable[[_V], float | None],
    on_error: Callable[[_V, Exception], None] | None,
) -> None:
    while True:
        view = ref()
        seconds = None if view is None else interval(view)
        del view  # not held while waiting
        if seconds is None or stop.wait(seconds):
            return
        view = ref()
        if view is None:
            return
        try:
            view.refresh()
        except Exception as e:  # a refresh must never kill the kernel's thread
            if on_error is not None:
                on_error(view, e)
        del view


def kernel_shell() -> Any:
    """The IPython shell of the Jupyter kernel this process is, or ``None``."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None


def current_cell() -> str | None:
    """The id of the notebook cell the kernel runs now (``None``: not in a kernel, no cell
    runs, or the frontend does not say)."""
    shell = kernel_shell()
    try:
        parent = shell.kernel.get_parent("shell")
    except Exception:  # no kernel, or an ipykernel without get_parent (before 6)
        return None
    metadata = parent.get("metadata") if isinstance(parent, dict) else None
    if not isinstance(metadata, dict) or parent.get("msg_type") != "execute_request":
        return None
    cell = metadata.get("cellId")
    return cell if isinstance(cell, str) and cell else None


def stop_on_rerun(view: Any) -> None:
    """Call ``view.stop()`` when the cell running now runs again."""
    cell = current_cell()
    shell = kernel_shell()
    if cell is None or shell is None:
        return
    if shell not in STATE.views.shells:
        shell.events.register("pre_run_cell", _on_cell)
        STATE.views.shells.append(shell)
    refs = [r for r in STATE.views.cells.get(cell, []) if r() is not None]
    if not any(r() is view for r in refs):
        refs.append(weakref.ref(view))
    STATE.views.cells[cell] = refs


def _on_cell(info: Any = None) -> None:
    """The shell's ``pre_run_cell`` hook: stop the views of the cell that starts."""
    cell = getattr(info, "cell_id", None) or current_cell()
    for ref in STATE.views.cells.pop(cell, []) if cell else []:
        view = ref()
        try:
            if view is not None:
                view.stop()
        except Exception:  # a hook must never fail the user's cell
            pass
