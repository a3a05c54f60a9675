"""Cross-process ordering of GPU work, with interprocess CUDA events.

When an array is handed to another process, the work this process queued on it may still be
running. The exporter records an event on its current stream (:func:`export_sync`) and puts
the returned *token* in the payload; the importer makes its current stream wait for that
event (:func:`import_sync`) before user code sees the array. Neither side blocks the CPU.

Steady-state cost is one ``cuEventRecord`` on the exporter and one ``cuStreamWaitEvent`` on the
importer: no event is created and no handle is opened per handoff. When the exporter's stream
is idle at the handoff (``cuStreamQuery``: everything queued on it is done) no event is
recorded at all and the importer does not wait; one pickling (a pool task, a queue item)
records at most one event for all the arrays in it (:func:`one_record`).

- Each process keeps, per device, a *ring* of events created with
  ``CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING``, each with its 64-byte IPC handle
  (``cuIpcGetEventHandle``, taken once). :func:`export_sync` records the next event of the
  ring. A slot whose previous record has not completed yet (``cuEventQuery`` says
  ``CUDA_ERROR_NOT_READY``) is not reused, since re-recording it would move the point its
  earlier consumers wait for; the ring grows instead, up to ``RING_LIMIT`` events, past
  which export waits (on the CPU) for the slot's earlier work to finish. Reusing a
  completed slot is safe: a consumer that waits late then waits for a later point, never an
  earlier one.
- Importers open each handle once (``cuIpcOpenEventHandle``) and keep it, keyed by the
  handle's bytes. A token names the exporting process (pid and start time): a token from this
  very process uses the event itself (CUDA cannot open its own IPC handles), and a token
  from a process that has exited needs no wait (its work is over), and its cached event is
  dropped.
- "Current stream" is CuPy's current stream for the device when CuPy is imported, else the
  legacy default stream (which PyTorch also uses unless told otherwise). Work queued on other
  streams is not covered; synchronise those yourself or make them current.

Everything is released at process exit. :func:`no_sync` turns export off for a block.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import struct
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sharedarrays.errors import PayloadError
from sharedarrays.process import at_fork, running, start_time

if TYPE_CHECKING:
    from sharedarrays.backends.cuda.driver import CudaDevice

__all__ = [
    "no_sync",
    "one_record",
    "sync_enabled",
    "export_sync",
    "import_sync",
    "current_stream",
    "RING_LIMIT",
]

RING_LIMIT = 256
"""Most events in one device's ring."""

_HEAD = struct.Struct("<QQ")  # exporter pid, exporter start time (clock ticks since boot)
_HANDLE_SIZE = 64
_SEQ = struct.Struct("<Q")  # which record of the event: a token names one point in time
TOKEN_SIZE = _HEAD.size + _HANDLE_SIZE + _SEQ.size

_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600

_no_sync: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sharedarrays_no_sync", default=False
)
_batch: contextvars.ContextVar[dict[tuple[int, int], bytes] | None] = contextvars.ContextVar(
    "sharedarrays_sync_batch", default=None
)


@contextlib.contextmanager
def one_record() -> Iterator[None]:
    """Inside this block, every export on one device and stream shares one event record.

    For one pickling: ``multiprocessing``'s ``ForkingPickler.dumps`` runs in it (see
    ``array.py``), so a task with 10,000 arrays records one event, its token is pickled once
    (pickle's memo) and the importer waits once. Safe because no work can be queued between
    the exports of one pickling; do not run GPU work inside the block.
    """
    token = _batch.set({})
    try:
        yield
    finally:
        _batch.reset(token)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Hand arrays off without ordering inside this block (thread- and task-local).

    Use it when you have synchronised yourself (or nothing is in flight): payloads made inside
    carry no event, and importers do not wait.

    Examples
    --------
    >>> with sharedarrays.no_sync():          # doctest: +SKIP
    ...     pool.map(work, [a] * 4)
    """
    token = _no_sync.set(True)
    try:
        yield
    finally:
        _no_sync.reset(token)


def sync_enabled() -> bool:
    """Whether :func:`export_sync` records events here (``False`` inside :func:`no_sync`)."""
    return not _no_sync.get()


# --------------------------------------------------------------------------------------------
# process state


@dataclass
class _Ring:
    slots: list[tuple[Any, bytes]] = field(default_factory=list)  # (event, its IPC handle)
    cursor: int = 0


_lock = threading.Lock()
_state_pid = os.getpid()
_rings: dict[int, _Ring] = {}  # device index -> ring
_own: dict[bytes, Any] = {}  # handle bytes -> an event of this process's rings
_opened: dict[bytes, tuple[int, int, Any]] = {}  # handle bytes -> (pid, start, opened event)
_waited: dict[tuple[int, int], bytes] = {}  # (device, stream) -> the last token it waited for
_records = 0  # events recorded by this process (the tokens' sequence numbers)
_start_time_cache: int | None = None


def _reset_after_fork() -> None:
    """Forget the parent's events in a fork child (CUDA is unusable there anyway)."""
    global _state_pid, _start_time_cache
    if _state_pid != os.getpid():
        _rings.clear()
        _own.clear()
        _opened.clear()
        _waited.clear()
        _state_pid = os.getpid()
        _start_time_cache = None


at_fork("backends", order=1, after_in_child=_reset_after_fork)


_head_cache: tuple[int, bytes] | None = None


def _token_head() -> bytes:
    """This process's part of every token it makes (pid and start time), made once."""
    global _head_cache
    pid = os.getpid()
    if _head_cache is None or _head_cache[0] != pid:
        _head_cache = (pid, _HEAD.pack(pid, _my_start_time()))
    return _head_cache[1]


def _my_start_time() -> int:
    global _start_time_cache
    if _start_time_cache is None:
        _start_time_cache = start_time(os.getpid()) or 0
    return _start_time_cache


def current_stream(device_index: int) -> int:
    """The stream handle that export and import use for a device.

    CuPy's current stream for that device when CuPy is imported, else ``0`` (the legacy
    default stream of the current context).
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            return int(cupy.cuda.get_current_stream(device_index).ptr)
        except TypeError:  # a CuPy without the device_id argument
            with cupy.cuda.Device(device_index):
                return int(cupy.cuda.get_current_stream().ptr)
    return 0


# --------------------------------------------------------------------------------------------
# export


def _next_slot(driver: Any, ring: _Ring) -> tuple[Any, bytes]:
    """The ring's next reusable event and its handle, creating one when the next is pending."""
    from sharedarrays.backends.cuda.driver import check, opaque_bytes

    n = len(ring.slots)
    if n:
        slot = ring.slots[ring.cursor]
        err = int(driver.cuEventQuery(slot[0])[0])
        if err == _CUDA_ERROR_NOT_READY and n >= RING_LIMIT:
            check(driver.cuEventSynchronize(slot[0]), "cuEventSynchronize")
            err = _CUDA_SUCCESS
        if err == _CUDA_SUCCESS:
            ring.cursor = (ring.cursor + 1) % n
            return slot
        if err != _CUDA_ERROR_NOT_READY:
            check((err,), "cuEventQuery")
    flags = int(driver.CUevent_flags.CU_EVENT_INTERPROCESS) | int(
        driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
    )
    event = check(driver.cuEventCreate(flags), "cuEventCreate(INTERPROCESS)")
    try:
        handle = opaque_bytes(check(driver.cuIpcGetEventHandle(event), "cuIpcGetEventHandle"))
    except BaseException:
        driver.cuEventDestroy(event)
        raise
    slot = (event, handle)
    ring.slots.insert(ring.cursor, slot)
    ring.cursor = (ring.cursor + 1) % len(ring.slots)
    _own[handle] = event
    return slot


def export_sync(backend: CudaDevice) -> bytes | None:
    """Record an event on the current stream of the backend's device; return its token.

    Returns
    -------
    bytes or None
        ``None`` inside :func:`no_sync`, and when the stream has nothing left to run
        (``cuStreamQuery`` says so: everything queued on it so far is done, so an importer
        has nothing to wait for); else 88 bytes: exporter pid, its start time, the event's
        IPC handle and the record's sequence number. Inside :func:`one_record` the same
        token (the same object) for every export on that device and stream.
    """
    global _records
    if _no_sync.get():
        return None
    from sharedarrays.backends.cuda.driver import check, load_driver

    driver = load_driver()
    stream = current_stream(backend.device.index)
    batch = _batch.get()
    if batch is not None:
        known = batch.get((backend.device.index, stream))
        if known is not None:
            return known or None  # b"": the stream was idle
    with _lock, backend.context():
        if int(driver.cuStreamQuery(stream)[0]) == _CUDA_SUCCESS:  # idle: nothing to order
            if batch is not None:
                batch[(backend.device.index, stream)] = b""
            return None
        _reset_after_fork()
        ring = _rings.setdefault(backend.device.index, _Ring())
        event, handle = _next_slot(driver, ring)
        check(driver.cuEventRecord(event, stream), "cuEventRecord")
        _records += 1
        token = _token_head() + handle + _SEQ.pack(_records)
    if batch is not None:
        batch[(backend.device.index, stream)] = token
    return token


# --------------------------------------------------------------------------------------------
# import


def _event_for(driver: Any, token: bytes) -> Any | None:
    """The event a token names, opened once per process; ``None`` if no wait is needed."""
    from sharedarrays.backends.cuda.driver import check, opaque_from_bytes

    if len(token) != TOKEN_SIZE:
        raise PayloadError(f"a sync token has {TOKEN_SIZE} bytes, not {len(token)}")
    pid, start = _HEAD.unpack_from(token)
    handle = bytes(token[_HEAD.size : _HEAD.size + _HANDLE_SIZE])
    if pid == os.getpid():
        event = _own.get(handle)
        if event is None:
            raise PayloadError("the sync token names an event this process never exported")
        return event
    cached = _opened.get(handle)
    if cached is not None and cached[:2] == (pid, start) and running(pid):
        return cached[2]  # the steady state: no /proc read, no open
    alive = start_time(pid)
    if alive is None or (start and alive != start):
        # The exporter has exited: its work is over, and its events are gone.
        if cached is not None:
            del _opened[handle]
            driver.cuEventDestroy(cached[2])
        return None
    ipc = opaque_from_bytes(driver.CUipcEventHandle, handle)
    event = check(driver.cuIpcOpenEventHandle(ipc), "cuIpcOpenEventHandle")
    if cached is not None:
        driver.cuEventDestroy(cached[2])
    _opened[handle] = (pid, start, event)
    return event


def import_sync(backend: CudaDevice, token: bytes) -> None:
    """Make the current stream of the backend's device wait for the event a token names.

    Does not block the CPU. A token from a process that has exited needs no wait, nor does
    the token the stream waited for last (many arrays of one pickling share one).

    Raises
    ------
    PayloadError
        The token is malformed.
    CudaDriverError
        Opening the event or waiting on it failed.
    """
    from sharedarrays.backends.cuda.driver import check, load_driver

    driver = load_driver()
    key = (backend.device.index, current_stream(backend.device.index))
    if _waited.get(key) == token and _state_pid == os.getpid():
        return  # this stream already waits for that very record
    with _lock, backend.context():
        _reset_after_fork()
        event = _event_for(driver, token)
        if event is not None:
            check(driver.cuStreamWaitEvent(key[1], event, 0), "cuStreamWaitEvent")
        _waited[key] = token
