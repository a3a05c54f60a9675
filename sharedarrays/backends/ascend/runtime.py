"""The CANN runtime (``libascendcl`` through ctypes, ``aclInit`` once per process): errors,
why a device is unusable, the C types. ``SHAREDARRAYS_ASCEND_MODULE`` names a module to call
instead (``tests/simulated/ascend.py``), read on every use."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import types
from ctypes import POINTER, c_char_p, c_int, c_int32, c_size_t, c_uint32, c_uint64, c_void_p
from typing import Any

from sharedarrays.backends.base import cached_reason
from sharedarrays.backends.base import loadable as _loadable
from sharedarrays.errors import DriverError, OutOfMemory
from sharedarrays.process import STATE

MODULE_SETTING = "SHAREDARRAYS_ASCEND_MODULE"
LIBRARY = "libascendcl.so"

# aclError values the backend tells apart (acl_base.h, rt_error_codes.h)
ACL_SUCCESS = 0
ACL_ERROR_INVALID_PARAM = 100000
ACL_ERROR_REPEAT_INITIALIZE = 100002
ACL_ERROR_RT_PARAM_INVALID = 107000
ACL_ERROR_RT_INVALID_DEVICEID = 107001
ACL_ERROR_RT_INVALID_HANDLE = 107017
ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000
ACL_ERROR_RT_MEMORY_ALLOCATION = 207001
ACL_ERROR_RT_NO_DEVICE = 207004
ACL_ERROR_RT_NO_PERMISSION = 207006
ACL_ERROR_RT_DEVICE_OOM = 207018

ERROR_NAMES = types.MappingProxyType(
    {v: k for k, v in dict(globals()).items() if k.startswith("ACL_ERROR_")}
)

# enums (acl_rt.h)
ACL_MEM_HANDLE_TYPE_NONE = 0
ACL_MEM_ALLOCATION_TYPE_PINNED = 0
ACL_HBM_MEM_HUGE = 4
ACL_MEM_LOCATION_TYPE_DEVICE = 1
ACL_RT_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
ACL_RT_VMM_EXPORT_FLAG_DEFAULT = 0  # the pid trust list is checked on import
ACL_MEMCPY_DEVICE_TO_HOST = 2


class MemLocation(ctypes.Structure):  # aclrtMemLocation
    _fields_ = [("id", c_uint32), ("type", c_int)]


class PhysicalMemProp(ctypes.Structure):  # aclrtPhysicalMemProp
    _fields_ = [
        ("handleType", c_int),
        ("allocationType", c_int),
        ("memAttr", c_int),
        ("location", MemLocation),
        ("reserve", c_uint64),
    ]


_SIGNATURES = types.MappingProxyType({
    "aclInit": (c_char_p,),
    "aclrtSetDevice": (c_int32,),
    "aclrtGetDevice": (POINTER(c_int32),),
    "aclrtGetDeviceCount": (POINTER(c_uint32),),
    "aclrtSynchronizeDevice": (),
    "aclrtGetMemInfo": (c_int, POINTER(c_size_t), POINTER(c_size_t)),
    "aclrtMemGetAllocationGranularity": (POINTER(PhysicalMemProp), c_int, POINTER(c_size_t)),
    "aclrtMallocPhysical": (POINTER(c_void_p), c_size_t, POINTER(PhysicalMemProp), c_uint64),
    "aclrtFreePhysical": (c_void_p,),
    "aclrtReserveMemAddress": (POINTER(c_void_p), c_size_t, c_size_t, c_void_p, c_uint64),
    "aclrtReleaseMemAddress": (c_void_p,),
    "aclrtMapMem": (c_void_p, c_size_t, c_size_t, c_void_p, c_uint64),
    "aclrtUnmapMem": (c_void_p,),
    "aclrtMemExportToShareableHandle": (c_void_p, c_int, c_uint64, POINTER(c_uint64)),
    "aclrtMemSetPidToShareableHandle": (c_uint64, POINTER(c_int32), c_size_t),
    "aclrtMemImportFromShareableHandle": (c_uint64, c_int32, POINTER(c_void_p)),
    "aclrtMemcpy": (c_void_p, c_size_t, c_void_p, c_size_t, c_int),
})  # fmt: skip
"""The C signature of every call the backend makes (all return ``aclError``)."""


class AclError(DriverError):
    """A CANN runtime call failed (``code``: the ``aclError``, ``error_name`` its name)."""


class AclOutOfMemory(AclError, OutOfMemory):
    """The NPU has not the memory a call asked for."""


def check(code: int, call: str) -> None:
    """Raise :class:`AclError` unless ``code`` (an ``aclError``) is ``ACL_SUCCESS``."""
    code = int(code)
    if code == ACL_SUCCESS:
        return
    name = ERROR_NAMES.get(code, f"aclError {code}")
    oom = code in (ACL_ERROR_RT_MEMORY_ALLOCATION, ACL_ERROR_RT_DEVICE_OOM)
    raise (AclOutOfMemory if oom else AclError)(call, code, name)


def module_name() -> str:
    """The module standing in for ``libascendcl`` (``SHAREDARRAYS_ASCEND_MODULE``), or ``""``."""
    return os.environ.get(MODULE_SETTING, "").strip()


def load_acl() -> Any:
    """The CANN runtime (the library or :func:`module_name`'s module), initialised once per
    process; ``OSError``, ``ImportError`` or :class:`AclError` (``aclInit`` failed)."""
    name = module_name()
    state = STATE.backends
    with state.driver_lock:
        acl = state.acl.get(name)
        if acl is None:
            acl = importlib.import_module(name) if name else ctypes.CDLL(LIBRARY)
            for call, argtypes in _SIGNATURES.items() if not name else ():
                getattr(acl, call).argtypes = argtypes  # the library's C signatures
                getattr(acl, call).restype = c_int
            code = int(acl.aclInit(None))
            if code != ACL_ERROR_REPEAT_INITIALIZE:
                check(code, "aclInit")
            state.acl[name] = acl
    return acl


def _reason(index: int) -> str | None:
    name = module_name()
    if not name and ctypes.util.find_library("ascendcl") is None and not _loadable(LIBRARY):
        return (
            "no Ascend NPU: libascendcl not found (install the CANN toolkit and source its "
            "set_env.sh, so that libascendcl.so is on LD_LIBRARY_PATH)"
        )
    try:
        acl = load_acl()
    except ImportError as exc:
        return f"the Ascend module {name!r} cannot be imported ({exc})"
    except OSError as exc:
        return f"no Ascend NPU: libascendcl not found ({exc})"
    except AclError as exc:
        return str(exc)
    count = c_uint32(0)
    try:
        check(acl.aclrtGetDeviceCount(ctypes.pointer(count)), "aclrtGetDeviceCount")
    except AclError as exc:
        if exc.code == ACL_ERROR_RT_NO_DEVICE:
            return f"no Ascend NPU is visible: {exc}"
        return str(exc)
    if index >= count.value:
        return f"there is no device npu:{index} (CANN sees {count.value})"
    return None


def why_unusable(index: int = 0) -> str | None:
    """Why Ascend device ``index`` cannot be used here, or ``None``; never raises."""
    key = ("ascend", module_name(), index)
    return cached_reason(key, lambda: _reason(index), "the CANN runtime")
