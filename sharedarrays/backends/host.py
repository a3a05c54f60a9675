"""The host backend, CUDA VMM's model on Linux: a reservation is a ``PROT_NONE`` mapping, a
chunk a sealed memfd, mapping ``mmap(MAP_FIXED|MAP_SHARED)``, access ``mprotect`` (libc's:
Python's :mod:`mmap` cannot map at a fixed address)."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os
import types
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

from sharedarrays.backends.base import Access, Chunk, DeviceBase, DType, NativeView, Shape
from sharedarrays.backends.device import CPU, Device
from sharedarrays.backends.registry import Registration, register
from sharedarrays.errors import (
    BackendUnavailable,
    HandleUnavailable,
    OutOfMemory,
    PayloadError,
    PermissionDenied,
    fd_limit_error,
)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_PLACEHOLDER = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE  # a reservation: no swap
_PROT = types.MappingProxyType(
    {"rw": mmap.PROT_READ | mmap.PROT_WRITE, "r": mmap.PROT_READ, "none": 0}
)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; not in fcntl


def check_chunk_fd(fd: int, size: int) -> None:
    """Refuse (``PayloadError``) a received handle but a memfd of ``size`` bytes sealed
    against shrinking (else its sender could crash us with ``SIGBUS``); keeps ``fd``."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        actual = os.fstat(fd).st_size
    except OSError as e:
        raise PayloadError(
            f"the handle received for a host chunk is not a memfd ({e.strerror}): it was not "
            "made by sharedarrays; load only payloads of arrays made by this user's processes"
        ) from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise PayloadError(
            "the handle received for a host chunk is a memfd that is not sealed against "
            "shrinking (its sender could make this process crash with SIGBUS): it was not "
            "made by sharedarrays; load only payloads of arrays made by this user's processes"
        )
    if actual != size:
        raise PayloadError(
            f"the handle describes {actual} bytes but the payload says {size}; "
            "the payload does not belong to this allocation"
        )


@functools.cache
def _read_overcommit() -> int:
    with open("/proc/sys/vm/overcommit_memory", "rb") as f:
        return int(f.read())


def _overcommit_mode() -> int:
    """``vm.overcommit_memory`` (0 heuristic, 1 always, 2 strict); 0 if unreadable."""
    try:
        return _read_overcommit()
    except (OSError, ValueError):
        return 0


def memory_available() -> tuple[int, str] | None:
    """Bytes a new host chunk may use and how that was reckoned (``MemAvailable + SwapFree``,
    under strict overcommit at most ``CommitLimit - Committed_AS``), or ``None``."""
    mode = _overcommit_mode()
    if mode == 1:
        return None
    info: dict[bytes, int] = {}
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                fields = rest.split()
                if fields:
                    info[key] = int(fields[0]) * 1024  # kB
    except (OSError, ValueError):
        return None
    if b"MemAvailable" not in info:
        return None
    free, swap = info[b"MemAvailable"], info.get(b"SwapFree", 0)
    available = free + swap
    how = f"MemAvailable {_gib(free)} + SwapFree {_gib(swap)} in /proc/meminfo"
    if mode == 2 and b"CommitLimit" in info and b"Committed_AS" in info:
        commit = max(info[b"CommitLimit"] - info[b"Committed_AS"], 0)
        if commit < available:
            available = commit
            how = (
                "CommitLimit - Committed_AS in /proc/meminfo, vm.overcommit_memory=2 "
                "(MemAvailable + SwapFree would allow more)"
            )
    return available, how


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _check_mmap(result: int | None, what: str) -> int:
    _check(int(result is None or result == _MAP_FAILED), what)
    return result  # type: ignore[return-value]


_BYTES = np.dtype(np.uint8)
Array = np.ndarray[Any, Any]


class _HostMemory:
    """A mapped range for NumPy, which keeps it (and ``owner``) alive."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, view: NativeView) -> None:
        address, _, offset, self.owner, dtype, shape, strides, readonly, _ = view
        interface = {
            "version": 3,
            "shape": shape,
            "typestr": dtype.str,
            "strides": strides,
            "data": (address + offset, readonly),
        }
        if dtype.names is not None:  # only a structured dtype needs its fields spelled out
            interface["descr"] = dtype.descr
        self.__array_interface__ = interface


def host_view(view: NativeView) -> Array:
    """A NumPy array over memory the CPU addresses, keeping ``view.owner`` alive."""
    return np.asarray(_HostMemory(view))


def host_native(
    view: NativeView, addressable: bool, copy: Callable[[int, int, int], None]
) -> Array:
    """Device memory as NumPy: a view where the CPU addresses it, else a read-only copy by
    ``copy(destination, source, size)``."""
    if addressable:
        return host_view(view)
    buffer = np.empty(view.size, dtype=np.uint8)
    copy(buffer.ctypes.data, view.address, view.size)
    out: Array = np.ndarray(
        view.shape, dtype=view.dtype, buffer=buffer, offset=view.offset, strides=view.strides
    ).copy()
    out.flags.writeable = False
    return out


def to_numpy(obj: Any) -> Array:
    """``obj`` as a NumPy array (may copy; torch through ``.cpu()``, CuPy ``.get()``)."""
    if isinstance(obj, np.ndarray):
        return obj
    cpu = getattr(obj, "cpu", None)
    if callable(cpu) and hasattr(obj, "numpy"):
        return np.asarray(cpu().detach().numpy())
    get = getattr(obj, "get", None)
    if callable(get):
        return np.asarray(get())
    return np.asarray(obj)


class HostBackend(DeviceBase):
    """Host memory shared through memfd file descriptors (the ``"host"`` backend)."""

    name: ClassVar[str] = "host"
    zeroed: ClassVar[bool] = True
    maps: ClassVar[bool] = True
    exporter_owned: ClassVar[bool] = False
    peer_access: ClassVar[bool] = False
    fds_taken: ClassVar[bool] = True
    granularity = mmap.PAGESIZE

    def __init__(self, device: Device = CPU) -> None:
        self.device: Device = CPU

    def check_memory(self, nbytes: int) -> None:
        """Refuse more than :func:`memory_available` (a touch past it means ``SIGBUS`` or the
        OOM killer); up to half the free RAM passes on ``sysconf`` alone."""
        if _overcommit_mode() != 2 and nbytes <= os.sysconf("SC_AVPHYS_PAGES") * mmap.PAGESIZE // 2:
            return
        known = memory_available()
        if known is None or nbytes <= known[0]:
            return
        available, how = known
        raise OutOfMemory(
            f"cannot make {_gib(nbytes)} ({nbytes} bytes) of host memory: this machine has "
            f"{_gib(available)} ({available} bytes) available ({how}). Make the array smaller "
            "or in several parts, free memory (close other arrays and processes), or add swap"
        )

    def create_chunk(self, size: int) -> Chunk:
        """A memfd of ``size`` bytes, sealed against resizing."""
        try:
            fd = os.memfd_create("sharedarrays", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            raise fd_limit_error("cannot make a memfd for new memory", str(e.strerror)) from None
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        except BaseException:
            os.close(fd)
            raise
        return Chunk(size=size, handle=fd, fd=fd)

    def seal(self, chunk: Chunk, readonly: bool) -> bool:
        """Forbid further seals and with ``readonly`` new writes (Linux 5.1)."""
        try:
            fcntl.fcntl(
                chunk.fd, fcntl.F_ADD_SEALS, (_F_SEAL_FUTURE_WRITE if readonly else 0) | _SEALS
            )
        except OSError as e:
            if not readonly or e.errno != errno.EINVAL:
                raise
            raise BackendUnavailable(
                "readonly=True on host memory needs Linux 5.1 or later (F_SEAL_FUTURE_WRITE), "
                f"and this kernel is {os.uname().release}; leave out readonly= (and share the "
                "array only with processes you trust not to write), or update the kernel"
            ) from None
        return True

    def reopen_readonly(self, fd: int) -> int | None:
        """Open the memfd again ``O_RDONLY`` (against mistakes; :meth:`seal` stops the rest)."""
        try:
            return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            what = "cannot open a read-only handle of the array's memory to hand it on"
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise fd_limit_error(what, str(e.strerror)) from None
            raise HandleUnavailable(f"{what}: {e.strerror or e} (is /proc mounted?)") from None

    def import_chunk(self, fd: int, size: int, export: bytes = b"") -> Chunk:
        try:
            check_chunk_fd(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return Chunk(size=size, handle=fd, fd=fd)

    def release_chunk(self, chunk: Chunk) -> None:
        if chunk.fd >= 0:
            fd, chunk.fd, chunk.handle = chunk.fd, -1, -1
            os.close(fd)

    def reserve(self, size: int) -> int:
        address: int | None = _libc.mmap(None, size, 0, _PLACEHOLDER, -1, 0)
        if address is None or address == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OutOfMemory(
                f"cannot reserve {_gib(size)} ({size} bytes) of address space in this process "
                f"(mmap: {os.strerror(err)}). Ask for less (a smaller capacity=), or raise the "
                "process's address-space limit (ulimit -v)"
            )
        return address

    def free_reservation(self, address: int, size: int) -> None:
        _check(_libc.munmap(address, size), "free reservation")

    def map(self, address: int, size: int, chunk: Chunk, chunk_offset: int = 0) -> None:
        got = _libc.mmap(address, size, 0, mmap.MAP_SHARED | _MAP_FIXED, chunk.fd, chunk_offset)
        if got is None or got == _MAP_FAILED:
            err = ctypes.get_errno()
            if err == errno.ENOMEM:
                raise OutOfMemory(
                    f"cannot map {size} bytes of host memory: this process has too many "
                    "mappings (vm.max_map_count) or no address space left. Close arrays it "
                    "no longer needs (a.close()), or use fewer, larger chunks"
                )
            raise PayloadError(
                f"cannot map the handle received for a host chunk (mmap: {os.strerror(err)}): "
                "it was not made by sharedarrays; load only payloads of arrays made by this "
                "user's processes"
            )

    def set_access(
        self, address: int, size: int, access: Access, peers: Mapping[int, Access] | None = None
    ) -> None:
        """``mprotect``; the kernel refuses write access to a sealed read-only chunk."""
        if peers:
            raise ValueError("host memory has no peer devices: access= takes 'cpu' only")
        if _libc.mprotect(address, size, _PROT[access]) != 0:
            err = ctypes.get_errno()
            if err in (errno.EACCES, errno.EPERM):
                raise PermissionDenied(
                    "this memory was made readonly=True by its creator and cannot be mapped "
                    "writable here (its memfd is sealed against writing). Load it from an "
                    "unaltered payload, which says readonly, and read it only"
                )
            if err == errno.ENOMEM:
                raise OutOfMemory(
                    f"cannot set access to {size} bytes of host memory: this process has too "
                    "many mappings (vm.max_map_count). Close arrays it no longer needs"
                )
            raise OSError(err, f"set access: {os.strerror(err)}")  # pragma: no cover - a bug

    def unmap(self, address: int, size: int) -> None:
        # put the PROT_NONE placeholder back: a hole could be taken by another mmap
        _check_mmap(_libc.mmap(address, size, 0, _PLACEHOLDER | _MAP_FIXED, -1, 0), "unmap")

    def synchronize(self) -> None:  # host memory is accessed synchronously
        pass

    as_native = staticmethod(host_view)

    def native_memory(
        self, address: int, size: int, owner: object, readonly: bool, device_index: int | None
    ) -> Array:
        return host_view(NativeView(address, size, 0, owner, _BYTES, (size,), (1,), readonly))

    def native_view(
        self, base: Array, offset: int, dtype: DType, shape: Shape, strides: Shape, readonly: bool
    ) -> Array:
        view: Array = np.ndarray(shape, dtype, buffer=base, offset=offset, strides=strides)
        if readonly:
            view.flags.writeable = False
        return view

    def native_intact(
        self, native: Array, dtype: DType, shape: Shape, strides: Shape, readonly: bool
    ) -> bool:
        return (
            native.shape == shape
            and native.strides == strides
            and native.dtype == dtype
            and native.flags.writeable is not readonly
        )

    def to_native(self, obj: Any) -> Array:
        if isinstance(obj, np.ndarray) or hasattr(obj, "__cuda_array_interface__"):
            return to_numpy(obj)
        if hasattr(obj, "__dlpack__") and not hasattr(obj, "__array__"):
            return np.from_dlpack(obj)
        return np.asarray(obj)

    def current_device(self) -> int:
        return 0


register(Registration.of(HostBackend, "cpu", 0, check_handle=check_chunk_fd))
