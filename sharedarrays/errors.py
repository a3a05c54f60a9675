"""Exceptions raised by sharedarrays.

Every message says what happened and what to do about it.
"""

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
    """The requested memory system cannot be used in this process.

    The message names the missing piece: no driver, no device, a package that is not
    installed, or a CUDA context that cannot be used after ``fork``.
    """


class PeerAccessUnavailable(BackendUnavailable):
    """A device cannot reach another device's memory (``cuDeviceCanAccessPeer`` is 0): it
    cannot be granted access to an array there, nor import one on it."""


class ClosedArrayError(SharedArrayError, ValueError):
    """The array was closed with :meth:`SharedDeviceArray.close` and cannot be used."""


class HandleUnavailable(SharedArrayError):
    """The handles of an allocation cannot be obtained.

    The process that exported the array has exited (or released it) and no other process
    holds its handles; or this process cannot open one more (too many open files: the
    message gives the limit).
    """


def fd_limit_error(what: str, strerror: str) -> HandleUnavailable:
    """The error for ``what`` (e.g. "cannot make a memfd for new memory") failing because
    this process can open no more files (``EMFILE``/``ENFILE``, ``strerror`` the OS's words):
    a :class:`HandleUnavailable` naming the limit and what to do."""
    import resource  # (Unix only, like the package; imported where needed)

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return HandleUnavailable(
        f"{what}: {strerror} (this process may have {limit} open, ulimit -n). Close arrays "
        "this process no longer needs (a.close()), or raise the limit"
    )


def thread_error(what: str, error: BaseException) -> ThreadUnavailable:
    """The error for ``what`` (e.g. "cannot start the handle server's thread") failing
    because no thread can start (``error``, Python's "can't start new thread"): a
    :class:`ThreadUnavailable` naming the limits and what to do."""
    import resource

    def limit(which: int, unit: int) -> str:
        soft = resource.getrlimit(which)[0]
        return "unlimited" if soft == resource.RLIM_INFINITY else str(soft // unit)

    return ThreadUnavailable(
        f"{what}: {error} (this process is at its limit of threads or of address space for "
        f"their stacks: ulimit -u {limit(resource.RLIMIT_NPROC, 1)}, ulimit -v "
        f"{limit(resource.RLIMIT_AS, 1024)}). Raise the limit, or end threads this process "
        "no longer needs"
    )


class PermissionDenied(SharedArrayError, PermissionError):
    """The requesting process may not import this allocation.

    Raised for another OS user, a wrong secret, or a process outside the allow-list.
    """


class PayloadError(SharedArrayError, ValueError):
    """A payload is malformed, truncated, tampered with, or of an unknown version."""


class MisalignedView(SharedArrayError, ValueError):
    """A view of device (GPU) memory whose byte offset or a stride is not a multiple of its
    dtype's alignment (``a[1:9].view("float64")`` of a uint8 array on a GPU): a kernel
    reading it would fail with a misaligned address, which ends every later GPU computation
    of the process (CUDA's ``cudaErrorMisalignedAddress``). Host memory allows such views,
    as NumPy does. Copy the bytes first (``a.array[1:9].copy().view("float64")``)."""


class ThreadUnavailable(SharedArrayError, RuntimeError):
    """This process cannot start a thread sharedarrays needs (its handle server, the
    keeper's reaper, the release notices): it is at its limit of threads or of address
    space for their stacks (``ulimit -u``, ``ulimit -v``). Nothing made for it is left
    open. Raise the limit, or end threads this process no longer needs."""


class NameExists(SharedArrayError, FileExistsError):
    """An array of that name exists already (for this user, in the keeper).

    Attach to it with :func:`sharedarrays.attach`, or remove the name first with
    :func:`sharedarrays.unlink`.
    """


class NameNotFound(SharedArrayError, FileNotFoundError):
    """No array of that name exists for this user (it was never made, was unlinked, or the
    keeper that held it was stopped)."""


class KeeperError(SharedArrayError):
    """The keeper refused a request as malformed, answered with something that is not a
    keeper reply, or runs but did not accept or answer in time (it is overloaded or stopped:
    try again; ``python -m sharedarrays status`` shows it)."""


class InUse(SharedArrayError, RuntimeError):
    """Memory cannot be freed from outside the processes that use it: a view maps it, or
    exporter-owned memory drains in its exporter until its importers close it
    (``python -m sharedarrays rm``). The message names those processes."""


class WorkerLost(SharedArrayError, RuntimeError):
    """A worker of a :class:`sharedarrays.Pool` died (killed by a signal, the kernel's
    out-of-memory killer, a crash) while it ran a task of this job. The standard library's
    pool would wait for that task forever; this one fails its job (every job pending, in
    the rare case where the worker died before it could say which) and goes on with a new
    worker and its other jobs: submit it again."""


class TaskNotLoaded(SharedArrayError, AttributeError):
    """A worker of a :class:`sharedarrays.Pool` cannot find the function of a task (or
    another name it refers to): a function defined inside ``if __name__ == "__main__":``,
    or in a module the worker cannot import. That task's error; the worker goes on."""


class TaskExited(SharedArrayError, RuntimeError):
    """A task of a :class:`sharedarrays.Pool` or :class:`sharedarrays.ProcessPoolExecutor`
    called ``sys.exit()`` (raised ``SystemExit``). A task cannot end its worker: the
    standard library's pool would wait for its result forever, and its executor would raise
    the ``SystemExit`` in the caller, which ends the caller's program. Here it is that
    task's error, and the worker goes on: return a value or raise an exception instead."""


class WaitTimeout(SharedArrayError, TimeoutError):
    """A wait with a time limit ended before what it waited for happened (a
    :class:`~sharedarrays.Timeline` not reaching a value on the CPU): the message says what
    was awaited. A ``TimeoutError`` too, so ``except TimeoutError`` still catches it."""


class ResizeRefused(SharedArrayError, RuntimeError):
    """A growable array cannot be resized now.

    Shrinking is refused while something still maps the chunks it would remove: a view or a
    native array in this process that reaches past the new end, or another process that
    imported those chunks and is still running. Resizing is refused in importers (only the
    exporter resizes; importers call :meth:`SharedDeviceArray.refresh`). The message says
    which and what to do.
    """


class OutOfMemory(SharedArrayError, MemoryError):
    """The memory or address space an array needs is not there.

    Raised when a new array, or the growth of one, is larger than the memory this machine
    has available (host memory: ``MemAvailable`` plus free swap, see the user guide; on CUDA
    the driver's refusal, ``CudaOutOfMemory``), or when this process cannot reserve or map
    the address range. The message gives the size asked for and what is available, and
    what to do.
    """


class NotShareable(SharedArrayError, ValueError):
    """Memory that already exists cannot be shared in place (:func:`sharedarrays.share`).

    Raised for host memory (a NumPy array is private to its process), for device memory that
    CUDA IPC cannot export (stream-ordered pools such as ``cudaMallocAsync``, managed memory,
    VMM memory such as PyTorch's ``expandable_segments``), and for objects that are not
    arrays. The message says why; :func:`sharedarrays.from_array` copies the array into new
    shared memory instead.
    """


class WrongNode(SharedArrayError):
    """A payload made on another node (another machine, user, or mount or pid namespace: see
    :mod:`sharedarrays.node`) was loaded here.

    Its handles name processes and sockets of that node, so nothing here is opened. Send the
    array's data instead (``a.get()``, or let Dask do it: with ``sharedarrays.api.dask``
    registered, Dask moves an array between nodes as data). An array placed directly in a
    Dask task travels as its payload: on a worker of another node the task fails with this
    error when it uses the array (:class:`~sharedarrays.api.othernode.OtherNodeArray`).
    """


class DriverError(SharedArrayError, OSError):
    """A call into a device's driver or runtime failed (the base of ``CudaDriverError``,
    ``HipError`` and ``AclError``).

    Attributes
    ----------
    call : str
        The function (and what it was asked for).
    code : int
        The error value the call returned.
    error_name : str
        Its name, e.g. ``"CUDA_ERROR_INVALID_VALUE"``.
    description : str
        The driver's own words for it, where it gives them.
    """

    def __init__(self, call: str, code: int, error_name: str, description: str = "") -> None:
        self.call = call
        self.code = code
        self.error_name = error_name
        self.description = description
        super().__init__(f"{call} failed: {error_name} ({description or code})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.call, self.code, self.error_name, self.description))
