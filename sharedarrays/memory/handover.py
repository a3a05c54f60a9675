"""Handing an allocation's payloads in flight over to the keeper (:class:`HandOver`).

When an allocation is released here (or at exit) with payloads not loaded yet, their
handles go to ``STATE.memory.hand_over_hooks`` (the keeper) for the rest of their bound.
"""

from __future__ import annotations

import os
import sys

from sharedarrays.memory.growth import Growth
from sharedarrays.process import STATE

__all__ = ["HandOver"]


class HandOver(Growth):
    """The payloads in flight of an allocation, and their hand-over (see the module)."""

    pid: int

    def in_flight(self) -> tuple[int, float]:
        """Payloads pickled here that may still be loaded, and the seconds left of their bound.

        ``(0, 0.0)`` when none. Uncounted warm loads make the count err on the side of
        keeping memory alive.
        """
        return self.flight.in_flight()

    def busy(self) -> bool:
        """Whether a payload pickled here may still be loaded."""
        return self.in_flight()[0] > 0

    def hand_over(self, say: bool = True) -> tuple[int, str] | None:
        """Give the handles of payloads in flight to the keeper (``hand_over_hooks``).

        For memory that outlives its exporter (host, cuda-vmm). A failure is printed on
        stderr unless ``say=False``.

        Returns
        -------
        tuple of (int, str) or None
            On a failure, how many payloads will not load and the message that says so.
        """
        if self.pid != os.getpid() or self.growable or not self.backend.maps:
            return None
        count, seconds = self.in_flight()
        if not count:
            return None
        for hook in STATE.memory.hand_over_hooks:
            try:
                hook(self, count, seconds)
            except Exception as exc:
                message = (
                    f"sharedarrays: {count} payload(s) of allocation {self.id} are in flight "
                    f"but their memory could not be handed to the keeper ({exc}); they will "
                    "not load. Keep a view open until they are loaded, or park() the array"
                )
                if say:
                    print(message, file=sys.stderr)
                return count, message
        self.flight.handed_over()
        return None
