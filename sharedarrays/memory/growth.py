"""Growth: how big chunks are, and mapping chunks at the end of an allocation.

The sizing policy (:func:`chunk_sizes` for a new allocation, :func:`growth_sizes` for a
growing one) and :class:`Growth`, the part of :class:`~sharedarrays.memory.allocation.Allocation`
that adds, removes and moves chunks: :meth:`Growth.grow` (the exporter), :meth:`Growth.extend`
(an importer mapping chunks its exporter added), unmapping the chunks past a size (the
allocation's ``shrink``) and moving to a larger reservation. ``Growth`` is a base class of
``Allocation`` (this module sits below ``allocation.py`` and does not import it); the
attributes it declares are the allocation's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import cast

from sharedarrays.backends import Access, Backend, Chunk, MappingBackend, round_up
from sharedarrays.errors import PayloadError, ResizeRefused
from sharedarrays.memory.inflight import InFlight
from sharedarrays.memory.reservation import Reservation, teardown
from sharedarrays.settings import env_number

__all__ = ["DEFAULT_CHUNK_BYTES", "MAX_CHUNKS", "Growth", "chunk_sizes", "growth_sizes"]

DEFAULT_CHUNK_BYTES = 2 << 30
"""Largest chunk a growable array maps at a time by default (2 GiB; see
:func:`growth_sizes`). An array of fixed size is one chunk by default, whatever its size
(:func:`chunk_sizes`). Override per array with ``chunk_bytes=`` or for the process with the
``SHAREDARRAYS_CHUNK_BYTES`` environment variable (which then splits fixed-size arrays too)."""

MAX_CHUNKS = 1 << 16
"""No allocation has more chunks than this (a payload claiming more is rejected)."""


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
    # (past the doubling, every chunk is ``largest``: counted before the loop makes them)
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


class Growth:
    """The methods of an allocation that add, remove and move its chunks.

    Every change happens under :attr:`growth_lock` (the handle server holds it while it
    sends fds, so an fd is never sent closed) and bumps :attr:`generation`.
    """

    id: str
    backend: Backend
    address: int
    size: int
    capacity: int
    generation: int
    growth_lock: threading.RLock
    write_sealed: bool
    export_readonly: bool
    _chunk_bytes: int | None
    _chunks: list[Chunk]
    _access: Access
    _peers: dict[int, Access]
    _reservation: Reservation
    _growable: bool
    flight: InFlight

    @property
    def growable(self) -> bool:
        """Whether the allocation was made with a ``capacity`` (and so may grow and shrink)."""
        return self._growable

    def grow(self, nbytes: int) -> None:
        """Map new chunks at the end so that at least ``nbytes`` are mapped (the exporter).

        Chunk sizes follow :func:`growth_sizes`. Existing data and addresses do not change,
        unless the chunks do not fit the capacity: then the allocation first *moves* to a
        new reservation of at least twice the capacity, mapping the same chunks there (no
        data is copied); native arrays made before keep the old reservation mapped while
        they live.
        """
        with self.growth_lock:
            if nbytes > self.size:  # (what is missing at least, refused before it is planned)
                self.backend.check_memory(nbytes - self.size)
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

    def _unmap_past(self, nbytes: int, reach: Callable[[], int]) -> None:
        """Unmap and release the chunks that lie wholly past ``nbytes`` (the exporter);
        ``reach()``: one past the highest byte a lease here may touch.

        Raises
        ------
        ResizeRefused
            A lease reaches into those chunks, or a running process was served them.
        """
        with self.growth_lock:
            target = round_up(max(nbytes, 1), self.backend.granularity)
            keep, kept = 0, 0
            while keep < len(self._chunks) and kept < target:
                kept += self._chunks[keep].size
                keep += 1
            if keep == len(self._chunks):
                return
            reached = reach()
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
            start = kept
            self.size = kept  # new views and payloads stop here before anything is unmapped
            self._chunks = self._chunks[:keep]
            self.generation += 1
            mapped = []
            for c in dropped:
                mapped.append((start, c.size))
                start += c.size
            teardown(self.backend, self.address, self.capacity, mapped, dropped, free=False)

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
                    teardown(backend, self.address, 0, mapped, [chunk], free=False)
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
            teardown(backend, address, capacity, mapped, [])
            raise
        old = self._reservation
        old.retire(mapped)  # the same layout at the old address
        self._reservation = Reservation(backend, address, capacity)
        self.address = address
        self.capacity = capacity
        self.generation += 1
        del old  # freed now unless a native array still uses its addresses
