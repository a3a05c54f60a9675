"""The memory layer's per-process state: one object, reset in a forked child.

Like CPython's ``multiprocessing.resource_tracker``, the state of this process lives in one
instance of one class, :data:`state` (a :class:`ProcessState`): the registry of the
allocations mapped here by id, the parked and draining ones, the current slabs, the locks
that guard them, and the hooks upper layers subscribe to. No other module of ``memory/``
keeps module globals of state.

The values it holds are :class:`~sharedarrays.memory.allocation.Allocation` objects (and
their leases, for slabs); this module sits below ``allocation.py`` in the layer, so it names
them only by what it needs of them (:class:`Member`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from sharedarrays.backends.device import Device
from sharedarrays.process import at_fork

__all__ = ["Member", "ProcessState", "state"]


class Member(Protocol):
    """What the state needs of an allocation to reset itself in a forked child."""

    @property
    def id(self) -> str: ...

    @property
    def device(self) -> Device: ...

    @property
    def growable(self) -> bool: ...

    def adopt(self) -> None: ...

    def disown(self) -> None: ...

    @property
    def parked(self) -> bool: ...


class ProcessState:
    """Everything the memory layer keeps per process (one instance: :data:`state`).

    Attributes
    ----------
    registry : dict of str to Allocation
        Every allocation mapped in this process (parked ones too), by id.
    lock : threading.RLock
        Guards ``registry``, ``parked`` and ``draining``.
    unregistered : threading.Condition
        On ``lock``: notified when a released allocation leaves ``registry``
        (:meth:`wait_unregistered`).
    parked : OrderedDict of str to Allocation
        Imported allocations kept mapped with no live view, least recently used first
        (:attr:`Allocation.parked`). One leased again stays listed until it is idle again
        (moved to the end) or an eviction passes it (taken off): a lease costs nothing here,
        and only the idle ones listed are parked.
    draining : dict of str to Allocation
        Exporter-owned allocations released here that other processes still hold.
    slabs : dict of (backend name, Device) to (Lease, int)
        The current slab per memory system and device, with its first free byte.
    slabs_lock : threading.Lock
        Guards ``slabs``.
    inherited : list
        In a forked child: what it inherited and never releases (its parent's slabs and
        parked mappings), so that nothing runs on them here.
    release_hooks : list of callable
        Called with each allocation this process releases (the transport layer tells the
        processes it served, so that they drop their parked mappings too). A hook that
        fails is skipped.
    hand_over_hooks : list of callable
        Called with an allocation, the number of its payloads still in flight and the
        seconds left of their bound, before an allocation of memory that outlives its
        exporter leaves this process (released, or the process exits): the keeper takes
        over their handles. A hook that fails raises; the allocation is then released all
        the same.
    """

    def __init__(self) -> None:
        self.registry: dict[str, Any] = {}
        self.lock = threading.RLock()
        self.unregistered = threading.Condition(self.lock)
        self.parked: OrderedDict[str, Any] = OrderedDict()
        self.draining: dict[str, Any] = {}
        self.slabs: dict[tuple[str, Device], tuple[Any, int]] = {}
        self.slabs_lock = threading.Lock()
        self.inherited: list[object] = []
        self.release_hooks: list[Callable[[Any], None]] = []
        self.hand_over_hooks: list[Callable[[Any, int, float], None]] = []

    def wait_unregistered(self, alloc: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``alloc`` (being released by another thread:
        it stays registered while the keeper takes its handles) has left ``registry``;
        whether it has."""
        with self.unregistered:
            return self.unregistered.wait_for(
                lambda: self.registry.get(alloc.id) is not alloc, timeout
            )

    def reset_in_child(self) -> None:
        """A forked child starts with its own per-process state.

        It gets new locks (another thread of the parent may have held them), no slab (its
        small arrays never share its parent's or a sibling's free space), no parked mappings
        and no draining allocations. The host allocations it inherited mapped, with the
        views that use them, become its own imports from the parent (it may hand them on and
        serve them); CUDA and growable ones stay the parent's (CUDA cannot be used after
        fork; a growable array's chunks are its creator's to change: the child may not
        resize it). The hooks stay: they
        belong to modules, which the child has too.
        """
        self.lock = threading.RLock()
        self.unregistered = threading.Condition(self.lock)
        self.slabs_lock = threading.Lock()
        self.inherited.extend(self.slabs.values())
        self.slabs.clear()
        for alloc in self.parked.values():
            if alloc.parked:  # (idle: no view of it came with the child)
                self.registry.pop(alloc.id, None)
                self.inherited.append(alloc)
        self.parked.clear()
        self.draining.clear()
        for alloc_id in [k for k, a in self.registry.items() if a.released]:
            # being released by a thread of the parent (registered while the keeper took its
            # handles): no thread here finishes it, and a load would wait for it in vain
            self.inherited.append(self.registry.pop(alloc_id))
        for alloc in self.registry.values():
            member: Member = alloc
            if member.growable:
                member.disown()
            elif not member.device.needs_context:
                member.adopt()


state = ProcessState()
"""This process's memory-layer state."""

at_fork("memory", after_in_child=state.reset_in_child)
