"""Handing an allocation's payloads in flight over to the keeper: :class:`HandOver`, a base
class of :class:`~sharedarrays.memory.allocation.Allocation`.

The payloads of an allocation pickled here and not loaded yet are counted in its
:class:`~sharedarrays.memory.inflight.InFlight` record; when the allocation is released here
(and at exit) their handles go to what outlives this process, the hooks of
``STATE.memory.hand_over_hooks`` (the keeper's client, ``transport/keeper.py``), for the rest
of their bound.
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
        """Payloads pickled here that may still be loaded, and the seconds left of their
        bound (:func:`in_flight_seconds`, counted from the last one pickled).

        Every payload pickled here counts until as many were counted loaded
        (``flight.note_loaded``: a handle request answered here, a payload loaded back
        here, the loads its exporter's release notice reports, the warm loads importers of
        exporter-owned memory report), or the bound passed. Other warm loads (a process that
        already maps the allocation asks nothing) are not counted, so the count errs on the
        side of keeping memory alive.

        Returns
        -------
        count, seconds
            ``(0, 0.0)`` when nothing is in flight.
        """
        return self.flight.in_flight()

    def busy(self) -> bool:
        """Whether a payload of this allocation pickled here may still be loaded
        (:meth:`in_flight`)."""
        return self.in_flight()[0] > 0

    def hand_over(self, say: bool = True) -> tuple[int, str] | None:
        """Give the handles of the payloads in flight to something that outlives this
        process (the process state's ``hand_over_hooks``: the keeper), for the rest of their bound.

        Called when the allocation is released here and at exit, for memory that outlives
        its exporter (host, cuda-vmm); does nothing when no payload is in flight. A hook's
        failure is said on stderr (this runs from finalizers; with ``say=False`` the caller
        says it): those payloads will not load.

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
        self.flight.handed_over()  # the keeper answers for them from now on
        return None
