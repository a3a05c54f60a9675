"""Address space: a reservation of this process, and the teardown of what is mapped in it.

A :class:`Reservation` the allocation moved away from is *retired*: a finalizer tears it
down once the last native array using its addresses goes.
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

    Unmaps ``mapped`` (offset, length) pairs, frees the reservation (with ``free``; ``address``
    0: none) and releases ``chunks``. Every step is tried; the first failure is raised.
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
    """A reservation's finalizer: unmap and free it if retired (errors are dropped)."""
    if retired:
        try:
            teardown(backend, address, size, retired[0], [])
        except Exception:
            pass


class Reservation:
    """One reservation of an allocation in this process (a retired one frees itself)."""

    __slots__ = ("backend", "address", "size", "_retired", "__weakref__")

    def __init__(self, backend: Backend, address: int, size: int) -> None:
        self.backend = backend
        self.address = address
        self.size = size
        self._retired: list[list[tuple[int, int]]] = []  # its mappings, once retired
        finalizer = weakref.finalize(self, _free_retired, backend, address, size, self._retired)
        finalizer.atexit = False  # at exit the process's mappings go with it

    def retire(self, mapped: list[tuple[int, int]]) -> None:
        """The allocation moved away: unmap ``mapped`` and free it once unreferenced."""
        self._retired.append(mapped)

    @property
    def retired(self) -> list[tuple[int, int]] | None:
        """Its mappings once retired; ``None`` while current."""
        return self._retired[0] if self._retired else None
