"""The CUDA VMM backend: device memory shared through POSIX file descriptors.

CUDA's virtual memory management API, called through ``cuda.bindings.driver`` (the
tuple-returning driver bindings, ``err, value = driver.cuX(...)``):

=========== =================================================================
reservation ``cuMemAddressReserve`` (aligned to the granularity)
chunk       ``cuMemCreate`` (pinned device memory of this device, requested handle
            type ``POSIX_FILE_DESCRIPTOR``), exported once with
            ``cuMemExportToShareableHandle``; the fd is kept for the chunk's life
mapping     ``cuMemMap``
access      ``cuMemSetAccess`` for the owning device
handle      the exported fd; an importer turns it back into a chunk with
            ``cuMemImportFromShareableHandle`` and keeps it too, so it can serve it on
=========== =================================================================

Every driver call runs with the device's *primary context* current (the one CuPy, PyTorch
and the runtime API use). Where another context is current, the primary context is pushed
for the call and popped after it, so the caller's current device is never changed behind its
back; where none is current, it is made current and left so, as the runtime would.

Nothing here imports ``cuda.bindings`` or ``cupy`` at import time: :func:`why_unusable` and
:class:`CudaVmmBackend` import them on first use.

Fork safety
-----------
A process forked from one that had initialised CUDA cannot use CUDA. This module notices it
in three ways, each cheap:

1. It records the pid in which *it* called ``cuInit``; a child has another pid.
2. An ``os.register_at_fork`` hook asks, just before every fork, whether CUDA was
   initialised in the forking process by anyone (CuPy, PyTorch, ...): where
   ``cuda.bindings.driver`` is already imported, or CuPy or PyTorch is, ``cuCtxGetCurrent``
   answers ``CUDA_ERROR_NOT_INITIALIZED`` exactly when nobody called ``cuInit``. The child
   is marked. (The hook exists from the import of this module on: ``sharedarrays`` imports
   it early for that reason.)
3. PyTorch's own mark (``torch.cuda._is_in_bad_fork()``) where PyTorch is imported.

:func:`why_unusable` then says to use the ``spawn`` or ``forkserver`` start method, and a
backend object inherited through fork refuses to make driver calls (teardown calls become
no-ops there: the child's copy of the CUDA state is not usable, and its fds are closed).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from ..device import Device
from ..errors import BackendUnavailable, PayloadError, SharedArrayError
from .base import Access, Chunk

__all__ = [
    "CudaVmmBackend",
    "CudaDriverError",
    "CudaOutOfMemory",
    "why_unusable",
    "load_driver",
    "check",
    "INSTALL_HINT",
    "FORK_REASON",
]

INSTALL_HINT = "pip install 'sharedarrays[cuda13]'"

FORK_REASON = (
    "this process was forked from a process that had already initialised CUDA, and CUDA "
    "cannot be used in such a child; start worker processes with the 'spawn' or "
    "'forkserver' start method, e.g. multiprocessing.get_context('spawn') or "
    "concurrent.futures.ProcessPoolExecutor(mp_context=multiprocessing.get_context('spawn'))"
)

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_CUDA_ERROR_NOT_INITIALIZED = 3

# What cuMemImportFromShareableHandle answers for an fd that is no exported allocation.
_NOT_AN_ALLOCATION = frozenset(
    {
        "CUDA_ERROR_INVALID_VALUE",
        "CUDA_ERROR_INVALID_HANDLE",
        "CUDA_ERROR_NOT_SUPPORTED",
        "CUDA_ERROR_OPERATING_SYSTEM",
        "CUDA_ERROR_INVALID_DEVICE",
        "CUDA_ERROR_UNKNOWN",  # what driver 580 answers for a memfd or a closed fd
    }
)

# Modules whose presence means CUDA may have been initialised in this process.
_CUDA_USERS = ("cuda.bindings.driver", "cupy", "torch", "numba.cuda", "jax")


# --------------------------------------------------------------------------------------------
# errors


class CudaDriverError(SharedArrayError, OSError):
    """A CUDA driver call failed.

    Attributes
    ----------
    call : str
        The driver function (and what it was asked for).
    code : int
        The ``CUresult`` value.
    error_name : str
        Its name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
    """

    def __init__(self, call: str, code: int, error_name: str, description: str = "") -> None:
        self.call = call
        self.code = code
        self.error_name = error_name
        self.description = description
        message = f"{call} failed: {error_name}"
        if description:
            message += f" ({description})"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.code, self.error_name, self.description))


class CudaOutOfMemory(CudaDriverError, MemoryError):
    """The device has too little free memory for a chunk (``CUDA_ERROR_OUT_OF_MEMORY``)."""


def _error_name(err: Any) -> str:
    name = getattr(err, "name", None)
    return name if isinstance(name, str) else f"CUresult {int(err)}"


def _error_description(driver: Any, err: Any) -> str:
    try:
        res, text = driver.cuGetErrorString(err)
    except Exception:
        return ""
    if int(res) != _CUDA_SUCCESS or not text:
        return ""
    return text.decode(errors="replace") if isinstance(text, bytes) else str(text)


def _raise(err: Any, call: str) -> None:
    code = int(err)
    cls = CudaOutOfMemory if code == _CUDA_ERROR_OUT_OF_MEMORY else CudaDriverError
    raise cls(call, code, _error_name(err), _error_description(_driver, err))


def check(result: Any, call: str) -> Any:
    """Check the ``CUresult`` of a ``cuda.bindings.driver`` call and return its values.

    Parameters
    ----------
    result : tuple
        What the binding returned: ``(err,)``, ``(err, value)`` or ``(err, v1, v2, ...)``.
    call : str
        What was called, for the error message.

    Returns
    -------
    None, the value, or a tuple of the values.

    Raises
    ------
    CudaDriverError
        ``err`` is not ``CUDA_SUCCESS`` (:class:`CudaOutOfMemory` for out of memory).
    """
    err = result[0]
    if int(err) != _CUDA_SUCCESS:
        _raise(err, call)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


# --------------------------------------------------------------------------------------------
# loading the driver bindings, and whether CUDA can be used here

_driver: Any = None
_lock = threading.RLock()
_reasons: dict[int | None, str | None] = {}  # device index (None: the driver) -> reason
_reasons_pid = os.getpid()
_device_count = 0
_init_pid: int | None = None  # the pid in which this module's cuInit succeeded
_parent_had_cuda = False  # set just before a fork; read in the child
_forked_from_cuda = False  # this process is a fork child of a process that had CUDA


def load_driver() -> Any:
    """Import and return ``cuda.bindings.driver`` (raises ``ImportError`` if absent)."""
    global _driver
    if _driver is None:
        _driver = importlib.import_module("cuda.bindings.driver")
    return _driver


def _cuda_initialised_here() -> bool:
    """Best effort: has anyone called ``cuInit`` in this process?"""
    if _init_pid == os.getpid():
        return True
    if not any(name in sys.modules for name in _CUDA_USERS):
        return False
    try:
        driver = load_driver()
        err = driver.cuCtxGetCurrent()[0]
    except Exception:
        return False
    return int(err) != _CUDA_ERROR_NOT_INITIALIZED


def _before_fork() -> None:
    global _parent_had_cuda
    try:
        _parent_had_cuda = _cuda_initialised_here()
    except Exception:  # pragma: no cover - a fork hook must never raise
        _parent_had_cuda = False


def _after_fork_in_child() -> None:
    global _forked_from_cuda
    if _parent_had_cuda:
        _forked_from_cuda = True


def _after_fork_in_parent() -> None:
    global _parent_had_cuda
    _parent_had_cuda = False


os.register_at_fork(
    before=_before_fork, after_in_child=_after_fork_in_child, after_in_parent=_after_fork_in_parent
)


def _fork_reason() -> str | None:
    if _forked_from_cuda or (_init_pid is not None and _init_pid != os.getpid()):
        return FORK_REASON
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda._is_in_bad_fork():
                return FORK_REASON
        except Exception:
            pass
    return None


def _driver_reason() -> str | None:
    """Why the driver cannot be used at all, or ``None``; sets ``_device_count``."""
    global _init_pid, _device_count
    try:
        driver = load_driver()
    except ImportError as exc:
        return (
            f"the CUDA backend needs the cuda-bindings package, which is not installed ({exc}): "
            f"{INSTALL_HINT}"
        )
    try:
        has_cupy = importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):
        has_cupy = False
    if not has_cupy:
        return (
            "the CUDA backend needs CuPy, which is not installed: "
            f"{INSTALL_HINT} (it installs cupy-cuda13x)"
        )
    try:
        (err,) = driver.cuInit(0)
    except RuntimeError as exc:  # cuda.bindings could not dlopen libcuda.so.1
        return (
            f"no NVIDIA driver: libcuda could not be loaded ({exc}); this machine needs an "
            "NVIDIA GPU and its driver"
        )
    name = _error_name(err)
    if int(err) == _CUDA_ERROR_NOT_INITIALIZED:
        return (
            f"cuInit failed with {name}; if this process was forked from one that had "
            "initialised CUDA, use the 'spawn' or 'forkserver' start method"
        )
    if name == "CUDA_ERROR_NO_DEVICE":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"no CUDA device is visible{where}: cuInit failed with CUDA_ERROR_NO_DEVICE"
    if int(err) != _CUDA_SUCCESS:
        text = _error_description(driver, err)
        return f"cuInit failed with {name}" + (f" ({text})" if text else "")
    _init_pid = os.getpid()
    err, count = driver.cuDeviceGetCount()
    if int(err) != _CUDA_SUCCESS:
        return f"cuDeviceGetCount failed with {_error_name(err)}"
    if count == 0:
        return "no CUDA device is visible (cuDeviceGetCount returned 0)"
    _device_count = int(count)
    return None


def _device_name(driver: Any, dev: Any) -> str:
    err, raw = driver.cuDeviceGetName(256, dev)
    if int(err) != _CUDA_SUCCESS:
        return "unknown device"
    text = raw.split(b"\0", 1)[0] if isinstance(raw, bytes) else str(raw)
    return text.decode(errors="replace") if isinstance(text, bytes) else text


def _device_reason(index: int) -> str | None:
    """Why device ``index`` cannot serve the backend, or ``None``."""
    if index < 0:
        return f"device index must be >= 0, got {index}"
    if index >= _device_count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return (
            f"device index {index} is out of range: {_device_count} CUDA device(s) visible "
            f"(cuda:0 to cuda:{_device_count - 1}{where})"
        )
    driver = load_driver()
    err, dev = driver.cuDeviceGet(index)
    if int(err) != _CUDA_SUCCESS:
        return f"cuDeviceGet({index}) failed with {_error_name(err)}"
    attr = driver.CUdevice_attribute
    wanted = (
        (
            attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            "does not support CUDA virtual memory management (cuMemCreate/cuMemMap)",
        ),
        (
            attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            "cannot export memory as POSIX file descriptors",
        ),
    )
    for attribute, lack in wanted:
        err, value = driver.cuDeviceGetAttribute(attribute, dev)
        if int(err) != _CUDA_SUCCESS:
            return f"cuDeviceGetAttribute({attribute.name}) failed with {_error_name(err)}"
        if not value:
            return (
                f"cuda:{index} ({_device_name(driver, dev)}) {lack}, which the cuda-vmm "
                "backend needs"
            )
    return None


def why_unusable(index: int | None = None) -> str | None:
    """Say why the CUDA VMM backend cannot be used here, or return ``None`` when it can.

    Cheap after the first call (the answer is cached per process and device), never raises,
    and imports nothing heavy: ``cuda.bindings`` is imported (and ``cuInit`` called) on the
    first call, CuPy is only looked for.

    Parameters
    ----------
    index : int, optional
        The device ordinal to check as well (default 0).

    Returns
    -------
    str or None
        A sentence naming what is missing and what to do: a package to install, no driver,
        a ``cuInit`` error, no device, an ordinal out of range, a device without VMM or
        POSIX-fd handles, or a process forked after CUDA was initialised.
    """
    global _reasons_pid
    idx = 0 if index is None else int(index)
    try:
        fork = _fork_reason()
        if fork is not None:
            return fork
        with _lock:
            if _reasons_pid != os.getpid():
                _reasons.clear()
                _reasons_pid = os.getpid()
            if None not in _reasons:
                _reasons[None] = _driver_reason()
            reason = _reasons[None]
            if reason is not None:
                return reason
            if idx not in _reasons:
                _reasons[idx] = _device_reason(idx)
            return _reasons[idx]
    except Exception as exc:  # never raise: this answers a question
        return f"checking CUDA failed unexpectedly ({type(exc).__name__}: {exc})"


# --------------------------------------------------------------------------------------------
# the backend


class CudaVmmBackend:
    """Device memory of one CUDA device, shared through exported fds (``"cuda-vmm"``).

    Parameters
    ----------
    device : Device
        A CUDA device (``Device("cuda", N)``).

    Raises
    ------
    BackendUnavailable
        :func:`why_unusable` gave a reason.

    Notes
    -----
    Chunks are pinned device memory of this device, ``requestedHandleTypes`` =
    ``POSIX_FILE_DESCRIPTOR``; sizes and mapping offsets are multiples of the recommended
    granularity (2 MiB on an H200). New chunks are not zeroed. The device's primary context
    is retained once and kept for the life of the process.
    """

    name: ClassVar[str] = "cuda-vmm"
    zeroed: ClassVar[bool] = False  # cuMemCreate does not clear memory

    def __init__(self, device: Device) -> None:
        if not device.is_cuda:
            raise BackendUnavailable(f"the cuda-vmm backend needs a CUDA device, not {device}")
        why = why_unusable(device.index)
        if why is not None:
            raise BackendUnavailable(f"cannot use {device}: {why}")
        self.device: Device = device
        self._pid = os.getpid()
        d = load_driver()
        self._d = d
        self._dev = check(d.cuDeviceGet(device.index), f"cuDeviceGet({device.index})")
        self._ctx = check(d.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._ctx_int = int(self._ctx)

        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        prop.requestedHandleTypes = (
            d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        self._prop = prop
        self._fd_type = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        with self.context():
            self._granularity = int(
                check(
                    d.cuMemGetAllocationGranularity(
                        prop,
                        d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                    ),
                    "cuMemGetAllocationGranularity",
                )
            )

        flags = d.CUmemAccess_flags
        self._access: dict[str, list[Any]] = {}
        for access, flag in (
            ("rw", flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE),
            ("r", flags.CU_MEM_ACCESS_FLAGS_PROT_READ),
            ("none", flags.CU_MEM_ACCESS_FLAGS_PROT_NONE),
        ):
            desc = d.CUmemAccessDesc()
            desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = device.index
            desc.flags = flag
            self._access[access] = [desc]

    def __repr__(self) -> str:
        return f"CudaVmmBackend({self.device})"

    @property
    def granularity(self) -> int:
        """The recommended allocation granularity of this device (2 MiB on an H200)."""
        return self._granularity

    # process and context --------------------------------------------------------------
    def _forked(self) -> bool:
        return os.getpid() != self._pid

    def context(self) -> contextlib.AbstractContextManager[None]:
        """Make this device's primary context current for a ``with`` block.

        Does nothing when it already is (the common case, and a cheap one: one
        ``cuCtxGetCurrent``); makes it current (and leaves it so) when no context is; pushes
        it and pops it afterwards when another context is current.

        Raises
        ------
        BackendUnavailable
            This backend object was inherited through ``fork``.
        """
        if self._forked():
            raise BackendUnavailable(f"cannot use {self.device}: {FORK_REASON}")
        current = check(self._d.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is not None and int(current) == self._ctx_int:
            return contextlib.nullcontext()
        return self._make_current(0 if current is None else int(current))

    @contextlib.contextmanager
    def _make_current(self, current_int: int) -> Iterator[None]:
        d = self._d
        if current_int == 0:
            check(d.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
            yield
        else:
            check(d.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
            try:
                yield
            finally:
                d.cuCtxPopCurrent()

    def mem_get_info(self) -> tuple[int, int]:
        """Free and total memory of the device in bytes (``cuMemGetInfo``)."""
        with self.context():
            free, total = check(self._d.cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def _check_size(self, size: int, what: str) -> None:
        if size <= 0 or size % self._granularity:
            raise ValueError(
                f"{what} must be a positive multiple of the granularity "
                f"({self._granularity} bytes), got {size}"
            )

    def _handle(self, chunk: Chunk) -> Any:
        if chunk.handle < 0:
            raise ValueError("the chunk was released")
        return self._d.CUmemGenericAllocationHandle(chunk.handle)

    # chunks -----------------------------------------------------------------------------
    def create_chunk(self, size: int) -> Chunk:
        """Allocate ``size`` bytes of pinned device memory and export its fd (once)."""
        self._check_size(size, "a chunk size")
        d = self._d
        with self.context():
            handle = check(
                d.cuMemCreate(size, self._prop, 0), f"cuMemCreate({size} bytes on {self.device})"
            )
            try:
                fd = int(
                    check(
                        d.cuMemExportToShareableHandle(handle, self._fd_type, 0),
                        "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)",
                    )
                )
            except BaseException:
                d.cuMemRelease(handle)
                raise
        try:
            os.set_inheritable(fd, False)
        except BaseException:
            os.close(fd)
            with self.context():
                d.cuMemRelease(handle)
            raise
        return Chunk(size=size, handle=int(handle), fd=fd)

    def reopen_readonly(self, fd: int) -> int | None:
        """CUDA's shareable fds carry no access mode: read-only is set by each importer
        with ``cuMemSetAccess`` (see ``set_access``)."""
        return None

    def import_chunk(self, fd: int, size: int) -> Chunk:
        """Import a chunk from an fd exported by :meth:`create_chunk` (in any process).

        Takes ownership of ``fd`` (closed on failure; kept open in the chunk on success so it
        can be served on). The driver cannot tell an imported chunk's size: a payload that
        claims more than the chunk holds fails later, in :meth:`map`.

        Raises
        ------
        PayloadError
            ``size`` is not a multiple of the granularity, the fd is not an exported CUDA
            allocation, or the chunk lives on another device.
        """
        d = self._d
        try:
            if size <= 0 or size % self._granularity:
                raise PayloadError(
                    f"chunk size {size} is not a positive multiple of {self.device}'s "
                    f"granularity ({self._granularity} bytes)"
                )
            with self.context():
                try:
                    handle = check(
                        d.cuMemImportFromShareableHandle(fd, self._fd_type),
                        "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)",
                    )
                except CudaDriverError as exc:
                    if exc.error_name in _NOT_AN_ALLOCATION:
                        raise PayloadError(
                            f"the handle is not an exported CUDA allocation: {exc}"
                        ) from exc
                    raise
                try:
                    prop = check(
                        d.cuMemGetAllocationPropertiesFromHandle(handle),
                        "cuMemGetAllocationPropertiesFromHandle",
                    )
                    where = int(prop.location.id)
                    if where != self.device.index:
                        raise PayloadError(
                            f"the chunk lives on cuda:{where} (as numbered in this process), "
                            f"not on {self.device}"
                        )
                except BaseException:
                    d.cuMemRelease(handle)
                    raise
        except BaseException:
            os.close(fd)
            raise
        try:
            os.set_inheritable(fd, False)
        except OSError:
            pass
        return Chunk(size=size, handle=int(handle), fd=fd)

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
                    check(
                        self._d.cuMemRelease(self._d.CUmemGenericAllocationHandle(handle)),
                        "cuMemRelease",
                    )
        finally:
            if fd >= 0:
                os.close(fd)

    # address space ----------------------------------------------------------------------
    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of device address space, aligned to the granularity."""
        self._check_size(size, "a reservation size")
        with self.context():
            ptr = check(
                self._d.cuMemAddressReserve(size, self._granularity, 0, 0),
                f"cuMemAddressReserve({size} bytes)",
            )
        return int(ptr)

    def free_reservation(self, address: int, size: int) -> None:
        """Give back a reservation (a no-op in a forked child)."""
        if self._forked():
            return
        with self.context():
            check(self._d.cuMemAddressFree(address, size), "cuMemAddressFree")

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        """Map the whole of ``chunk`` at ``address``.

        The range is not accessible until :meth:`set_access`. CUDA maps whole chunks only:
        ``size`` must be the chunk's size and ``chunk_offset`` 0. (``cuMemMap`` answers
        ``CUDA_ERROR_NOT_SUPPORTED`` for an offset into a device allocation or a part of
        one, on driver 580 with an H200, although its documentation allows both.)
        """
        self._check_size(size, "a mapping size")
        if chunk_offset != 0 or size != chunk.size:
            raise ValueError(
                "CUDA maps whole chunks only (cuMemMap supports no offset into, and no part "
                f"of, a device allocation): asked for {size} bytes from offset {chunk_offset} "
                f"of a chunk of {chunk.size} bytes"
            )
        with self.context():
            try:
                check(
                    self._d.cuMemMap(address, size, 0, self._handle(chunk), 0),
                    f"cuMemMap({size} bytes at {address:#x})",
                )
            except CudaDriverError as exc:
                if exc.error_name == "CUDA_ERROR_INVALID_VALUE":
                    raise PayloadError(
                        f"{exc}; the chunk may be smaller than its payload says"
                    ) from exc
                raise

    def set_access(self, address: int, size: int, access: Access) -> None:
        """Set this device's access to a mapped range: ``"rw"``, ``"r"`` or ``"none"``.

        Lowering access waits first (:meth:`synchronize`) for queued work that may still
        touch the range.
        """
        descs = self._access.get(access)
        if descs is None:
            raise ValueError(f"access must be 'rw', 'r' or 'none', not {access!r}")
        if access != "rw":
            self.synchronize()
        with self.context():
            check(
                self._d.cuMemSetAccess(address, size, descs, len(descs)),
                f"cuMemSetAccess({access!r}, {size} bytes at {address:#x})",
            )

    def unmap(self, address: int, size: int) -> None:
        """Wait for queued work (``cuMemUnmap`` does not), then unmap the range.

        A no-op in a forked child.
        """
        if self._forked():
            return
        self.synchronize()
        with self.context():
            check(self._d.cuMemUnmap(address, size), f"cuMemUnmap({size} bytes at {address:#x})")

    def synchronize(self) -> None:
        """Wait for all work queued in this device's primary context, on every stream."""
        with self.context():
            check(self._d.cuCtxSynchronize(), "cuCtxSynchronize")

    # arrays -----------------------------------------------------------------------------
    def as_native(
        self,
        address: int,
        size: int,
        offset: int,
        owner: object,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        readonly: bool,
    ) -> Any:
        """Wrap mapped memory as a ``cupy.ndarray``, without copying.

        The CuPy memory object spans the whole mapped range (``address``, ``size``), names
        this device explicitly and holds ``owner``, so every CuPy view keeps the mapping
        alive; the array starts ``offset`` bytes in. CuPy has no read-only arrays:
        ``readonly`` is the caller's to enforce.
        """
        import cupy

        memory = cupy.cuda.UnownedMemory(address, size, owner, self.device.index)
        pointer = cupy.cuda.MemoryPointer(memory, offset)
        return cupy.ndarray(shape, dtype=dtype, memptr=pointer, strides=strides)

    def to_native(self, obj: Any) -> Any:
        """Return ``obj`` as a ``cupy.ndarray`` on this device (copying only when needed).

        Accepts CuPy arrays, NumPy arrays, objects with ``__dlpack__`` (PyTorch tensors, JAX
        arrays; CUDA ones without a copy), objects with ``__cuda_array_interface__``, and
        anything ``numpy.asarray`` accepts. An array on another device is copied here.
        """
        import cupy

        index = self.device.index
        with cupy.cuda.Device(index):
            if isinstance(obj, cupy.ndarray):
                return obj if obj.device.id == index else obj.copy()
            if isinstance(obj, np.ndarray):
                return cupy.asarray(obj)
            dlpack_device = getattr(obj, "__dlpack_device__", None)
            if callable(dlpack_device) and hasattr(obj, "__dlpack__"):
                kind = int(dlpack_device()[0])
                if kind == 1:  # kDLCPU
                    return cupy.asarray(np.from_dlpack(obj))
                if kind in (2, 3, 13):  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
                    arr = cupy.from_dlpack(obj)
                    return arr if arr.device.id == index else arr.copy()
            if hasattr(obj, "__cuda_array_interface__"):
                arr = cupy.asarray(obj)
                return arr if arr.device.id == index else arr.copy()
            return cupy.asarray(np.asarray(obj))

    # ordering ---------------------------------------------------------------------------
    def export_sync(self) -> bytes | None:
        """Record an interprocess event on the current stream; see :mod:`sharedarrays.sync`."""
        from ..sync import export_sync

        return export_sync(self)

    def import_sync(self, token: bytes) -> None:
        """Make the current stream wait for an exported event; see :mod:`sharedarrays.sync`."""
        from ..sync import import_sync

        import_sync(self, token)
