"""Leases: each view's hold on an allocation (:class:`Lease`), and :class:`Leasing`, the base
class of :class:`~sharedarrays.memory.allocation.Allocation` that hands them out, parks an
imported allocation when its last view goes (:func:`keep_imports`) and makes the native
arrays of its views (:meth:`Leasing.native_base`, :meth:`Leasing.native_view`).

A lease and what makes it are in one module, so that neither imports the other; the
allocation releases itself (:meth:`~sharedarrays.memory.allocation.Allocation.release`) when
its last lease ends and it is not parked.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from sharedarrays._cpython import ITEM_ALONE, LOCAL_ALONE, refcount
from sharedarrays.errors import ClosedArrayError
from sharedarrays.memory.records import AllocationRecords
from sharedarrays.memory.reservation import Reservation
from sharedarrays.process import STATE, running
from sharedarrays.protocol.payload import remember
from sharedarrays.settings import env_number

__all__ = ["NATIVES_KEPT", "Lease", "Leasing", "keep_imports", "use_clock"]

_L = TypeVar("_L", bound="Leasing")  # (the allocation: a lease is typed by what it holds)


_keep_imports: tuple[float, int] = (float("-inf"), 64)  # (when read, the value)


def keep_imports() -> int:
    """How many imported allocations with no live view this process keeps mapped.

    A worker that receives the same array again then finds it mapped (a *warm* handoff: no
    connection, no import, no map). Set by ``SHAREDARRAYS_KEEP_IMPORTS`` (default 64; 0 turns
    parking off), read at most once a second, when an import parks: its last view goes for
    the first time, or after the lease it kept was let go. (A parked import keeps a lease,
    which its next view takes and gives back: a warm handoff parks nothing and reads no
    limit, so a lowered limit takes effect at the next park.) A parked mapping is dropped as
    soon as its exporter releases the allocation (a notice) or exits (seen when it parks,
    or by the handle server's housekeeping), and the least recently used are dropped when
    a park goes over the limit.
    """
    global _keep_imports
    now = time.monotonic()
    if now - _keep_imports[0] >= 1.0:
        _keep_imports = (now, env_number("SHAREDARRAYS_KEEP_IMPORTS", 64, 0))
    return _keep_imports[1]


NATIVES_KEPT = 1024
"""Most native arrays an allocation keeps for reuse (:meth:`Leasing.native_view`): one per
view layout used, a few hundred bytes each."""


def _last_used(alloc: Leasing) -> int:
    return alloc.last_used


use_clock = time.monotonic_ns
"""The clock of ``Allocation.last_used`` (a C call: no Python frame)."""


class Lease(Generic[_L]):
    """One user's hold on an allocation: each view takes one, which the native array built
    over it shares (pinned: :meth:`Leasing.pin`).

    When the last lease of an allocation goes away, the allocation is released (in the
    exporter) or parked (in an importer, see :func:`keep_imports`). A lease ends when it is
    garbage collected (:meth:`__del__`).

    Attributes
    ----------
    allocation : Leasing
        What it holds.
    end : int
        One past the highest byte its holder may touch (shrinking never unmaps below it).
    """

    __slots__ = ("allocation", "end", "_pinned", "__weakref__")

    def __init__(self, allocation: _L, end: int, reservation: Reservation | None = None) -> None:
        """Hold ``allocation`` up to byte ``end``; ``reservation``: for a native array, the
        reservation its addresses are in, kept mapped while the lease lives even after the
        allocation moved to a larger one."""
        self.allocation = allocation
        self.end = end
        # (a list only when pinned: emptied first when the lease ends)
        self._pinned = None if reservation is None else [reservation]

    @property
    def reservation(self) -> Reservation | None:
        """For a native array: the reservation its addresses are in (the latest pinned),
        kept mapped while the lease lives even after the allocation moved to a larger one."""
        return self._pinned[-1] if self._pinned else None

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # The lease ends when it is collected: the reservation it pinned goes first (an
        # abandoned reservation is freed before the allocation), then the hold. A __del__
        # and not a weakref.finalize: a lease is made for every view and every load, and a
        # finalizer object each (a reference the collector tracks, a callback) made a
        # message of 10,000 arrays 15-20% slower to load (docs/performance.md). It only
        # drops counts, so it can bring nothing back to life. Not while the interpreter
        # shuts down (the process's mappings go with it). ``sys.is_finalizing`` is bound
        # as a default: a lease collected late in shutdown finds this module's globals, sys
        # among them, already None.
        if _finalizing():
            return
        self._pinned = None
        try:
            self.allocation._unlease(self.end)
        except Exception as e:  # nowhere to raise to from a finalizer: say so
            warnings.warn(
                f"sharedarrays: releasing allocation {self.allocation.id} failed: {e}",
                RuntimeWarning,
                stacklevel=1,
            )


class Leasing(AllocationRecords):
    """The leases of an allocation, its parking and its native arrays (see the module).

    The allocation supplies :meth:`release`."""

    released: bool
    kept_lease: Lease[Any] | None
    pool_server: str | None
    done_asked: bool
    flight: Any
    last_used: int
    native_device: int | None
    _lock: threading.Lock
    _leases: int
    _growable: bool
    _ends: dict[int, int]
    _release_when_idle: bool
    _orphaned: bool
    _reservation: Reservation
    _native_base: tuple[int | None, Any] | None
    _natives: dict[tuple[Any, ...], tuple[Any, Any, bool, Any]]

    def release(self) -> bool:
        """Release the allocation here (the allocation's; see there)."""
        raise NotImplementedError

    def lease(self: _L, end: int | None = None, pin: bool = False) -> Lease[_L]:
        """A new hold on this allocation (each view takes one). A parked allocation is no
        longer parked while one lives.

        Parameters
        ----------
        end : int, optional
            One past the highest byte the holder may touch (default: all mapped bytes).
        pin : bool
            Keep the current reservation mapped while the lease lives, even after the
            allocation moves (native arrays hold addresses in it).
        """
        if end is None:
            end = self.size
        self.last_used = use_clock()
        if self.pool_server is not None:
            self.flight.note_block_lease()
        with self._lock:
            if self.released:
                raise ClosedArrayError(f"allocation {self.id} was released in this process")
            if not pin and end == self.size and self._kept_idle():
                # parked: the lease it keeps, which no view holds, is the view's now (and is
                # parked again when the view lets it go: no lease made or ended, no list)
                self._release_when_idle = False
                return self.kept_lease  # type: ignore[return-value]
            self._leases += 1
            if self._growable:  # (ends bound shrinking: see reach)
                self._ends[end] = self._ends.get(end, 0) + 1
            self._release_when_idle = False  # (used again: a pending eviction is off)
            reservation = self._reservation if pin else None
        # (still listed in STATE.memory.parked if it was parked: leased, it is not parked any more)
        return Lease(self, end, reservation)

    def native_base(self) -> Any:
        """The native memory object of the whole allocation (the backend's
        ``native_memory``), which the native arrays of its views share in this process (its
        ``native_view`` derives them from it: one native memory object per allocation, not
        per view).

        Made on first use with a lease of its own, pinned. It is kept while a view holds the
        allocation, and while an importer keeps the allocation parked (so that the next
        handoff of it makes none); else, when only its own lease is left, it is let go
        (:meth:`_unlease`, :meth:`release`), and the lease ends with the last native array
        made from it. Read-only where this
        process maps the allocation read-only. Not for a growable allocation, whose views'
        native arrays each pin the reservation of their own time."""
        device = self.native_device
        cached = self._native_base
        if cached is not None and cached[0] == device:
            return cached[1]
        base = self.backend.native_memory(  # type: ignore[attr-defined]
            self.address, self.size, self.lease(pin=True), self.access != "rw", device
        )
        with self._lock:
            replaced, self._native_base = self._native_base, (device, base)
            kept, self._natives = self._natives, {}
        del replaced, kept  # (a peer device's, if any: its lease ends with its native arrays)
        return base

    def native_view(
        self,
        offset: int,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        readonly: bool,
    ) -> Any:
        """A native array of a view of this allocation: the backend's ``native_view`` of
        :meth:`native_base` (not for a growable allocation).

        Each native array made is kept, by its layout (up to :data:`NATIVES_KEPT` of them,
        the oldest let go first), and handed out again for a view of the same layout when
        nothing else holds it any more and the backend finds its layout unchanged
        (``native_intact``): a warm handoff's ``.array``, and each of a warm message of
        many views of the allocation, then makes no new native array (CuPy's constructor is
        the costliest step of it on the H200, and its two objects per array are what the
        collector's passes cost in a worker that loads many). A native array someone still
        holds, or changed (``x.shape = ...``), is never handed out twice. The kept ones go
        with the native base (:meth:`release`, a move to a peer device).
        """
        device = self.native_device
        backend = self.backend
        natives = self._natives
        key = (offset, shape, strides)
        last = natives.pop(key, None)  # (taken out: no other thread hands it out too)
        if (
            last is not None
            and last[0] == device
            and (last[1] is dtype or last[1] == dtype)
            and last[2] is readonly
            and refcount(last[3]) <= ITEM_ALONE  # (held by its tuple alone: ITEM_ALONE's shape)
            and backend.native_intact(  # type: ignore[attr-defined]
                last[3], dtype, shape, strides, readonly
            )
        ):
            natives[key] = last
            return last[3]
        del last
        # (a view calls this: its lease holds the allocation, which release() leaves alone
        # then, so the table is only ever filled here)
        native = backend.native_view(  # type: ignore[attr-defined]
            self.native_base(), offset, dtype, shape, strides, readonly
        )
        # (into the table now: native_base() may have made a new one)
        remember(self._natives, key, (device, dtype, readonly, native), NATIVES_KEPT)
        return native

    def pin(self: _L, lease: Lease[_L]) -> Lease[_L]:
        """Make ``lease`` (one of this allocation's) keep the current reservation mapped
        while it lives, as a lease taken with ``pin=True`` does; returns it.

        A growable allocation's native arrays hold their view's own lease this way (one
        lease per view and its native array: the lease ends when both are gone); other
        allocations' native arrays share :meth:`native_base` and its lease."""
        with self._lock:
            reservation = self._reservation
            pinned = lease._pinned
            if pinned is None:
                lease._pinned = [reservation]
            elif pinned[-1] is not reservation:
                pinned.append(reservation)
        return lease

    def _unlease(self, end: int) -> None:
        with self._lock:
            if self._growable:
                left = self._ends.get(end, 0) - 1
                if left > 0:
                    self._ends[end] = left
                else:
                    self._ends.pop(end, None)
            self._leases -= 1
            if self._view_leases() or self.released:  # (idle: none but the native base's)
                return
        if self.done_asked and not self._say_done():
            return
        with self._lock:
            if self._view_leases() or self.released:
                return
            park = not self._release_when_idle
            park = park and not self.origin.created_here and not self._orphaned
        # a mapping whose source process has exited will not be handed to us again: drop it
        # (a Pool worker's source is its parent, alive while getppid still names it: one
        # cheap call instead of kill(pid, 0) at every park)
        pid = self.origin.pid
        limit = keep_imports() if park and (pid == os.getppid() or running(pid)) else 0
        if limit == 0:
            self.release()  # (or lets the native base go, which comes back here when it ends)
            return
        dropped: list[Leasing] = []
        with STATE.memory.lock:
            parked = STATE.memory.parked
            parked[self.id] = self  # (where it was, if listed: the order is last_used's)
            over = len(parked) - limit
            evict: list[Leasing] = []
            if over > 0:
                oldest = sorted((a for a in parked.values() if a is not self), key=_last_used)
                evict = oldest[:over]
            for a in evict:
                if not a.parked:  # leased again since it was listed: not parked
                    del parked[a.id]
                    dropped.append(a)
        self._keep_lease()
        for a in dropped:  # (its kept lease, if a view holds it, parks it again at its end)
            a._let_kept_go()
        for a in evict:
            a.release()  # (does nothing to one leased again)

    def _keep_lease(self) -> None:
        """Parked: keep a lease for the next view (:meth:`lease` hands it out), so that a
        warm handoff makes and ends no lease; the allocation holds it, and is parked again
        whenever no view holds it. Not for a growable allocation (its views' ends count).

        The lease is counted under the lock and made outside it: making an object may start
        a collection, and a lease of this allocation that it ends would take the lock in
        this thread. Where a release, an orphaning or another keep came in between, the
        lease is not kept: it ends at once, as any lease does (its end releases or parks
        the allocation)."""
        with self._lock:
            if (
                self.kept_lease is not None
                or self._growable
                or self.done_asked  # (each view's end may have to say DONE)
                or self.released
                or self._release_when_idle
                or self._orphaned
                or self._view_leases()
            ):
                return
            self._leases += 1
        kept: Lease[Any] | None = Lease(self, self.size)
        with self._lock:
            if self.kept_lease is None and not (
                self.released or self._release_when_idle or self._orphaned
            ):
                self.kept_lease, kept = kept, None
        del kept  # (outside the lock: a lease not kept ends here)

    def ask_done(self) -> None:
        """(An importer of a block) its exporter released it and waits to reuse the memory:
        say ``DONE`` now if no view holds it here, else when the last one goes
        (:mod:`~sharedarrays.memory.cache`). No lease is kept for the next view from now on."""
        self.done_asked = True
        self._let_kept_go()  # (its end says DONE, if it was idle)
        with self._lock:
            idle = not self._view_leases() and not self.released
        if idle:
            self._say_done()

    def _say_done(self) -> bool:
        """Idle and asked: tell the exporter, once no native array is left either (the native
        base is let go first: its lease's end comes back here). Whether it was said."""
        with self._lock:
            base, self._native_base = self._native_base, None
            natives, self._natives = self._natives, {}
        if base is not None:
            del base, natives
            return False
        loads = self.flight.take_block_loads()
        if loads:
            for hook in STATE.memory.done_hooks:
                hook(self, loads)
        return True

    def _let_kept_go(self) -> None:
        """Stop keeping a lease: one that no view holds ends now (and its end releases or
        parks the allocation, as any lease's does); one a view holds ends with the view."""
        with self._lock:
            kept, self.kept_lease = self.kept_lease, None
        del kept  # (outside the lock: its end takes it)

    def _kept_idle(self) -> int:
        # 1 where the allocation keeps a lease that no view holds (only this attribute
        # refers to it), else 0; the caller holds no reference to it
        kept = self.kept_lease  # (the shape LOCAL_ALONE was measured with: one local)
        return 0 if kept is None else int(refcount(kept) <= LOCAL_ALONE)

    @property
    def parked(self) -> bool:
        """Whether this importer keeps the allocation mapped with no live view (listed in
        :data:`STATE.memory.parked` and idle: one leased again stays listed until idle again)."""
        return not self.released and not self._view_leases() and self.id in STATE.memory.parked

    @property
    def leases(self) -> int:
        """How many leases hold the allocation here: the views' (one per view, or one for
        the views of one message) and the native base's (:meth:`native_base`), if any."""
        return self._leases - self._kept_idle()

    @property
    def view_leases(self) -> int:
        """:attr:`leases` less the native base's: what views (and a growable allocation's
        native arrays) hold here. Zero while the allocation is parked."""
        with self._lock:
            return self._view_leases()

    def _view_leases(self) -> int:
        # (:attr:`view_leases`, the caller holding the lock: the one rule of idleness that
        # lease, _unlease and release read)
        # (and the parked allocation's kept lease, while no view holds it)
        return self._leases - (self._native_base is not None) - self._kept_idle()
