"""How a shared array shows itself: its values, and a line about its shared memory."""

from __future__ import annotations

import html
from typing import Any

from sharedarrays.api.arraybase import ArrayBase

__all__ = ["Display"]


class Display(ArrayBase):
    """``repr``, ``str``, ``format``, Jupyter's display and :meth:`show`."""

    __slots__ = ()

    def show(self, *, interval: float = 2.0, auto_refresh: bool = False) -> Any:
        """The memory map of this view's allocation, as :func:`sharedarrays.show` draws it."""
        from sharedarrays.api.widgets import show

        return show(self, interval=interval, auto_refresh=auto_refresh)

    def _allocation_line(self) -> str:
        """One line about the shared memory behind this open view."""
        a = self.allocation
        who = a.origin.role
        served = len({s.pid for s in a.served})
        if served:
            who += f", served to {served} importer{'s' if served != 1 else ''}"
        ro = ", read-only view" if self._readonly else ""
        return (
            f"SharedDeviceArray on {a.device} ({a.backend.name}), allocation {a.id[:12]} "
            f"offset {self._offset}, {who}{ro}"
        )

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """Jupyter display: the values and a line about the allocation."""
        bundle = {"text/plain": repr(self)}
        if self._lease is not None:
            bundle["text/html"] = (
                f'<pre class="sa-values">{html.escape(repr(self.array))}</pre>'
                f'<div class="sa-allocation" style="font-size:smaller;opacity:0.75">'
                f"{html.escape(self._allocation_line())} &middot; <code>.show()</code> draws "
                "its memory map</div>"
            )
        return {
            k: v
            for k, v in bundle.items()
            if (not include or k in include) and not (exclude and k in exclude)
        }

    def __repr__(self) -> str:
        """The values as the native array shows them, and a line about the allocation."""
        if self._lease is None:
            return f"<SharedDeviceArray shape={self._shape} dtype={self._dtype} closed>"
        return f"{self.array!r}\n{self._allocation_line()}"

    def __str__(self) -> str:
        """The values alone, as ``str`` of the native array shows them."""
        return repr(self) if self._lease is None else str(self.array)

    def __format__(self, spec: str) -> str:
        """``format(a, spec)`` as the native array formats (``f"{a[0]:.2f}"``)."""
        return format(repr(self) if self._lease is None else self.array, spec)
