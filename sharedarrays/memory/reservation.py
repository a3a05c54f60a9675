"""Address space: a reservation of this process, and the teardown of what is mapped in it.

:func:`teardown` releases what an allocation holds in the order the driver needs
(synchronise, unmap, free the reservation, release the chunks). A :class:`Reservation` the
allocation moved away from (growth past the capacity) is *retired*: it keeps its mappings
until the last native array using its addresses goes, then a finalizer tears it down.
"""

from __future__ import annotations

import weakref
from typing import cast

from sharedarrays.backends import Backend, Chunk, MappingBackend

__all__ = ["Reservation", "teardown"]


def teardown(
    backend: Backend,
    address: int,
    size: int,
    mapped: list[tuple[int, int]],
    chunks: list[Chunk],
    free: bool = True,
) -> None:
    """Release everything an allocation holds, in the order the driver needs.

    Parameters
    ----------
    backend : Backend
        The memory system.
    address, size : int
        The reservation (``address`` 0: none).
    mapped : list of (offset, length)
        The mappings to unmap, by offset into the reservation.
    chunks : list of Chunk
        The chunks to release (their fds closed).
    free : bool
        Also give back the reservation.

    Every step is tried; the first failure is raised afterwards.
    """
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


def _free_retired(
    backend: Backend, address: int, size: int, retired: list[list[tuple[int, int]]]
) -> None:
    """A reservation's finalizer: unmap and free it if it was retired (the current one is
    torn down with its allocation). A failure has nowhere to go from a finalizer: what could
    be released is."""
    if retired:
        try:
            teardown(backend, address, size, retired[0], [])
        except Exception:
            pass


class Reservation:
    """One reservation of an allocation in this process.

    The current one is torn down with the allocation. One the allocation moved away from is
    retired (:meth:`retire`): once nothing refers to it any more (the last native array
    using its addresses went), its finalizer unmaps and frees it.

    Attributes
    ----------
    backend : Backend
        The memory system.
    address : int
        Its start.
    size : int
        Bytes reserved.
    """

    __slots__ = ("backend", "address", "size", "_retired", "__weakref__")

    def __init__(self, backend: Backend, address: int, size: int) -> None:
        self.backend = backend
        self.address = address
        self.size = size
        self._retired: list[list[tuple[int, int]]] = []  # its mappings, once retired
        finalizer = weakref.finalize(self, _free_retired, backend, address, size, self._retired)
        finalizer.atexit = False  # at exit the process's mappings go with it

    def retire(self, mapped: list[tuple[int, int]]) -> None:
        """The allocation moved away: unmap ``mapped`` (offset, length) and free the
        reservation once nothing refers to it any more."""
        self._retired.append(mapped)

    @property
    def retired(self) -> list[tuple[int, int]] | None:
        """Its mappings (offset, length), once the allocation moved away from it; ``None``
        while it is the allocation's current reservation."""
        return self._retired[0] if self._retired else None
