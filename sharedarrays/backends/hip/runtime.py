"""The HIP runtime (hip-python's ``hip.hip``, loaded on first use): errors, why a device is
unusable. ``SHAREDARRAYS_HIP_MODULE`` names a module to use instead (``tests/simulated/hip.py``),
read on every use."""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import types
from typing import Any

from sharedarrays.backends.base import cached_reason, installed
from sharedarrays.backends.base import loadable as _loadable
from sharedarrays.errors import DriverError, OutOfMemory

MODULE_SETTING = "SHAREDARRAYS_HIP_MODULE"
DEFAULT_MODULE = "hip.hip"
INSTALL_HINT = "pip install 'sharedarrays[hip]'"

FEATURES = types.MappingProxyType(
    {
        "vmm": (
            "hipDeviceAttributeVirtualMemoryManagementSupported",
            "virtual memory management (hipMemCreate)",
        ),
        "pool": ("hipDeviceAttributeMemoryPoolsSupported", "memory pools (hipMemPoolCreate)"),
    }
)
"""What each HIP backend needs of a device: the attribute saying it has it, and its name."""


class HipError(DriverError):
    """A HIP runtime call failed (``code``: the ``hipError_t``, ``error_name`` its name)."""


class HipOutOfMemory(HipError, OutOfMemory):
    """The device has not the memory a HIP call asked for (``hipErrorOutOfMemory``)."""


def module_name() -> str:
    """The module the HIP backends call (``SHAREDARRAYS_HIP_MODULE``, default ``hip.hip``)."""
    return os.environ.get(MODULE_SETTING, "").strip() or DEFAULT_MODULE


def load_hip() -> Any:
    """The HIP module (``ImportError``, or ``OSError``: no ``libamdhip64.so``)."""
    return importlib.import_module(module_name())


def check(result: Any, call: str) -> Any:
    """The values of a ``(hipError_t, values...)`` result (``None``, one, or a tuple), or
    raises :class:`HipError`."""
    if not isinstance(result, tuple):
        result = (result,)
    err, rest = result[0], result[1:]
    code = int(err)
    if code != 0:
        name = getattr(err, "name", f"hipError {code}")
        cls = HipOutOfMemory if name == "hipErrorOutOfMemory" else HipError
        raise cls(call, code, name)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _reason(index: int, feature: str) -> str | None:
    name = module_name()
    if name == DEFAULT_MODULE:  # hip-python and the library it loads
        if ctypes.util.find_library("amdhip64") is None and not _loadable("libamdhip64.so"):
            return (
                "no AMD GPU: libamdhip64 not found (install ROCm; HIP also needs hip-python: "
                f"{INSTALL_HINT})"
            )
        if not installed("hip"):
            return f"no AMD GPU support: the hip-python package is not installed ({INSTALL_HINT})"
    try:
        hip = load_hip()
    except (ImportError, OSError) as exc:  # OSError: hip-python could not dlopen libamdhip64
        if isinstance(exc, OSError) or "amdhip64" in str(exc):
            return f"no AMD GPU: libamdhip64 not found ({exc})"
        return f"the HIP module {name!r} cannot be imported ({exc})"
    attribute, what = FEATURES[feature]
    try:
        count = check(hip.hipGetDeviceCount(), "hipGetDeviceCount")
        if index >= int(count):
            return f"there is no device hip:{index} (HIP sees {int(count)})"
        supported = check(
            hip.hipDeviceGetAttribute(getattr(hip.hipDeviceAttribute_t, attribute), index),
            f"hipDeviceGetAttribute({attribute.removeprefix('hipDeviceAttribute')})",
        )
    except HipError as exc:
        if exc.error_name == "hipErrorNoDevice" and exc.call == "hipGetDeviceCount":
            return "no AMD GPU is visible: hipGetDeviceCount failed with hipErrorNoDevice"
        return str(exc)
    return None if supported else f"hip:{index} does not support {what}"


def why_unusable(index: int = 0, feature: str = "vmm") -> str | None:
    """Why HIP device ``index`` cannot be used for ``feature`` (a key of :data:`FEATURES`),
    or ``None``; never raises, asked once."""
    key = ("hip", module_name(), index, feature)
    return cached_reason(key, lambda: _reason(index, feature), "the HIP runtime")
