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
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from .backends import Access, Backend, Chunk, round_up
from .device import Device
from .errors import ClosedArrayError, PayloadError
from .process import running

__all__ = [
    "Allocation",
    "MappingInfo",
    "ChunkInfo",
    "Origin",
    "Served",
    "DEFAULT_CHUNK_BYTES",
    "chunk_sizes",
    "Lease",
    "PACK_BYTES",
    "SLAB_BYTES",
    "pack_into_slab",
    "live_allocations",
    "parked_allocations",
    "drop_parked",
    "keep_imports",
    "lookup",
]

DEFAULT_CHUNK_BYTES = 2 << 30
"""Largest chunk made by default (2 GiB). Larger allocations are several chunks, mapped
back to back in one reservation. Override per array with ``chunk_bytes=`` or for the process
with the ``SHAREDARRAYS_CHUNK_BYTES`` environment variable."""

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
    value = os.environ.get("SHAREDARRAYS_CHUNK_BYTES")
    if not value:
        return DEFAULT_CHUNK_BYTES
    try:
        n = int(value)
    except ValueError:
        raise ValueError(
            f"SHAREDARRAYS_CHUNK_BYTES={value!r} is not an integer number of bytes"
        ) from None
    if n <= 0:
        raise ValueError(f"SHAREDARRAYS_CHUNK_BYTES must be positive, got {n}")
    return n


def chunk_sizes(nbytes: int, granularity: int, chunk_bytes: int | None = None) -> list[int]:
    """Split an allocation of ``nbytes`` into chunk sizes.

    The allocation is rounded up to the granularity (at least one granule, so zero-size
    arrays have real memory too) and cut into chunks of at most ``chunk_bytes`` (itself
    rounded up to the granularity); only the last chunk may be smaller.

    Parameters
    ----------
    nbytes : int
        Bytes the array needs.
    granularity : int
        The backend's granularity.
    chunk_bytes : int, optional
        Largest chunk; default :data:`DEFAULT_CHUNK_BYTES`.
    """
    if chunk_bytes is None:
        chunk_bytes = _default_chunk_bytes()
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    total = round_up(max(nbytes, 1), granularity)
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

release_hooks: list[Callable[[Allocation], None]] = []
"""Called with each allocation this process releases (the transport layer tells the
processes it served, so that they drop their parked mappings too)."""


def keep_imports() -> int:
    """How many imported allocations with no live view this process keeps mapped.

    A worker that receives the same array again then finds it mapped (a *warm* handoff: no
    connection, no import, no map). Set by ``SHAREDARRAYS_KEEP_IMPORTS`` (default 64; 0 turns
    parking off). A parked mapping is dropped as soon as its exporter releases the allocation
    or exits, and the oldest is dropped when the limit is reached.
    """
    value = os.environ.get("SHAREDARRAYS_KEEP_IMPORTS", "64")
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"SHAREDARRAYS_KEEP_IMPORTS={value!r} is not an integer") from None


def lookup(alloc_id: str) -> Allocation | None:
    """Return this process's mapped allocation with id ``alloc_id``, if any."""
    return _registry.get(alloc_id)


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
    for a in victims:
        a.release()
    return len(victims)


def _teardown(
    backend: Backend,
    address: int,
    size: int,
    mapped: list[tuple[int, int]],
    chunks: list[Chunk],
) -> None:
    """Release everything an allocation holds, in the order the driver needs."""
    errors: list[BaseException] = []
    if mapped:
        try:
            backend.synchronize()
        except BaseException as e:  # keep going: fds must be closed regardless
            errors.append(e)
    for offset, length in mapped:
        try:
            backend.unmap(address + offset, length)
        except BaseException as e:
            errors.append(e)
    if address:
        try:
            backend.free_reservation(address, size)
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
    """One user's hold on an allocation: each view and the native arrays built over it.

    When the last lease of an allocation goes away, the allocation is released (in the
    exporter) or parked (in an importer, see :func:`keep_imports`).
    """

    __slots__ = ("allocation",)

    def __init__(self, allocation: Allocation) -> None:
        self.allocation = allocation

    def __del__(self) -> None:
        try:
            self.allocation._unlease()
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
        Start of this process's reservation.
    size : int
        Bytes reserved (and mapped): the sum of the chunk sizes.
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
    ) -> None:
        self.id = alloc_id
        self.secret = secret
        self.backend = backend
        self.address = address
        self.size = sum(c.size for c in chunks)
        self._chunks = chunks
        self._access: Access = access
        self.origin = origin
        self._served: deque[Served] = deque(maxlen=_SERVED_HISTORY)
        self._servers: set[str] = set()
        self._lock = threading.Lock()
        self._leases = 0
        self._released = False
        self._orphaned = False
        self.pid = os.getpid()  # a forked child inherits the object but is not this process
        self.allow_pids: frozenset[int] | None = None
        """Processes allowed to import it (besides this one); ``None``: any of this user."""
        self.export_readonly = False
        """Whether importers get read-only mappings (payloads say ``readonly``)."""
        with _registry_lock:
            _registry[alloc_id] = self

    # construction -----------------------------------------------------------------------
    @classmethod
    def create(cls, backend: Backend, nbytes: int, chunk_bytes: int | None = None) -> Allocation:
        """Make a new allocation of at least ``nbytes`` bytes in this process (the exporter).

        Parameters
        ----------
        backend : Backend
            Where the memory lives.
        nbytes : int
            Bytes needed; rounded up to the backend's granularity.
        chunk_bytes : int, optional
            Largest chunk (see :func:`chunk_sizes`).
        """
        sizes = chunk_sizes(nbytes, backend.granularity, chunk_bytes)
        return cls._build(
            backend,
            secrets.token_hex(16),
            secrets.token_bytes(32),
            sizes,
            backend.create_chunk,
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
    ) -> Allocation:
        """Map an allocation from its chunks' handles (an importer).

        Takes ownership of every fd in ``fds``, on success and on failure. If this process
        already maps ``alloc_id``, the fds are closed and the existing allocation returned.
        """
        if len(sizes) != len(fds):
            for fd in fds:
                os.close(fd)
            raise PayloadError(f"{len(sizes)} chunk sizes but {len(fds)} handles")
        with _registry_lock:
            existing = _registry.get(alloc_id)
            if existing is not None:
                for fd in fds:
                    os.close(fd)
                return existing
            pending = list(fds)

            def import_next(size: int) -> Chunk:
                return backend.import_chunk(pending.pop(0), size)

            try:
                return cls._build(
                    backend,
                    alloc_id,
                    secret,
                    sizes,
                    import_next,
                    access,
                    Origin(False, source_pid, time.time()),
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
    ) -> Allocation:
        total = sum(sizes)
        chunks: list[Chunk] = []
        mapped: list[tuple[int, int]] = []
        address = 0
        try:
            address = backend.reserve(total)
            offset = 0
            for size in sizes:
                chunk = make_chunk(size)
                chunks.append(chunk)
                backend.map(address + offset, size, chunk, 0)
                mapped.append((offset, size))
                offset += size
            backend.set_access(address, total, access)
        except BaseException:
            _teardown(backend, address, total, mapped, chunks)
            raise
        return cls(backend, alloc_id, secret, address, chunks, access, origin)

    # lifetime ---------------------------------------------------------------------------
    def lease(self) -> Lease:
        """A new hold on this allocation (each view takes one). Unparks it if parked."""
        with self._lock:
            if self._released:
                raise ClosedArrayError(f"allocation {self.id} was released in this process")
            self._leases += 1
            parked = self._leases == 1 and not self.origin.created_here
        if parked:
            with _registry_lock:
                _parked.pop(self.id, None)
        return Lease(self)

    def _unlease(self) -> None:
        with self._lock:
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
            unused = self._leases == 0
        if unused:
            self.release()

    def release(self) -> None:
        """Unmap and close everything this process holds of the allocation, now.

        Called when the last lease goes (or a parked mapping is dropped). Views still holding
        a lease must not exist: use :meth:`SharedDeviceArray.close` on views instead.
        Idempotent.
        """
        with self._lock:
            if self._released:
                return
            self._released = True
        with _registry_lock:
            if _registry.get(self.id) is self:
                del _registry[self.id]
            _parked.pop(self.id, None)
        mapped = [(m.offset, m.size) for m in self.mappings]
        try:
            _teardown(self.backend, self.address, self.size, mapped, self._chunks)
        finally:
            for hook in release_hooks:
                try:
                    hook(self)
                except Exception:
                    continue

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
        """How many views (and native arrays through them) hold the allocation here."""
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
        """This process's access to the whole reservation."""
        return self._access

    @property
    def served(self) -> tuple[Served, ...]:
        """The most recent processes this process served the handles to (pid, time)."""
        with self._lock:
            return tuple(self._served)

    def record_served(self, pid: int, server: str | None = None) -> None:
        """Note that the handles were sent to process ``pid``, whose own handle server (if
        given) is told when this process releases the allocation."""
        with self._lock:
            self._served.append(Served(pid, time.time()))
            if server:
                self._servers.add(server)

    def served_servers(self) -> list[str]:
        """Handle servers of the processes this one served (told on release)."""
        with self._lock:
            return sorted(self._servers)

    def chunk_fds(self) -> list[int]:
        """The exported fds of the chunks, owned by this allocation (do not close them)."""
        return [c.fd for c in self._chunks]

    def handles_for_importers(self) -> tuple[list[int], list[int]]:
        """The fds to hand to another process, and those of them the caller must close.

        The chunks' own fds, except for a read-only export on a memory system that can
        reopen a handle read-only (the host backend): then new read-only fds, so that the
        importer cannot map the memory writable even if it tried.
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
            f"reservation {self.address:#x}-{self.address + self.size:#x} ({_fmt(self.size)})",
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
