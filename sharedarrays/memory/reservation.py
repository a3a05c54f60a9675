"""A reservation of address space in this process, and the teardown of what is mapped in it."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable
from itertools import accumulate
from typing import cast

from sharedarrays.backends import Backend, Chunk, MappingBackend


def close_fds(fds: Iterable[int]) -> None:
    """Close ``fds`` (handles this process owns and no longer needs)."""
    for fd in fds:
        os.close(fd)


def back_to_back(chunks: list[Chunk], start: int = 0) -> list[tuple[int, int]]:
    """The (offset, length) of ``chunks`` mapped one after another from ``start``."""
    sizes = [c.size for c in chunks]
    return list(zip(accumulate(sizes, initial=start), sizes))


def teardown(
    backend: Backend,
    address: int,
    size: int,
    mapped: list[tuple[int, int]],
    chunks: list[Chunk],
) -> None:
    """Unmap ``mapped`` (offset, length), free the reservation of ``size`` bytes (none if 0)
    and release ``chunks``: every step tried, the first failure raised."""
    errors: list[BaseException] = []

    def attempt(step: Callable[..., object], *args: object) -> None:
        try:
            step(*args)
        except BaseException as e:  # keep going: fds must be closed regardless
            errors.append(e)

    if mapped:
        attempt(backend.synchronize)
    if backend.maps:
        mapper = cast(MappingBackend, backend)
        for offset, length in mapped:
            attempt(mapper.unmap, address + offset, length)
        if address and size:
            attempt(mapper.free_reservation, address, size)
    for chunk in chunks:
        attempt(backend.release_chunk, chunk)
    if errors:
        raise errors[0]


def _free_retired(
    backend: Backend, address: int, size: int, retired: list[list[tuple[int, int]]]
) -> None:
    if retired:  # (a finalizer: errors are dropped)
        with contextlib.suppress(Exception):
            teardown(backend, address, size, retired[0], [])


class Reservation:
    """One reservation of an allocation in this process; once *retired* (the allocation
    moved away), a finalizer tears it down when the last native array using it goes."""

    __slots__ = ("_retired", "__weakref__")

    def __init__(self, backend: Backend, address: int, size: int) -> None:
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
