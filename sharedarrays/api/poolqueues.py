"""What a :class:`~sharedarrays.Pool` and its workers share: two queues whose locks a dead worker
never holds (record locks, ``fcntl.lockf``, released at the holder's exit) and a ``memfd`` table
of the job each worker runs and of the jobs a dead worker failed."""

from __future__ import annotations

import fcntl
import functools
import io
import mmap
import multiprocessing.queues
import os
import pickle
import select
import struct
from collections.abc import Callable, Iterable, Mapping
from multiprocessing import reduction
from typing import Any, NamedTuple, NoReturn

from sharedarrays._cpython import fail_pool_job, next_pool_job
from sharedarrays.errors import SharedArrayError, TaskNotLoaded, WorkerLost
from sharedarrays.process import STATE, running

__all__ = ["MESSAGE_STALL", "STARTING", "RING", "PipeCut", "PoolTable", "ResultQueue"]
__all__ += ["TaskQueue", "Workers", "died_of", "not_run", "read_message", "start_worker"]

RING = 64  # how many of the last jobs failed by a dead worker the table names
# cells: (job below which all failed, pid, exit code), RING of (job + 1, pid, exit code), then
# per worker slot (pid, state): STARTING, 0 nothing, _TAKING a task being read, else job + 1
_MARK, _RING = 0, 3
_SLOTS = _RING + 3 * RING
_TAKING, STARTING = -1, -2  # STARTING: the pool's initializer has not returned yet
_TASKS_LOCK, _RESULTS_LOCK, _SLOTS_LOCK = 0, 1, 2  # the locks' bytes, past the cells


class PoolTable:
    """One pool's table and locks: a ``memfd`` of int64 ``cells``; pickles as a ``DupFd``."""

    __slots__ = ("fd", "slots", "_map", "cells", "_ring_next")

    def __init__(self, slots: int, dup: Any = None) -> None:
        size = 8 * (_SLOTS + 2 * slots)
        fd = os.memfd_create("sharedarrays-pool", os.MFD_CLOEXEC) if dup is None else dup.detach()
        try:
            if dup is None:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.cells = memoryview(self._map).cast("q")
        self.fd, self.slots = fd, slots
        self._ring_next = 0  # (the pool's own: the next ring cell it writes)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return PoolTable, (self.slots, reduction.DupFd(self.fd))

    def close(self) -> None:
        """Unmap the table and close its fd (idempotent)."""
        if getattr(self, "fd", -1) < 0:  # (construction failed, or closed)
            return
        self.cells.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1

    __del__ = close

    def lock(self, which: int) -> RecordLock:
        return RecordLock(self, len(self._map) + which)

    def _slot_cells(self) -> range:  # (each slot's first cell: the pid)
        return range(_SLOTS, _SLOTS + 2 * self.slots, 2)

    def reap(self, pid: int) -> int | None:
        """Free the slot of worker ``pid``: what it held, or ``None`` when it had none."""
        cells = self.cells
        for cell in self._slot_cells():
            if cells[cell] == pid:
                state = int(cells[cell + 1])
                cells[cell + 1] = cells[cell] = 0
                return state
        return None

    def lose(self, job: int, pid: int, code: int, below: bool = False) -> None:
        """Job ``job`` (``below``: every job below it) failed as worker ``pid`` died."""
        if below:
            cell = _MARK
        else:
            cell, job = _RING + 3 * self._ring_next, job + 1
            self._ring_next = (self._ring_next + 1) % RING
        self.cells[cell + 1], self.cells[cell + 2] = pid, code
        self.cells[cell] = job  # (last: a worker reads the job first)

    def claim(self, pid: int) -> int:
        """A worker's: the state cell of a free slot (or a dead worker's) for worker ``pid``."""
        cells = self.cells
        with self.lock(_SLOTS_LOCK):
            free = [cell for cell in self._slot_cells() if cells[cell] == 0]
            if not free:
                free = [cell for cell in self._slot_cells() if not running(int(cells[cell]))]
            if not free:
                raise SharedArrayError(
                    f"this pool's table has {self.slots} slots, all held by running workers: "
                    "a worker of the pool cannot start; make a new pool"
                )
            cells[free[0] + 1] = 0
            cells[free[0]] = pid
            return free[0] + 1

    def lost(self, job: int) -> tuple[int, int] | None:
        """The pid and exit code of the worker whose death failed ``job``, or ``None``."""
        cells = self.cells
        if job < cells[_MARK]:
            return int(cells[_MARK + 1]), int(cells[_MARK + 2])
        for cell in range(_RING, _SLOTS, 3):
            if cells[cell] == job + 1:
                return int(cells[cell + 1]), int(cells[cell + 2])
        return None


class RecordLock(NamedTuple):
    """A lock between processes that its holder's exit releases: a record lock on one byte."""

    table: PoolTable
    byte: int

    def acquire(self) -> bool:
        """Take the lock, waiting; a closed table's is taken at once."""
        fd = self.table.fd
        if fd >= 0:  # (closed: the standard library's pool takes its task lock as it ends)
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, self.byte)
        return True

    def release(self) -> None:
        if self.table.fd >= 0:
            fcntl.lockf(self.table.fd, fcntl.LOCK_UN, 1, self.byte)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Workers(list):  # type: ignore[type-arg]
    """``Pool._pool``, failing the job a dead worker ran: the handler thread's ``del pool[i]``
    asks the table what it held, and that job (where it cannot tell, every pending job) fails
    once the next worker is appended."""

    def __init__(self, workers: Iterable[Any], cache: Mapping[int, Any], table: PoolTable) -> None:
        super().__init__(workers)
        self.cache = cache
        self.table = table
        self.failed: list[tuple[Any, WorkerLost]] = []  # (jobs to fail once replaced)
        self.lost_all: tuple[WorkerLost, int, int] | None = None  # (every job: pid, code)

    def __delitem__(self, index: Any) -> None:
        if isinstance(index, int):
            worker = self[index]
            held = self.table.reap(worker.pid)
            # (None: no slot yet; an error then ends every new worker the same way)
            if held or (held is None and worker.exitcode > 0):
                self._lost(worker.pid, worker.exitcode, held)
        super().__delitem__(index)

    def _lost(self, pid: int, code: int, held: int | None) -> None:
        died = f"a worker of this Pool (pid {pid}) died ({died_of(code)})"
        others = (
            "(its tasks no worker had taken are not run; those other workers were running "
            "finish, their results dropped), and a new worker took its place"
        )
        again = (
            "; its standard error may say why (a task that called os._exit(), a crash; the "
            "kernel's log names the out-of-memory killer's victims): submit it again once "
            "that is mended"
        )
        if held is not None and held > 0:
            job = self.cache.get(held - 1)
            self.table.lose(held - 1, pid, code)  # (before the new worker can take a task)
            if job is not None:
                why = f"{died} while it ran a task of this job, so the job failed with this error"
                lost = WorkerLost(f"{why} {others}; the pool's other jobs go on{again}")
                self.failed.append((job, lost))
            return
        every = "so every job pending then failed with this error"
        if held is None:
            what = (
                f"as it started, before the pool's initializer ran, {every}, and a new worker "
                "took its place: each one that ends so fails the jobs pending then. Its "
                "standard error says why. A spawned or forkserver worker first imports the "
                'main module again: make the pool only under if __name__ == "__main__": (the '
                "main module must not make one as it is imported), run the script from a file "
                "(python - reads it from standard input, which cannot be imported again), and "
                "make the pool again"
            )
        elif held == STARTING:
            what = (
                f"as the pool's initializer ran (it raised, or ended the process), {every}, "
                "and a new worker took its place: each one the initializer ends fails the jobs "
                "pending then; mend the initializer, and make the pool again"
            )
        else:
            what = f"as it took a task, before it could say of which job, {every} {others}{again}"
        self.lost_all = WorkerLost(f"{died} {what}"), pid, code
        # untaken tasks of every job so far are not run (set before the new worker starts)
        self.table.lose(next_pool_job(), pid, code, below=True)

    def append(self, worker: Any) -> None:
        super().append(worker)
        failed, self.failed = self.failed, []
        if self.lost_all is not None:
            (lost, pid, code), self.lost_all = self.lost_all, None
            self.table.lose(next_pool_job(), pid, code, below=True)  # (jobs submitted since, too)
            failed = [(job, lost) for job in list(self.cache.values())]
        for job, error in failed:
            fail_pool_job(job, error)


def start_worker(
    table: PoolTable, initializer: Callable[..., object] | None = None, initargs: Any = ()
) -> None:
    """A new worker's initializer: claim a slot in ``table``, then run the user's."""
    cell = table.claim(os.getpid())
    STATE.pools.worker = table, cell
    table.cells[cell] = STARTING
    if initializer is not None:
        initializer(*initargs)
    table.cells[cell] = 0


MESSAGE_STALL = 30.0
"""Seconds a worker waits for the rest of a task message before it takes the pipe for cut."""


class PipeCut(EOFError):
    """A pool's task pipe holds the rest of a message a dead reader began."""


def read_message(fd: int, before_read: Callable[[], None] | None = None) -> bytes:
    """One message of a pool's task pipe ``fd``, as ``Connection.recv_bytes`` reads it;
    ``before_read`` is called once bytes are there. A reader killed mid-message leaves its
    rest in the pipe: a bad size, a stall of :data:`MESSAGE_STALL` seconds or a body that is
    no pickle drains the pipe and raises :class:`PipeCut`, ending this worker."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll()  # (the first byte may take forever)
    if before_read is not None:
        before_read()

    def read(n: int) -> bytes:  # (fewer where the rest stalls; EOFError at the pipe's end)
        data = bytearray()
        while len(data) < n and poller.poll(int(MESSAGE_STALL * 1000)):
            part = os.read(fd, min(n - len(data), 1 << 20))
            if not part:
                raise EOFError
            data += part
        return bytes(data)

    header = read(4)
    (size,) = struct.unpack("!i", header) if len(header) == 4 else (0,)
    if size == -1:
        big = read(8)
        (size,) = struct.unpack("!Q", big) if len(big) == 8 else (0,)
    body = read(size) if size > 0 else b""
    if len(body) != size or body[:1] != b"\x80":
        while poller.poll(0) and os.read(fd, 1 << 16):  # (drop what the pipe holds now)
            pass
        raise PipeCut("the pool's task pipe was cut in the middle of a message")
    return body


def not_run(pid: int, code: int) -> None:
    """What a worker calls instead of a task of a job failed by worker ``pid``'s death."""
    raise WorkerLost(
        f"not run: its job failed when a worker of the pool (pid {pid}) died "
        f"({died_of(code)}); submit it again once that is mended"
    )


def died_of(code: int) -> str:
    """A dead process's exit code in words."""
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


class _TaskUnpickler(pickle.Unpickler):
    """Loads a function this worker cannot find as one raising ``TaskNotLoaded``."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (AttributeError, ImportError) as e:
            return functools.partial(_not_loaded, f"{module}.{name}", f"{type(e).__name__}: {e}")


def _not_loaded(what: str, error: str, *args: Any, **kwargs: Any) -> NoReturn:
    raise TaskNotLoaded(
        f"a worker cannot find {what} ({error}): a function a pool runs must be importable "
        "by the worker, at the top level of a module or script (not inside "
        "`if __name__ == '__main__':`), or defined in a notebook cell"
    )


class TaskQueue(multiprocessing.queues.SimpleQueue):  # type: ignore[type-arg]
    """A task queue: the worker's slot says what it took; a failed job's tasks not run."""

    def __init__(self, *, ctx: Any, table: PoolTable) -> None:
        super().__init__(ctx=ctx)
        self._rlock = table.lock(_TASKS_LOCK)

    def get(self) -> Any:
        worker = STATE.pools.worker
        if worker is None or worker[0] is not self._rlock.table:
            return super().get()  # (not this pool's worker: the parent's terminate)
        table, cell = worker
        fd = self._reader.fileno()  # type: ignore[attr-defined]
        with self._rlock:  # (taken before the first byte is read: never a task lost unsaid)
            res = read_message(fd, lambda: table.cells.__setitem__(cell, _TAKING))
        try:
            task = reduction.ForkingPickler.loads(res)
        except (AttributeError, ImportError):  # (a name this worker cannot find)
            task = _TaskUnpickler(io.BytesIO(res)).load()
        if type(task) is not tuple or len(task) != 5 or type(task[0]) is not int:
            table.cells[cell] = 0  # (the sentinel that ends the worker)
            return task
        job = task[0]
        table.cells[cell] = job + 1
        lost = table.lost(job)
        return task if lost is None else (job, task[1], not_run, lost, {})


class ResultQueue(multiprocessing.queues.SimpleQueue):  # type: ignore[type-arg]
    """A result queue; once a result is written, the worker's slot says it holds nothing."""

    def __init__(self, *, ctx: Any, table: PoolTable) -> None:
        super().__init__(ctx=ctx)
        self._wlock = table.lock(_RESULTS_LOCK)

    def put(self, obj: Any) -> None:
        super().put(obj)
        worker = STATE.pools.worker
        if worker is not None and worker[0] is self._wlock.table:
            worker[0].cells[worker[1]] = 0
