"""The VMM backend of every GPU vendor (``cuda-vmm``, ``hip-vmm``) on its
:class:`~.base.VendorCalls`: a chunk is pinned device memory exported once as an fd, alive
while any process holds a handle, fd or mapping."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from typing import ClassVar

from sharedarrays.backends.base import Access, Chunk, DeviceBase
from sharedarrays.backends.device import Device
from sharedarrays.errors import DriverError, PayloadError, PeerAccessUnavailable

ACCESS: tuple[Access, ...] = ("rw", "r", "none")


class VmmBackend(DeviceBase):
    """Device memory of one GPU shared through exported fds, put before the vendor's device
    base class (:attr:`calls`: its table)."""

    zeroed: ClassVar[bool] = False
    maps: ClassVar[bool] = True
    exporter_owned: ClassVar[bool] = False
    _peer_reason: Callable[[int, int], str | None]  # asked where peer_access

    def __init__(self, device: Device) -> None:
        super().__init__(device)  # type: ignore[call-arg]  # (the device base class)
        calls = self._calls = self.calls(self)
        with self.context():
            flag = calls.enum["granularity"]
            self._granularity = int(calls.call("MemGetAllocationGranularity", calls.prop, flag))
        self._access = {access: [calls.access(device.index, access)] for access in ACCESS}

    @property
    def granularity(self) -> int:  # recommended: 2 MiB on an H200
        return self._granularity

    def _release(self, handle: int) -> None:  # undoing a failed step
        with contextlib.suppress(DriverError):
            self._calls.call("MemRelease", self._calls.handle(handle))

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes of pinned device memory and export its fd once."""
        self._check_size(size, "a chunk size")
        calls = self._calls
        with self.context():
            what = f"({size} bytes on {self.device})"
            chunk = "a chunk of device memory"
            handle = int(calls.allocating(chunk, size, "MemCreate", size, calls.prop, 0, what=what))
            fd = -1
            try:
                fd = calls.export_fd("MemExportToShareableHandle", calls.handle(handle))
                os.set_inheritable(fd, False)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                self._release(handle)
                raise
        return Chunk(size=size, handle=handle, fd=fd)

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from an fd of :meth:`create_chunk` (kept to serve on); ``PayloadError``
        for no exported allocation or another device's (a too-large size fails in :meth:`map`)."""
        calls = self._calls
        try:
            self._check_size(size, "the payload's chunk size", PayloadError)
            args, what = (fd, calls.fd_type), f"({calls.fd_name})"
            with self.context():
                try:
                    handle = int(calls.call("MemImportFromShareableHandle", *args, what=what))
                except DriverError as exc:
                    if exc.error_name in calls.not_an_allocation:
                        raise PayloadError(
                            f"the handle is not an exported {calls.vendor} allocation: {exc}"
                        ) from exc
                    raise
                try:
                    where = calls.location(handle)
                    if where is not None and where != self.device.index:
                        raise PayloadError(
                            f"the chunk lives on {self.device.kind}:{where} (as numbered in "
                            f"this process), not on {self.device}"
                        )
                except BaseException:
                    self._release(handle)
                    raise
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):
            os.set_inheritable(fd, False)
        return Chunk(size=size, handle=handle, fd=fd, imported=True)

    def release_chunk(self, chunk: Chunk) -> None:
        handle, fd = chunk.handle, chunk.fd
        if handle < 0 and fd < 0:
            return
        chunk.handle = chunk.fd = -1
        try:
            if handle >= 0 and not self._forked():
                with self.context():
                    self._calls.call("MemRelease", self._calls.handle(handle))
        finally:
            if fd >= 0:
                os.close(fd)

    def reserve(self, size: int) -> int:
        self._check_size(size, "a reservation size")
        thing, what = "a reservation of address space", f"({size} bytes)"
        args = (size, self._granularity, 0, 0)
        with self.context():
            return int(self._calls.allocating(thing, size, "MemAddressReserve", *args, what=what))

    def free_reservation(self, address: int, size: int) -> None:
        if self._forked():
            return
        with self.context():
            self._calls.call("MemAddressFree", address, size)

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map the whole of ``chunk`` at ``address``: ``cuMemMap`` answers
        ``CUDA_ERROR_NOT_SUPPORTED`` for a part of a device allocation (driver 580)."""
        calls = self._calls
        if chunk_offset != 0 or size != chunk.size:
            raise ValueError(
                f"{calls.vendor} maps whole chunks only{calls.whole_chunks}: asked for {size} "
                f"bytes from offset {chunk_offset} of a chunk of {chunk.size} bytes"
            )
        if chunk.handle < 0:
            raise ValueError("the chunk was released")
        what = f"({size} bytes at {address:#x})"
        with self.context():
            try:
                calls.call("MemMap", address, size, 0, calls.handle(chunk.handle), 0, what=what)
            except DriverError as exc:
                if exc.error_name == calls.invalid_value:
                    raise PayloadError(
                        f"{exc}; the chunk may be smaller than its payload says"
                    ) from exc
                raise

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """Set this device's and ``peers``' access in one call; lowering it waits for work."""
        own = self._access.get(access)
        if own is None:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        descs = list(own)
        for index, mode in sorted((peers or {}).items()):
            if index == self.device.index:
                continue
            if not self.peer_access:
                raise ValueError(f"{self.name} grants no peer devices: access= takes {self.device}")
            why = self._peer_reason(index, self.device.index)
            if why is not None:
                raise PeerAccessUnavailable(why)
            if mode not in ACCESS:
                raise ValueError(f"access must be 'rw', 'r' or 'none', not {mode!r}")
            descs.append(self._calls.access(index, mode))
        if access != "rw" or any(m != "rw" for m in (peers or {}).values()):
            self.synchronize()
        what = f"({access!r}, {size} bytes at {address:#x})"
        with self.context():
            self._calls.call("MemSetAccess", address, size, descs, len(descs), what=what)

    def unmap(self, address: int, size: int) -> None:
        """Wait for queued work (unmapping does not), then unmap."""
        if self._forked():
            return
        self.synchronize()
        with self.context():
            self._calls.call("MemUnmap", address, size, what=f"({size} bytes at {address:#x})")
