"""Exceptions raised by sharedarrays; every message says what happened and what to do."""

from __future__ import annotations

from typing import Any

__all__ = ["SharedArrayError", "BackendUnavailable", "PeerAccessUnavailable", "ClosedArrayError"]
__all__ += ["HandleUnavailable", "PermissionDenied", "PayloadError", "NameExists", "NameNotFound"]
__all__ += ["KeeperError", "InUse", "ResizeRefused", "OutOfMemory", "NotShareable", "WrongNode"]
__all__ += ["WorkerLost", "TaskExited", "TaskNotLoaded", "WaitTimeout", "MisalignedView"]
__all__ += ["ThreadUnavailable", "SettingError"]


class SharedArrayError(Exception):
    """Base class of every error sharedarrays raises on purpose."""


class SettingError(SharedArrayError, ValueError):
    """A ``SHAREDARRAYS_*`` environment variable (or a value it stands for) is not valid."""


class BackendUnavailable(SharedArrayError):
    """The requested memory system cannot be used here (the message says why)."""


class PeerAccessUnavailable(BackendUnavailable):
    """A device cannot reach another device's memory (``cuDeviceCanAccessPeer`` is 0)."""


class ClosedArrayError(SharedArrayError, ValueError):
    """The array was closed with :meth:`SharedDeviceArray.close` and cannot be used."""


class HandleUnavailable(SharedArrayError):
    """An allocation's handles cannot be had (its exporter is gone, or no more open files)."""


def _limit(which: str, unit: int = 1) -> str:
    # this process's soft resource.RLIMIT_<which> in unit, as ulimit says
    import resource

    soft = resource.getrlimit(getattr(resource, f"RLIMIT_{which}"))[0]
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft // unit)


def fd_limit_error(what: str, strerror: str) -> HandleUnavailable:
    """The error for ``what`` failing because this process can open no more files."""
    return HandleUnavailable(
        f"{what}: {strerror} (this process may have {_limit('NOFILE')} open, ulimit -n). Close "
        "arrays this process no longer needs (a.close()), or raise the limit"
    )


def thread_error(what: str, error: BaseException) -> ThreadUnavailable:
    """The error for ``what`` failing because no thread can start (``error``)."""
    return ThreadUnavailable(
        f"{what}: {error} (this process is at its limit of threads or of address space for "
        f"their stacks: ulimit -u {_limit('NPROC')}, ulimit -v {_limit('AS', 1024)}). Raise "
        "the limit, or end threads this process no longer needs"
    )


class PermissionDenied(SharedArrayError, PermissionError):
    """This process may not import the allocation (another user, a wrong secret, not allowed)."""


class PayloadError(SharedArrayError, ValueError):
    """A payload is malformed, truncated, tampered with, or of an unknown version."""


class MisalignedView(SharedArrayError, ValueError):
    """A view of GPU memory off its dtype's alignment (a kernel would fail): copy it first."""


class ThreadUnavailable(SharedArrayError, RuntimeError):
    """No thread can start (``ulimit -u``, ``ulimit -v``); nothing made for it is left open."""


class NameExists(SharedArrayError, FileExistsError):
    """An array of that name exists already: attach it, or unlink the name first."""


class NameNotFound(SharedArrayError, FileNotFoundError):
    """No array of that name exists for this user (never made, unlinked, or keeper gone)."""


class KeeperError(SharedArrayError):
    """The keeper refused a request, answered nonsense, or did not answer in time."""


class InUse(SharedArrayError, RuntimeError):
    """Memory cannot be freed from outside the processes that use it (the message names them)."""


class WorkerLost(SharedArrayError, RuntimeError):
    """A :class:`sharedarrays.Pool` worker died running a task: the job fails, the pool lives."""


class TaskNotLoaded(SharedArrayError, AttributeError):
    """A :class:`sharedarrays.Pool` worker cannot find a task's function (defined in main?)."""


class TaskExited(SharedArrayError, RuntimeError):
    """A pool task called ``sys.exit()``: that task fails, the worker goes on."""


class WaitTimeout(SharedArrayError, TimeoutError):
    """A wait with a time limit ended first (a :class:`~sharedarrays.Timeline` on the CPU)."""


class ResizeRefused(SharedArrayError, RuntimeError):
    """A growable array cannot be resized here (an importer), or not below chunks in use."""


class OutOfMemory(SharedArrayError, MemoryError):
    """The memory or address space an array (or its growth) needs is not there."""


class NotShareable(SharedArrayError, ValueError):
    """:func:`sharedarrays.share` cannot share this in place (host memory, device memory
    CUDA IPC cannot export, or no array); :func:`sharedarrays.from_array` copies it."""


class WrongNode(SharedArrayError):
    """A payload of another node (machine, user, namespace) was loaded here: send the data."""


class DriverError(SharedArrayError, OSError):
    """A call into a device's driver or runtime failed: ``call`` (what was asked), the
    ``code`` it returned, its ``error_name`` and the driver's ``description``."""

    def __init__(self, call: str, code: int, error_name: str, description: str = "") -> None:
        self.call = call
        self.code = code
        self.error_name = error_name
        self.description = description
        super().__init__(f"{call} failed: {error_name} ({description or code})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.code, self.error_name, self.description))
