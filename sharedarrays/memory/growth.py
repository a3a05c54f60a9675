"""Growth: how big chunks are (:func:`chunk_sizes`, :func:`growth_sizes`), and
:class:`Growth`, the base of ``Allocation`` that adds, removes and moves chunks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, cast

from sharedarrays.backends import Chunk, MappingBackend, round_up
from sharedarrays.errors import PayloadError, ResizeRefused
from sharedarrays.memory.info import AllocationRecords
from sharedarrays.memory.lease import Lease
from sharedarrays.memory.reservation import Reservation, back_to_back, close_fds, teardown
from sharedarrays.settings import env_number

DEFAULT_CHUNK_BYTES = 2 << 30
"""Largest chunk a growable array maps at a time by default (``SHAREDARRAYS_CHUNK_BYTES``)."""
MAX_CHUNKS = 1 << 16
"""No allocation has more chunks than this (a payload claiming more is rejected)."""


def _chunk_limit(chunk_bytes: int | None, default: int = DEFAULT_CHUNK_BYTES) -> int:
    if chunk_bytes is None:
        chunk_bytes = env_number("SHAREDARRAYS_CHUNK_BYTES", default, 1)
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return chunk_bytes


def chunk_sizes(nbytes: int, granularity: int, chunk_bytes: int | None = None) -> list[int]:
    """Split ``nbytes`` (rounded up to ``granularity``) into chunks of ``chunk_bytes`` (default
    ``SHAREDARRAYS_CHUNK_BYTES``, else one: each costs every importer a map), the last smaller."""
    total = round_up(max(nbytes, 1), granularity)
    step = round_up(_chunk_limit(chunk_bytes, total), granularity)
    count = -(-total // step)  # (counted before the list is made: it may be huge)
    if count > MAX_CHUNKS:
        raise ValueError(
            f"{nbytes} bytes in chunks of {step} bytes would need {count} chunks "
            f"(at most {MAX_CHUNKS}); pass a larger chunk_bytes"
        )
    sizes = [step] * (total // step)
    if total % step:
        sizes.append(total % step)
    return sizes


def growth_sizes(
    mapped: int, nbytes: int, granularity: int, capacity: int, chunk_bytes: int | None = None
) -> list[int]:
    """The chunks a growable allocation with ``mapped`` bytes mapped (of ``capacity``) adds to
    map at least ``nbytes``: each doubles what is mapped (``O(log n)`` for ``n`` appends), at
    most ``chunk_bytes``; past ``capacity``, the allocation must move."""
    target = round_up(max(nbytes, 1), granularity)
    largest = round_up(_chunk_limit(chunk_bytes), granularity)
    if (target - mapped) // largest > MAX_CHUNKS:
        raise ValueError(
            f"growing to {nbytes} bytes in chunks of at most {largest} bytes would need more "
            f"than {MAX_CHUNKS} chunks; pass a larger chunk_bytes"
        )
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


class Growth(AllocationRecords):
    """Adding, removing and moving chunks (under ``growth_lock``; each bumps ``generation``)."""

    def grow(self, nbytes: int) -> None:
        """Map new chunks at the end so that at least ``nbytes`` are mapped (the exporter); past
        the capacity it first *moves* to a reservation at least twice as large (no copy)."""
        with self.growth_lock:
            if nbytes > self.size:
                self.backend.check_memory(nbytes - self.size)
            sizes = growth_sizes(
                self.size, nbytes, self.backend.granularity, self.capacity, self._chunk_bytes
            )
            if sizes:
                self.backend.check_memory(sum(sizes))
                self._add_chunks(sizes, self.backend.create_chunk, 0, seal=True)

    def extend(self, sizes: list[int], fds: list[int], capacity: int = 0) -> None:
        """Map chunks the exporter added (an importer); takes ownership of ``fds``."""
        pending = list(fds)
        try:
            if len(sizes) != len(pending):
                raise PayloadError(f"{len(sizes)} chunk sizes but {len(pending)} handles")
            with self.growth_lock:
                self._add_chunks(
                    sizes, lambda size: self.backend.import_chunk(pending.pop(0), size), capacity
                )
        finally:
            close_fds(pending)

    def shrink(self, nbytes: int, exclude: Lease[Any] | None = None) -> None:
        """Unmap and release the chunks wholly past ``nbytes`` (the exporter): ResizeRefused
        where a lease here (but ``exclude``) or a running process may use them."""
        with self.growth_lock:
            target = round_up(max(nbytes, 1), self.backend.granularity)
            keep, kept = 0, 0
            while keep < len(self._chunks) and kept < target:
                kept += self._chunks[keep].size
                keep += 1
            if keep == len(self._chunks):
                return
            with self._lock:  # (the lease ends here, but exclude's, bound what may go)
                ends = self._ends.copy()
            if exclude is not None and exclude.allocation is self:
                ends -= Counter((exclude.end,))
            reached = max(ends, default=0)
            if reached > kept:
                raise ResizeRefused(
                    f"cannot unmap bytes {kept}-{self.size} of allocation {self.id}: a view or "
                    f"native array in this process reaches byte {reached}. Close those views "
                    "(a.close()) and drop those native arrays first"
                )
            holders = self.flight.mapping_past(keep)
            if holders:
                raise ResizeRefused(
                    f"cannot unmap chunks {keep}-{len(self._chunks) - 1} of allocation "
                    f"{self.id}: process{'es' if len(holders) > 1 else ''} "
                    f"{', '.join(map(str, holders))} imported them and may still map them "
                    "(an importer keeps its mapping until it exits). Shrink after they exited, "
                    "or leave the array at its length"
                )
            dropped = self._chunks[keep:]
            self.size = kept  # (before anything is unmapped)
            self._chunks = self._chunks[:keep]
            self.generation += 1
            mapped = back_to_back(dropped, kept)
            teardown(self.backend, self.address, 0, mapped, dropped)

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
                    backend.set_access(address, size, self.access, self._peers)
                    if seal:
                        backend.seal(chunk, self.export_readonly)
                except BaseException:
                    teardown(backend, self.address, 0, mapped, [chunk])
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
            for (offset, size), c in zip(back_to_back(self._chunks), self._chunks):
                backend.map(address + offset, size, c, 0)
                mapped.append((offset, size))
            backend.set_access(address, self.size, self.access, self._peers)
        except BaseException:
            teardown(backend, address, capacity, mapped, [])
            raise
        # the same layout at the old address, freed unless a native array still uses it
        self._reservation.retire(mapped)
        self._reservation = Reservation(backend, address, capacity)
        self.address = address
        self.capacity = capacity
        self.generation += 1
