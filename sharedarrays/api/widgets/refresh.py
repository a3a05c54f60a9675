"""The auto-refresh thread of a live view (the memory map, the node-wide map)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from sharedarrays.errors import thread_error

__all__ = ["AutoRefresh", "MIN_INTERVAL", "MAX_INTERVAL"]

MIN_INTERVAL = 0.2
"""The shortest auto-refresh interval in seconds (what the widgets' *every (s)* allows)."""
MAX_INTERVAL = 3600.0
"""The longest auto-refresh interval in seconds."""


class _Refreshable(Protocol):
    def refresh(self) -> Any: ...


_V = TypeVar("_V", bound=_Refreshable)


class AutoRefresh(Generic[_V]):
    """Calls a view's ``refresh()`` every few seconds in a daemon thread.

    The thread holds the view only weakly: a view that is garbage-collected stops it (a
    finalizer sets its stop event), and so does :meth:`stop`. A refresh that raises never ends
    it; ``on_error`` is told.

    Parameters
    ----------
    name : str
        The thread's name.
    interval : callable
        ``interval(view)``: the seconds to wait before the next refresh, read anew each time;
        ``None`` ends the thread (e.g. the view's widget was closed from outside).
    on_error : callable, optional
        ``on_error(view, exception)`` after a failed refresh.
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
            No thread can start in this process now (its limit of threads or address space).
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
        except RuntimeError as e:  # no thread can start: nothing left waiting for the view
            self._finalizer.detach()
            self._finalizer = self._thread = None
            raise thread_error(f"cannot start the refresh thread {self._name!r}", e) from None

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop refreshing; waits up to ``timeout`` seconds for the thread to end (not when
        called from the thread itself)."""
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
        if view is None:
            return
        seconds = interval(view)
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
