"""The Backend protocols: what every memory system provides.

A backend knows how to make and import *chunks* (physical allocations with an exported
handle) and wrap memory as the native array type of its device. It knows nothing of
pickling, payloads, registries or widgets: those live above it (``allocation.py``,
``array.py``).

Memory systems come in two shapes:

* **mapping** backends (:class:`MappingBackend`: ``host``, ``cuda-vmm``) also *reserve*
  address ranges, *map* chunks into them and set *access*; their handles are file
  descriptors, and the memory lives as long as any process holds a handle or a mapping;
* **pointer** backends (``cuda-ipc``, ``cuda-pool``) hand out memory whose address the
  driver chooses (:attr:`Chunk.address`), one chunk per allocation; their handles are
  portable bytes (:attr:`Chunk.export`, plus for ``cuda-pool`` the pool's fd), and the
  memory lives only while its exporter keeps it (:attr:`Backend.exporter_owned`).

Every method that creates an OS resource either returns an object that owns it or raises
having released everything it made.

Four methods are optional, looked up with ``getattr``.

``native_memory(address, size, owner, readonly, device_index)``, ``native_view(memory,
offset, dtype, shape, strides, readonly)`` and ``native_intact(native, dtype, shape, strides,
readonly)``, defined together: the native memory object of a whole mapped allocation, which
keeps ``owner`` alive, a native array of a view derived from it, and whether such an array
still has the layout it was made with (:meth:`sharedarrays.Allocation.native_view` hands the
last one out again when nobody holds it). The views of one allocation in a process then
share one native memory object, and each native array costs only its own header (``host``:
a NumPy byte array, and NumPy arrays over its buffer; ``cuda-*``: a CuPy ``MemoryPointer``,
and CuPy arrays at it plus ``offset``). Without them every native array is made by
:meth:`Backend.as_native`.

``admit(chunk, pid)``, which a pointer
backend may define to be called before a chunk's :attr:`Chunk.export` is handed to process
``pid`` (by the exporter's handle server, once it has checked ``allow_pids=``; see
:meth:`sharedarrays.Allocation.exports_for`). ``ascend`` adds ``pid`` to the driver's trust
list of the chunk there (``aclrtMemSetPidToShareableHandle``); it raises a
:class:`~sharedarrays.SharedArrayError` when the driver refuses.
"""

from __future__ import annotations

import errno
import functools
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

from sharedarrays.backends.device import Device
from sharedarrays.errors import BackendUnavailable, fd_limit_error

__all__ = [
    "Access",
    "Chunk",
    "NativeView",
    "Backend",
    "MappingBackend",
    "StreamBackend",
    "BorrowingBackend",
    "ValueReader",
    "installed",
    "round_up",
]

Access = Literal["rw", "r", "none"]
"""Who may touch a mapping: read-write, read-only, or nobody."""


def round_up(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple`` (a positive int)."""
    return -(-n // multiple) * multiple


def installed(module: str) -> bool:
    """Whether the optional ``module`` (an array library a backend hands its memory to) is
    imported or importable. A native array asks it every time: the search of the import path
    for a module that is not there is made once per process."""
    return module in sys.modules or _findable(module)


@functools.cache
def _findable(module: str) -> bool:
    """Whether the import path has ``module``: only an answer is kept (the cache keeps no
    exception), so a search that fails is made again at the next call.

    Raises
    ------
    HandleUnavailable
        The search could not list a directory of the path (too many open files).
    BackendUnavailable
        It failed otherwise.
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    except OSError as e:
        what = f"cannot search the import path for {module!r}"
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error(what, str(e.strerror)) from None
        raise BackendUnavailable(f"{what}: {e}; try again") from None


@dataclass
class Chunk:
    """One physical allocation and its exported handle, owned by this process.

    Attributes
    ----------
    size : int
        Size in bytes, a multiple of the backend's granularity.
    handle : int
        The backend's native handle (a memfd on the host backend, a
        ``CUmemGenericAllocationHandle`` value on cuda-vmm, the device pointer on cuda-ipc
        and cuda-pool).
    fd : int
        The exported POSIX file descriptor (on the host backend the memfd itself; on
        cuda-pool the pool's, which the backend owns; ``-1`` on cuda-ipc). It is kept open
        for the chunk's lifetime so that it can be served to importers without exporting
        again. ``-1`` once released.
    address : int
        Pointer backends: where the chunk is in this process (``0`` on mapping backends,
        whose chunks are placed by :meth:`MappingBackend.map`).
    export : bytes
        Pointer backends: the portable handle an importer opens (``b""`` on mapping
        backends).
    imported : bool
        Whether this process imported the chunk (rather than created it).
    owner : object
        Pointer backends: for memory this process *borrowed* from another library
        (:func:`sharedarrays.share`), the object that keeps it allocated (a CuPy array, a
        torch tensor). Releasing the chunk drops this reference instead of freeing the memory.
        ``None`` for memory the backend made or imported.
    """

    size: int
    handle: int
    fd: int
    address: int = 0
    export: bytes = b""
    imported: bool = False
    owner: object = None


class NativeView(NamedTuple):
    """A native array to make over mapped memory: what :meth:`Backend.as_native` wraps (the
    one signature of every backend's ``as_native``).

    Attributes
    ----------
    address : int
        The start of the whole mapped range (the reservation).
    size : int
        Its size in bytes.
    offset : int
        Where the array's first element is, in bytes from ``address``.
    owner : object
        What the native array (and every view of it) keeps alive: the mapping's owner.
    dtype : numpy.dtype
        The element type.
    shape : tuple of int
        The array's shape.
    strides : tuple of int
        Its strides in bytes (may be negative).
    readonly : bool
        Whether the array is read-only (where the native type can be).
    device_index : int or None
        The device the native array belongs to, when another device than the memory's own
        reads it as a peer (CUDA); ``None``: the memory's own.
    """

    address: int
    size: int
    offset: int
    owner: object
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    readonly: bool
    device_index: int | None = None


@runtime_checkable
class Backend(Protocol):
    """One memory system on one device.

    Attributes
    ----------
    name : str
        The backend's name in payloads and widgets: ``"host"``, ``"cuda-vmm"``,
        ``"cuda-ipc"`` or ``"cuda-pool"``.
    zeroed : bool
        Whether new chunks are guaranteed to read as zeros (memfd is; cuMemCreate is not).
    maps : bool
        Whether it is a :class:`MappingBackend` (chunks mapped into reservations, handles are
        fds); otherwise each chunk comes with its own address and an allocation is one chunk.
    exporter_owned : bool
        Whether the memory lives only while the exporter keeps it (cuda-ipc, cuda-pool):
        importers must release it before the exporter frees it. Otherwise any process that
        holds a handle or a mapping keeps it alive.
    peer_access : bool
        Whether other devices of the same kind may be granted access to its mappings and read
        them as peers (cuda-vmm); see :meth:`MappingBackend.set_access`.
    device : Device
        The device whose memory this backend allocates.
    """

    name: ClassVar[str]
    zeroed: ClassVar[bool]
    maps: ClassVar[bool]
    exporter_owned: ClassVar[bool]
    peer_access: ClassVar[bool]
    device: Device

    @property
    def granularity(self) -> int:
        """Chunk sizes and mapping offsets are multiples of this many bytes."""
        ...

    def check_memory(self, nbytes: int) -> None:
        """Refuse, before any of it is made, new memory of ``nbytes`` bytes (an allocation's
        chunks, or a growth's) that the memory system cannot back.

        Raises :class:`~sharedarrays.OutOfMemory` with the size and what is available. Host
        memory is taken only when first touched, so the host backend checks what is
        available now; CUDA takes device memory when a chunk is made, and fails there.
        """
        ...

    def create_chunk(self, size: int) -> Chunk:
        """Allocate a chunk of ``size`` bytes (a multiple of the granularity) and export it."""
        ...

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Called once on each chunk this process made, after mapping it (before its handle
        leaves the process): forbid what must never change of it (a host chunk's size); with
        ``readonly``, forbid every new write to it in every process, this one included (the
        mappings made so far keep their access).

        Returns whether the memory system enforces ``readonly`` (host:
        ``F_SEAL_FUTURE_WRITE``); ``False`` where read-only is each importer's own access
        setting, which a process of the same user may change (CUDA).
        """
        ...

    def reopen_readonly(self, fd: int) -> int | None:
        """A new handle of the same chunk that can only be mapped read-only, or ``None``
        where the memory system has no such handle (CUDA: access is then set by the
        importer, and a read-only export is a promise, not a guarantee)."""
        ...

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from an exported handle: ``fd`` (mapping backends; cuda-pool's pool
        fd, or ``-1`` once this process has that pool) and ``export`` (pointer backends).

        Takes ownership of ``fd`` on success and on failure (it is closed if the import
        fails or the backend does not keep it). Raises :class:`~sharedarrays.PayloadError`
        if the handle does not describe a chunk of ``size`` bytes, and
        :class:`~sharedarrays.HandleUnavailable` if its exporter no longer has it.
        """
        ...

    def release_chunk(self, chunk: Chunk) -> None:
        """Release this process's reference to a chunk and close its fd. Idempotent."""
        ...

    def synchronize(self) -> None:
        """Wait for all work this process queued that may touch mapped memory."""
        ...

    def as_native(self, view: NativeView) -> Any:
        """Wrap mapped memory as the device's native array type, without copying (where the
        device's native array type can address it; see each backend).

        ``view`` says where the array lies in the mapping and its layout (see
        :class:`NativeView`); its ``owner`` is kept alive by the returned array (and by
        every view of it).
        """
        ...

    def to_native(self, obj: Any) -> Any:
        """Convert ``obj`` to an array of this device's native type (may copy)."""
        ...

    def current_device(self) -> int:
        """The index of the device of this backend's kind that this process works on now
        (CUDA: CuPy's or PyTorch's current device), else the memory's own device's."""
        ...

    def export_sync(self) -> bytes | None:
        """Record, now, what an importer must wait for before using memory handed off now.

        Returns opaque bytes (an ordering token), or ``None`` where no ordering is needed.
        """
        ...

    def export_fence(self) -> object | None:
        """The ordering argument of one message (a pickling) that hands memory off now.

        ``None`` where no ordering is needed; else an object whose ``token`` attribute is
        :meth:`export_sync`'s token (bytes, or ``None`` for nothing to wait for), which the
        message carries, and which is shared by every call of this thread while it is alive,
        so every array of one pickling (whose memo keeps it alive) shares one record,
        written once.
        """
        ...

    def import_sync(self, token: bytes) -> None:
        """Make this process's current work wait for the point recorded by :meth:`export_sync`."""
        ...


@runtime_checkable
class MappingBackend(Backend, Protocol):
    """A backend whose chunks are mapped into reservations (``maps`` is true): the host
    backend and cuda-vmm. Chunk sizes and mapping offsets are multiples of the granularity."""

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of address space and return its start address."""
        ...

    def free_reservation(self, address: int, size: int) -> None:
        """Give back a reservation made by :meth:`reserve` (nothing may be mapped in it)."""
        ...

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map ``size`` bytes of ``chunk`` from ``chunk_offset`` at ``address``."""
        ...

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """Set the access of the owning device to a mapped range, and of ``peers`` (other
        devices of the same kind, by index, each with its own access) where the memory
        system has them (CUDA; the host has none and refuses any)."""
        ...

    def unmap(self, address: int, size: int) -> None:
        """Unmap a range mapped by :meth:`map`, after work that may use it has finished."""
        ...


class ValueReader(Protocol):
    """Reads 64-bit words of device memory now, without waiting for any stream."""

    def read(self, address: int) -> int:
        """The word at ``address``."""
        ...

    def close(self) -> None:
        """Release what it holds. Idempotent."""
        ...


@runtime_checkable
class StreamBackend(Backend, Protocol):
    """A backend whose work is queued on streams (CUDA): stream-ordered 64-bit values and
    external semaphores, each on the current stream of the backend's device.

    Attributes
    ----------
    values_refused : str or None
        Why :meth:`write_value` and :meth:`wait_value` cannot be used on this backend's
        memory (a sentence saying what to use instead), or ``None`` when they can.
    """

    values_refused: ClassVar[str | None]

    def current_stream(self) -> int:
        """The stream work is queued on here (as an int)."""
        ...

    def write_value(self, address: int, value: int) -> None:
        """Enqueue a write of the 64-bit ``value`` at device ``address`` on the current
        stream (done once the stream's earlier work is)."""
        ...

    def wait_value(self, address: int, value: int) -> None:
        """Make the current stream's later work wait until the 64-bit word at ``address`` is
        at least ``value``."""
        ...

    def value_reader(self) -> ValueReader:
        """A reader of 64-bit words of this device's memory that waits for no stream (its
        own private one), released by its ``close`` or when it is freed."""
        ...

    def import_semaphore(self, fd: int, timeline: bool) -> object:
        """Import an external semaphore exported as a file descriptor (a binary one, or a
        timeline with ``timeline``); takes ownership of ``fd`` (closed on failure too).
        The handle returned is released by :meth:`destroy_semaphore` or when it is freed."""
        ...

    def signal_semaphore(self, semaphore: object, value: int) -> None:
        """Enqueue a signal of an imported semaphore (to ``value``, timelines) on the
        current stream."""
        ...

    def wait_semaphore(self, semaphore: object, value: int) -> None:
        """Make the current stream wait for an imported semaphore (to reach ``value``,
        timelines)."""
        ...

    def destroy_semaphore(self, semaphore: object) -> None:
        """Release an imported semaphore now. Idempotent."""
        ...


@runtime_checkable
class BorrowingBackend(Backend, Protocol):
    """A pointer backend that can share memory another library allocated (cuda-ipc), for
    :func:`sharedarrays.share`."""

    def borrow_chunk(self, pointer: int, owner: object) -> tuple[Chunk, int]:
        """The chunk of the allocation that holds ``pointer`` (holding ``owner``, which keeps
        that memory allocated) and ``pointer``'s offset in it; raises
        :class:`~sharedarrays.NotShareable` where the memory cannot be exported."""
        ...
