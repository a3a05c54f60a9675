"""Allocations: one array's memory, made by its *exporter*, mapped at most once per process
(``STATE.memory.registry``) and released here when its last lease goes."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from itertools import accumulate
from typing import cast

from sharedarrays.backends import Access, Backend, Chunk, MappingBackend, round_up
from sharedarrays.errors import HandleUnavailable, OutOfMemory, PayloadError
from sharedarrays.memory.cache import cache_bytes, settle_draining
from sharedarrays.memory.growth import Growth, chunk_sizes
from sharedarrays.memory.inflight import InFlight
from sharedarrays.memory.info import Origin
from sharedarrays.memory.lease import Leasing
from sharedarrays.memory.reservation import back_to_back, close_fds, teardown
from sharedarrays.process import STATE


def _fresh() -> tuple[str, bytes, Origin]:
    """A new allocation's id, secret and origin (this process, now)."""
    return secrets.token_hex(16), secrets.token_bytes(32), Origin(True, os.getpid(), time.time())


class Allocation(Leasing, Growth):
    """A reservation with its chunks mapped back to back: the memory of one array, made by
    :meth:`create` (exporter) or :meth:`import_` (importer); views hold leases on it.

    Attributes
    ----------
    id : str
        32 hex digits, the same in every process that maps it.
    device, access : Device, str
        The memory's device, and this process's access from it ("rw", "r").
    address, size, capacity : int
        Start of this process's reservation, bytes mapped, bytes reserved (more if growable).
    used, generation : int
        Bytes of a growable array (else ``size``); changes of chunks or address here.
    allow_pids : frozenset of int or None
        Processes allowed to import it (besides this one); ``None``: any of this user.
    export_readonly, write_sealed : bool
        Importers map it read-only; the kernel forbids every new write (host backend).
    """

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
        """Make a new allocation of at least ``nbytes`` bytes here (the exporter): chunks of
        at most ``chunk_bytes``; a ``capacity`` makes it *growable*; ``peers`` get access
        (:meth:`grant`); ``readonly`` for every other process, enforced where the backend can."""
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
        cacheable = backend.maps and capacity is None and not peers and not readonly
        cacheable = cacheable and sum(sizes) <= cache_bytes()
        old = STATE.memory.cache.take(backend.name, backend.device, sizes) if cacheable else None
        if old is not None:  # a new allocation on cached memory of these sizes
            alloc = cls(backend, *_fresh(), old.address, old._chunks, "rw")
            alloc.block, alloc.used, alloc.reused = old.block, nbytes, True
            alloc.flight.servers.update(old.flight.servers)  # (told when it is freed at last)
            alloc.flight.reporting.update(old.flight.reporting)
            return alloc
        for last_try in (False, True):  # (out of memory or fds: empty the cache, again)
            try:
                backend.check_memory(sum(sizes))
                made = (backend, *_fresh(), sizes, backend.create_chunk)
                alloc = cls._build(*made, "rw", capacity, peers, seal=True, readonly=readonly)
                break
            except (OutOfMemory, HandleUnavailable):
                if last_try or not STATE.memory.cache.trim():
                    raise
        alloc._chunk_bytes = chunk_bytes
        alloc.used = nbytes
        if cacheable:
            alloc.block = secrets.token_bytes(32)  # names the memory across its reuses
        return alloc

    @classmethod
    def borrow(cls, backend: Backend, chunk: Chunk) -> Allocation:
        """Make an allocation of memory borrowed from another library (``borrow_chunk``)."""
        if backend.maps or not backend.exporter_owned:
            raise ValueError(f"memory cannot be borrowed into a {backend.name} allocation")
        return cls._build(backend, *_fresh(), [chunk.size], lambda size: chunk, "rw")

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
        """Map an allocation from its chunks' ``fds`` (or a pointer backend's ``exports``), an
        importer, taking the fds; or return the one mapped here already."""
        bad = (
            len(sizes) != len(fds) or bool(exports)
            if backend.maps
            else len(sizes) != 1 or len(exports) != 1 or len(fds) > 1
        )
        if bad:
            close_fds(fds)
            raise PayloadError(
                f"{len(sizes)} chunk sizes but {len(fds)} handles and {len(exports)} exports"
            )
        with STATE.memory.lock:
            existing: Allocation | None = STATE.memory.registry.get(alloc_id)
            if existing is not None:
                close_fds(fds)
                return existing
            pending = list(fds)

            def import_next(size: int) -> Chunk:
                fd = pending.pop(0) if pending else -1
                return backend.import_chunk(fd, size, exports[0] if exports else b"")

            origin = Origin(False, source_pid, time.time())
            capacity = None if capacity is None else max(capacity, sum(sizes))
            try:
                return cls._build(
                    backend, alloc_id, secret, origin, sizes, import_next, access, capacity, peers
                )
            finally:
                close_fds(pending)

    @classmethod
    def _build(
        cls,
        backend: Backend,
        alloc_id: str,
        secret: bytes,
        origin: Origin,
        sizes: list[int],
        make_chunk: Callable[[int], Chunk],
        access: Access,
        capacity: int | None = None,
        peers: Mapping[int, Access] | None = None,
        seal: bool = False,
        readonly: bool = False,
    ) -> Allocation:
        # make, map and (with seal) seal the chunks; everything is released on failure
        if peers and not backend.maps:
            raise ValueError(
                f"access for other devices needs backend='cuda-vmm' ({backend.name} memory "
                "cannot be granted to peers here)"
            )
        mapper = cast(MappingBackend, backend)
        total = sum(sizes)
        reserved = total if capacity is None else round_up(capacity, backend.granularity)
        chunks: list[Chunk] = []
        mapped: list[tuple[int, int]] = []
        address = 0
        try:
            if not backend.maps:  # one chunk, which comes with its own address
                chunks.append(make_chunk(total))
                address, capacity = chunks[0].address, None
            else:
                address = mapper.reserve(reserved)
                for offset, size in zip(accumulate(sizes, initial=0), sizes):
                    chunks.append(make_chunk(size))
                    mapper.map(address + offset, size, chunks[-1], 0)
                    mapped.append((offset, size))
                mapper.set_access(address, total, access, peers)
            write_sealed = seal and all([backend.seal(c, readonly) for c in chunks])
        except BaseException:
            teardown(backend, address, reserved, mapped, chunks)
            raise
        alloc = cls(backend, alloc_id, secret, origin, address, chunks, access, capacity, peers)
        alloc.export_readonly, alloc.write_sealed = readonly, write_sealed and readonly
        return alloc

    def orphan(self, now: bool = True) -> None:
        """The source released it: release it here too, never parked (``now=False``: later)."""
        with self._lock:
            self._orphaned = True
        if now:
            self._let_kept_go()
            self.release()  # (in use: its last lease releases it)

    def release(self) -> bool:
        """Unmap and close all this process holds unless a view uses it; whether it did. It
        *drains* (is still served) while others may need it: holders of exporter-owned memory,
        a growable array's payload in flight, a reusable block's importers not ``DONE``."""
        with self._lock:
            if self.released:
                return False
            idle = not self._view_leases()
            kept, base = self.kept_lease, self._native_base
            if idle and (kept is not None or base is not None):
                # let them go: their leases' ends come back here through _unlease
                self.kept_lease = None
                self._native_base = None
                last, self._natives = self._natives, {}
                self._release_when_idle = True
            elif self._leases:
                return False
            else:
                self.released = True
                STATE.memory.takeable.clear(self.id)  # (before any fd of it may close)
        if kept is not None or base is not None:
            del kept, base, last
            if not self.released:  # native arrays live on: not parked
                with STATE.memory.lock:
                    STATE.memory.parked.pop(self.id, None)
            return self.released
        cacheable = self.cacheable()
        if not self.backend.exporter_owned and not cacheable:
            # (still registered: a load asks here until the keeper has the handles)
            self.hand_over()
        cached = False
        try:
            with self.growth_lock:
                with STATE.memory.lock:
                    if STATE.memory.registry.get(self.id) is self:
                        del STATE.memory.registry[self.id]
                        STATE.memory.unregistered.notify_all()  # (a load here waits for this)
                    STATE.memory.parked.pop(self.id, None)
                    if self.block is not None and STATE.memory.blocks.get(self.block) is self:
                        del STATE.memory.blocks[self.block]
                    drain = (
                        (self.backend.exporter_owned and (bool(self.holders) or self.busy()))
                        or (self.growable and self.busy())
                        or (cacheable and self.flight.undone()[0] > 0)
                    )
                    if drain:
                        STATE.memory.draining[self.id] = self
                        self.released_at = time.monotonic()
                cached = cacheable and (drain or STATE.memory.cache.put(self))
                if not drain and not cached:
                    self._free()
            # (servers that say DONE unasked are not asked: a message less per result, 49-108
            # us less per 1 MiB result on the host, benchmarks/ab_trees.py --case results;
            # unless payloads of theirs came back here, which they count in flight till told)
            if cacheable and drain:
                reporting, returned = self.flight.reporting, self.flight.returned
                unasked = [s for s in self.served_servers() if s not in reporting or returned(s)]
                for hook in STATE.memory.ask_hooks if unasked else ():
                    hook(self, unasked)
        finally:
            if not cached:
                self._released_hooks()
        return True

    def _free(self) -> None:
        mapped = back_to_back(self._chunks) if self.backend.maps else []
        teardown(self.backend, self.address, self.capacity, mapped, self._chunks)

    def _released_hooks(self) -> None:
        for hook in STATE.memory.release_hooks:
            with contextlib.suppress(Exception):
                hook(self)

    def free_cached(self) -> None:
        """Free memory the cache let go (and tell the processes it was served to)."""
        try:
            self._free()
        finally:
            self._released_hooks()

    def cacheable(self) -> bool:
        """Whether the memory may be kept for reuse on release (a plain block made here)."""
        return (
            self.block is not None
            and self.origin.created_here
            and self.pid == os.getpid()
            and not self.flight.was_handed_over
        )

    def drop_block(self) -> None:
        """Take the memory out of reuse, where a process nobody can ask for ``DONE`` may hold
        it: made here, it is never cached (its payloads carry no block from now on);
        imported, it never says ``DONE`` (its exporter waits for the in-flight bound)."""
        if self.block is not None:
            with STATE.memory.lock:  # (an import is found by its block no more)
                if STATE.memory.blocks.get(self.block) is self:
                    del STATE.memory.blocks[self.block]
            self.block = self.pool_server = None
            self.generation += 1

    def done_by_importers(self, count: int, servers: Iterable[str] = ()) -> None:
        """An importer said ``DONE`` for ``count`` payloads; its ``servers`` say it unasked
        for the block's later loads."""
        self.flight.reporting.update(servers)
        self.flight.note_done(count)
        settle_draining()

    def closed_by(self, pid: int | None) -> None:
        """Process ``pid`` (``None``: those that exited) let go: free it if draining and unheld."""
        self.flight.closed_by(pid)
        if self.holders or self.busy() or self.cacheable():  # (a block: settle_draining)
            return
        try:  # (the handle server's thread: it must go on serving)
            with self.growth_lock:
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
        """In a forked child: the inherited allocation stays its creator's to resize."""
        self._lock = threading.Lock()
        self.growth_lock = threading.RLock()
        if self.origin.created_here:
            self.origin = Origin(False, self.origin.pid, self.origin.time)

    def adopt(self) -> None:
        """In a forked child: make this inherited mapping an import from the parent."""
        self.disown()
        self.kept_lease = None
        self.pid = os.getpid()
        self.flight = InFlight()  # (none of what the parent did)

    def in_flight(self) -> tuple[int, float]:
        """Payloads pickled here that may still be loaded, and seconds left of their bound."""
        return self.flight.in_flight()

    def busy(self) -> bool:
        """Whether a payload pickled here may still be loaded."""
        return self.flight.in_flight()[0] > 0

    def hand_over(self, say: bool = True) -> tuple[int, str] | None:
        """Give the handles of payloads in flight to the keeper; on a failure, how many will not
        load and the message saying so (printed if ``say``)."""
        if self.pid != os.getpid() or self.growable or not self.backend.maps:
            return None
        count, seconds = self.in_flight()
        if count:  # (those served may have loaded payloads warm, untold; an importer that
            # took the fds said TOOK before its answer, which may be why this runs)
            for settle in STATE.memory.settle_hooks:
                settle(self)
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

    def grant(self, index: int, access: Access = "rw") -> None:
        """Give peer device ``index`` ``access`` to the whole reservation in this process."""
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
            mapper.set_access(self.address, self.size, self.access, {index: access})
            self._peers[index] = access
