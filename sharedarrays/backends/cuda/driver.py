"""The CUDA driver (``cuda.bindings.driver``, imported on first use): errors, why a device is
unusable, the current stream, and fork safety: a child forked after ``cuInit`` cannot use
CUDA, noticed by ``cuInit``'s pid, a fork hook asking the parent, and PyTorch's mark."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import sys
import types
from typing import Any, Protocol

from sharedarrays.backends.base import cached_reason, installed
from sharedarrays.backends.device import Device
from sharedarrays.errors import DriverError, OutOfMemory
from sharedarrays.process import STATE, at_fork

INSTALL_HINT = "pip install 'sharedarrays[cuda13]'"

FORK_REASON = (
    "this process was forked from a process that had already initialised CUDA, and CUDA "
    "cannot be used in such a child; start worker processes with the 'spawn' or "
    "'forkserver' start method, e.g. multiprocessing.get_context('spawn') or "
    "concurrent.futures.ProcessPoolExecutor(mp_context=multiprocessing.get_context('spawn'))"
)

OPAQUE_BYTES = 64  # CUDA's IPC handles and pool export data

_CUDA_SUCCESS = 0
_CUDA_ERROR_OUT_OF_MEMORY = 2
_CUDA_ERROR_NOT_INITIALIZED = 3

# Modules whose presence means CUDA may have been initialised in this process.
_CUDA_USERS = ("cuda.bindings.driver", "cupy", "torch", "numba.cuda", "jax")


class OnDevice(Protocol):
    """What :mod:`.sync` and :mod:`.device`'s stream objects need of a CUDA backend."""

    device: Device

    def context(self) -> contextlib.AbstractContextManager[None]: ...
    def stream_token(self, stream: int) -> bytes | None: ...


class CudaDriverError(DriverError):
    """A CUDA driver call failed (``code``: the ``CUresult``, ``error_name`` its name)."""


class CudaOutOfMemory(CudaDriverError, OutOfMemory):
    """``CUDA_ERROR_OUT_OF_MEMORY``; ``hint`` says what was asked, what is free, what to do."""

    def __init__(
        self, call: str, code: int, error_name: str, description: str = "", hint: str = ""
    ) -> None:
        super().__init__(call, code, error_name, description)
        self.hint = hint
        if hint:
            self.args = (f"{self.args[0]}: {hint}",)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.code, self.error_name, self.description, self.hint))


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


def check(result: Any, call: str) -> Any:
    """The values of an ``(err, values...)`` result (``None``, one, or a tuple), or raises
    :class:`CudaDriverError`."""
    err = result[0]
    code = int(err)
    if code != _CUDA_SUCCESS:
        cls = CudaOutOfMemory if code == _CUDA_ERROR_OUT_OF_MEMORY else CudaDriverError
        description = _error_description(STATE.backends.cuda_driver, err)
        raise cls(call, code, _error_name(err), description)
    if len(result) == 1:
        return None
    if len(result) == 2:
        return result[1]
    return result[1:]


def opaque_bytes(handle: Any) -> bytes:
    """The 64 bytes of an opaque driver struct (cuda-bindings 13.5 has no ``reserved``)."""
    reserved = getattr(handle, "reserved", None)
    if reserved is not None:
        return bytes(reserved)
    return ctypes.string_at(handle.getPtr(), OPAQUE_BYTES)


def opaque_from_bytes(cls: Any, data: bytes) -> Any:
    """A new opaque driver struct of type ``cls`` holding ``data`` (64 bytes)."""
    if len(data) != OPAQUE_BYTES:
        raise ValueError(f"an opaque CUDA handle is {OPAQUE_BYTES} bytes, not {len(data)}")
    handle = cls()
    try:
        handle.reserved = data
    except AttributeError:
        ctypes.memmove(handle.getPtr(), data, OPAQUE_BYTES)
    return handle


def load_driver() -> Any:
    """``cuda.bindings.driver`` (``ImportError`` if absent)."""
    state = STATE.backends
    if state.cuda_driver is None:
        state.cuda_driver = importlib.import_module("cuda.bindings.driver")
    return state.cuda_driver


def _cuda_initialised_here() -> bool:  # best effort
    if STATE.backends.cuda_init_pid == os.getpid():
        return True
    if not any(name in sys.modules for name in _CUDA_USERS):
        return False
    try:
        err = load_driver().cuCtxGetCurrent()[0]
    except Exception:
        return False
    return int(err) != _CUDA_ERROR_NOT_INITIALIZED


def _before_fork() -> None:
    STATE.backends.cuda_parent_had = _cuda_initialised_here()  # (never raises)


def _after_fork_in_parent() -> None:
    STATE.backends.cuda_parent_had = False


# (the child: STATE.backends.reset_in_child marks it forked from CUDA)
at_fork("backends", before=_before_fork, after_in_parent=_after_fork_in_parent)


def _fork_reason() -> str | None:
    state = STATE.backends
    if state.cuda_forked or state.cuda_init_pid not in (None, os.getpid()):
        return FORK_REASON
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda._is_in_bad_fork():
                return FORK_REASON
    return None


def _driver_reason() -> str | None:  # and counts the devices
    try:
        driver = load_driver()
    except ImportError as exc:
        return (
            f"the CUDA backend needs the cuda-bindings package, which is not installed ({exc}): "
            f"{INSTALL_HINT}"
        )
    if not installed("cupy"):
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
    STATE.backends.cuda_init_pid = os.getpid()
    err, count = driver.cuDeviceGetCount()
    if int(err) != _CUDA_SUCCESS:
        return f"cuDeviceGetCount failed with {_error_name(err)}"
    if count == 0:
        return "no CUDA device is visible (cuDeviceGetCount returned 0)"
    STATE.backends.cuda_count = int(count)
    return None


def _device_name(driver: Any, dev: Any) -> str:
    err, raw = driver.cuDeviceGetName(256, dev)
    if int(err) != _CUDA_SUCCESS:
        return "unknown device"
    text = raw.split(b"\0", 1)[0] if isinstance(raw, bytes) else str(raw)
    return text.decode(errors="replace") if isinstance(text, bytes) else text


# What each CUDA backend needs of a device: attributes whose lowest bit must be set (for
# MEMPOOL_SUPPORTED_HANDLE_TYPES, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), and what lacks.
_NEEDS = types.MappingProxyType(
    {
        "cuda-vmm": (
            ("VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED", "does not support CUDA virtual memory "
             "management (cuMemCreate/cuMemMap)"),
            ("HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED", "cannot export memory as POSIX "
             "file descriptors"),
        ),
        "cuda-ipc": (
            ("UNIFIED_ADDRESSING", "has no unified addressing, which CUDA IPC "
             "(cuIpcGetMemHandle) needs"),
        ),
        "cuda-pool": (
            ("MEMORY_POOLS_SUPPORTED", "does not support stream-ordered memory pools "
             "(cuMemPoolCreate)"),
            ("MEMPOOL_SUPPORTED_HANDLE_TYPES", "cannot export memory pools as POSIX file "
             "descriptors"),
        ),
    }
)  # fmt: skip


def _device_reason(index: int, backend: str) -> str | None:
    if index < 0:
        return f"device index must be >= 0, got {index}"
    count = STATE.backends.cuda_count
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        return (
            f"device index {index} is out of range: {count} CUDA device(s) visible "
            f"(cuda:0 to cuda:{count - 1}{where})"
        )
    driver = load_driver()
    err, dev = driver.cuDeviceGet(index)
    if int(err) != _CUDA_SUCCESS:
        return f"cuDeviceGet({index}) failed with {_error_name(err)}"
    for short, lacks in _NEEDS[backend]:
        name = f"CU_DEVICE_ATTRIBUTE_{short}"
        attribute = getattr(driver.CUdevice_attribute, name)
        err, value = driver.cuDeviceGetAttribute(attribute, dev)
        if int(err) != _CUDA_SUCCESS:
            return f"cuDeviceGetAttribute({name}) failed with {_error_name(err)}"
        if not int(value) & 1:
            return (
                f"cuda:{index} ({_device_name(driver, dev)}) {lacks}, which the {backend} "
                "backend needs"
            )
    return None


def why_unusable(index: int = 0, backend: str = "cuda-vmm") -> str | None:
    """Why CUDA backend ``backend`` cannot be used on device ``index`` here, or ``None``: what
    is missing (a package, the driver, a device or a feature of it, or a fork after CUDA was
    initialised) and what to do. Never raises; asked once."""
    if backend not in _NEEDS:
        return f"unknown CUDA backend {backend!r}; the CUDA backends are {', '.join(_NEEDS)}"
    what = "checking CUDA unexpectedly"
    return (
        _fork_reason()
        or cached_reason(("cuda",), _driver_reason, what)
        or cached_reason(("cuda", index, backend), lambda: _device_reason(index, backend), what)
    )


def peer_reason(index: int, owner: int) -> str | None:
    """Why device ``index`` cannot access memory of device ``owner`` (``None``: it can)."""
    what = f"checking peer access cuda:{index} -> cuda:{owner}"
    return cached_reason(("cuda-peer", index, owner), lambda: _peer_reason(index, owner), what)


def _peer_reason(index: int, owner: int) -> str | None:
    why = why_unusable(index, "cuda-vmm") or why_unusable(owner, "cuda-vmm")
    if why is not None or index == owner:
        return why
    d = load_driver()
    peer, dev = d.cuDeviceGet(index)[1], d.cuDeviceGet(owner)[1]
    if check(d.cuDeviceCanAccessPeer(peer, dev), "cuDeviceCanAccessPeer"):
        return None
    return (
        f"cuda:{index} ({_device_name(d, peer)}) cannot access the memory of cuda:{owner} "
        f"({_device_name(d, dev)}): cuDeviceCanAccessPeer is 0 (no NVLink or PCIe peer path "
        "between them). Copy the data to that device instead, or use a device that can reach it"
    )


def current_stream(device_index: int) -> int:
    """The stream work is queued on: CuPy's current one when CuPy is imported, else ``0``
    (the legacy default stream, PyTorch's unless told otherwise)."""
    get = STATE.backends.cupy_stream
    if get is None:
        cupy = sys.modules.get("cupy")
        if cupy is None:
            return 0
        try:
            get = cupy.cuda.get_current_stream
            get(device_index)
        except AttributeError:  # another thread is importing CuPy: none of its streams is
            return 0  # in use yet (a Pool's result thread loads while the main one imports)
        except TypeError:  # a CuPy without the device_id argument

            def get(device_index: int) -> Any:
                with cupy.cuda.Device(device_index):
                    return cupy.cuda.get_current_stream()

        STATE.backends.cupy_stream = get
    return int(get(device_index).ptr)
