"""A pointer backend on the host, for CPU tests of what exporter-owned memory needs.

``host-pointer`` behaves like cuda-ipc and cuda-pool as far as everything above the backend
can tell: ``maps`` is false (each chunk comes at an address the kernel chooses, one chunk per
allocation), ``exporter_owned`` is true (the exporter keeps a released allocation until its
importers closed it), and importers get the chunk from a portable ``export`` plus one fd from
the handle server (as cuda-pool gets its pool's fd). Underneath it is a memfd mapped with
``mmap`` (so unlike CUDA IPC the memory would in fact outlive its exporter; the tests check
the protocol, not the driver).

Importing this module registers it (:func:`sharedarrays.backends.register`); spawned
workers that receive such arrays must import it first (the functions in
``pointer_workers`` do).
"""

from __future__ import annotations

import mmap
import os
from typing import ClassVar

from sharedarrays.backends import Chunk, Registration, register
from sharedarrays.backends.device import CPU, Device
from sharedarrays.backends.host import HostBackend, _check, _check_mmap, _libc
from sharedarrays.errors import HandleUnavailable, PayloadError

NAME = "host-pointer"


class HostPointerBackend(HostBackend):
    """memfd chunks at kernel-chosen addresses, with exporter-owned lifetime rules."""

    name: ClassVar[str] = NAME
    maps: ClassVar[bool] = False
    exporter_owned: ClassVar[bool] = True

    def create_chunk(self, size: int) -> Chunk:
        chunk = super().create_chunk(size)
        try:
            chunk.address = self._map(chunk.fd, size)
        except BaseException:
            os.close(chunk.fd)
            raise
        chunk.export = os.urandom(16)
        return chunk

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Like cuda-ipc: read-only is the importer's promise (its mapping is read-write)."""
        super().seal(chunk, False)
        return False

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        try:
            if fd < 0:
                raise HandleUnavailable("no handle came with this host-pointer allocation")
            if len(export) != 16:
                raise PayloadError(f"a host-pointer handle is 16 bytes, not {len(export)}")
            if os.fstat(fd).st_size < size:
                raise PayloadError("the handle is smaller than the payload says")
            address = self._map(fd, size)
        finally:
            if fd >= 0:
                os.close(fd)
        return Chunk(
            size=size, handle=address, fd=-1, address=address, export=export, imported=True
        )

    def release_chunk(self, chunk: Chunk) -> None:
        if chunk.address:
            address, chunk.address = chunk.address, 0
            _check(_libc.munmap(address, chunk.size), "munmap")
        if chunk.fd >= 0:
            fd, chunk.fd = chunk.fd, -1
            os.close(fd)
        chunk.handle = -1

    @staticmethod
    def _map(fd: int, size: int) -> int:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        return _check_mmap(_libc.mmap(None, size, prot, mmap.MAP_SHARED, fd, 0), "mmap")


def _make(device: Device) -> HostPointerBackend:
    if device != CPU:
        raise ValueError("host-pointer serves the cpu only")
    return HostPointerBackend()


register(
    Registration(
        name=NAME,
        kind="cpu",
        factory=_make,
        preference=1,  # backend="auto" keeps choosing host
        maps=HostPointerBackend.maps,
        exporter_owned=HostPointerBackend.exporter_owned,
    )
)
