"""Exceptions raised by sharedarrays; every message says what happened and what to do."""

from __future__ import annotations

from typing import Any

__all__ = [
    "SharedArrayError",
    "BackendUnavailable",
    "PeerAccessUnavailable",
    "ClosedArrayError",
    "HandleUnavailable",
    "PermissionDenied",
    "PayloadError",
    "NameExists",
    "NameNotFound",
    "KeeperError",
    "InUse",
    "ResizeRefused",
    "OutOfMemory",
    "NotShareable",
    "WrongNode",
    "WorkerLost",
    "TaskExited",
    "TaskNotLoaded",
    "WaitTimeout",
    "MisalignedView",
    "ThreadUnavailable",
    "SettingError",
]


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
    """A view of GPU memory with an offset or stride off its dtype's alignment, which would
    fail a kernel: copy the bytes first (``a.array[1:9].copy().view("float64")``)."""


class ThreadUnavailable(SharedArrayError, RuntimeError):
    """No thread can start (``ulimit -u``, ``ulimit -v``); nothing made for it is left open."""


class NameExists(SharedArrayError, FileExistsError):
    """An array of that name exists already: :func:`sharedarrays.attach` it, or
    :func:`sharedarrays.unlink` the name first."""


class NameNotFound(SharedArrayError, FileNotFoundError):
    """No array of that name exists for this user (never made, unlinked, or keeper gone)."""


class KeeperError(SharedArrayError):
    """The keeper refused a request, answered nonsense, or did not answer in time."""


class InUse(SharedArrayError, RuntimeError):
    """Memory cannot be freed from outside the processes that use it (the message names them)."""


class WorkerLost(SharedArrayError, RuntimeError):
    """A :class:`sharedarrays.Pool` worker died running a task of this job: the job fails, the
    pool goes on."""


class TaskNotLoaded(SharedArrayError, AttributeError):
    """A :class:`sharedarrays.Pool` worker cannot find a task's function (defined under
    ``if __name__ == "__main__":``, say)."""


class TaskExited(SharedArrayError, RuntimeError):
    """A pool task called ``sys.exit()``: that task fails, the worker goes on."""


class WaitTimeout(SharedArrayError, TimeoutError):
    """A wait with a time limit ended first (a :class:`~sharedarrays.Timeline` on the CPU)."""


class ResizeRefused(SharedArrayError, RuntimeError):
    """A growable array cannot be resized: this process is an importer (it calls
    :meth:`SharedDeviceArray.refresh`), or a shrink would unmap chunks still in use."""


class OutOfMemory(SharedArrayError, MemoryError):
    """The memory or address space an array (or its growth) needs is not there."""


class NotShareable(SharedArrayError, ValueError):
    """:func:`sharedarrays.share` cannot share this in place (host memory, device memory
    CUDA IPC cannot export, or no array); :func:`sharedarrays.from_array` copies it."""


class WrongNode(SharedArrayError):
    """A payload of another node (machine, user, mount or pid namespace) was loaded here: send
    the data instead (``a.get()``, or Dask with ``sharedarrays.api.dask``)."""


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
