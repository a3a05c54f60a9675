"""External semaphores on CUDA: import one another API exported as an fd, signal and wait on
it in stream order, destroy it. :class:`sharedarrays.ExternalSemaphore` holds the
:class:`ImportedSemaphore` that :meth:`.device.CudaDevice.import_semaphore` returns."""

from __future__ import annotations

import os
import weakref
from typing import Any, Literal

from sharedarrays.backends.cuda.driver import OnDevice, check, load_driver
from sharedarrays.errors import BackendUnavailable, ClosedArrayError

__all__ = ["ImportedSemaphore", "import_semaphore", "enqueue"]


def _destroy(on: OnDevice, handle: Any, pid: int) -> None:
    if os.getpid() != pid:
        return  # a fork child's copy: the parent owns it
    with on.context():
        load_driver().cuDestroyExternalSemaphore(handle)


class ImportedSemaphore:
    """A ``CUexternalSemaphore`` imported into one device's primary context (``timeline``:
    a 64-bit timeline, else binary), destroyed by :meth:`close` or when freed."""

    def __init__(self, on: OnDevice, handle: Any, timeline: bool) -> None:
        self.timeline = timeline
        self._handle: Any = handle
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, _destroy, on, handle, self._pid)

    def live(self) -> Any:
        """The driver handle; raises :class:`~sharedarrays.ClosedArrayError` once closed,
        :class:`~sharedarrays.BackendUnavailable` after fork."""
        if not self._finalizer.alive:
            raise ClosedArrayError("this external semaphore was closed")
        if os.getpid() != self._pid:
            raise BackendUnavailable("an external semaphore cannot be used after fork")
        return self._handle

    @property
    def closed(self) -> bool:
        """Whether it was released."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Destroy it now (``cuDestroyExternalSemaphore``). Idempotent."""
        self._finalizer()


def import_semaphore(on: OnDevice, fd: int, timeline: bool) -> ImportedSemaphore:
    """Import a semaphore exported as ``fd`` (opaque or timeline fd) into ``on``'s device;
    CUDA owns ``fd`` on success, the caller closes it on failure."""
    d = load_driver()
    types = d.CUexternalSemaphoreHandleType
    desc = d.CUDA_EXTERNAL_SEMAPHORE_HANDLE_DESC()
    desc.type = (
        types.CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_TIMELINE_SEMAPHORE_FD
        if timeline
        else types.CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD
    )
    desc.handle.fd = fd
    desc.flags = 0
    what = "timeline" if timeline else "opaque"
    with on.context():
        handle = check(d.cuImportExternalSemaphore(desc), f"cuImportExternalSemaphore({what})")
    return ImportedSemaphore(on, handle, timeline)


def enqueue(
    on: OnDevice, op: Literal["Signal", "Wait"], sem: ImportedSemaphore, value: int, stream: int
) -> None:
    """``cu{op}ExternalSemaphoresAsync`` of ``sem`` (to ``value``: timelines) on ``stream``."""
    handle = sem.live()
    d = load_driver()
    params = getattr(d, f"CUDA_EXTERNAL_SEMAPHORE_{op.upper()}_PARAMS")()
    params.params.fence.value = value
    params.flags = 0
    call = f"cu{op}ExternalSemaphoresAsync"
    with on.context():
        check(getattr(d, call)([handle], [params], 1, stream), call)
