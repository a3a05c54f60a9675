"""What an allocation tells of itself (:class:`AllocationRecords`, a base of ``Allocation``)
and the read-only records the widgets and the CLI show."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sharedarrays.backends import Access, Backend, Chunk
from sharedarrays.backends.device import Device
from sharedarrays.memory.inflight import InFlight, Served
from sharedarrays.memory.reservation import Reservation, back_to_back, close_fds
from sharedarrays.memory.takeable import TakeTable
from sharedarrays.process import STATE
from sharedarrays.protocol.payload import MAX_TAKEN, Takeable


@dataclass(frozen=True)
class Origin:
    """Where an allocation here came from: made here (exporter) or imported from ``pid``, when."""

    created_here: bool
    pid: int
    time: float

    @property
    def role(self) -> str:
        """This process's part, e.g. ``"importer of pid 123's allocation"``."""
        if self.created_here:
            return "exporter: this process"
        return f"importer of pid {self.pid}'s allocation"


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of an allocation, as seen from this process."""

    index: int
    size: int
    fd: int


@dataclass(frozen=True)
class MappingInfo:
    """One mapping: ``size`` bytes of chunk ``chunk`` at ``offset`` in the reservation."""

    offset: int
    size: int
    chunk: int
    chunk_offset: int
    access: Access


use_clock = time.monotonic_ns  # the clock of ``Allocation.last_used`` (a C call: no frame)


def format_bytes(n: int) -> str:
    """Bytes as a short human-readable size (binary units)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"


class AllocationRecords:
    """The fields of an allocation (shared by the bases of ``Allocation``) and what it shows."""

    def __init__(
        self,
        backend: Backend,
        alloc_id: str,
        secret: bytes,
        origin: Origin,
        address: int,
        chunks: list[Chunk],
        access: Access,
        capacity: int | None = None,
        peers: Mapping[int, Access] | None = None,
    ) -> None:
        self.id = alloc_id
        self.secret = secret
        self.backend = backend
        self.device: Device = backend.device  # the device the memory lives on
        # who keeps the memory alive: "exporter" (cuda-ipc, cuda-pool) or "any holder"
        self.lifetime = "exporter" if backend.exporter_owned else "any holder"
        self.origin = origin
        self.address = address
        self.size = sum(c.size for c in chunks)
        self.capacity = self.size if capacity is None else capacity
        self.used = self.size
        self.generation = 0
        self._chunks = chunks
        self.access: Access = access
        self._peers: dict[int, Access] = dict(peers or {})
        self._reservation = Reservation(backend, address, self.capacity)
        self.growable = capacity is not None  # (made with a capacity: may grow and shrink)
        self._chunk_bytes: int | None = None
        self._ends: Counter[int] = Counter()  # (growable) leases by end: bounds shrinking
        self.growth_lock = threading.RLock()  # held while chunks are added, removed or served
        self._lock = threading.Lock()
        self._leases = 0
        self.released = False  # (read-only) this process has released it
        self._release_when_idle = False  # a release asked for waits for a native base's end
        self._orphaned = False
        self.kept_lease: Any = None  # (importer, read-only) a parked one's Lease for its next view
        self.last_used = use_clock()  # when last leased or loaded here
        self.pid = os.getpid()  # a forked child inherits the object but is not this process
        self.flight = InFlight()
        self.allow_pids: frozenset[int] | None = None
        self.export_readonly = False
        self.write_sealed = False
        self.source_server: str | None = None  # (imported growable) its exporter's server
        self.derives_natives = capacity is None and hasattr(backend, "native_view")
        self.native_device: int | None = None  # device of native arrays read as a peer
        self._native_base: tuple[int | None, Any] | None = None  # (device, native array)
        # native arrays by layout (offset, shape, strides): (device, dtype, readonly, array)
        self._natives: dict[tuple[Any, ...], tuple[Any, Any, bool, Any]] = {}
        # reuse (memory/cache.py): block token, reused, drain start, pool server, DONE asked
        self.block: bytes | None = None
        self.reused = False
        self.released_at = 0.0
        self.pool_server: str | None = None
        self.done_asked = False
        with STATE.memory.lock:
            STATE.memory.registry[alloc_id] = self

    @property
    def chunks(self) -> tuple[ChunkInfo, ...]:
        """The chunks, in reservation order."""
        return tuple(ChunkInfo(i, c.size, c.fd) for i, c in enumerate(self._chunks))

    @property
    def mappings(self) -> tuple[MappingInfo, ...]:
        """The mappings, in reservation order (one per chunk, back to back)."""
        layout = enumerate(back_to_back(self._chunks))
        return tuple(MappingInfo(offset, size, i, 0, self.access) for i, (offset, size) in layout)

    @property
    def access_by_device(self) -> dict[Device, Access]:
        """Every device that may touch the memory here (its own and peers), and how."""
        peers = {Device(self.device.kind, i): mode for i, mode in sorted(self._peers.items())}
        return {self.device: self.access, **peers}

    @property
    def holders(self) -> tuple[int, ...]:
        """(Exporter of exporter-owned memory) running processes that have not closed it."""
        return self.flight.holders()

    @property
    def served(self) -> tuple[Served, ...]:
        """The most recent processes this process served the handles to (pid, time)."""
        return self.flight.served()

    def record_served(self, pid: int, server: str | None = None, chunks: int = 0) -> None:
        """Note that the handles (``chunks`` of them) were sent to process ``pid``."""
        holder = self.backend.exporter_owned and self.origin.created_here and pid != os.getpid()
        self.flight.record_served(pid, server, chunks, holder)

    def served_servers(self) -> list[str]:
        """Handle servers of the processes this one served (told on release)."""
        return self.flight.served_servers()

    def chunk_fds(self) -> list[int]:
        """The chunks' exported fds, owned by this allocation (do not close them)."""
        return [c.fd for c in self._chunks if c.fd >= 0 or self.backend.maps]

    def takeable_fds(self) -> Takeable | None:
        """Where an importer may take the chunk fds from this process itself (its slot in the
        take table, written once); ``None`` where it must ask: a backend whose fds are not
        taken, a read-only or allow-listed export (the server checks those), growable memory
        (its server counts the chunks served), too many chunks."""
        if (
            not self.backend.maps
            or not getattr(self.backend, "fds_taken", False)
            or self.export_readonly
            or self.allow_pids is not None
            or self.growable
            or len(self._chunks) > MAX_TAKEN
        ):
            return None
        table: TakeTable = STATE.memory.takeable
        return table.add(self.id, self.secret, self.chunk_fds())

    def exports(self) -> tuple[bytes, ...]:
        """A pointer backend's portable chunk handles (empty on a mapping backend)."""
        return () if self.backend.maps else tuple(c.export for c in self._chunks)

    def exports_for(self, pid: int) -> tuple[bytes, ...]:
        """:meth:`exports` for process ``pid``, admitting it first where the backend can."""
        exports = self.exports()
        admit = getattr(self.backend, "admit", None)
        if admit is not None and exports:
            for chunk in self._chunks:
                admit(chunk, pid)
        return exports

    def handles_for_importers(self) -> tuple[list[int], list[int]]:
        """The fds to hand to another process and those the caller must close (new
        ``O_RDONLY`` ones for a read-only export where the backend can: host)."""
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
            close_fds(reopened)
            raise
        return reopened, reopened

    def chunk_sizes(self) -> list[int]:
        """The chunk sizes, in reservation order."""
        return [c.size for c in self._chunks]

    def has_chunk_sizes(self, sizes: tuple[int, ...]) -> bool:
        """Whether the chunks are ``sizes``, in order (checked on every warm load)."""
        chunks = self._chunks
        if len(chunks) != len(sizes):
            return False
        for i in range(len(sizes)):  # noqa: SIM110 - all() would make a generator per load
            if chunks[i].size != sizes[i]:
                return False
        return True

    def describe(self) -> str:
        """A multi-line table of the reservation, its mappings and their chunks."""
        o = self.origin
        stamp = time.strftime("%H:%M:%S", time.localtime(o.time))
        owned = " (the exporter must outlive every importer)" if self.backend.exporter_owned else ""
        lines = [
            f"allocation {self.id} on {self.device} ({self.backend.name}), {o.role}, since {stamp}",
            f"memory kept alive by: {self.lifetime}{owned}",
            f"reservation {self.address:#x}-{self.address + self.capacity:#x} "
            f"({format_bytes(self.capacity)}, {format_bytes(self.size)} mapped)",
            f"{'mapping':>8} {'offset':>12} {'size':>10} {'chunk':>6} {'fd':>4} access",
        ]
        for m, c in zip(self.mappings, self._chunks):
            size = format_bytes(m.size)
            lines.append(
                f"{m.chunk:>8} {m.offset:>#12x} {size:>10} {m.chunk:>6} {c.fd:>4} {m.access}"
            )
        if self.served:
            pids = sorted({s.pid for s in self.served})
            lines.append(f"served handles to pids {', '.join(map(str, pids))}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        where = "here" if self.origin.created_here else f"from pid {self.origin.pid}"
        n, size = len(self._chunks), format_bytes(self.size)
        return (
            f"<Allocation {self.id[:12]} {self.backend.name} {self.device} {size} "
            f"in {n} chunk{'s' if n != 1 else ''}, {where}>"
        )
