"""Cross-process ordering of GPU work: the exporter records an interprocess event (from a
per-device ring of at most :data:`RING_LIMIT`) on its stream and sends its *token*, naming the
exporter, whose exit ends the wait; the importer's stream waits. None when idle."""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sharedarrays import process
from sharedarrays.backends.cuda.driver import (
    OnDevice,
    check,
    current_stream,
    load_driver,
    opaque_bytes,
    opaque_from_bytes,
)
from sharedarrays.errors import PayloadError
from sharedarrays.process import running, start_time
from sharedarrays.protocol import token as wire

RING_LIMIT = 256  # most events in one device's ring
TOKEN_SIZE = wire.TOKEN_SIZE

_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600

_no_sync: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sharedarrays_no_sync", default=False
)


@contextlib.contextmanager
def no_sync() -> Iterator[None]:
    """Hand arrays off without ordering inside this block (thread- and task-local), when you
    have synchronised yourself: payloads carry no event, importers do not wait."""
    token = _no_sync.set(True)
    try:
        yield
    finally:
        _no_sync.reset(token)


class Fence:
    """The ordering of one message (``token``; ``None``: idle), pickled as the token; held
    by one ``dumps``'s memo and :func:`export_fence` only weakly, so each message records."""

    __slots__ = ("token", "__weakref__")
    token: bytes | None  # (set by export_fence, which skips the constructor)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        if self.token is None:
            return type(None), ()
        return bytes, (self.token,)

    def __repr__(self) -> str:
        return f"<Fence {'idle' if self.token is None else self.token[-8:].hex()}>"


_new_fence = object.__new__


def export_fence(on: OnDevice) -> Fence | None:
    """The live :class:`Fence` of this thread and stream, else a new one; ``None`` inside
    :func:`no_sync`. No helpers: every array asks, a call costs 1-2 us in a woken thread."""
    if _no_sync.get():
        return None
    index = on.device.index
    stream = current_stream(index)
    fences = process.STATE.backends.fences  # (per thread)
    refs: dict[tuple[int, int], weakref.ref[Fence]] | None = getattr(fences, "refs", None)
    if refs is None:
        refs = fences.refs = {}
    key = (index, stream)
    ref = refs.get(key)
    found = None if ref is None else ref()
    if found is not None:
        return found
    made = _new_fence(Fence)  # (Fence's constructor without its frame)
    made.token = on.stream_token(stream)
    refs[key] = weakref.ref(made)
    return made


@dataclass
class _Ring:
    slots: list[tuple[Any, bytes]] = field(default_factory=list)  # (event, its IPC handle)
    cursor: int = 0


# In STATE.backends: ``rings``: device index -> _Ring; ``own``: handle -> own event;
# ``opened``: handle -> (pid, start, opened event); ``waited``: (device, stream) -> the last
# token waited for; ``records``: events recorded here (the tokens' sequence numbers).


def _my_start_time() -> int:
    state = process.STATE.backends
    if state.start_time is None:
        state.start_time = start_time(os.getpid()) or 0
    return state.start_time


def _next_slot(driver: Any, ring: _Ring) -> tuple[Any, bytes]:  # (a new one if pending)
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
    kinds = driver.CUevent_flags
    flags = int(kinds.CU_EVENT_INTERPROCESS) | int(kinds.CU_EVENT_DISABLE_TIMING)
    event = check(driver.cuEventCreate(flags), "cuEventCreate(INTERPROCESS)")
    try:
        handle = opaque_bytes(check(driver.cuIpcGetEventHandle(event), "cuIpcGetEventHandle"))
    except BaseException:
        driver.cuEventDestroy(event)
        raise
    slot = (event, handle)
    ring.slots.insert(ring.cursor, slot)
    ring.cursor = (ring.cursor + 1) % len(ring.slots)
    process.STATE.backends.own[handle] = event
    return slot


def export_sync(on: OnDevice) -> bytes | None:
    """The token of an event recorded on ``on``'s current stream now (``None``: idle, or
    inside :func:`no_sync`)."""
    if _no_sync.get():
        return None
    return on.stream_token(current_stream(on.device.index))


def record(on: OnDevice, stream: int) -> bytes:
    driver = load_driver()
    state = process.STATE.backends
    with state.sync_lock, on.context():
        ring = state.rings.setdefault(on.device.index, _Ring())
        event, handle = _next_slot(driver, ring)
        check(driver.cuEventRecord(event, stream), "cuEventRecord")
        state.records += 1
        token = wire.OrderingToken(os.getpid(), _my_start_time(), handle, state.records)
        return wire.encode(token)


def _event_for(driver: Any, token: bytes) -> Any | None:
    """The event a token names, opened once per process; ``None``: no wait needed."""
    record = wire.decode(token)
    pid, start, handle = record.pid, record.start, record.handle
    state = process.STATE.backends
    if pid == os.getpid():
        event = state.own.get(handle)
        if event is None:
            raise PayloadError("the sync token names an event this process never exported")
        return event
    cached = state.opened.get(handle)
    if cached is not None and cached[:2] == (pid, start) and running(pid):
        return cached[2]  # the steady state: no /proc read, no open
    alive = start_time(pid)
    if alive is None or (start and alive != start):
        # The exporter has exited: its work is over, and its events are gone.
        if cached is not None:
            del state.opened[handle]
            driver.cuEventDestroy(cached[2])
        return None
    ipc = opaque_from_bytes(driver.CUipcEventHandle, handle)
    event = check(driver.cuIpcOpenEventHandle(ipc), "cuIpcOpenEventHandle")
    if cached is not None:
        driver.cuEventDestroy(cached[2])
    _drop_exited(driver, pid)
    state.opened[handle] = (pid, start, event)
    return event


def _drop_exited(driver: Any, sender: int) -> None:  # destroy exited exporters' events
    gone: dict[int, bool] = {}
    opened = process.STATE.backends.opened
    for handle, (pid, _, event) in list(opened.items()):
        if pid == sender:
            continue
        if pid not in gone:
            gone[pid] = not running(pid)
        if gone[pid]:
            del opened[handle]
            driver.cuEventDestroy(event)


def import_sync(on: OnDevice, token: bytes) -> None:
    """Make ``on``'s current stream wait for the event a token names (none for an exited
    exporter's or the one it waited for last); ``PayloadError``: a malformed token."""
    driver = load_driver()
    state = process.STATE.backends
    key = (on.device.index, current_stream(on.device.index))
    if state.waited.get(key) == token:
        return  # this stream already waits for that very record
    with state.sync_lock, on.context():
        event = _event_for(driver, token)
        if event is not None:
            check(driver.cuStreamWaitEvent(key[1], event, 0), "cuStreamWaitEvent")
        state.waited[key] = token
