"""The Backend protocols: what every memory system provides, and what the accelerator
backends share.

A backend makes and imports *chunks* (physical allocations with an exported handle) and wraps
memory as its device's native array type. **Mapping** backends (``host``, ``*-vmm``) also
reserve address ranges and map chunks there; their handles are fds, and the memory lives while
any process holds one. **Pointer** backends (``cuda-ipc``, ``*-pool``, ``ascend``) hand out
memory at the driver's address, one chunk per allocation, with portable bytes as handle; it
lives only while its exporter keeps it. A method that creates an OS resource returns its owner
or raises having released everything it made.

Optional methods, looked up with ``getattr``: ``native_memory``, ``native_view`` and
``native_intact`` together (one native memory object per allocation, cheap views of it, and
whether a view kept its layout; else :meth:`Backend.as_native` makes each), and ``admit(chunk,
pid)``, called before a chunk's export goes to ``pid`` (``ascend``'s trust list).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

from sharedarrays.backends.device import Device
from sharedarrays.errors import BackendUnavailable, PayloadError, fd_limit_error
from sharedarrays.process import STATE

__all__ = [
    "Access",
    "Chunk",
    "NativeView",
    "Backend",
    "MappingBackend",
    "StreamBackend",
    "BorrowingBackend",
    "ValueReader",
    "DeviceBase",
    "SyncOrdering",
    "VendorCalls",
    "installed",
    "loadable",
    "cached_reason",
    "fork_reason",
    "round_up",
]

Access = Literal["rw", "r", "none"]
"""Who may touch a mapping: read-write, read-only, or nobody."""


def round_up(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple`` (a positive int)."""
    return -(-n // multiple) * multiple


def installed(module: str) -> bool:
    """Whether the optional ``module`` is imported or importable (a failed search of the
    import path is made once per process)."""
    return module in sys.modules or _findable(module)


@functools.cache
def _findable(module: str) -> bool:
    """Whether the import path has ``module`` (answers are cached, not exceptions: a
    :class:`~sharedarrays.HandleUnavailable` with too many open files, else
    :class:`~sharedarrays.BackendUnavailable`)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
    except OSError as e:
        what = f"cannot search the import path for {module!r}"
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise fd_limit_error(what, str(e.strerror)) from None
        raise BackendUnavailable(f"{what}: {e}; try again") from None


def loadable(soname: str) -> bool:
    """Whether the shared library ``soname`` can be loaded."""
    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def cached_reason(key: tuple[Any, ...], probe: Callable[[], str | None], what: str) -> str | None:
    """Why a driver, device or feature is unusable here (``None``: it is usable): ``probe()``
    asked once per ``key`` (kept in ``STATE.backends.reasons``). Never raises: an exception is
    the answer ``"{what} failed (...)"``, not kept (the next call asks again)."""
    state = STATE.backends
    with state.driver_lock:
        if key not in state.reasons:
            try:
                state.reasons[key] = probe()
            except Exception as exc:  # a broken installation must not break list_backends()
                return f"{what} failed ({type(exc).__name__}: {exc})"
        return state.reasons[key]


def fork_reason(runtime: str) -> str:
    """Why a backend object inherited through fork refuses to call ``runtime``."""
    return (
        f"this backend object was inherited through fork, and {runtime} cannot be used in "
        "such a child; start worker processes with the 'spawn' or 'forkserver' start method"
    )


@dataclass
class Chunk:
    """One physical allocation and its exported handle, owned by this process.

    Attributes
    ----------
    size : int
        Size in bytes, a multiple of the backend's granularity.
    handle : int
        The native handle (memfd, VMM handle, or device pointer); ``-1`` once released.
    fd : int
        The exported fd, kept open to serve importers (host: the memfd; pools: the pool's,
        owned by the backend; ``-1`` where none, or once released).
    address : int
        Pointer backends: where the chunk is here (``0`` on mapping backends).
    export : bytes
        Pointer backends: the portable handle an importer opens (``b""`` on mapping ones).
    imported : bool
        Whether this process imported the chunk rather than made it.
    owner : object
        Memory borrowed from another library (:func:`sharedarrays.share`): what keeps it
        allocated; releasing the chunk drops it instead of freeing. ``None`` otherwise.
    """

    size: int
    handle: int
    fd: int
    address: int = 0
    export: bytes = b""
    imported: bool = False
    owner: object = None


class NativeView(NamedTuple):
    """A native array over mapped memory, the argument of every :meth:`Backend.as_native`:
    the whole mapped range (``address``, ``size``), the first element's ``offset`` in it,
    the ``owner`` to keep alive, the layout (``strides`` in bytes, may be negative), and the
    peer device reading it (``device_index``; ``None``: the memory's own)."""

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
        Its name in payloads and widgets (``"host"``, ``"cuda-vmm"``, ...).
    zeroed : bool
        Whether new chunks read as zeros (memfd does; cuMemCreate does not).
    maps : bool
        Whether it is a :class:`MappingBackend`; else an allocation is one chunk.
    exporter_owned : bool
        Whether the memory lives only while the exporter keeps it: importers must release
        it before the exporter frees it.
    peer_access : bool
        Whether other devices of the same kind may be given access to its mappings.
    device : Device
        The device whose memory it allocates.
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
        """Refuse, before any is made, ``nbytes`` of new memory the system cannot back
        (:class:`~sharedarrays.OutOfMemory` with the size and what is available)."""
        ...

    def create_chunk(self, size: int) -> Chunk:
        """Allocate a chunk of ``size`` bytes (a multiple of the granularity) and export it."""
        ...

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Once per chunk made here, after mapping it and before its handle leaves: forbid
        resizing, and with ``readonly`` every new write in every process. Whether the memory
        system enforces ``readonly`` (``False``: it is each importer's access setting)."""
        ...

    def reopen_readonly(self, fd: int) -> int | None:
        """A new handle of the same chunk that maps read-only only, or ``None``."""
        ...

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from ``fd`` (mapping backends; a pool's fd or ``-1``) and ``export``
        (pointer backends); takes ``fd``, also on failure. Raises
        :class:`~sharedarrays.PayloadError` for no chunk of ``size`` bytes,
        :class:`~sharedarrays.HandleUnavailable` where its exporter no longer has it."""
        ...

    def release_chunk(self, chunk: Chunk) -> None:
        """Release this process's reference to a chunk and close its fd. Idempotent."""
        ...

    def synchronize(self) -> None:
        """Wait for all work this process queued that may touch mapped memory."""
        ...

    def as_native(self, view: NativeView) -> Any:
        """Mapped memory as the device's native array type (no copy where that type can
        address it), keeping ``view.owner`` alive."""
        ...

    def to_native(self, obj: Any) -> Any:
        """``obj`` as an array of this device's native type (may copy)."""
        ...

    def current_device(self) -> int:
        """The index of the device of this kind this process works on now, else the
        memory's own."""
        ...

    def export_sync(self) -> bytes | None:
        """Record what an importer must wait for before using memory handed off now: an
        ordering token, or ``None``."""
        ...

    def export_fence(self) -> object | None:
        """The ordering argument of one message: ``None``, or an object whose ``token`` is
        :meth:`export_sync`'s, shared by this thread's calls while alive."""
        ...

    def import_sync(self, token: bytes) -> None:
        """Make this process's current work wait for the point :meth:`export_sync` recorded."""
        ...


@runtime_checkable
class MappingBackend(Backend, Protocol):
    """A backend whose chunks are mapped into reservations (``maps`` is true)."""

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of address space; its start address."""
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
        """Set the owning device's access to a mapped range, and that of ``peers`` (other
        devices of the same kind, by index) where the memory system has them."""
        ...

    def unmap(self, address: int, size: int) -> None:
        """Unmap a range mapped by :meth:`map`, after work that may use it has finished."""
        ...


class ValueReader(Protocol):
    """Reads 64-bit words of device memory now, without waiting for any stream."""

    def read(self, address: int) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class StreamBackend(Backend, Protocol):
    """A backend whose work is queued on streams (CUDA): 64-bit values and external
    semaphores on its device's current stream; ``values_refused`` says why the values cannot
    be used on its memory, or is ``None``."""

    values_refused: ClassVar[str | None]

    def current_stream(self) -> int: ...

    def write_value(self, address: int, value: int) -> None: ...

    def wait_value(self, address: int, value: int) -> None: ...

    def value_reader(self) -> ValueReader: ...

    def import_semaphore(self, fd: int, timeline: bool) -> object: ...

    def signal_semaphore(self, semaphore: object, value: int) -> None: ...

    def wait_semaphore(self, semaphore: object, value: int) -> None: ...

    def destroy_semaphore(self, semaphore: object) -> None: ...


@runtime_checkable
class BorrowingBackend(Backend, Protocol):
    """A pointer backend that can share memory another library allocated (cuda-ipc)."""

    def borrow_chunk(self, pointer: int, owner: object) -> tuple[Chunk, int]:
        """The chunk of the allocation holding ``pointer`` (holding ``owner``) and
        ``pointer``'s offset in it; :class:`~sharedarrays.NotShareable` where it cannot be
        exported."""
        ...


class DeviceBase:
    """What the accelerator backends share: their device, fork detection, size checks, and
    no sealing (their handles carry no access mode: read-only is the importer's setting)."""

    name: ClassVar[str]
    device: Device
    _pid: int

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    @property
    def granularity(self) -> int:
        """Chunk sizes are multiples of this many bytes (each backend says)."""
        raise NotImplementedError

    def _take(self, device: Device, kind: str, what: str, why: Callable[[int], str | None]) -> None:
        """Serve ``device``, of ``kind`` (``what`` in messages), unless ``why`` says no."""
        if device.kind != kind:
            raise BackendUnavailable(f"the {self.name} backend needs {what}, not {device}")
        reason = why(device.index)
        if reason is not None:
            raise BackendUnavailable(f"cannot use {device}: {reason}")
        self.device = device
        self._pid = os.getpid()

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _refuse_forked(self, reason: str) -> None:
        """Raise :class:`~sharedarrays.BackendUnavailable` saying ``reason`` in a process
        that inherited this object through fork."""
        if self._forked():
            raise BackendUnavailable(f"cannot use {self.device}: {reason}")

    def _check_size(self, size: int, what: str) -> None:
        if size <= 0 or size % self.granularity:
            raise ValueError(
                f"{what} must be a positive multiple of the granularity "
                f"({self.granularity} bytes), got {size}"
            )

    def _check_import_size(self, size: int) -> None:
        if size <= 0 or size % self.granularity:
            raise PayloadError(
                f"chunk size {size} is not a positive multiple of {self.device}'s "
                f"granularity ({self.granularity} bytes)"
            )

    def check_memory(self, nbytes: int) -> None:
        """Nothing to check beforehand: the driver fails when a chunk is made."""

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Nothing to seal: the handle carries no access mode (read-only is a promise)."""
        return False

    def reopen_readonly(self, fd: int) -> int | None:
        """The handle carries no access mode: read-only is set by each importer."""
        return None


class VendorCalls:
    """A GPU vendor's driver calls for the shared VMM and pool backends (:mod:`.vmm`,
    :mod:`.pool`): CUDA's and HIP's are the same calls under two prefixes (``cu``, ``hip``),
    made here; a vendor's subclass says what differs (types, enums, out-parameters).

    Attributes
    ----------
    prefix : str
        Of every call's name.
    fd_type : object
        The POSIX fd handle type; ``fd_name`` its name in messages.
    """

    prefix: ClassVar[str]
    fd_name: ClassVar[str]
    fd_type: Any
    _m: Any  # the vendor's module
    _check: Callable[[Any, str], Any]

    def __init__(self, backend: Any) -> None:
        self.device: Device = backend.device

    def call(self, name: str, *args: Any, what: str = "") -> Any:
        """``{prefix}{name}(*args)``, checked (``what``: its arguments in messages)."""
        return self._check(getattr(self._m, self.prefix + name)(*args), self.prefix + name + what)

    def allocating(self, thing: str, nbytes: int, name: str, *args: Any, what: str = "") -> Any:
        """:meth:`call` of a call taking ``nbytes`` for ``thing`` (CUDA explains running
        out of memory)."""
        return self.call(name, *args, what=what)

    def export_fd(self, name: str, *args: Any) -> int:
        """The new fd of export call ``name`` of ``args`` (none left open on failure)."""
        raise NotImplementedError

    def handle(self, handle: int) -> Any:
        """A VMM handle as the calls take it."""
        return handle


class SyncOrdering:
    """Ordering by synchronising the device when memory is handed off (no interprocess
    events): an importer has nothing to wait for."""

    if TYPE_CHECKING:

        def synchronize(self) -> None: ...

    def export_sync(self) -> bytes | None:
        """Wait for the device's queued work now; no token."""
        self.synchronize()
        return None

    def export_fence(self) -> object | None:
        """See :meth:`export_sync`."""
        self.synchronize()
        return None

    def import_sync(self, token: bytes) -> None:
        """Nothing to wait for (see :meth:`export_sync`)."""
