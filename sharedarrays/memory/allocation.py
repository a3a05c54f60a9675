"""Allocations: a reservation, its mappings and their chunks, and the per-process registry.

An :class:`Allocation` is what one array's memory is. It is created in one process (the
*exporter*) and imported into others (the *importers*); each process maps an allocation at
most once, so the registry here is keyed by the allocation's id.

Lifetime
--------
An allocation is released (synchronised, unmapped, its reservation freed, its chunks
released and their fds closed) when the last Python object that refers to it goes away:
the :class:`~sharedarrays.SharedDeviceArray` views that are still open and the native arrays
(NumPy or CuPy) built over it. Memory itself lives on while any other process maps it or
holds one of its handles.
"""

from __future__ import annotations

import os
import secrets
import sys
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

from sharedarrays.backends import Access, Backend, Chunk, MappingBackend, round_up
from sharedarrays.backends.device import Device
from sharedarrays.errors import ClosedArrayError, PayloadError, ResizeRefused
from sharedarrays.process import at_fork, running
from sharedarrays.settings import env_number

__all__ = [
    "Allocation",
    "MappingInfo",
    "ChunkInfo",
    "Origin",
    "Served",
    "DEFAULT_CHUNK_BYTES",
    "chunk_sizes",
    "growth_sizes",
    "Lease",
    "PACK_BYTES",
    "SLAB_BYTES",
    "pack_into_slab",
    "live_allocations",
    "parked_allocations",
    "drop_parked",
    "draining_allocations",
    "reap_draining",
    "wait_draining",
    "held_elsewhere",
    "keep_imports",
    "lookup",
]

DEFAULT_CHUNK_BYTES = 2 << 30
"""Largest chunk a growable array maps at a time by default (2 GiB; see
:func:`growth_sizes`). An array of fixed size is one chunk by default, whatever its size
(:func:`chunk_sizes`). Override per array with ``chunk_bytes=`` or for the process with the
``SHAREDARRAYS_CHUNK_BYTES`` environment variable (which then splits fixed-size arrays too)."""

PACK_BYTES = 64 << 10
"""Arrays of at most this many bytes are packed into slabs by default (see ``pack=``)."""

SLAB_BYTES = 2 << 20
"""Size of one slab allocation (rounded up to the backend's granularity)."""

PACK_ALIGN = 256
"""Packed arrays start at multiples of this many bytes (CuPy's and cuBLAS's alignment)."""

MAX_CHUNKS = 1 << 16
"""No allocation has more chunks than this (a payload claiming more is rejected)."""

_SERVED_HISTORY = 256


def _default_chunk_bytes() -> int:
    return env_number("SHAREDARRAYS_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, 1)


def _chunk_limit(chunk_bytes: int | None) -> int:
    """The largest chunk: ``chunk_bytes``, or the process default when ``None``."""
    if chunk_bytes is None:
        chunk_bytes = _default_chunk_bytes()
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return chunk_bytes


def chunk_sizes(nbytes: int, granularity: int, chunk_bytes: int | None = None) -> list[int]:
    """Split an allocation of ``nbytes`` into chunk sizes.

    The allocation is rounded up to the granularity (at least one granule, so zero-size
    arrays have real memory too). By default it is one chunk: every chunk costs each
    importer one import and one map on its first load (about 80 us per chunk on an H200:
    16 chunks of 2 GiB made a 32 GiB cold handoff 1.3 ms slower than one chunk). With
    ``chunk_bytes`` (or ``SHAREDARRAYS_CHUNK_BYTES``) it is cut into chunks of at most that
    many bytes (rounded up to the granularity); only the last chunk may be smaller.

    Parameters
    ----------
    nbytes : int
        Bytes the array needs.
    granularity : int
        The backend's granularity.
    chunk_bytes : int, optional
        Largest chunk; by default ``SHAREDARRAYS_CHUNK_BYTES`` if set, else no limit.
    """
    total = round_up(max(nbytes, 1), granularity)
    if chunk_bytes is None:  # unset: one chunk
        chunk_bytes = env_number("SHAREDARRAYS_CHUNK_BYTES", total, 1)
    chunk_bytes = _chunk_limit(chunk_bytes)
    step = round_up(chunk_bytes, granularity)
    sizes = [step] * (total // step)
    if total % step:
        sizes.append(total % step)
    if len(sizes) > MAX_CHUNKS:
        raise ValueError(
            f"{nbytes} bytes in chunks of {step} bytes would need {len(sizes)} chunks "
            f"(at most {MAX_CHUNKS}); pass a larger chunk_bytes"
        )
    return sizes


def growth_sizes(
    mapped: int, nbytes: int, granularity: int, capacity: int, chunk_bytes: int | None = None
) -> list[int]:
    """The chunks a growable allocation adds so that at least ``nbytes`` are mapped.

    The growth policy: each new chunk is at least as large as what is mapped already
    (doubling, so ``n`` appends make ``O(log n)`` chunks and fds) and at least what is still
    missing, at most ``chunk_bytes`` (default :data:`DEFAULT_CHUNK_BYTES`), rounded up to the
    granularity. Near the end of the reservation a chunk is cut to the room left when the
    rest fits there; otherwise the sizes run past ``capacity`` and the caller moves the
    allocation to a larger reservation. Mapped memory is therefore at most
    ``max(2 * needed, needed + chunk_bytes)``.

    Parameters
    ----------
    mapped : int
        Bytes mapped now (a multiple of ``granularity``).
    nbytes : int
        Bytes needed.
    granularity : int
        The backend's granularity.
    capacity : int
        Bytes reserved now.
    chunk_bytes : int, optional
        Largest chunk.
    """
    chunk_bytes = _chunk_limit(chunk_bytes)
    target = round_up(max(nbytes, 1), granularity)
    largest = round_up(chunk_bytes, granularity)
    sizes: list[int] = []
    total = mapped
    while total < target:
        missing = target - total
        step = round_up(min(max(missing, total), largest), granularity)
        room = capacity - total
        if step > room >= missing:
            step = room
        sizes.append(step)
        total += step
    return sizes


@dataclass(frozen=True)
class Origin:
    """Where an allocation in this process came from.

    Attributes
    ----------
    created_here : bool
        True in the exporter, False in importers.
    pid : int
        The process that created it (this one when ``created_here``), or for an importer the
        process it was imported from.
    time : float
        When it was created or imported (``time.time()``).
    """

    created_here: bool
    pid: int
    time: float


@dataclass(frozen=True)
class Served:
    """One time this process handed an allocation's handles to another process."""

    pid: int
    time: float


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of an allocation, as seen from this process."""

    index: int
    size: int
    fd: int


@dataclass(frozen=True)
class MappingInfo:
    """One mapping: ``size`` bytes of chunk ``chunk`` from ``chunk_offset`` placed at
    ``offset`` bytes into the reservation, with this process's access."""

    offset: int
    size: int
    chunk: int
    chunk_offset: int
    access: Access


_registry: dict[str, Allocation] = {}
_registry_lock = threading.RLock()
_parked: OrderedDict[str, Allocation] = OrderedDict()
_draining: dict[str, Allocation] = {}

release_hooks: list[Callable[[Allocation], None]] = []
"""Called with each allocation this process releases (the transport layer tells the
processes it served, so that they drop their parked mappings too)."""

hand_over_hooks: list[Callable[[Allocation, int, float], None]] = []
"""Called, before an allocation of memory that outlives its exporter leaves this process
(released, or the process exits), with the number of its payloads still in flight and the
seconds left of their bound: the keeper layer takes over their handles. A hook that fails
raises; the allocation is then released all the same."""

IN_FLIGHT_SECONDS = 60.0
"""Default bound on how long a payload in flight keeps its memory alive (seconds)."""


def in_flight_seconds() -> float:
    """How long a payload in flight (pickled here, not yet loaded) keeps its memory alive
    after this process let go of it: ``SHAREDARRAYS_IN_FLIGHT`` seconds (default 60).

    Within the bound a payload loads even when its sender closed its last view or exited
    in the meantime; a payload loaded later raises :class:`~sharedarrays.HandleUnavailable`
    (park or name the array to keep it longer)."""
    return env_number("SHAREDARRAYS_IN_FLIGHT", IN_FLIGHT_SECONDS, 0.0)


def keep_imports() -> int:
    """How many imported allocations with no live view this process keeps mapped.

    A worker that receives the same array again then finds it mapped (a *warm* handoff: no
    connection, no import, no map). Set by ``SHAREDARRAYS_KEEP_IMPORTS`` (default 64; 0 turns
    parking off). A parked mapping is dropped as soon as its exporter releases the allocation
    or exits, and the oldest is dropped when the limit is reached.
    """
    return env_number("SHAREDARRAYS_KEEP_IMPORTS", 64, 0)


def lookup(alloc_id: str, draining: bool = False) -> Allocation | None:
    """Return this process's mapped allocation with id ``alloc_id``, if any (``draining``:
    also one released here but still held by other processes, see
    :func:`draining_allocations`)."""
    alloc = _registry.get(alloc_id)
    if alloc is None and draining:
        alloc = _draining.get(alloc_id)
    return alloc


def revive(alloc_id: str) -> Allocation | None:
    """Put a draining allocation made here back in the registry and return it (``None`` if
    none drains under that id): a payload of it came back to its exporter, which maps it
    still (a pointer backend cannot import its own memory)."""
    with _registry_lock:
        alloc = _draining.pop(alloc_id, None)
        if alloc is not None:
            with alloc._lock:
                alloc._released = False
            _registry[alloc_id] = alloc
    return alloc


def live_allocations() -> list[Allocation]:
    """Every allocation currently mapped in this process (parked ones too), oldest first."""
    with _registry_lock:
        allocs = list(_registry.values())
    return sorted(allocs, key=lambda a: a.origin.time)


def parked_allocations() -> list[Allocation]:
    """Imported allocations kept mapped with no live view, least recently used first."""
    with _registry_lock:
        return list(_parked.values())


def drop_parked(only_orphans: bool = False) -> int:
    """Release parked allocations: all of them, or only those whose source process is gone.

    Returns how many were released.
    """
    with _registry_lock:
        victims = [a for a in _parked.values() if not only_orphans or not running(a.origin.pid)]
    return sum(a.release() for a in victims)


def draining_allocations() -> list[Allocation]:
    """Allocations of exporter-owned memory (cuda-ipc, cuda-pool) that this process released
    but cannot free yet: other processes still hold them (see :attr:`Allocation.holders`)."""
    with _registry_lock:
        return list(_draining.values())


def reap_draining() -> int:
    """Free the draining allocations whose holders have all closed or exited.

    Returns how many are still waiting.
    """
    for alloc in draining_allocations():
        alloc.closed_by(None)
    with _registry_lock:
        return len(_draining)


def held_elsewhere() -> list[Allocation]:
    """Exporter-owned allocations made here (live or draining) that other running processes
    still hold (see :attr:`Allocation.holders`)."""
    with _registry_lock:
        mine = [a for a in _registry.values() if a.origin.created_here] + list(_draining.values())
    return [a for a in mine if a.backend.exporter_owned and (a.holders or a.busy())]


def wait_draining(timeout: float) -> list[Allocation]:
    """Wait up to ``timeout`` seconds until no other process holds exporter-owned memory
    made here, freeing draining allocations as their holders go (used at exit).

    Returns those still held afterwards.
    """
    deadline = time.monotonic() + timeout
    while True:
        reap_draining()
        held = held_elsewhere()
        if not held or time.monotonic() >= deadline:
            return held
        time.sleep(0.05)


def _teardown(
    backend: Backend,
    address: int,
    size: int,
    mapped: list[tuple[int, int]],
    chunks: list[Chunk],
    free: bool = True,
) -> None:
    """Release everything an allocation holds, in the order the driver needs (``free``:
    also give back the reservation)."""
    errors: list[BaseException] = []
    if mapped:
        try:
            backend.synchronize()
        except BaseException as e:  # keep going: fds must be closed regardless
            errors.append(e)
    if backend.maps:
        mapper = cast(MappingBackend, backend)
        for offset, length in mapped:
            try:
                mapper.unmap(address + offset, length)
            except BaseException as e:
                errors.append(e)
        if address and free:
            try:
                mapper.free_reservation(address, size)
            except BaseException as e:
                errors.append(e)
    for chunk in chunks:
        try:
            backend.release_chunk(chunk)
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


class Lease:
    """One user's hold on an allocation: each view, and each native array built over it.

    When the last lease of an allocation goes away, the allocation is released (in the
    exporter) or parked (in an importer, see :func:`keep_imports`).

    Attributes
    ----------
    allocation : Allocation
        What it holds.
    end : int
        One past the highest byte its holder may touch (shrinking never unmaps below it).
    reservation : object or None
        For a native array: the reservation its addresses are in, kept mapped while the
        native array lives even after the allocation moved to a larger one.
    """

    __slots__ = ("allocation", "end", "reservation")

    def __init__(self, allocation: Allocation, end: int, reservation: object = None) -> None:
        self.allocation = allocation
        self.end = end
        self.reservation = reservation

    def __del__(self) -> None:
        self.reservation = None  # an abandoned reservation is freed before the allocation
        try:
            self.allocation._unlease(self.end)
        except Exception:
            pass


class _Reservation:
    """One reservation of an allocation in this process.

    The current one is torn down with the allocation. One the allocation moved away from
    (:meth:`Allocation.grow` beyond the capacity) is *retired*: it keeps its mappings of the
    chunks until the last native array using its addresses goes, then unmaps and frees itself.
    """

    __slots__ = ("backend", "address", "size", "retired", "__weakref__")

    def __init__(self, backend: Backend, address: int, size: int) -> None:
        self.backend = backend
        self.address = address
        self.size = size
        self.retired: list[tuple[int, int]] | None = None  # its mappings, once retired

    def __del__(self) -> None:
        if self.retired is not None:
            try:
                _teardown(self.backend, self.address, self.size, self.retired, [])
            except Exception:
                pass


class Allocation:
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
        self._reservation = _Reservation(backend, address, self.capacity)
        self._growable = capacity is not None
        self._chunk_bytes: int | None = None
        self._ends: dict[int, int] = {}
        self._served_chunks: dict[int, int] = {}
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
        self._served: deque[Served] = deque(maxlen=_SERVED_HISTORY)
        self._servers: set[str] = set()
        self._holders: set[int] = set()  # exporter-owned memory: importers not done yet
        self._lock = threading.Lock()
        self._leases = 0
        self._released = False
        self._orphaned = False
        self.pid = os.getpid()  # a forked child inherits the object but is not this process
        self.allow_pids: frozenset[int] | None = None
        """Processes allowed to import it (besides this one); ``None``: any of this user."""
        self.export_readonly = False
        """Whether importers get read-only mappings (payloads say ``readonly``)."""
        self.write_sealed = False
        """Whether the kernel forbids every new write to the memory (``readonly=True`` on the
        host backend): only the creator's mappings made before can write."""
        self._sent = 0  # payloads pickled here that name this process's handle server
        self._sent_at = 0.0  # time.monotonic() of the last
        self._fetched = 0  # handle requests for it this process answered
        self._returned: dict[str, int] = {}  # payloads of it loaded here, by their sender's
        # handle server (one this process served): told to that process when released here
        with _registry_lock:
            _registry[alloc_id] = self

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
        with _registry_lock:
            existing = _registry.get(alloc_id)
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
                _teardown(backend, 0, 0, [], [chunk])
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
            _teardown(backend, address, reserved, mapped, chunks)
            raise
        alloc = cls(backend, alloc_id, secret, address, chunks, access, origin, capacity, peers)
        alloc.export_readonly, alloc.write_sealed = readonly, write_sealed and readonly
        return alloc

    # lifetime ---------------------------------------------------------------------------
    def lease(self, end: int | None = None, pin: bool = False) -> Lease:
        """A new hold on this allocation (each view takes one). Unparks it if parked.

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
        with self._lock:
            if self._released:
                raise ClosedArrayError(f"allocation {self.id} was released in this process")
            self._leases += 1
            self._ends[end] = self._ends.get(end, 0) + 1
            parked = self._leases == 1 and not self.origin.created_here
            reservation = self._reservation if pin else None
        if parked:
            with _registry_lock:
                _parked.pop(self.id, None)
        return Lease(self, end, reservation)

    def _unlease(self, end: int) -> None:
        with self._lock:
            left = self._ends.get(end, 0) - 1
            if left > 0:
                self._ends[end] = left
            else:
                self._ends.pop(end, None)
            self._leases -= 1
            if self._leases or self._released:
                return
            park = not self.origin.created_here and not self._orphaned
        # a mapping whose source process has exited will not be handed to us again: drop it
        limit = keep_imports() if park and running(self.origin.pid) else 0
        if limit == 0:
            self.release()
            return
        with _registry_lock:
            _parked[self.id] = self
            _parked.move_to_end(self.id)
            evict = list(_parked.values())[: max(0, len(_parked) - limit)]
        for a in evict:
            a.release()

    def orphan(self) -> None:
        """The source released this allocation: release it here too once nothing uses it."""
        with self._lock:
            self._orphaned = True
        self.release()  # does nothing while a view uses it: its last lease releases it then

    def release(self) -> bool:
        """Unmap and close everything this process holds of the allocation, now.

        Called when the last lease goes, or to drop a parked mapping. Does nothing while a
        view (a lease) still uses the allocation, so a mapping is never taken from under a
        view: another thread may have just leased a parked allocation again. Close views with
        :meth:`SharedDeviceArray.close` instead. Idempotent.

        Exporter-owned memory (cuda-ipc, cuda-pool) that other processes still hold is not
        freed yet: the allocation leaves the registry (nothing new is served) and *drains*
        until its last holder closes it or exits (:attr:`holders`,
        :func:`draining_allocations`); the processes it was served to are told to drop
        their parked mappings.

        Returns
        -------
        bool
            Whether this call released it.
        """
        with self._lock:
            if self._released or self._leases:
                return False
            self._released = True
        if not self.backend.exporter_owned:
            # still registered: a load asks this process until the keeper has the handles
            self.hand_over()
        try:
            with self.growth_lock:  # the handle server sends no fd while they are closed
                with _registry_lock:
                    if _registry.get(self.id) is self:
                        del _registry[self.id]
                    _parked.pop(self.id, None)
                    drain = self.backend.exporter_owned and (bool(self.holders) or self.busy())
                    if drain:
                        _draining[self.id] = self
                if not drain:
                    self._free()
        finally:
            for hook in release_hooks:
                try:
                    hook(self)
                except Exception:
                    continue
        return True

    def _free(self) -> None:
        mapped = [(m.offset, m.size) for m in self.mappings] if self.backend.maps else []
        _teardown(self.backend, self.address, self.capacity, mapped, self._chunks)

    def closed_by(self, pid: int | None) -> None:
        """Process ``pid`` no longer holds this exporter-owned allocation (it said so, or it
        exited); ``None`` only forgets holders that exited. Frees a draining allocation
        once no holder is left and no payload of it is in flight."""
        with self._lock:
            self._holders.discard(-1 if pid is None else pid)
        if self.holders or self.busy():
            return
        try:  # this runs in the handle server's thread, which must go on serving
            with self.growth_lock:  # (the server sends no fd while they are closed)
                with _registry_lock:
                    if _draining.pop(self.id, None) is not self:
                        return
                self._free()
        except Exception as exc:
            warnings.warn(
                f"sharedarrays: freeing allocation {self.id} after its importers closed it "
                f"failed: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _adopt(self) -> None:
        """In a forked child: make this inherited mapping this process's import from the
        parent, with no record of what the parent served or sent."""
        self._lock = threading.Lock()
        self.growth_lock = threading.RLock()
        if self.origin.created_here:  # (made by the process that forked this one)
            self.origin = Origin(False, self.pid, self.origin.time)
        self.pid = os.getpid()
        self._served.clear()
        self._servers.clear()
        self._holders.clear()
        self._served_chunks.clear()
        self._returned.clear()
        self._sent = self._fetched = 0

    # payloads in flight ----------------------------------------------------------------
    def note_sent(self) -> None:
        """A payload naming this process's handle server was pickled (and may be loaded by
        another process later): see :meth:`in_flight`."""
        with self._lock:
            self._sent += 1
            self._sent_at = time.monotonic()

    def note_loaded(self, count: int = 1) -> None:
        """``count`` payloads pickled here were loaded (here, or where the process they came
        back to said so): they are no longer in flight."""
        with self._lock:
            self._fetched += count

    def note_returned(self, server: str) -> None:
        """A payload of this allocation from the process whose handle server is ``server``
        was loaded here. Counted only for processes this one served (those it tells when it
        releases the allocation: :meth:`returned`), so that they need not keep it in flight."""
        with self._lock:
            if server in self._servers:
                self._returned[server] = self._returned.get(server, 0) + 1

    def returned(self, server: str) -> int:
        """How many payloads from the process of handle server ``server`` were loaded here."""
        with self._lock:
            return self._returned.get(server, 0)

    def in_flight(self) -> tuple[int, float]:
        """Payloads pickled here that may still be loaded, and the seconds left of their
        bound (:func:`in_flight_seconds`, counted from the last one pickled).

        Every payload pickled here counts until as many were counted loaded
        (:meth:`note_loaded`: a handle request answered here, a payload loaded back here, the
        loads its exporter's release notice reports, the warm loads importers of
        exporter-owned memory report), or the bound passed. Other warm loads (a process that
        already maps the allocation asks nothing) are not counted, so the count errs on the
        side of keeping memory alive.

        Returns
        -------
        count, seconds
            ``(0, 0.0)`` when nothing is in flight.
        """
        with self._lock:
            count, sent_at = self._sent - self._fetched, self._sent_at
        left = sent_at + in_flight_seconds() - time.monotonic() if count > 0 else 0.0
        return (count, left) if left > 0 else (0, 0.0)

    def busy(self) -> bool:
        """Whether a payload of this allocation pickled here may still be loaded
        (:meth:`in_flight`)."""
        return self.in_flight()[0] > 0

    def hand_over(self) -> None:
        """Give the handles of the payloads in flight to something that outlives this
        process (the :data:`hand_over_hooks`: the keeper), for the rest of their bound.

        Called when the allocation is released here and at exit, for memory that outlives
        its exporter (host, cuda-vmm); does nothing when no payload is in flight. A hook's
        failure is said on stderr (this runs from finalizers): those payloads will not load.
        """
        if self.pid != os.getpid() or self.growable or not self.backend.maps:
            return
        count, seconds = self.in_flight()
        if not count:
            return
        for hook in hand_over_hooks:
            try:
                hook(self, count, seconds)
            except Exception as exc:
                print(
                    f"sharedarrays: {count} payload(s) of allocation {self.id} are in flight "
                    f"but their memory could not be handed to the keeper ({exc}); they will "
                    "not load. Keep a view open until they are loaded, or park() the array",
                    file=sys.stderr,
                )
                return
        with self._lock:  # handed over: the keeper answers for them from now on
            self._fetched = self._sent

    # description ------------------------------------------------------------------------
    @property
    def device(self) -> Device:
        """The device the memory lives on."""
        return self.backend.device

    @property
    def released(self) -> bool:
        """Whether this process has already released the allocation."""
        return self._released

    @property
    def parked(self) -> bool:
        """Whether this importer keeps the allocation mapped with no live view."""
        return self.id in _parked and not self._released

    @property
    def leases(self) -> int:
        """How many views and native arrays (a lease each) hold the allocation here."""
        return self._leases

    @property
    def chunks(self) -> tuple[ChunkInfo, ...]:
        """The chunks, in reservation order."""
        return tuple(ChunkInfo(i, c.size, c.fd) for i, c in enumerate(self._chunks))

    @property
    def mappings(self) -> tuple[MappingInfo, ...]:
        """The mappings, in reservation order (one per chunk, back to back)."""
        out = []
        offset = 0
        for i, c in enumerate(self._chunks):
            out.append(MappingInfo(offset, c.size, i, 0, self._access))
            offset += c.size
        return tuple(out)

    @property
    def access(self) -> Access:
        """This process's access to the whole reservation, from the memory's own device."""
        return self._access

    @property
    def access_by_device(self) -> dict[Device, Access]:
        """Every device that may touch the memory in this process, and how: the memory's own
        device, and the peers granted access (:meth:`grant`, ``access=``)."""
        out: dict[Device, Access] = {self.device: self._access}
        for index, mode in sorted(self._peers.items()):
            out[Device(self.device.kind, index)] = mode
        return out

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
        if not self.backend.maps or not self.device.is_cuda:
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

    @property
    def lifetime(self) -> str:
        """Who keeps the memory alive: ``"any holder"`` (host, cuda-vmm: every process that
        maps it or holds a handle) or ``"exporter"`` (cuda-ipc, cuda-pool: only the process
        that made it, which must outlive every importer; it waits for them before it frees
        the memory)."""
        return "exporter" if self.backend.exporter_owned else "any holder"

    @property
    def holders(self) -> tuple[int, ...]:
        """In the exporter of exporter-owned memory: the running processes it was served to
        that have not closed it yet (it is freed only after they have). Empty otherwise."""
        with self._lock:
            alive = {pid for pid in self._holders if running(pid)}
            self._holders = alive
        return tuple(sorted(alive))

    @property
    def served(self) -> tuple[Served, ...]:
        """The most recent processes this process served the handles to (pid, time)."""
        with self._lock:
            return tuple(self._served)

    def record_served(self, pid: int, server: str | None = None, chunks: int = 0) -> None:
        """Note that the handles were sent to process ``pid``, whose own handle server (if
        given) is told when this process releases the allocation; ``chunks``: how many
        chunks it may map now (shrinking below that is refused while it runs)."""
        with self._lock:
            self._fetched += 1
            self._served.append(Served(pid, time.time()))
            if server:
                self._servers.add(server)
            if self.backend.exporter_owned and self.origin.created_here and pid != os.getpid():
                self._holders.add(pid)  # (this process asking its own server imports nothing)
            if chunks > self._served_chunks.get(pid, 0):
                self._served_chunks[pid] = chunks

    def served_servers(self) -> list[str]:
        """Handle servers of the processes this one served (told on release)."""
        with self._lock:
            return sorted(self._servers)

    # growth -----------------------------------------------------------------------------
    @property
    def growable(self) -> bool:
        """Whether the allocation was made with a ``capacity`` (and so may grow and shrink)."""
        return self._growable

    def reach(self, exclude: Lease | None = None) -> int:
        """One past the highest byte any lease here (but ``exclude``) may touch."""
        with self._lock:
            ends = dict(self._ends)
        if exclude is not None and exclude.allocation is self:
            left = ends.get(exclude.end, 0) - 1
            if left > 0:
                ends[exclude.end] = left
            else:
                ends.pop(exclude.end, None)
        return max(ends, default=0)

    def grow(self, nbytes: int) -> None:
        """Map new chunks at the end so that at least ``nbytes`` are mapped (the exporter).

        Chunk sizes follow :func:`growth_sizes`. Existing data and addresses do not change,
        unless the chunks do not fit the capacity: then the allocation first *moves* to a
        new reservation of at least twice the capacity, mapping the same chunks there (no
        data is copied); native arrays made before keep the old reservation mapped while
        they live.
        """
        with self.growth_lock:
            sizes = growth_sizes(
                self.size, nbytes, self.backend.granularity, self.capacity, self._chunk_bytes
            )
            if sizes:
                self.backend.check_memory(sum(sizes))
                self._add_chunks(sizes, self.backend.create_chunk, 0, seal=True)

    def extend(self, sizes: list[int], fds: list[int], capacity: int = 0) -> None:
        """Map chunks the exporter added (an importer), at the end; takes ownership of
        ``fds``. ``capacity``: the exporter's capacity, reserved if the chunks need a move."""
        pending = list(fds)
        try:
            if len(sizes) != len(pending):
                raise PayloadError(f"{len(sizes)} chunk sizes but {len(pending)} handles")

            def import_next(size: int) -> Chunk:
                return self.backend.import_chunk(pending.pop(0), size)

            with self.growth_lock:
                self._add_chunks(sizes, import_next, capacity)
        finally:
            for fd in pending:
                os.close(fd)

    def shrink(self, nbytes: int, exclude: Lease | None = None) -> None:
        """Unmap and release the chunks that lie wholly past ``nbytes`` (the exporter).

        Raises
        ------
        ResizeRefused
            A lease here (but ``exclude``) reaches into those chunks, or a running process
            was served them.
        """
        with self.growth_lock:
            target = round_up(max(nbytes, 1), self.backend.granularity)
            keep, kept = 0, 0
            while keep < len(self._chunks) and kept < target:
                kept += self._chunks[keep].size
                keep += 1
            if keep == len(self._chunks):
                return
            reach = self.reach(exclude)
            if reach > kept:
                raise ResizeRefused(
                    f"cannot unmap bytes {kept}-{self.size} of allocation {self.id}: a view or "
                    f"native array in this process reaches byte {reach}. Close those views "
                    "(a.close()) and drop those native arrays first"
                )
            with self._lock:
                holders = sorted(
                    pid
                    for pid, n in self._served_chunks.items()
                    if n > keep and pid != os.getpid() and running(pid)
                )
            if holders:
                raise ResizeRefused(
                    f"cannot unmap chunks {keep}-{len(self._chunks) - 1} of allocation "
                    f"{self.id}: process{'es' if len(holders) > 1 else ''} "
                    f"{', '.join(map(str, holders))} imported them and may still map them "
                    "(an importer keeps its mapping until it exits). Shrink after they exited, "
                    "or leave the array at its length"
                )
            dropped = self._chunks[keep:]
            start = kept
            self.size = kept  # new views and payloads stop here before anything is unmapped
            self._chunks = self._chunks[:keep]
            self.generation += 1
            mapped = []
            for c in dropped:
                mapped.append((start, c.size))
                start += c.size
            _teardown(self.backend, self.address, self.capacity, mapped, dropped, free=False)

    def _add_chunks(
        self,
        sizes: list[int],
        make_chunk: Callable[[int], Chunk],
        capacity: int,
        seal: bool = False,
    ) -> None:
        if len(self._chunks) + len(sizes) > MAX_CHUNKS:
            raise ValueError(
                f"allocation {self.id} would have more than {MAX_CHUNKS} chunks; "
                "pass a larger chunk_bytes"
            )
        total = self.size + sum(sizes)
        if total > self.capacity:
            self._move(max(total, 2 * self.capacity, capacity))
        backend = cast(MappingBackend, self.backend)
        try:
            for size in sizes:
                address = self.address + self.size
                chunk = make_chunk(size)
                mapped: list[tuple[int, int]] = []
                try:
                    backend.map(address, size, chunk, 0)
                    mapped.append((self.size, size))
                    backend.set_access(address, size, self._access, self._peers)
                    if seal:  # made here: sealed like the first chunks
                        backend.seal(chunk, self.export_readonly)
                except BaseException:
                    _teardown(backend, self.address, 0, mapped, [chunk], free=False)
                    raise
                self._chunks.append(chunk)
                self.size += size  # only now may views reach it: nobody sees a hole
        finally:
            self.generation += 1

    def _move(self, capacity: int) -> None:
        """Map the chunks into a new, larger reservation and retire the old one."""
        if self.write_sealed:
            raise ResizeRefused(
                f"allocation {self.id} is readonly=True: its chunks are sealed against every "
                f"new writable mapping, so it cannot move past its capacity of {self.capacity} "
                "bytes (that maps them again). Make it with a larger capacity="
            )
        backend = cast(MappingBackend, self.backend)
        capacity = round_up(capacity, backend.granularity)
        address = backend.reserve(capacity)
        mapped: list[tuple[int, int]] = []
        try:
            offset = 0
            for c in self._chunks:
                backend.map(address + offset, c.size, c, 0)
                mapped.append((offset, c.size))
                offset += c.size
            backend.set_access(address, offset, self._access, self._peers)
        except BaseException:
            _teardown(backend, address, capacity, mapped, [])
            raise
        old = self._reservation
        old.retired = mapped  # the same layout at the old address
        self._reservation = _Reservation(backend, address, capacity)
        self.address = address
        self.capacity = capacity
        self.generation += 1
        del old  # freed now unless a native array still uses its addresses

    def chunk_fds(self) -> list[int]:
        """The exported fds of the chunks, owned by this allocation (do not close them).

        On a pointer backend: the fds an importer needs besides :meth:`exports` (cuda-pool:
        the pool's; cuda-ipc: none)."""
        return [c.fd for c in self._chunks if c.fd >= 0 or self.backend.maps]

    def exports(self) -> tuple[bytes, ...]:
        """A pointer backend's portable chunk handles (empty on a mapping backend)."""
        return () if self.backend.maps else tuple(c.export for c in self._chunks)

    def handles_for_importers(self) -> tuple[list[int], list[int]]:
        """The fds to hand to another process, and those of them the caller must close.

        The chunks' own fds, except for a read-only export on a memory system that can
        reopen a handle read-only (the host backend): then new ``O_RDONLY`` fds. (That alone
        would not stop an importer, which can open such an fd again read-write through
        ``/proc``; what does is the seal against new writes, see :meth:`create`.)
        """
        fds = self.chunk_fds()
        if not self.export_readonly:
            return fds, []
        reopened: list[int] = []
        try:
            for fd in fds:
                ro = self.backend.reopen_readonly(fd)
                if ro is None:
                    return fds, reopened
                reopened.append(ro)
        except BaseException:
            for fd in reopened:
                os.close(fd)
            raise
        return reopened, reopened

    def chunk_sizes(self) -> list[int]:
        """The chunk sizes, in reservation order."""
        return [c.size for c in self._chunks]

    def describe(self) -> str:
        """A multi-line table of the reservation, its mappings and their chunks."""
        o = self.origin
        where = "created here" if o.created_here else f"imported from pid {o.pid}"
        stamp = time.strftime("%H:%M:%S", time.localtime(o.time))
        lines = [
            f"allocation {self.id} on {self.device} ({self.backend.name}), {where} at {stamp}",
            f"memory kept alive by: {self.lifetime}"
            + (
                " (the exporter must outlive every importer)" if self.backend.exporter_owned else ""
            ),
            f"reservation {self.address:#x}-{self.address + self.capacity:#x} "
            f"({_fmt(self.capacity)}, {_fmt(self.size)} mapped)",
            f"{'mapping':>8} {'offset':>12} {'size':>10} {'chunk':>6} {'fd':>4} access",
        ]
        for m in self.mappings:
            fd = self._chunks[m.chunk].fd
            lines.append(
                f"{m.chunk:>8} {m.offset:>#12x} {_fmt(m.size):>10} {m.chunk:>6} {fd:>4} {m.access}"
            )
        served = self.served
        if served:
            pids = sorted({s.pid for s in served})
            lines.append(f"served handles to pids {', '.join(map(str, pids))}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        where = "here" if self.origin.created_here else f"from pid {self.origin.pid}"
        n = len(self._chunks)
        return (
            f"<Allocation {self.id[:12]} {self.backend.name} {self.device} {_fmt(self.size)} "
            f"in {n} chunk{'s' if n != 1 else ''}, {where}>"
        )


def _fmt(n: int) -> str:
    """Bytes as a short human-readable size (binary units)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


_slabs: dict[tuple[str, Device], tuple[Lease, int]] = {}
_slabs_lock = threading.Lock()
_inherited: list[object] = []
"""In a forked child: what it inherited and never releases (its parent's slabs and parked
mappings), so that nothing runs on them here."""


def _reset_in_child() -> None:
    """A forked child starts with its own per-process state.

    It gets new locks (another thread of the parent may have held them), no slab (its small
    arrays never share its parent's or a sibling's free space), no parked mappings and no
    draining allocations. The host allocations it inherited mapped, with the views that use
    them, become its own imports from the parent (it may hand them on and serve them); CUDA
    and growable ones stay the parent's (CUDA cannot be used after fork; a growable array's
    chunks are served by its exporter).
    """
    global _registry_lock, _slabs_lock
    _registry_lock = threading.RLock()
    _slabs_lock = threading.Lock()
    _inherited.extend(_slabs.values())
    _slabs.clear()
    for alloc in _parked.values():
        _registry.pop(alloc.id, None)
        _inherited.append(alloc)
    _parked.clear()
    _draining.clear()
    for alloc in _registry.values():
        if not alloc.device.is_cuda and not alloc.growable:
            alloc._adopt()


at_fork("memory", after_in_child=_reset_in_child)


def pack_into_slab(backend: Backend, nbytes: int) -> tuple[Allocation, int]:
    """Carve ``nbytes`` out of this process's current slab for ``backend``'s device.

    A slab is an ordinary allocation of :data:`SLAB_BYTES` that small arrays are placed in
    back to back (a bump allocator: space is never reused, so a region another process still
    maps never changes owner). The current slab stays mapped while it has room; each slab is
    released, like any allocation, once no array in it is alive anywhere in this process.

    Returns
    -------
    allocation, offset
        The slab and the byte offset of the new array in it.
    """
    need = round_up(max(nbytes, 1), PACK_ALIGN)
    size = round_up(SLAB_BYTES, backend.granularity)
    if need > size:
        raise ValueError(f"an array of {nbytes} bytes does not fit a {size}-byte slab; pack=False")
    key = (backend.name, backend.device)
    with _slabs_lock:
        current = _slabs.get(key)
        if current is None or current[1] + need > current[0].allocation.size:
            lease = Allocation.create(backend, size).lease()
            offset = 0
        else:
            lease, offset = current
        _slabs[key] = (lease, offset + need)  # the previous slab's lease goes here, if replaced
        return lease.allocation, offset
