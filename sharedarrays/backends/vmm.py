"""Virtual memory management backends, written once for every GPU vendor (``cuda-vmm``,
``hip-vmm``): device memory shared through POSIX file descriptors.

CUDA and HIP have the same VMM API under two names. :class:`VmmBackend` is the backend,
written against :class:`VmmCalls`, a table of the vendor's driver calls; a vendor is that
table and a device base class (context, synchronisation, native arrays):

=========== =================================================================
reservation :meth:`VmmCalls.reserve` (aligned to the granularity)
chunk       :meth:`VmmCalls.create` (pinned memory of this device, requested handle type
            POSIX file descriptor), exported once with :meth:`VmmCalls.export`; the fd is
            kept for the chunk's life
mapping     :meth:`VmmCalls.map` (whole chunks)
access      :meth:`VmmCalls.set_access` for the owning device (and peers, where the vendor
            has them)
handle      the exported fd; an importer turns it back into a chunk with
            :meth:`VmmCalls.import_fd` and keeps it too, so it can serve it on
release     :meth:`VmmCalls.unmap`, :meth:`VmmCalls.release`, :meth:`VmmCalls.free`
=========== =================================================================

The memory lives while any process holds a handle, an fd or a mapping of it. Every call of
the table runs with the device made current (the backend's ``context()``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from sharedarrays.backends.base import Access, Chunk
from sharedarrays.backends.device import Device
from sharedarrays.errors import DriverError, PayloadError, PeerAccessUnavailable

__all__ = ["VmmCalls", "VmmBackend", "ACCESS"]

ACCESS: tuple[Access, ...] = ("rw", "r", "none")


class VmmCalls(Protocol):
    """One vendor's VMM driver calls, each checked (raising the vendor's
    :class:`~sharedarrays.DriverError`, whose ``call`` names the driver function).

    Attributes
    ----------
    vendor : str
        Its name in messages (``"CUDA"``).
    whole_chunks : str
        Why it maps whole chunks only, for the message that refuses a part (may be empty).
    not_an_allocation : frozenset of str
        The error names :meth:`import_fd` answers for an fd that is no exported allocation.
    invalid_value : str
        The error name :meth:`map` answers for a chunk smaller than the range.
    """

    vendor: str
    whole_chunks: str
    not_an_allocation: frozenset[str]
    invalid_value: str

    def granularity(self) -> int:
        """The recommended allocation granularity of the device."""
        ...

    def create(self, size: int) -> int:
        """A new chunk of ``size`` bytes of pinned device memory; its handle."""
        ...

    def export(self, handle: int) -> int:
        """A new POSIX fd of chunk ``handle`` (none is left open on failure)."""
        ...

    def import_fd(self, fd: int) -> int:
        """A new handle of the chunk exported as ``fd`` (the fd stays the caller's)."""
        ...

    def location(self, handle: int) -> int | None:
        """The index of the device the chunk lives on, or ``None`` where not asked."""
        ...

    def release(self, handle: int) -> None:
        """Release a chunk handle."""
        ...

    def reserve(self, size: int, alignment: int) -> int:
        """Reserve ``size`` bytes of device address space; its address."""
        ...

    def free(self, address: int, size: int) -> None:
        """Free a reservation."""
        ...

    def map(self, address: int, size: int, handle: int) -> None:
        """Map the whole chunk ``handle`` (``size`` bytes) at ``address``."""
        ...

    def access(self, index: int, access: Access) -> Any:
        """An access descriptor giving device ``index`` ``access``."""
        ...

    def set_access(self, address: int, size: int, descs: list[Any], access: Access) -> None:
        """Set the access ``descs`` (``access``: the owning device's, for the message) on a
        mapped range."""
        ...

    def unmap(self, address: int, size: int) -> None:
        """Unmap a mapped range."""
        ...

    def peer_reason(self, index: int, owner: int) -> str | None:
        """Why device ``index`` cannot access memory of device ``owner``, or ``None``."""
        ...


class VmmBackend:
    """Device memory of one GPU shared through exported fds: the backend of every vendor's
    VMM, put before the vendor's device base class (``class CudaVmmBackend(VmmBackend,
    CudaDevice)``), with :meth:`table` making its :class:`VmmCalls`.

    Notes
    -----
    Chunks are pinned device memory of this device, exported as POSIX fds; sizes and
    mapping offsets are multiples of the recommended granularity (2 MiB on an H200). New
    chunks are not zeroed.
    """

    zeroed: ClassVar[bool] = False  # cuMemCreate and hipMemCreate do not clear memory
    maps: ClassVar[bool] = True
    exporter_owned: ClassVar[bool] = False

    if TYPE_CHECKING:  # what the vendor's device base class provides
        name: ClassVar[str]
        peer_access: ClassVar[bool]
        device: Device

        def context(self) -> contextlib.AbstractContextManager[None]: ...
        def synchronize(self) -> None: ...
        def _forked(self) -> bool: ...
        def _check_size(self, size: int, what: str) -> None: ...

    def table(self) -> VmmCalls:
        """The vendor's calls for this backend (each vendor's subclass says)."""
        raise NotImplementedError

    def __init__(self, device: Device) -> None:
        super().__init__(device)  # type: ignore[call-arg]  # (the device base class)
        calls = self._calls = self.table()
        with self.context():
            self._granularity = calls.granularity()
        self._access: dict[str, list[Any]] = {
            access: [calls.access(device.index, access)] for access in ACCESS
        }

    @property
    def granularity(self) -> int:
        """The recommended allocation granularity of this device (2 MiB on an H200)."""
        return self._granularity

    def _desc(self, index: int, access: Access) -> Any:
        """An access descriptor giving device ``index`` ``access``."""
        if access not in ACCESS:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        return self._calls.access(index, access)

    def _release(self, handle: int) -> None:
        """Release ``handle`` while undoing a failed step (its own failure is not the one
        to report)."""
        with contextlib.suppress(DriverError):
            self._calls.release(handle)

    # chunks -----------------------------------------------------------------------------
    def check_memory(self, nbytes: int) -> None:
        """Nothing to check beforehand: the driver takes the device memory when a chunk is
        made, and fails then with an :class:`~sharedarrays.OutOfMemory`."""

    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes of pinned device memory and export its fd (once)."""
        self._check_size(size, "a chunk size")
        calls = self._calls
        with self.context():
            handle = calls.create(size)
            try:
                fd = calls.export(handle)
            except BaseException:
                self._release(handle)
                raise
            try:
                os.set_inheritable(fd, False)
            except BaseException:
                os.close(fd)
                self._release(handle)
                raise
        return Chunk(size=size, handle=handle, fd=fd)

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Nothing to seal: a chunk's size is fixed, and its shareable fd carries no access
        mode. Read-only is set by each importer (:meth:`set_access`), for its own mappings:
        a process of the same user holding the fd can set itself read-write."""
        return False

    def reopen_readonly(self, fd: int) -> int | None:
        """The shareable fds carry no access mode: read-only is set by each importer (see
        :meth:`set_access`)."""
        return None

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from an fd exported by :meth:`create_chunk` (in any process).

        Takes ownership of ``fd`` (closed on failure; kept open in the chunk on success so it
        can be served on). The driver cannot tell an imported chunk's size: a payload that
        claims more than the chunk holds fails later, in :meth:`map`.

        Raises
        ------
        PayloadError
            ``size`` is not a multiple of the granularity, the fd is not an exported
            allocation of this vendor, or the chunk lives on another device.
        """
        calls = self._calls
        try:
            if size <= 0 or size % self._granularity:
                raise PayloadError(
                    f"chunk size {size} is not a positive multiple of {self.device}'s "
                    f"granularity ({self._granularity} bytes)"
                )
            with self.context():
                try:
                    handle = calls.import_fd(fd)
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
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass
        return Chunk(size=size, handle=handle, fd=fd, imported=True)

    def release_chunk(self, chunk: Chunk) -> None:
        """Release this process's handle of the chunk and close its fd. Idempotent.

        The memory returns to the device once every process has released its handle and
        closed its fds (and nothing maps it).
        """
        handle, fd = chunk.handle, chunk.fd
        if handle < 0 and fd < 0:
            return
        chunk.handle = chunk.fd = -1
        try:
            if handle >= 0 and not self._forked():
                with self.context():
                    self._calls.release(handle)
        finally:
            if fd >= 0:
                os.close(fd)

    # address space ----------------------------------------------------------------------
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of device address space, aligned to the granularity."""
        self._check_size(size, "a reservation size")
        with self.context():
            return self._calls.reserve(size, self._granularity)

    def free_reservation(self, address: int, size: int) -> None:
        """Give back a reservation (a no-op in a forked child)."""
        if self._forked():
            return
        with self.context():
            self._calls.free(address, size)

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map the whole of ``chunk`` at ``address``.

        The range is not accessible until :meth:`set_access`. The GPU drivers map whole
        chunks only: ``size`` must be the chunk's size and ``chunk_offset`` 0. (``cuMemMap``
        answers ``CUDA_ERROR_NOT_SUPPORTED`` for an offset into a device allocation or a
        part of one, on driver 580 with an H200, although its documentation allows both.)
        """
        self._check_size(size, "a mapping size")
        calls = self._calls
        if chunk_offset != 0 or size != chunk.size:
            raise ValueError(
                f"{calls.vendor} maps whole chunks only{calls.whole_chunks}: asked for {size} "
                f"bytes from offset {chunk_offset} of a chunk of {chunk.size} bytes"
            )
        if chunk.handle < 0:
            raise ValueError("the chunk was released")
        with self.context():
            try:
                calls.map(address, size, chunk.handle)
            except DriverError as exc:
                if exc.error_name == calls.invalid_value:
                    raise PayloadError(
                        f"{exc}; the chunk may be smaller than its payload says"
                    ) from exc
                raise

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """Set this device's access to a mapped range (``"rw"``, ``"r"`` or ``"none"``), and
        that of the ``peers`` (other devices of the same kind by index, each with its access,
        where the vendor has peers: :attr:`peer_access`), in one call.

        Lowering access waits first (:meth:`synchronize`) for queued work that may still
        touch the range.

        Raises
        ------
        PeerAccessUnavailable
            A peer cannot access this device's memory (CUDA: ``cuDeviceCanAccessPeer`` is 0).
        ValueError
            Peers were given to a backend without peer access.
        """
        own = self._access.get(access)
        if own is None:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        descs = list(own)
        for index, mode in sorted((peers or {}).items()):
            if index == self.device.index:
                continue
            if not self.peer_access:
                raise ValueError(f"{self.name} grants no peer devices: access= takes {self.device}")
            why = self._calls.peer_reason(index, self.device.index)
            if why is not None:
                raise PeerAccessUnavailable(why)
            descs.append(self._desc(index, mode))
        if access != "rw" or any(m != "rw" for m in (peers or {}).values()):
            self.synchronize()
        with self.context():
            self._calls.set_access(address, size, descs, access)

    def unmap(self, address: int, size: int) -> None:
        """Wait for queued work (unmapping does not), then unmap the range.

        A no-op in a forked child.
        """
        if self._forked():
            return
        self.synchronize()
        with self.context():
            self._calls.unmap(address, size)
