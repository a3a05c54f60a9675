"""A simulated HIP runtime with hip-python's interface (``from hip import hip``), over memfd.

What it keeps of the real one, because ``sharedarrays.backends.hip`` depends on it:

- calls return tuples ``(hipError_t, value...)``, with HIP's error codes;
- ``hipMemCreate`` needs a size that is a multiple of the minimum granularity (4 KiB here,
  recommended 2 MiB, like an MI300) and makes a *pinned* chunk that is not cleared;
- a chunk exports a POSIX fd only if it was created asking for that handle type
  (``hipErrorNotSupported`` otherwise), and each export gives a new fd;
- an imported fd must be an exported allocation (``hipErrorInvalidValue`` otherwise), and
  each import gives a new handle;
- the memory lives while a handle, an exported fd or a mapping of it exists anywhere (the
  kernel's reference counting of the memfd, as the driver's own);
- ``hipMemMap`` maps into a reservation only, whole chunks only (a size larger than the chunk
  is ``hipErrorInvalidValue``), and the range is inaccessible until ``hipMemSetAccess``;
- the device is integrated (``hipDeviceAttributeIntegrated`` is 1, as an APU): the CPU
  addresses its memory, so a NumPy array over a mapping reads and writes the device memory.

And of its memory pools, for its ``hip-pool`` backend:

- ``hipMemPoolCreate`` makes a pool that exports a POSIX fd only if created with that handle
  type; the pool is one memfd (mapped whole in each process that has it), whose first page
  records which allocations are alive, so that every process sees a free at once;
- ``hipMallocFromPoolAsync`` allocates from an own pool only (an imported one is
  ``hipErrorInvalidValue``); ``hipMemPoolExportPointer`` fills 64 bytes (any writable
  buffer, as hip-python accepts for ``hipMemPoolPtrExportData*``) that
  ``hipMemPoolImportPointer`` turns back into a pointer, in a pool imported from that fd,
  while the allocation is alive (``hipErrorInvalidValue`` once its exporter freed it);
- ``hipFree`` frees an own allocation (its space is reused) or an imported pointer.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import mmap
import os
import secrets
import struct
import threading
from typing import Any

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
)  # fmt: skip
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000

MEMFD_NAME = "simulated-hip-allocation"
MIN_GRANULARITY = 4096
RECOMMENDED_GRANULARITY = 2 << 20
DEVICES = int(os.environ.get("SIMULATED_HIP_DEVICES", "1"))
TOTAL = 8 << 30


class hipError_t(enum.IntEnum):
    hipSuccess = 0
    hipErrorInvalidValue = 1
    hipErrorOutOfMemory = 2
    hipErrorNotInitialized = 3
    hipErrorNoDevice = 100
    hipErrorInvalidDevice = 101
    hipErrorMapFailed = 205
    hipErrorInvalidHandle = 400
    hipErrorNotSupported = 801


class hipMemAllocationType(enum.IntEnum):
    hipMemAllocationTypeInvalid = 0
    hipMemAllocationTypePinned = 1


class hipMemLocationType(enum.IntEnum):
    hipMemLocationTypeInvalid = 0
    hipMemLocationTypeDevice = 1


class hipMemAllocationHandleType(enum.IntEnum):
    hipMemHandleTypeNone = 0
    hipMemHandleTypePosixFileDescriptor = 1


class hipMemAllocationGranularity_flags(enum.IntEnum):
    hipMemAllocationGranularityMinimum = 0
    hipMemAllocationGranularityRecommended = 1


class hipMemAccessFlags(enum.IntEnum):
    hipMemAccessFlagsProtNone = 0
    hipMemAccessFlagsProtRead = 1
    hipMemAccessFlagsProtReadWrite = 3


class hipDeviceAttribute_t(enum.IntEnum):
    hipDeviceAttributeIntegrated = 38
    hipDeviceAttributeMemoryPoolsSupported = 95
    hipDeviceAttributeVirtualMemoryManagementSupported = 96


class hipMemLocation:
    def __init__(self) -> None:
        self.type = hipMemLocationType.hipMemLocationTypeInvalid
        self.id = 0


class hipMemAllocationProp:
    """ROCm 7's field name (``requestedHandleTypes``)."""

    def __init__(self) -> None:
        self.type = hipMemAllocationType.hipMemAllocationTypeInvalid
        self.requestedHandleTypes = hipMemAllocationHandleType.hipMemHandleTypeNone
        self.location = hipMemLocation()


class hipMemAccessDesc:
    def __init__(self) -> None:
        self.location = hipMemLocation()
        self.flags = hipMemAccessFlags.hipMemAccessFlagsProtNone


_PROT = {0: 0, 1: mmap.PROT_READ, 3: mmap.PROT_READ | mmap.PROT_WRITE}
_lock = threading.Lock()
_handles: dict[int, tuple[int, int, int]] = {}  # handle -> (memfd, size, handle type)
_reservations: dict[int, int] = {}  # start -> size
_mappings: dict[int, int] = {}  # start -> size
_next = [0x1000]
_current = threading.local()
E = hipError_t


def _new_handle(fd: int, size: int, kind: int) -> int:
    with _lock:
        _next[0] += 1
        _handles[_next[0]] = (fd, size, kind)
        return _next[0]


def hipGetDeviceCount() -> tuple[hipError_t, int]:
    return (E.hipSuccess, DEVICES) if DEVICES else (E.hipErrorNoDevice, 0)


def hipSetDevice(index: int) -> tuple[hipError_t]:
    if not 0 <= index < DEVICES:
        return (E.hipErrorInvalidDevice,)
    _current.index = index
    return (E.hipSuccess,)


def hipGetDevice() -> tuple[hipError_t, int]:
    return E.hipSuccess, getattr(_current, "index", 0)


def hipDeviceGetAttribute(attr: int, index: int) -> tuple[hipError_t, int]:
    if not 0 <= index < DEVICES:
        return E.hipErrorInvalidDevice, 0
    known = {
        hipDeviceAttribute_t.hipDeviceAttributeIntegrated: 1,
        hipDeviceAttribute_t.hipDeviceAttributeVirtualMemoryManagementSupported: 1,
        hipDeviceAttribute_t.hipDeviceAttributeMemoryPoolsSupported: 1,
    }
    if attr not in known:
        return E.hipErrorInvalidValue, 0
    return E.hipSuccess, known[hipDeviceAttribute_t(attr)]


def hipDeviceSynchronize() -> tuple[hipError_t]:
    return (E.hipSuccess,)  # the CPU does the work, synchronously


def hipMemGetInfo() -> tuple[hipError_t, int, int]:
    used = sum(size for _, size, _ in _handles.values())
    return E.hipSuccess, max(TOTAL - used, 0), TOTAL


def hipMemGetAllocationGranularity(prop: Any, option: int) -> tuple[hipError_t, int]:
    if prop.location.type != hipMemLocationType.hipMemLocationTypeDevice:
        return E.hipErrorInvalidValue, 0
    if option == hipMemAllocationGranularity_flags.hipMemAllocationGranularityRecommended:
        return E.hipSuccess, RECOMMENDED_GRANULARITY
    return E.hipSuccess, MIN_GRANULARITY


def hipMemCreate(size: int, prop: Any, flags: int) -> tuple[hipError_t, int]:
    if (
        size <= 0
        or size % MIN_GRANULARITY
        or flags != 0
        or prop.type != hipMemAllocationType.hipMemAllocationTypePinned
        or prop.location.type != hipMemLocationType.hipMemLocationTypeDevice
    ):
        return E.hipErrorInvalidValue, 0
    if not 0 <= prop.location.id < DEVICES:
        return E.hipErrorInvalidDevice, 0
    if size > hipMemGetInfo()[1]:
        return E.hipErrorOutOfMemory, 0
    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return E.hipSuccess, _new_handle(fd, size, int(prop.requestedHandleTypes))


def hipMemExportToShareableHandle(
    shareable: int, handle: int, handle_type: int, flags: int
) -> tuple[hipError_t]:
    entry = _handles.get(int(handle))
    if entry is None or flags != 0 or not shareable:
        return (E.hipErrorInvalidValue,)
    fd, _, kind = entry
    if handle_type != hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor:
        return (E.hipErrorInvalidValue,)
    if kind != handle_type:
        return (E.hipErrorNotSupported,)  # not requested at hipMemCreate
    ctypes.c_int.from_address(shareable).value = os.dup(fd)
    return (E.hipSuccess,)


def _is_allocation(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{MEMFD_NAME} (deleted)"
    except OSError:
        return False


def hipMemImportFromShareableHandle(os_handle: int, handle_type: int) -> tuple[hipError_t, int]:
    if handle_type != hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor:
        return E.hipErrorInvalidValue, 0
    fd = int(os_handle)
    if not _is_allocation(fd):
        return E.hipErrorInvalidValue, 0
    mine = os.dup(fd)
    os.set_inheritable(mine, False)
    return E.hipSuccess, _new_handle(mine, os.fstat(mine).st_size, int(handle_type))


def hipMemRelease(handle: int) -> tuple[hipError_t]:
    with _lock:
        entry = _handles.pop(int(handle), None)
    if entry is None:
        return (E.hipErrorInvalidValue,)
    os.close(entry[0])  # the memory goes with the last fd and mapping, in any process
    return (E.hipSuccess,)


def hipMemAddressReserve(
    size: int, alignment: int, addr: int, flags: int
) -> tuple[hipError_t, int]:
    if size <= 0 or size % MIN_GRANULARITY:
        return E.hipErrorInvalidValue, 0
    align = max(alignment, MIN_GRANULARITY)
    flags_ = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    raw = _libc.mmap(None, size + align, 0, flags_, -1, 0)
    if raw is None or raw == _MAP_FAILED:
        return E.hipErrorOutOfMemory, 0
    start = -(-raw // align) * align
    if start > raw:
        _libc.munmap(raw, start - raw)
    if raw + size + align > start + size:
        _libc.munmap(start + size, raw + size + align - start - size)
    with _lock:
        _reservations[start] = size
    return E.hipSuccess, start


def _in_reservation(ptr: int, size: int) -> bool:
    return any(s <= ptr and ptr + size <= s + n for s, n in _reservations.items())


def hipMemAddressFree(ptr: int, size: int) -> tuple[hipError_t]:
    with _lock:
        if _reservations.get(int(ptr)) != size:
            return (E.hipErrorInvalidValue,)
        if any(ptr <= m < ptr + size for m in _mappings):
            return (E.hipErrorInvalidValue,)  # still mapped
        del _reservations[int(ptr)]
    _libc.munmap(ptr, size)
    return (E.hipSuccess,)


def hipMemMap(ptr: int, size: int, offset: int, handle: int, flags: int) -> tuple[hipError_t]:
    entry = _handles.get(int(handle))
    if entry is None or flags != 0 or offset != 0:
        return (E.hipErrorInvalidValue,)
    fd, chunk_size, _ = entry
    if size != chunk_size or not _in_reservation(ptr, size):
        return (E.hipErrorInvalidValue,)
    got = _libc.mmap(ptr, size, 0, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
    if got != ptr:
        return (E.hipErrorMapFailed,)
    with _lock:
        _mappings[int(ptr)] = size
    return (E.hipSuccess,)


def hipMemSetAccess(ptr: int, size: int, descs: list[Any], count: int) -> tuple[hipError_t]:
    inside = any(m <= ptr and ptr + size <= m + n for m, n in _mappings.items())
    if count != len(descs) or not (inside or _covered(ptr, size)):
        return (E.hipErrorInvalidValue,)
    for desc in descs:
        if not 0 <= desc.location.id < DEVICES or int(desc.flags) not in _PROT:
            return (E.hipErrorInvalidValue,)
    if _libc.mprotect(ptr, size, _PROT[int(descs[0].flags)]) != 0:
        return (E.hipErrorInvalidValue,)
    return (E.hipSuccess,)


def _covered(ptr: int, size: int) -> bool:
    """Whether ``[ptr, ptr+size)`` is made of whole mappings, end to end."""
    at = ptr
    while at < ptr + size:
        n = _mappings.get(at)
        if n is None:
            return False
        at += n
    return at == ptr + size


def hipMemUnmap(ptr: int, size: int) -> tuple[hipError_t]:
    with _lock:
        if not _covered(ptr, size):
            return (E.hipErrorInvalidValue,)
        at = ptr
        while at < ptr + size:
            at += _mappings.pop(at)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
    _libc.mmap(ptr, size, 0, flags, -1, 0)  # the reservation's placeholder back
    return (E.hipSuccess,)


def hipMemcpyDtoH(dst: int, src: int, size: int) -> tuple[hipError_t]:
    ctypes.memmove(dst, src, size)
    return (E.hipSuccess,)


# memory pools ------------------------------------------------------------------------------
POOL_MEMFD_NAME = "simulated-hip-pool"
POOL_BYTES = 1 << 30  # address space of one pool (the memfd is sparse)
SLOTS = 512  # allocations alive at once per pool: one uint64 generation each, in page 0
POOL_PAGE = 4096
_EXPORT = struct.Struct("<IQQQ")  # slot, generation, offset, size; then zeros to 64 bytes


class hipMemPoolProps:
    def __init__(self) -> None:
        self.allocType = hipMemAllocationType.hipMemAllocationTypeInvalid
        self.handleTypes = hipMemAllocationHandleType.hipMemHandleTypeNone
        self.location = hipMemLocation()


_pools: dict[int, dict[str, Any]] = {}  # pool handle -> fd, base, own, handle type, free list
_pool_pointers: dict[int, tuple[int, int, int]] = {}  # pointer -> (pool, slot, size); own


def _slots(pool: dict[str, Any]) -> Any:
    return (ctypes.c_uint64 * SLOTS).from_address(pool["base"])


def _new_pool(fd: int, own: bool, kind: int) -> int:
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    base = _libc.mmap(None, POOL_BYTES, prot, mmap.MAP_SHARED | _MAP_NORESERVE, fd, 0)
    if base is None or base == _MAP_FAILED:
        os.close(fd)
        return 0
    entry = {"fd": fd, "base": base, "own": own, "kind": kind, "free": [(POOL_PAGE, POOL_BYTES)]}
    with _lock:
        _next[0] += 1
        _pools[_next[0]] = entry
        return _next[0]


def hipMemPoolCreate(props: Any) -> tuple[hipError_t, int]:
    if (
        props.allocType != hipMemAllocationType.hipMemAllocationTypePinned
        or props.location.type != hipMemLocationType.hipMemLocationTypeDevice
    ):
        return E.hipErrorInvalidValue, 0
    if not 0 <= props.location.id < DEVICES:
        return E.hipErrorInvalidDevice, 0
    fd = os.memfd_create(POOL_MEMFD_NAME, os.MFD_CLOEXEC)
    os.ftruncate(fd, POOL_BYTES)
    pool = _new_pool(fd, True, int(props.handleTypes))
    return (E.hipSuccess, pool) if pool else (E.hipErrorOutOfMemory, 0)


def hipMemPoolExportToShareableHandle(
    shareable: int, pool: int, handle_type: int, flags: int
) -> tuple[hipError_t]:
    entry = _pools.get(int(pool))
    if entry is None or not entry["own"] or flags != 0 or not shareable:
        return (E.hipErrorInvalidValue,)
    if handle_type != hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor:
        return (E.hipErrorInvalidValue,)
    if entry["kind"] != handle_type:
        return (E.hipErrorNotSupported,)  # not asked for at hipMemPoolCreate
    ctypes.c_int.from_address(shareable).value = os.dup(entry["fd"])
    return (E.hipSuccess,)


def hipMemPoolImportFromShareableHandle(
    shareable: int, handle_type: int, flags: int
) -> tuple[hipError_t, int]:
    if handle_type != hipMemAllocationHandleType.hipMemHandleTypePosixFileDescriptor or flags:
        return E.hipErrorInvalidValue, 0
    fd = int(shareable)
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{POOL_MEMFD_NAME} (deleted)":
            return E.hipErrorInvalidValue, 0
    except OSError:
        return E.hipErrorInvalidValue, 0
    mine = os.dup(fd)
    os.set_inheritable(mine, False)
    pool = _new_pool(mine, False, int(handle_type))
    return (E.hipSuccess, pool) if pool else (E.hipErrorOutOfMemory, 0)


def hipMemPoolDestroy(pool: int) -> tuple[hipError_t]:
    with _lock:
        entry = _pools.pop(int(pool), None)
    if entry is None:
        return (E.hipErrorInvalidValue,)
    _libc.munmap(entry["base"], POOL_BYTES)
    os.close(entry["fd"])
    return (E.hipSuccess,)


def hipMallocFromPoolAsync(size: int, pool: int, stream: Any) -> tuple[hipError_t, int]:
    entry = _pools.get(int(pool))
    if entry is None or not entry["own"] or size <= 0:
        return E.hipErrorInvalidValue, 0
    need = -(-size // POOL_PAGE) * POOL_PAGE
    with _lock:
        slots = _slots(entry)
        slot = next((i for i in range(SLOTS) if not slots[i]), None)
        at = next((i for i, (_, n) in enumerate(entry["free"]) if n >= need), None)
        if slot is None or at is None:
            return E.hipErrorOutOfMemory, 0
        offset, n = entry["free"].pop(at)
        if n > need:
            entry["free"].insert(at, (offset + need, n - need))
        slots[slot] = secrets.randbits(63) or 1
        ptr = entry["base"] + offset
        _pool_pointers[ptr] = (int(pool), slot, need)
    return E.hipSuccess, ptr


def hipStreamSynchronize(stream: Any) -> tuple[hipError_t]:
    return (E.hipSuccess,)  # the CPU does the work, synchronously


def hipMemPoolExportPointer(data: Any, ptr: int) -> tuple[hipError_t]:
    found = _pool_pointers.get(int(ptr))
    if found is None:
        return (E.hipErrorInvalidValue,)
    pool, slot, size = found
    entry = _pools[pool]
    packed = _EXPORT.pack(slot, _slots(entry)[slot], int(ptr) - entry["base"], size)
    view = memoryview(data).cast("B")
    view[:] = packed.ljust(len(view), b"\0")
    return (E.hipSuccess,)


def hipMemPoolImportPointer(pool: int, data: Any) -> tuple[hipError_t, int]:
    entry = _pools.get(int(pool))
    raw = bytes(memoryview(data).cast("B"))
    if entry is None or entry["own"] or len(raw) != 64:
        return E.hipErrorInvalidValue, 0
    slot, generation, offset, size = _EXPORT.unpack_from(raw)
    if slot >= SLOTS or not generation or _slots(entry)[slot] != generation:
        return E.hipErrorInvalidValue, 0  # freed by its exporter (or never exported)
    if offset < POOL_PAGE or offset + size > POOL_BYTES:
        return E.hipErrorInvalidValue, 0
    return E.hipSuccess, entry["base"] + offset


def hipFree(ptr: int) -> tuple[hipError_t]:
    with _lock:
        found = _pool_pointers.pop(int(ptr), None)
        if found is None:  # an imported pointer: it stays mapped with its pool
            inside = any(e["base"] <= ptr < e["base"] + POOL_BYTES for e in _pools.values())
            return (E.hipSuccess,) if inside else (E.hipErrorInvalidValue,)
        pool, slot, size = found
        entry = _pools[pool]
        _slots(entry)[slot] = 0
        entry["free"].append((int(ptr) - entry["base"], size))
    return (E.hipSuccess,)
