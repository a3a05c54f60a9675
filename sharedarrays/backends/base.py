"""The Backend protocols (a backend makes and imports *chunks*: mapping backends map them into
reservations, pointer backends give one per allocation; optional methods: ``native_memory``,
``native_view``, ``native_intact``, ``admit(chunk, pid)``, ``fill(native, value)``), and what
the backends share."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import importlib.util
import operator
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np

from sharedarrays.backends.device import Device
from sharedarrays.errors import BackendUnavailable, fd_limit_error
from sharedarrays.process import STATE

Access = Literal["rw", "r", "none"]
"""Who may touch a mapping: read-write, read-only, or nobody."""

DType = np.dtype[Any]
Shape = tuple[int, ...]  # a shape, or byte strides


def round_up(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple`` (a positive int)."""
    return -(-n // multiple) * multiple


def installed(module: str) -> bool:
    """Whether the optional ``module`` is imported or importable (searched once)."""
    return module in sys.modules or _findable(module)


@functools.cache
def _findable(module: str) -> bool:
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
    """Why a driver, device or feature is unusable (``None``: usable): ``probe()`` once per
    ``key``. Never raises: an exception answers ``"{what} failed (...)"``, not cached."""
    state = STATE.backends
    with state.driver_lock:
        if key not in state.reasons:
            try:
                state.reasons[key] = probe()
            except Exception as exc:  # a broken installation must not break list_backends()
                return f"{what} failed ({type(exc).__name__}: {exc})"
        return state.reasons[key]


@dataclass
class Chunk:
    """One physical allocation owned by this process: ``size`` in bytes, the native ``handle``
    (``-1`` once released), the exported ``fd`` kept to serve importers (``-1``: none), a
    pointer backend's ``address`` and portable ``export``, whether it was ``imported``, and
    the ``owner`` of memory borrowed from another library (dropped, not freed, on release)."""

    size: int
    handle: int
    fd: int
    address: int = 0
    export: bytes = b""
    imported: bool = False
    owner: object = None


class NativeView(NamedTuple):
    """What :meth:`Backend.as_native` shows: a mapped range, the first element's ``offset``,
    the ``owner`` to keep alive, the layout, and the peer device reading it (``None``: own)."""

    address: int
    size: int
    offset: int
    owner: object
    dtype: DType
    shape: Shape
    strides: Shape
    readonly: bool
    device_index: int | None = None


@runtime_checkable
class Backend(Protocol):
    """One memory system on one ``device``: its ``name``, whether new chunks are ``zeroed``,
    whether it ``maps`` (a :class:`MappingBackend`), whether memory is ``exporter_owned``
    (lives only while its exporter keeps it), and whether it grants ``peer_access``."""

    name: ClassVar[str]
    zeroed: ClassVar[bool]
    maps: ClassVar[bool]
    exporter_owned: ClassVar[bool]
    peer_access: ClassVar[bool]
    device: Device

    @property
    def granularity(self) -> int:
        """Chunk sizes and mapping offsets are multiples of this many bytes."""

    def check_memory(self, nbytes: int) -> None:
        """Refuse ``nbytes`` of new memory the system cannot back (``OutOfMemory``)."""

    def create_chunk(self, size: int) -> Chunk:
        """Allocate a chunk of ``size`` bytes (a multiple of the granularity) and export it."""

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Forbid resizing (and with ``readonly`` writes) before the handle leaves; whether
        ``readonly`` is enforced."""

    def reopen_readonly(self, fd: int) -> int | None:
        """A new handle of the same chunk that maps read-only only, or ``None``."""

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        """Import a chunk from ``fd`` (or ``-1``) and ``export``; takes ``fd``, also on
        failure. ``PayloadError``: no chunk of ``size`` bytes; ``HandleUnavailable``: gone."""

    def release_chunk(self, chunk: Chunk) -> None:
        """Release this process's reference to a chunk and close its fd. Idempotent."""

    def synchronize(self) -> None:
        """Wait for all work this process queued that may touch mapped memory."""

    def as_native(self, view: NativeView) -> Any:
        """Mapped memory as the device's native array type, keeping ``view.owner`` alive."""

    def to_native(self, obj: Any) -> Any:
        """``obj`` as an array of this device's native type (may copy)."""

    def current_device(self) -> int:
        """The index of the device of this kind this process works on now."""

    def export_sync(self) -> bytes | None:
        """What an importer must wait for before using memory handed off now (a token)."""

    def export_fence(self) -> object | None:
        """The ordering of one message: ``None``, or an object with a ``token``."""

    def import_sync(self, token: bytes) -> None:
        """Make this process's current work wait for what :meth:`export_sync` recorded."""


@runtime_checkable
class MappingBackend(Backend, Protocol):
    """A backend whose chunks are mapped into reservations (``maps`` is true)."""

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of address space; its start address."""

    def free_reservation(self, address: int, size: int) -> None:
        """Give back a reservation made by :meth:`reserve` (nothing may be mapped in it)."""

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map ``size`` bytes of ``chunk`` from ``chunk_offset`` at ``address``."""

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """Set the device's access to a mapped range, and that of ``peers`` (by index)."""

    def unmap(self, address: int, size: int) -> None:
        """Unmap a range mapped by :meth:`map`, after work that may use it has finished."""


class ValueReader(Protocol):
    """Reads 64-bit words of device memory now, without waiting for any stream."""

    def read(self, address: int) -> int: ...
    def close(self) -> None: ...


@runtime_checkable
class StreamBackend(Backend, Protocol):
    """A backend queueing work on streams (CUDA): 64-bit values and external semaphores;
    ``values_refused``: why values cannot be used on its memory, or ``None``."""

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
        """The chunk holding ``pointer`` (keeping ``owner``) and the offset in it;
        ``NotShareable`` where it cannot be exported."""


class DeviceBase:
    """What backends share: the device, fork detection, size checks, no sealing, and ordering
    by synchronising the device at handoff (importers wait for nothing; CUDA's differs)."""

    name: ClassVar[str]
    peer_access: ClassVar[bool]
    calls: ClassVar[type[VendorCalls]]  # the vendor's table (VMM and pool backends)
    # whether an importer may take the chunks' fds from their exporter (pidfd_getfd: no
    # request); off where a taken fd's import is not yet tested on the device (HIP)
    fds_taken: ClassVar[bool] = False
    device: Device
    _pid: int

    if TYPE_CHECKING:  # what the backend and the vendor's device base class provide

        @property
        def granularity(self) -> int: ...
        def context(self) -> contextlib.AbstractContextManager[None]: ...
        def synchronize(self) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    def _take(self, device: Device, kind: str, what: str, why: Callable[[int], str | None]) -> None:
        if device.kind != kind:
            raise BackendUnavailable(f"the {self.name} backend needs {what}, not {device}")
        reason = why(device.index)
        if reason is not None:
            raise BackendUnavailable(f"cannot use {device}: {reason}")
        self.device = device
        self._pid = os.getpid()

    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def _refuse_forked(self, runtime: str) -> None:
        if self._forked():
            raise BackendUnavailable(
                f"cannot use {self.device}: this backend object was inherited through fork, "
                f"and {runtime} cannot be used in such a child; start worker processes with "
                "the 'spawn' or 'forkserver' start method"
            )

    def _check_size(self, size: int, what: str, error: type[Exception] = ValueError) -> None:
        if size <= 0 or size % self.granularity:
            raise error(
                f"{what} must be a positive multiple of {self.device}'s granularity "
                f"({self.granularity} bytes), got {size}"
            )

    def check_memory(self, nbytes: int) -> None:
        """Nothing to check: the driver fails when a chunk is made."""

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        return False

    def reopen_readonly(self, fd: int) -> int | None:
        return None

    def export_sync(self) -> bytes | None:
        self.synchronize()
        return None

    def export_fence(self) -> object | None:
        return self.export_sync()

    def import_sync(self, token: bytes) -> None:
        pass


class VendorCalls:
    """A GPU vendor's table of driver calls for :mod:`.vmm` and :mod:`.pool`: CUDA's and
    HIP's are the same calls and structs under two prefixes; a subclass names its enums and
    says what else differs. ``backend._d`` is the vendor's module."""

    vendor: ClassVar[str]  # its name in messages
    prefix: ClassVar[str]  # of every call's name
    type_prefix: ClassVar[str]  # of every memory struct's name
    fd_name: ClassVar[str]  # the POSIX fd handle type's name, in messages
    whole_chunks: ClassVar[str] = ""  # why it maps whole chunks only (for the message)
    not_an_allocation: ClassVar[frozenset[str]]  # errors importing an fd of no allocation
    invalid_value: ClassVar[str]  # the error mapping a chunk smaller than the range
    allocate_call: ClassVar[str]  # pool allocation (after the prefix)
    free_call: ClassVar[str]  # and its free
    # "Enum.MEMBER" of the module by use: fd_type, pinned, on_device, granularity, and the
    # access flags by Access
    enums: ClassVar[Mapping[str, str]]
    _check: Callable[[Any, str], Any]

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.device: Device = backend.device
        self._m = backend._d
        self.enum = {use: operator.attrgetter(name)(self._m) for use, name in self.enums.items()}
        self.fd_type = self.enum["fd_type"]

    def call(self, name: str, *args: Any, what: str = "") -> Any:
        """``{prefix}{name}(*args)``, checked (``what``: its arguments, for messages)."""
        return self._check(getattr(self._m, self.prefix + name)(*args), self.prefix + name + what)

    def allocating(self, thing: str, nbytes: int, name: str, *args: Any, what: str = "") -> Any:
        """:meth:`call` taking ``nbytes`` for ``thing`` (CUDA explains running out)."""
        return self.call(name, *args, what=what)

    def handle(self, handle: int) -> Any:  # a VMM handle as the calls take it
        return handle

    def located(self, struct: str, index: int) -> Any:
        """A new ``{type_prefix}{struct}`` whose location is device ``index``."""
        obj = getattr(self._m, self.type_prefix + struct)()
        obj.location.type = self.enum["on_device"]
        obj.location.id = index
        return obj

    @functools.cached_property
    def prop(self) -> Any:
        """The properties of a VMM allocation on the device, exportable as a POSIX fd."""
        prop = self.located("AllocationProp", self.device.index)
        prop.type = self.enum["pinned"]
        # ROCm 7 renamed requestedHandleType to requestedHandleTypes
        plural = hasattr(prop, "requestedHandleTypes")
        setattr(prop, "requestedHandleTypes" if plural else "requestedHandleType", self.fd_type)
        return prop

    def location(self, handle: int) -> int | None:  # a VMM chunk's device; None: not asked
        return None

    def access(self, index: int, access: Access) -> Any:  # a descriptor for device index
        desc = self.located("AccessDesc", index)
        desc.flags = self.enum[access]
        return desc

    if TYPE_CHECKING:  # each vendor's: the new fd of an export call (none left open on
        # failure), the stream pool allocations are made on, a pool pointer's export data

        def export_fd(self, name: str, *args: Any) -> int: ...
        def stream(self) -> int: ...
        def export_pointer(self, pointer: int) -> bytes: ...
        def import_pointer(self, pool: Any, data: bytes) -> int: ...
