"""Leases: each view's hold on an allocation, and :class:`Leasing` (a base of
``Allocation``), which hands them out, parks idle imports and makes views' native arrays."""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from sharedarrays._cpython import ITEM_ALONE, LOCAL_ALONE, refcount
from sharedarrays.errors import ClosedArrayError
from sharedarrays.memory.info import AllocationRecords, use_clock
from sharedarrays.memory.reservation import Reservation
from sharedarrays.process import STATE, running
from sharedarrays.protocol.payload import remember
from sharedarrays.settings import env_number

_L = TypeVar("_L", bound="Leasing")  # (the allocation: a lease is typed by what it holds)


def keep_imports() -> int:
    """How many imports with no live view this process keeps mapped (*parked*) for a *warm*
    handoff: ``SHAREDARRAYS_KEEP_IMPORTS`` (default 64; 0: off), read at most once a second."""
    memory = STATE.memory
    now = time.monotonic()
    if now - memory.keep_imports[0] >= 1.0:
        memory.keep_imports = (now, env_number("SHAREDARRAYS_KEEP_IMPORTS", 64, 0))
    return memory.keep_imports[1]


NATIVES_KEPT = 1024  # most native arrays an allocation keeps for reuse, one per view layout


class Lease(Generic[_L]):
    """A view's hold on ``allocation`` up to byte ``end`` (shrinking never unmaps below it);
    when the last goes, the allocation is released (exporter) or parked (importer)."""

    __slots__ = ("allocation", "end", "_pinned", "__weakref__")

    def __init__(self, allocation: _L, end: int, reservation: Reservation | None = None) -> None:
        self.allocation = allocation
        self.end = end
        # (a list only when pinned: emptied first when the lease ends)
        self._pinned = None if reservation is None else [reservation]

    @property
    def reservation(self) -> Reservation | None:
        """The latest reservation pinned (kept mapped for a native array), or ``None``."""
        return self._pinned[-1] if self._pinned else None

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # (faster than weakref.finalize; is_finalizing bound early: at shutdown globals are None)
        if _finalizing():
            return
        self._pinned = None  # the pinned reservation first, then the hold
        try:
            self.allocation._unlease(self.end)
        except Exception as e:  # nowhere to raise to from a finalizer: say so
            warnings.warn(
                f"sharedarrays: releasing allocation {self.allocation.id} failed: {e}",
                RuntimeWarning,
                stacklevel=1,
            )


class Leasing(AllocationRecords):
    """The leases of an allocation, its parking and its native arrays."""

    release: Callable[[], bool]  # (Allocation's)

    def lease(self: _L, end: int | None = None, pin: bool = False) -> Lease[_L]:
        """A new hold up to byte ``end`` (default: all mapped), which unparks the allocation;
        ``pin``: keep the current reservation mapped while it lives."""
        if end is None:
            end = self.size
        self.last_used = use_clock()
        with self._lock:
            if self.released:
                raise ClosedArrayError(f"allocation {self.id} was released in this process")
            self._release_when_idle = False  # (used again: a pending eviction is off)
            if not pin and end == self.size and self._kept_idle():
                return self.kept_lease  # type: ignore[no-any-return]  # (parked: the kept one)
            self._leases += 1
            if self.growable:  # (ends bound shrinking)
                self._ends[end] += 1
            reservation = self._reservation if pin else None
        return Lease(self, end, reservation)

    def native_base(self) -> Any:
        """The native memory object of the whole allocation, shared by its views' arrays."""
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
        del replaced, kept
        return base

    def native_view(
        self,
        offset: int,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        readonly: bool,
    ) -> Any:
        """A view's native array, kept by layout and reused while nothing else holds it.

        The reuse buys 2-5 us of a ~20 us warm load on the host (``benchmarks/ab_trees.py
        --off natives``, 1,000 pairs, both orders, 4 runs)."""
        device = self.native_device
        backend = self.backend
        natives = self._natives
        key = (offset, shape, strides)
        last = natives.pop(key, None)  # (taken out: no other thread hands it out)
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
        native = backend.native_view(  # type: ignore[attr-defined]
            self.native_base(), offset, dtype, shape, strides, readonly
        )
        # (into the table now: native_base() may have made a new one)
        remember(self._natives, key, (device, dtype, readonly, native), NATIVES_KEPT)
        return native

    def pin(self: _L, lease: Lease[_L]) -> Lease[_L]:
        """Make ``lease`` keep the current reservation mapped while it lives; returns it."""
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
            if self.growable:  # (in place: ``-= Counter(...)`` would copy every end)
                self._ends[end] -= 1
                if not self._ends[end]:
                    del self._ends[end]
            self._leases -= 1
            if self._view_leases() or self.released:  # (idle: none but the native base's)
                return
        if self.done_asked and not self._say_done():
            return
        with self._lock:
            if self._view_leases() or self.released:
                return
            park = not (self._release_when_idle or self.origin.created_here or self._orphaned)
        # drop a mapping whose source exited (getppid: cheap check for a Pool's parent)
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
                others = [a for a in parked.values() if a is not self]
                evict = sorted(others, key=lambda a: a.last_used)[:over]
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
        # parked: keep a lease for the next view (made outside the lock: a collection it
        # starts may end a lease, which takes the lock)
        with self._lock:
            if (
                self.kept_lease is not None
                or self.growable
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
        """(An importer of a block) say ``DONE`` to its exporter once no view holds it."""
        self.done_asked = True
        self._let_kept_go()  # (its end says DONE, if it was idle)
        with self._lock:
            idle = not self._view_leases() and not self.released
        if idle:
            self._say_done()

    def _say_done(self) -> bool:
        # say DONE once no native array is left either; whether it was said
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
        with self._lock:
            kept, self.kept_lease = self.kept_lease, None
        del kept  # (outside the lock: its end takes it)

    def _kept_idle(self) -> int:  # 1 where the kept lease is held by no view, else 0
        kept = self.kept_lease
        return 0 if kept is None else int(refcount(kept) <= LOCAL_ALONE)

    @property
    def parked(self) -> bool:
        """Whether this importer keeps the allocation mapped with no live view."""
        return not self.released and not self._view_leases() and self.id in STATE.memory.parked

    @property
    def leases(self) -> int:
        """How many leases hold the allocation here (views' and the native base's)."""
        return self._leases - self._kept_idle()

    @property
    def view_leases(self) -> int:
        """:attr:`leases` less the native base's; zero while parked."""
        with self._lock:
            return self._view_leases()

    def _view_leases(self) -> int:  # (with the lock held: the one rule of idleness)
        return self._leases - (self._native_base is not None) - self._kept_idle()
