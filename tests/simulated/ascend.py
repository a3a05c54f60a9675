"""A simulated CANN runtime: the ``libascendcl`` calls of the ``ascend`` backend, over memfd.

Loaded in place of the library by ``SHAREDARRAYS_ASCEND_MODULE=simulated.ascend``: each
function takes the ctypes arguments the backend passes to the library (``ctypes.pointer``
objects for out-parameters, ints for addresses) and returns an ``aclError``.

What it keeps of the real runtime, because ``sharedarrays.backends.ascend`` depends on it:

- ``aclInit`` once per process (a second call answers ``ACL_ERROR_REPEAT_INITIALIZE``);
- ``aclrtMallocPhysical`` needs a size that is a multiple of the granularity (2 MiB, huge
  pages) and pinned device memory; the memory is not cleared;
- ``aclrtReserveMemAddress`` takes no alignment, expected address or flags (reserved, 0);
  ``aclrtMapMem`` maps a physical handle at the start of a reservation, no larger than the
  physical memory (``ACL_ERROR_RT_PARAM_INVALID`` otherwise);
- ``aclrtMemExportToShareableHandle`` gives a ``uint64`` that another process resolves (one
  export per handle); with ``ACL_RT_VMM_EXPORT_FLAG_DEFAULT`` only the pids added by
  ``aclrtMemSetPidToShareableHandle`` (in the exporting process) may import it: any other
  importer is refused with ``ACL_ERROR_RT_NO_PERMISSION``;
- import happens in another process than the export (``ACL_ERROR_RT_FEATURE_NOT_SUPPORT``
  in the same one), and only while the exporter has the memory: its ``aclrtFreePhysical``
  (or its exit) destroys the shareable handle (``ACL_ERROR_RT_INVALID_HANDLE`` after);
- the memory itself lives until every process freed its handle and unmapped it (the kernel's
  reference counting of the memfd, as the driver's own).

How a handle is resolved: the exporter writes ``<handle>.json`` (its pid, the memfd's fd
number, the trust list) in a per-user directory (``SIMULATED_ASCEND_DIR``, default
``$XDG_RUNTIME_DIR/simulated-ascend-UID``; a description goes when its exporter frees the
memory, or when an importer finds its exporter gone), and the importer opens the memfd through
``/proc/<pid>/fd/<fd>``. The error codes for a refused or unknown handle are the runtime's
closest documented ones (``rt_error_codes.h``); the real driver's were not observed.

The CPU addresses this "NPU memory" (it is host memory): ``SHAREDARRAYS_CPU_ADDRESSABLE``
tells the backend so, and its arrays are NumPy views that write in place.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import secrets
import tempfile
import threading
from typing import Any

SHAREDARRAYS_CPU_ADDRESSABLE = True

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
)  # fmt: skip
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000

GRANULARITY = 2 << 20
DEVICES = int(os.environ.get("SIMULATED_ASCEND_DEVICES", "1"))
TOTAL = 8 << 30

ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_CONTEXT_NULL = 107002
ACL_ERROR_RT_INVALID_HANDLE = 107017
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_NO_DEVICE = 207004
ACL_ERROR_RT_NO_PERMISSION = 207006

ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 1
ACL_MEMCPY_HOST_TO_DEVICE = 1
ACL_MEMCPY_DEVICE_TO_HOST = 2

_lock = threading.Lock()
_init_pid = [0]
_physical: dict[int, dict[str, Any]] = {}  # handle -> fd, size, shareable, imported
_reservations: dict[int, int] = {}  # start -> size
_mappings: dict[int, tuple[int, int]] = {}  # start -> (size, handle)
_current = threading.local()


def directory() -> str:
    """Where exported handles are described (made on first use, private to this user)."""
    base = os.environ.get("SIMULATED_ASCEND_DIR") or os.path.join(
        os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(),
        f"simulated-ascend-{os.getuid()}",
    )
    os.makedirs(base, mode=0o700, exist_ok=True)
    return base


def _meta_path(shareable: int) -> str:
    return os.path.join(directory(), f"{shareable:016x}.json")


def _memfd_name(shareable: int) -> str:
    return f"simulated-ascend-{shareable:016x}"


def _new_handle(entry: dict[str, Any]) -> int:
    with _lock:
        while True:
            handle = secrets.randbits(47) << 4 or 16
            if handle not in _physical:
                _physical[handle] = entry
                return handle


def aclInit(config: Any) -> int:
    if _init_pid[0] == os.getpid():
        return ACL_ERROR_REPEAT_INITIALIZE
    _init_pid[0] = os.getpid()
    return ACL_SUCCESS


def _initialised() -> bool:
    return _init_pid[0] == os.getpid()


def aclrtGetDeviceCount(count: Any) -> int:
    if not DEVICES:
        return ACL_ERROR_RT_NO_DEVICE
    count.contents.value = DEVICES
    return ACL_SUCCESS


def aclrtSetDevice(index: int) -> int:
    if not _initialised():
        return ACL_ERROR_RT_CONTEXT_NULL
    if not 0 <= int(index) < DEVICES:
        return ACL_ERROR_RT_INVALID_DEVICEID
    _current.index = int(index)
    return ACL_SUCCESS


def aclrtGetDevice(index: Any) -> int:
    if not hasattr(_current, "index"):
        return ACL_ERROR_RT_CONTEXT_NULL
    index.contents.value = _current.index
    return ACL_SUCCESS


def aclrtSynchronizeDevice() -> int:
    return ACL_SUCCESS if hasattr(_current, "index") else ACL_ERROR_RT_CONTEXT_NULL


def aclrtGetMemInfo(attr: int, free: Any, total: Any) -> int:
    used = sum(e["size"] for e in _physical.values() if not e["imported"])
    free.contents.value = max(TOTAL - used, 0)
    total.contents.value = TOTAL
    return ACL_SUCCESS


def _valid_prop(prop: Any) -> bool:
    p = prop.contents
    return (
        p.allocationType == ACL_MEM_ALLOCATION_TYPE_PINNED
        and p.location.type == ACL_MEM_LOCATION_TYPE_DEVICE
        and 0 <= p.location.id < DEVICES
    )


def aclrtMemGetAllocationGranularity(prop: Any, option: int, granularity: Any) -> int:
    if not _valid_prop(prop) or int(option) not in (0, 1):
        return ACL_ERROR_INVALID_PARAM
    granularity.contents.value = GRANULARITY
    return ACL_SUCCESS


def aclrtMallocPhysical(handle: Any, size: int, prop: Any, flags: int) -> int:
    if not hasattr(_current, "index"):
        return ACL_ERROR_RT_CONTEXT_NULL
    if size <= 0 or size % GRANULARITY or flags != 0 or not _valid_prop(prop):
        return ACL_ERROR_INVALID_PARAM
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    aclrtGetMemInfo(0, ctypes.pointer(free), ctypes.pointer(total))
    if size > free.value:
        return ACL_ERROR_RT_MEMORY_ALLOCATION
    token = secrets.randbits(63) or 1  # its shareable handle, once exported
    fd = os.memfd_create(_memfd_name(token), os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    entry = {"fd": fd, "size": size, "shareable": 0, "token": token, "imported": False}
    handle.contents.value = _new_handle(entry)
    return ACL_SUCCESS


def aclrtMemExportToShareableHandle(handle: Any, kind: int, flags: int, shareable: Any) -> int:
    entry = _physical.get(int(handle or 0))
    if entry is None or int(kind) != 0 or int(flags) not in (0, 1):
        return ACL_ERROR_INVALID_PARAM
    if entry["imported"] or entry["shareable"]:
        return ACL_ERROR_RT_PARAM_INVALID  # one shareable handle per physical handle
    value = entry["token"]
    meta = {
        "pid": os.getpid(),
        "fd": entry["fd"],
        "validate": int(flags) != ACL_RT_VMM_EXPORT_FLAG_DISABLE_PID_VALIDATION,
        "pids": [],
        "size": entry["size"],
    }
    _write_meta(value, meta)
    entry["shareable"] = value
    shareable.contents.value = value
    return ACL_SUCCESS


def _forget(shareable: int) -> None:
    try:
        os.unlink(_meta_path(shareable))
    except FileNotFoundError:
        pass


def _write_meta(shareable: int, meta: dict[str, Any]) -> None:
    path = _meta_path(shareable)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f)
    os.replace(tmp, path)


def _read_meta(shareable: int) -> dict[str, Any] | None:
    try:
        with open(_meta_path(shareable)) as f:
            meta: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return None
    return meta


def aclrtMemSetPidToShareableHandle(shareable: int, pids: Any, count: int) -> int:
    value = int(shareable)
    mine = [e for e in _physical.values() if e["shareable"] == value and not e["imported"]]
    meta = _read_meta(value)
    if not mine or meta is None or count <= 0:
        return ACL_ERROR_INVALID_PARAM  # only the exporting process sets the trust list
    with _lock:
        meta["pids"] = sorted(set(meta["pids"]) | {int(pids[i]) for i in range(count)})
        _write_meta(value, meta)
    return ACL_SUCCESS


def aclrtMemImportFromShareableHandle(shareable: int, device: int, handle: Any) -> int:
    if not 0 <= int(device) < DEVICES:
        return ACL_ERROR_RT_INVALID_DEVICEID
    value = int(shareable)
    meta = _read_meta(value)
    if meta is None:
        return ACL_ERROR_RT_INVALID_HANDLE
    if meta["pid"] == os.getpid():
        return ACL_ERROR_RT_FEATURE_NOT_SUPPORT  # import in another process than the export
    if meta["validate"] and os.getpid() not in meta["pids"]:
        return ACL_ERROR_RT_NO_PERMISSION
    try:
        fd = os.open(f"/proc/{meta['pid']}/fd/{meta['fd']}", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        _forget(value)  # the exporter was killed
        return ACL_ERROR_RT_INVALID_HANDLE
    if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{_memfd_name(value)} (deleted)":
        os.close(fd)  # freed (and its fd number reused) meanwhile
        return ACL_ERROR_RT_INVALID_HANDLE
    entry = {"fd": fd, "size": meta["size"], "shareable": value, "token": 0, "imported": True}
    handle.contents.value = _new_handle(entry)
    return ACL_SUCCESS


def aclrtFreePhysical(handle: Any) -> int:
    with _lock:
        h = int(handle or 0)
        if any(mh == h for _, mh in _mappings.values()):
            return ACL_ERROR_RT_PARAM_INVALID  # still mapped
        entry = _physical.pop(h, None)
    if entry is None:
        return ACL_ERROR_INVALID_PARAM
    if entry["shareable"] and not entry["imported"]:
        _forget(entry["shareable"])  # the shareable handle is destroyed: no new imports
    os.close(entry["fd"])  # the memory goes with the last fd and mapping, in any process
    return ACL_SUCCESS


def aclrtReserveMemAddress(ptr: Any, size: int, alignment: int, expect: Any, flags: int) -> int:
    if size <= 0 or alignment != 0 or expect or flags != 0:
        return ACL_ERROR_INVALID_PARAM
    size = -(-size // GRANULARITY) * GRANULARITY
    raw = _libc.mmap(
        None, size + GRANULARITY, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0
    )
    if raw is None or raw == _MAP_FAILED:
        return ACL_ERROR_RT_MEMORY_ALLOCATION
    start = -(-raw // GRANULARITY) * GRANULARITY
    if start > raw:
        _libc.munmap(raw, start - raw)
    if raw + GRANULARITY > start:
        _libc.munmap(start + size, raw + GRANULARITY - start)
    with _lock:
        _reservations[start] = size
    ptr.contents.value = start
    return ACL_SUCCESS


def aclrtReleaseMemAddress(ptr: Any) -> int:
    start = int(ptr or 0)
    with _lock:
        size = _reservations.get(start)
        if size is None or start in _mappings:
            return ACL_ERROR_RT_PARAM_INVALID
        del _reservations[start]
    _libc.munmap(start, size)
    return ACL_SUCCESS


def aclrtMapMem(ptr: Any, size: int, offset: int, handle: Any, flags: int) -> int:
    start, h = int(ptr or 0), int(handle or 0)
    entry = _physical.get(h)
    if entry is None or offset != 0 or flags != 0:
        return ACL_ERROR_INVALID_PARAM
    reserved = _reservations.get(start)
    if reserved is None or start in _mappings or size <= 0 or size > reserved:
        return ACL_ERROR_RT_PARAM_INVALID
    if size > entry["size"]:
        return ACL_ERROR_RT_PARAM_INVALID  # larger than the physical memory
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    got = _libc.mmap(start, size, prot, mmap.MAP_SHARED | _MAP_FIXED, entry["fd"], 0)
    if got != start:
        return ACL_ERROR_RT_MEMORY_ALLOCATION
    with _lock:
        _mappings[start] = (size, h)
    return ACL_SUCCESS


def aclrtUnmapMem(ptr: Any) -> int:
    start = int(ptr or 0)
    with _lock:
        mapping = _mappings.pop(start, None)
    if mapping is None:
        return ACL_ERROR_RT_PARAM_INVALID
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
    _libc.mmap(start, mapping[0], 0, flags, -1, 0)  # the reservation's placeholder back
    return ACL_SUCCESS


def aclrtMemcpy(dst: Any, dest_max: int, src: Any, count: int, kind: int) -> int:
    if count > dest_max or int(kind) not in (0, 1, 2, 3):
        return ACL_ERROR_INVALID_PARAM
    ctypes.memmove(int(dst), int(src), count)
    return ACL_SUCCESS
