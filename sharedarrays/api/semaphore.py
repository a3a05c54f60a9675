"""Ordering that other APIs and processes drive: :class:`ExternalSemaphore` (exported by
Vulkan, say) and :class:`Timeline` (a counter in a shared array)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from sharedarrays.backends import StreamBackend, get_backend
from sharedarrays.backends.base import ValueReader
from sharedarrays.backends.device import Device, DeviceLike, parse_device
from sharedarrays.errors import BackendUnavailable, ClosedArrayError, WaitTimeout

if TYPE_CHECKING:
    from sharedarrays.api.array import SharedDeviceArray

__all__ = ["ExternalSemaphore", "Timeline", "SemaphoreKind"]

SemaphoreKind = Literal["opaque", "timeline"]


def timeline_value(value: object) -> int:
    """``value`` as a timeline's value: an int (TypeError if not) in [0, 2**64)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"a timeline value is an int, not {type(value).__name__}")
    if not 0 <= int(value) < 1 << 64:
        raise ValueError(f"a timeline value is in [0, 2**64), not {value!r}")
    return int(value)


class ExternalSemaphore(contextlib.AbstractContextManager["ExternalSemaphore"]):
    """A semaphore another API (Vulkan, say) exported, imported into CUDA (:meth:`from_fd`),
    signalled and awaited on the current stream; ``kind``: ``"opaque"`` or ``"timeline"``."""

    def __init__(self, handle: Any, kind: SemaphoreKind, backend: StreamBackend) -> None:
        self._handle: Any = handle
        self.kind: SemaphoreKind = kind
        self.device = backend.device
        self._backend = backend
        self._pid = os.getpid()

    @classmethod
    def from_fd(
        cls, fd: int, kind: SemaphoreKind = "opaque", device: DeviceLike = None
    ) -> ExternalSemaphore:
        """Import the semaphore of ``fd`` (``vkGetSemaphoreFdKHR``; closed here, also on
        failure) into ``device`` (default ``cuda:0``). ValueError for a bad ``kind`` or ``fd``,
        BackendUnavailable without CUDA, CudaDriverError for a refused handle."""
        try:
            if kind not in ("opaque", "timeline"):
                raise ValueError(f"kind must be 'opaque' or 'timeline', not {kind!r}")
            if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
                raise ValueError(f"fd must be an open file descriptor, not {fd!r}")
            try:
                os.fstat(fd)  # a closed fd is a ValueError here, not a driver error
            except OSError as exc:
                raise ValueError(f"fd {fd} is not an open file descriptor ({exc})") from None
            dev = parse_device("cuda:0" if device is None else device)
            backend = get_backend(dev) if dev.needs_context else None
            if not isinstance(backend, StreamBackend):
                raise BackendUnavailable(f"an external semaphore needs a CUDA device, not {dev}")
            handle = backend.import_semaphore(fd, kind == "timeline")
        except BaseException:
            with contextlib.suppress(OSError, TypeError):
                os.close(fd)
            raise
        return cls(handle, kind, backend)

    def _enqueue(self, op: Callable[[Any, int], None], value: int | None) -> None:
        if self._handle is None:
            raise ClosedArrayError("this external semaphore was closed")
        if os.getpid() != self._pid:
            raise BackendUnavailable("an external semaphore cannot be used after fork")
        if self.kind != "timeline" and value is not None:
            raise ValueError("a binary ('opaque') semaphore takes no value")
        op(self._handle, timeline_value(value) if self.kind == "timeline" else 0)

    def signal(self, value: int | None = None) -> None:
        """Enqueue a signal on the current stream (``value`` for a timeline only)."""
        self._enqueue(self._backend.signal_semaphore, value)

    def wait(self, value: int | None = None) -> None:
        """Enqueue a wait on the current stream (``value`` for a timeline only)."""
        self._enqueue(self._backend.wait_semaphore, value)

    def close(self) -> None:
        """Destroy the imported semaphore. Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None:
            self._backend.destroy_semaphore(handle)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._handle is None else "open"
        return f"<ExternalSemaphore {self.kind} on {self.device} ({state})>"


class Timeline:
    """A 64-bit counter, element ``index`` of a ``uint64``/``int64`` shared ``array``, that
    processes signal and wait on in stream order on CUDA (``cuStreamWriteValue64``,
    ``cuStreamWaitValue64``), from the CPU on the host; it pickles with its array.

    A waiting stream blocks later GPU work until a value at least as large is signalled
    (values should only grow); device-wide synchronisation (a kernel's first load) stalls
    behind it: run each kernel once before queueing a wait it guards.
    """

    def __init__(self, array: SharedDeviceArray, index: int | tuple[int, ...] = 0) -> None:
        if array.dtype not in (np.dtype("uint64"), np.dtype("int64")):
            raise TypeError(f"a Timeline counter is uint64 or int64, not {array.dtype}")
        key = index if isinstance(index, tuple) else (index,)
        if array.ndim == 0:
            if key not in ((), (0,)):
                raise IndexError("a 0-d array has one element: index 0")
            key = ()
        one = (*key, Ellipsis)  # (with ..., a 0-d view, never NumPy's scalar)
        word = array[one] if key else array
        if word.ndim != 0:
            raise IndexError(f"index {index!r} does not name one element of shape {array.shape}")
        if word.address % 8:
            raise ValueError("the counter must be 8-byte aligned")
        backend = array.allocation.backend
        streams = backend if isinstance(backend, StreamBackend) else None
        if streams is not None and streams.values_refused is not None:
            raise ValueError(
                f"a Timeline cannot live in a {backend.name} array: {streams.values_refused}"
            )
        self.array = array
        self.index = index
        self.device: Device = array.device  # where the counter lives
        self._word = word
        self._streams = streams  # None: the CPU signals and polls the word
        self._reader: ValueReader | None = None
        self._lock = threading.Lock()

    @property
    def address(self) -> int:
        """The counter's address in this process."""
        return self._word.address

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return Timeline, (self.array, self.index)

    def signal(self, value: int | None) -> None:
        """Set the counter after the current stream's earlier work (CUDA), or now (host)."""
        v = timeline_value(value)
        if self._streams is None:
            self._word.array[...] = np.uint64(v).view(self.array.dtype)
        else:
            self._streams.write_value(self.address, v)

    def wait(self, value: int | None, timeout: float | None = None) -> None:
        """Make later work on the current stream wait for ``value`` (host: :meth:`wait_host`)."""
        if self._streams is None:
            self.wait_host(timeline_value(value), timeout)
        else:
            self._streams.wait_value(self.address, timeline_value(value))

    @property
    def value(self) -> int:
        """The counter now, read without waiting for any stream."""
        if self._streams is None:
            return int(self._word.array.view(np.uint64))  # (host memory: NumPy)
        with self._lock:
            if self._reader is None:
                self._reader = self._streams.value_reader()
            reader = self._reader
        return reader.read(self.address)

    def wait_host(self, value: int, timeout: float | None = None) -> None:
        """Wait on the CPU for the counter to reach ``value`` (WaitTimeout after ``timeout``)."""
        v = timeline_value(value)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 1e-5
        while self.value < v:
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"the timeline stayed at {self.value} < {v} for {timeout:g} s; is the "
                    "process that signals it running?"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def close(self) -> None:
        """Release the private reading stream (CUDA)."""
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def __repr__(self) -> str:
        return f"<Timeline {self.array.dtype} at {self.address:#x} on {self.device}>"
