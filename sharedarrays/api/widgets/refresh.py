"""The auto-refresh interval's bounds, and what stops a map's auto-refresh when the notebook
cell that made it runs again (the thread is the map's: ``view.py``).

A cell run again replaces its output, but the kernel still holds its widgets, whose threads
would go on. The frontend names each request's cell (``cellId`` in its metadata; JupyterLab
and Notebook 7 send it): :func:`stop_on_rerun` remembers the cell running now, and the
shell's ``pre_run_cell`` hook stops that cell's views when it runs again.
"""

from __future__ import annotations

import weakref
from typing import Any

from sharedarrays.process import STATE

__all__ = ["MIN_INTERVAL", "MAX_INTERVAL", "current_cell", "stop_on_rerun"]

MIN_INTERVAL = 0.2
"""The shortest auto-refresh interval in seconds (what the widgets' *every (s)* allows)."""
MAX_INTERVAL = 3600.0
"""The longest auto-refresh interval in seconds."""
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
"""The mime type of a live widget's view in a kernel's display data."""


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
