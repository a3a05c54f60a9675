"""Stopping a live view's auto-refresh when the notebook cell that made it runs again.

A cell that is run again replaces its output: the widget it showed is gone from the page,
but the kernel still holds it (ipywidgets keeps every open widget), so its auto-refresh
thread would go on for as long as the kernel runs, one more for every run. The frontend
names the cell of each request (``cellId`` in the request's metadata; JupyterLab and
Notebook 7 send it): :func:`stop_on_rerun` remembers the cell running now, and a
``pre_run_cell`` hook of the kernel's shell stops the views of a cell when it runs again.
Outside a kernel, or where the frontend names no cell, nothing happens.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

__all__ = ["current_cell", "stop_on_rerun"]


class _Stoppable(Protocol):
    def stop(self, timeout: float | None = 5.0) -> None: ...


_views: dict[str, list[weakref.ref[Any]]] = {}
"""Per cell id, the views made or started there (held weakly)."""
_hooked: list[Any] = []
"""The shells the hook is registered with (at most one)."""


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    return shell if getattr(shell, "kernel", None) is not None else None


def current_cell() -> str | None:
    """The id of the notebook cell the kernel runs now (``None``: not in a kernel, no cell
    is running, or the frontend does not say)."""
    shell = _shell()
    if shell is None:
        return None
    try:
        parent = shell.kernel.get_parent("shell")
    except Exception:  # an ipykernel without get_parent (before 6)
        return None
    metadata = parent.get("metadata") if isinstance(parent, dict) else None
    if not isinstance(metadata, dict) or parent.get("msg_type") != "execute_request":
        return None
    cell = metadata.get("cellId")
    return cell if isinstance(cell, str) and cell else None


def stop_on_rerun(view: _Stoppable) -> None:
    """Stop ``view``'s auto-refresh when the cell running now runs again."""
    cell = current_cell()
    shell = _shell()
    if cell is None or shell is None:
        return
    if shell not in _hooked:
        shell.events.register("pre_run_cell", _on_cell)
        _hooked.append(shell)
    refs = [r for r in _views.setdefault(cell, []) if r() is not None]
    if not any(r() is view for r in refs):
        refs.append(weakref.ref(view))
    _views[cell] = refs


def _on_cell(info: Any = None) -> None:
    """The shell's ``pre_run_cell`` hook: stop the views of the cell that starts."""
    cell = getattr(info, "cell_id", None) or current_cell()
    if not cell:
        return
    for ref in _views.pop(cell, []):
        view = ref()
        if view is not None:
            try:
                view.stop()
            except Exception:  # a hook must never fail the user's cell
                pass
