"""Allocations: a reservation with its chunks mapped, in this process; and the registry.

An :class:`Allocation` is what one array's memory is. It is created in one process (the
*exporter*) and imported into others (the *importers*); each process maps an allocation at
most once, so the registry (in the process state, ``STATE.memory``) is keyed
by the allocation's id.

This module holds the allocation's core: creating, importing and mapping its chunks, the
leases views take on it (:class:`Lease`: a lease and the allocation that makes it are in one
module, so that neither imports the other), parking, releasing and draining. The other
concerns have their own modules, below this one: the chunk sizing policy and growth
(:mod:`~sharedarrays.memory.growth`, a base class of :class:`Allocation`), payloads in
flight and served processes (:mod:`~sharedarrays.memory.inflight`, one record per
allocation) and their hand-over to the keeper (:mod:`~sharedarrays.memory.handover`, a base
class), what the allocation tells of itself (:mod:`~sharedarrays.memory.records`, a base
class: chunks, mappings, holders, served, handles for importers, ``describe``), the
reservation and teardown (:mod:`~sharedarrays.memory.reservation`), the read-only records
``describe`` shows (:mod:`~sharedarrays.memory.info`); and, above it, the
functions that read the registry (:mod:`~sharedarrays.memory.registry`: ``lookup``,
``live_allocations``, ...) and slabs (:mod:`~sharedarrays.memory.slabs`).

Lifetime
--------
An allocation is released (synchronised, unmapped, its reservation freed, its chunks
released and their fds closed) when the last Python object that refers to it goes away:
the :class:`~sharedarrays.SharedDeviceArray` views that are still open and the native arrays
(NumPy or CuPy) built over it, each holding a :class:`Lease`, which a ``weakref.finalize``
finalizer ends. Memory itself lives on while any other process maps it or holds one of its
handles.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from sharedarrays._cpython import ITEM_ALONE, LOCAL_ALONE, refcount
from sharedarrays.backends import Access, Backend, Chunk, MappingBackend, round_up
from sharedarrays.errors import ClosedArrayError, PayloadError
from sharedarrays.memory.growth import chunk_sizes
from sharedarrays.memory.handover import HandOver
from sharedarrays.memory.inflight import InFlight
from sharedarrays.memory.info import Origin
from sharedarrays.memory.records import AllocationRecords
from sharedarrays.memory.reservation import Reservation, teardown
from sharedarrays.process import STATE, running
from sharedarrays.protocol.payload import remember
from sharedarrays.settings import env_number

__all__ = [
    "Allocation",
    "Lease",
    "use_clock",
    "keep_imports",
]


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
"""Most native arrays an allocation keeps for reuse (:meth:`Allocation.native_view`): one per
view layout used, a few hundred bytes each."""


def _last_used(alloc: Allocation) -> int:
    return alloc.last_used


use_clock = time.monotonic_ns
"""The clock of :attr:`Allocation.last_used` (a C call: no Python frame)."""


class Lease:
    """One user's hold on an allocation: each view takes one, which the native array built
    over it shares (pinned: :meth:`Allocation.pin`).

    When the last lease of an allocation goes away, the allocation is released (in the
    exporter) or parked (in an importer, see :func:`keep_imports`). A lease ends when it is
    garbage collected (:meth:`__del__`).

    Attributes
    ----------
    allocation : Allocation
        What it holds.
    end : int
        One past the highest byte its holder may touch (shrinking never unmaps below it).
    """

    __slots__ = ("allocation", "end", "_pinned", "__weakref__")

    def __init__(
        self, allocation: Allocation, end: int, reservation: Reservation | None = None
    ) -> None:
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


class Allocation(AllocationRecords, HandOver):
    """A reservation with its chunks mapped back to back: the memory of one array.

    Do not construct directly: use :meth:`create` (exporter) or :meth:`import_` (importer).
    Views hold :class:`Lease` objects on it; the mapping is released when the last lease
    goes (in an importer it may stay *parked* a while, ready for the next handoff).

    Attributes
    ----------
    id : str
        32 hex digits, the same in every process that maps it.
    backend : Backend
        The memory system it lives in.
    address : int
        Start of this process's reservation (it changes when a growable allocation moves to
        a larger reservation).
    size : int
        Bytes mapped: the sum of the chunk sizes, back to back from the reservation's start.
    capacity : int
        Bytes reserved (``size`` unless the allocation is growable).
    used : int
        Bytes of the growable array (what its exporter's last resize asked for); ``size`` for
        others.
    generation : int
        Counts the changes of chunks or address in this process (payload caches key on it).
    origin : Origin
        Created here, or imported from which process and when.
    flight : InFlight
        Its payloads in flight, the processes it was served to and the loads they reported
        (``note_sent`` when a message carrying it is pickled, ``note_loaded`` and
        ``note_returned`` when one is loaded); :meth:`in_flight` reads it.
    """

    def __init__(
        self,
        backend: Backend,
        alloc_id: str,
        secret: bytes,
        address: int,
        chunks: list[Chunk],
        access: Access,
        origin: Origin,
        capacity: int | None = None,
        peers: Mapping[int, Access] | None = None,
    ) -> None:
        self.id = alloc_id
        self.secret = secret
        self.backend = backend
        self.address = address
        self.size = sum(c.size for c in chunks)
        self.capacity = self.size if capacity is None else capacity
        self.used = self.size
        self.generation = 0
        self._reservation = Reservation(backend, address, self.capacity)
        self._growable = capacity is not None
        self.derives_natives = capacity is None and hasattr(backend, "native_view")
        """Whether its views' native arrays come from :meth:`native_view` (one native memory
        per allocation; not a growable one, whose native arrays each pin their own
        reservation, nor a backend without ``native_memory`` and ``native_view``)."""
        self._chunk_bytes: int | None = None
        self._ends: dict[int, int] = {}
        self.growth_lock = threading.RLock()
        """Held while chunks are added, removed or served (so an fd is never sent closed)."""
        self.source_server: str | None = None
        """For an imported growable allocation: its exporter's handle server."""
        self._chunks = chunks
        self._access: Access = access
        self._peers: dict[int, Access] = dict(peers or {})
        self.native_device: int | None = None
        """The device index of the native arrays made here, when this process reads the
        memory as a peer from another CUDA device (``None``: the memory's own device)."""
        self.origin = origin
        self.flight = InFlight()
        self._lock = threading.Lock()
        self._leases = 0
        self.released = False
        """Whether this process has already released the allocation. Read-only."""
        self._release_when_idle = False  # a release asked for waits for a native base's end
        self._orphaned = False
        self.kept_lease: Lease | None = None
        """(An importer) the lease a parked allocation keeps for its next views, which
        :meth:`lease` hands out: ``None`` until it first parks, and after it was let go
        (released, orphaned, evicted while in use). Read-only."""
        self.last_used = use_clock()
        """When this process last leased or loaded the allocation (:data:`use_clock`): the
        parked allocations' order, least recently used first."""
        self.pid = os.getpid()  # a forked child inherits the object but is not this process
        self.allow_pids: frozenset[int] | None = None
        """Processes allowed to import it (besides this one); ``None``: any of this user."""
        self.export_readonly = False
        """Whether importers get read-only mappings (payloads say ``readonly``)."""
        self.slab = False
        """Whether it is a slab that small arrays are packed into (made here by
        :func:`~sharedarrays.memory.slabs.pack_into_slab`): its room belongs to them, none
        of it is lost to granularity."""
        self.keeper_name: str | None = None
        """The name this process gave it or attached it by (``sa.empty(..., name=)``,
        ``sa.attach``), while this process knows the keeper holds it under that name."""
        self.in_keeper = False
        """Whether this process knows the keeper holds its handles: it named or parked it,
        attached it by name, or had its handles from the keeper (its exporter gone). What
        the widgets show; no process is asked."""
        self.write_sealed = False
        """Whether the kernel forbids every new write to the memory (``readonly=True`` on the
        host backend): only the creator's mappings made before can write."""
        self._native_base: tuple[int | None, Any] | None = None  # (device, native array)
        # the native arrays native_view made, by layout (offset, shape, strides): (device,
        # dtype, read-only, the array), up to NATIVES_KEPT, oldest first; a thread takes one
        # out (dict.pop is atomic) and puts it back
        self._natives: dict[tuple[Any, ...], tuple[Any, Any, bool, Any]] = {}
        self.encoded: tuple[int, int, bytes] | None = None
        """The payload of the whole allocation that pickles of its views carry, with the pid
        and :attr:`generation` it was made for (:mod:`sharedarrays.api.array` makes it): one
        bytes object, so that pickle's memo writes it once per message."""
        with STATE.memory.lock:
            STATE.memory.registry[alloc_id] = self

    # construction -----------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        backend: Backend,
        nbytes: int,
        chunk_bytes: int | None = None,
        capacity: int | None = None,
        peers: Mapping[int, Access] | None = None,
        readonly: bool = False,
    ) -> Allocation:
        """Make a new allocation of at least ``nbytes`` bytes in this process (the exporter).

        Parameters
        ----------
        backend : Backend
            Where the memory lives.
        nbytes : int
            Bytes needed; rounded up to the backend's granularity.
        chunk_bytes : int, optional
            Largest chunk (see :func:`chunk_sizes`, and :func:`growth_sizes` for growth).
        capacity : int, optional
            Make a *growable* allocation: reserve this many bytes of address space (rounded
            up to the granularity, at least what ``nbytes`` maps) and map only ``nbytes``.
        peers : mapping of int to Access, optional
            Other devices (by index) that get access to the memory in this process, and
            which (CUDA VMM only: see :meth:`grant`).
        readonly : bool
            Read-only for every other process (:attr:`export_readonly`). Where the memory
            system enforces it (:meth:`Backend.seal`, the host backend) the chunks are sealed
            against every new write once this process has mapped them: its mappings stay
            writable, and nothing (importers, a mapping made anew here, a ``write`` on an fd
            opened again through ``/proc``) can write otherwise; such an allocation cannot
            grow past its capacity (it would have to map its chunks again).

        On a pointer backend (cuda-ipc, cuda-pool) the allocation is one chunk, and neither
        ``chunk_bytes`` nor ``capacity`` can be given.
        """
        if backend.maps:
            sizes = chunk_sizes(nbytes, backend.granularity, chunk_bytes)
        elif capacity is not None:
            raise ValueError(
                "capacity= needs a backend that maps chunks into a reservation (cuda-vmm, "
                f"host); {backend.name} memory cannot grow in place"
            )
        elif chunk_bytes is not None:
            raise ValueError(
                f"chunk_bytes= and capacity= need a backend that maps chunks into a reservation "
                f"(cuda-vmm, host); a {backend.name} allocation is one piece of memory"
            )
        else:
            sizes = [round_up(max(nbytes, 1), backend.granularity)]
        if capacity is not None:
            capacity = max(round_up(capacity, backend.granularity), sum(sizes))
        backend.check_memory(sum(sizes))
        alloc = cls._build(
            backend,
            secrets.token_hex(16),
            secrets.token_bytes(32),
            sizes,
            backend.create_chunk,
            "rw",
            Origin(True, os.getpid(), time.time()),
            capacity,
            peers,
            seal=True,
            readonly=readonly,
        )
        alloc._chunk_bytes = chunk_bytes
        alloc.used = nbytes
        return alloc

    @classmethod
    def borrow(cls, backend: Backend, chunk: Chunk) -> Allocation:
        """Make an allocation of memory this process borrowed from another library.

        ``chunk`` comes from the backend's ``borrow_chunk`` (cuda-ipc): it holds the object
        that keeps the memory allocated, and releasing the allocation drops that object
        instead of freeing. Importers see an ordinary allocation of ``backend``.
        """
        if backend.maps or not backend.exporter_owned:
            raise ValueError(f"memory cannot be borrowed into a {backend.name} allocation")
        return cls._build(
            backend,
            secrets.token_hex(16),
            secrets.token_bytes(32),
            [chunk.size],
            lambda size: chunk,
            "rw",
            Origin(True, os.getpid(), time.time()),
        )

    @classmethod
    def import_(
        cls,
        backend: Backend,
        alloc_id: str,
        secret: bytes,
        sizes: list[int],
        fds: list[int],
        source_pid: int,
        access: Access = "rw",
        capacity: int | None = None,
        exports: tuple[bytes, ...] = (),
        peers: Mapping[int, Access] | None = None,
    ) -> Allocation:
        """Map an allocation from its chunks' handles (an importer).

        Takes ownership of every fd in ``fds``, on success and on failure. If this process
        already maps ``alloc_id``, the fds are closed and the existing allocation returned.
        ``capacity`` makes it growable, reserving that many bytes (at least the chunks' sum).
        A pointer backend's chunk comes from its portable handle in ``exports`` (and, for
        cuda-pool, the pool's fd in ``fds``, which may be empty).
        """
        bad = (
            len(sizes) != len(fds) or bool(exports)
            if backend.maps
            else len(sizes) != 1 or len(exports) != 1 or len(fds) > 1
        )
        if bad:
            for fd in fds:
                os.close(fd)
            raise PayloadError(
                f"{len(sizes)} chunk sizes but {len(fds)} handles and {len(exports)} exports"
            )
        with STATE.memory.lock:
            existing: Allocation | None = STATE.memory.registry.get(alloc_id)
            if existing is not None:
                for fd in fds:
                    os.close(fd)
                return existing
            pending = list(fds)

            def import_next(size: int) -> Chunk:
                fd = pending.pop(0) if pending else -1
                return backend.import_chunk(fd, size, exports[0] if exports else b"")

            try:
                return cls._build(
                    backend,
                    alloc_id,
                    secret,
                    sizes,
                    import_next,
                    access,
                    Origin(False, source_pid, time.time()),
                    None if capacity is None else max(capacity, sum(sizes)),
                    peers,
                )
            finally:
                for fd in pending:
                    os.close(fd)

    @classmethod
    def _build(
        cls,
        backend: Backend,
        alloc_id: str,
        secret: bytes,
        sizes: list[int],
        make_chunk: Callable[[int], Chunk],
        access: Access,
        origin: Origin,
        capacity: int | None = None,
        peers: Mapping[int, Access] | None = None,
        seal: bool = False,
        readonly: bool = False,
    ) -> Allocation:
        """Make the chunks, map them, set access and, with ``seal`` (chunks made here), seal
        them (``readonly``: against every new write); everything is released on failure."""
        total = sum(sizes)
        write_sealed = False
        if not backend.maps:  # the chunk comes with its own address
            if peers:
                raise ValueError(
                    f"access for other devices needs backend='cuda-vmm' ({backend.name} memory "
                    "cannot be granted to peers here)"
                )
            chunk = make_chunk(total)
            try:
                write_sealed = seal and backend.seal(chunk, readonly)
            except BaseException:
                teardown(backend, 0, 0, [], [chunk])
                raise
            alloc = cls(backend, alloc_id, secret, chunk.address, [chunk], access, origin)
            alloc.export_readonly, alloc.write_sealed = readonly, write_sealed and readonly
            return alloc
        mapper = cast(MappingBackend, backend)
        reserved = total if capacity is None else round_up(capacity, backend.granularity)
        chunks: list[Chunk] = []
        mapped: list[tuple[int, int]] = []
        address = 0
        try:
            address = mapper.reserve(reserved)
            offset = 0
            for size in sizes:
                chunk = make_chunk(size)
                chunks.append(chunk)
                mapper.map(address + offset, size, chunk, 0)
                mapped.append((offset, size))
                offset += size
            mapper.set_access(address, total, access, peers)
            if seal:
                write_sealed = all([backend.seal(c, readonly) for c in chunks])
        except BaseException:
            teardown(backend, address, reserved, mapped, chunks)
            raise
        alloc = cls(backend, alloc_id, secret, address, chunks, access, origin, capacity, peers)
        alloc.export_readonly, alloc.write_sealed = readonly, write_sealed and readonly
        return alloc

    # lifetime ---------------------------------------------------------------------------
    def lease(self, end: int | None = None, pin: bool = False) -> Lease:
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

    def pin(self, lease: Lease) -> Lease:
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
        dropped: list[Allocation] = []
        with STATE.memory.lock:
            parked = STATE.memory.parked
            parked[self.id] = self  # (where it was, if listed: the order is last_used's)
            over = len(parked) - limit
            evict: list[Allocation] = []
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
                or self.released
                or self._release_when_idle
                or self._orphaned
                or self._view_leases()
            ):
                return
            self._leases += 1
        kept: Lease | None = Lease(self, self.size)
        with self._lock:
            if self.kept_lease is None and not (
                self.released or self._release_when_idle or self._orphaned
            ):
                self.kept_lease, kept = kept, None
        del kept  # (outside the lock: a lease not kept ends here)

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

    def orphan(self) -> None:
        """The source released this allocation: release it here too once nothing uses it."""
        with self._lock:
            self._orphaned = True
        self._let_kept_go()  # (held by a view: the view's end releases it)
        self.release()  # does nothing while a view uses it: its last lease releases it then

    def release(self) -> bool:
        """Unmap and close everything this process holds of the allocation, now.

        Called when the last lease goes, or to drop a parked mapping. Does nothing while a
        view (a lease) still uses the allocation, so a mapping is never taken from under a
        view: another thread may have just leased a parked allocation again. Close views with
        :meth:`SharedDeviceArray.close` instead. Idempotent. A parked allocation's kept native
        base (:meth:`native_base`) is let go first; where a native array made from it still
        lives, the release happens when the last one goes (and this call returns ``False``).

        Exporter-owned memory (cuda-ipc, cuda-pool) that other processes still hold is not
        freed yet: the allocation leaves the registry (nothing new is served) and *drains*
        until its last holder closes it or exits (:attr:`holders`,
        :func:`~sharedarrays.memory.registry.draining_allocations`); the processes it was
        served to are told to drop their parked mappings. A growable allocation (never
        handed to the keeper) drains the same way while a payload of it is in flight (a pool
        worker's result), so that it loads while this process runs.

        Returns
        -------
        bool
            Whether this call released it.
        """
        with self._lock:
            if self.released:
                return False
            idle = not self._view_leases()
            kept, base = self.kept_lease, self._native_base
            if idle and (kept is not None or base is not None):  # idle, but for what it keeps
                # let them go (the kept lease, the native base with the native arrays
                # kept for reuse): their leases end now, the base's where no native array of
                # it is left (else with the last one), and come back to release through
                # _unlease
                self.kept_lease = None
                self._native_base = None
                last, self._natives = self._natives, {}
                self._release_when_idle = True
            elif self._leases:
                return False
            else:
                self.released = True
        if kept is not None or base is not None:
            del kept, base, last
            if not self.released:  # native arrays of it live on: not parked, kept by them
                with STATE.memory.lock:
                    STATE.memory.parked.pop(self.id, None)
            return self.released
        if not self.backend.exporter_owned:
            # still registered: a load asks this process until the keeper has the handles
            self.hand_over()
        try:
            with self.growth_lock:  # the handle server sends no fd while they are closed
                with STATE.memory.lock:
                    if STATE.memory.registry.get(self.id) is self:
                        del STATE.memory.registry[self.id]
                        STATE.memory.unregistered.notify_all()  # (a load here waits for this)
                    STATE.memory.parked.pop(self.id, None)
                    # (a growable array is not handed over: it drains while its payloads
                    # are in flight, served here until they load or their bound passes)
                    drain = (
                        self.backend.exporter_owned and (bool(self.holders) or self.busy())
                    ) or (self._growable and self.busy())
                    if drain:
                        STATE.memory.draining[self.id] = self
                if not drain:
                    self._free()
        finally:
            for hook in STATE.memory.release_hooks:
                try:
                    hook(self)
                except Exception:
                    continue
        return True

    def _free(self) -> None:
        mapped = [(m.offset, m.size) for m in self.mappings] if self.backend.maps else []
        teardown(self.backend, self.address, self.capacity, mapped, self._chunks)

    def closed_by(self, pid: int | None) -> None:
        """Process ``pid`` no longer holds this exporter-owned allocation (it said so, or it
        exited); ``None`` only forgets holders that exited. Frees a draining allocation
        once no holder is left and no payload of it is in flight."""
        self.flight.closed_by(pid)
        if self.holders or self.busy():
            return
        try:  # this runs in the handle server's thread, which must go on serving
            with self.growth_lock:  # (the server sends no fd while they are closed)
                with STATE.memory.lock:
                    if STATE.memory.draining.pop(self.id, None) is not self:
                        return
                self._free()
        except Exception as exc:
            warnings.warn(
                f"sharedarrays: freeing allocation {self.id} after its importers closed it "
                f"failed: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )

    def disown(self) -> None:
        """In a forked child: an inherited growable allocation stays the array of the process
        that made it (its chunks and its length are that process's to change): this one
        may use it, but resizing it raises :class:`~sharedarrays.ResizeRefused`, as in any
        importer, and pickling it :class:`~sharedarrays.NotShareable` (its payload would
        name this process, which cannot tell its length). (Grown here, two processes would
        hold different chunks under one allocation id.)"""
        self._lock = threading.Lock()
        self.growth_lock = threading.RLock()
        if self.origin.created_here:
            self.origin = Origin(False, self.origin.pid, self.origin.time)

    def adopt(self) -> None:
        """In a forked child: make this inherited mapping this process's import from the
        parent, with no record of what the parent served or sent."""
        self.disown()  # (new locks; made by the process that forked this one: not here)
        self.kept_lease = None  # (a view came with it: its end parks it here)
        self.pid = os.getpid()
        self.flight.forget()

    # leases and access ---------------------------------------------------------------------
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

    def grant(self, index: int, access: Access = "rw") -> None:
        """Give device ``index`` (a peer of the memory's device) ``access`` to the whole
        reservation in this process (``cuMemSetAccess``; also for chunks mapped later).

        Raises
        ------
        ValueError
            Not a CUDA VMM allocation, or a bad access mode.
        PeerAccessUnavailable
            That device cannot reach this memory (``cuDeviceCanAccessPeer`` is 0).
        """
        if access not in ("rw", "r", "none"):
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        if not self.backend.peer_access:
            raise ValueError(
                f"access for other devices needs backend='cuda-vmm', not {self.backend.name}"
            )
        if index == self.device.index:
            raise ValueError(
                f"{self.device} is the memory's own device; its access is set when the array "
                "is made (readonly=) or imported"
            )
        with self.growth_lock:
            mapper = cast(MappingBackend, self.backend)
            mapper.set_access(self.address, self.size, self._access, {index: access})
            self._peers[index] = access

    # growth -----------------------------------------------------------------------------
    def reach(self, exclude: Lease | None = None) -> int:
        """One past the highest byte any lease here (but ``exclude``) may touch (of a
        growable allocation, whose leases' ends are tracked; 0 for another)."""
        with self._lock:
            ends = dict(self._ends)
        if exclude is not None and exclude.allocation is self:
            left = ends.get(exclude.end, 0) - 1
            if left > 0:
                ends[exclude.end] = left
            else:
                ends.pop(exclude.end, None)
        return max(ends, default=0)

    def shrink(self, nbytes: int, exclude: Lease | None = None) -> None:
        """Unmap and release the chunks that lie wholly past ``nbytes`` (the exporter).

        Raises
        ------
        ResizeRefused
            A lease here (but ``exclude``) reaches into those chunks, or a running process
            was served them.
        """
        self._unmap_past(nbytes, lambda: self.reach(exclude))

    def has_chunk_sizes(self, sizes: tuple[int, ...]) -> bool:
        """Whether the chunks are ``sizes``, in reservation order (what a payload names),
        compared without making an object (a warm load asks it for every view)."""
        chunks = self._chunks
        if len(chunks) != len(sizes):
            return False
        for i in range(len(sizes)):  # noqa: SIM110 - all() would make a generator per load
            if chunks[i].size != sizes[i]:
                return False
        return True
