"""What a :class:`~sharedarrays.Pool` and its workers share: its two queues, with locks that
a dead worker never holds, and a table of the job each worker is running.

The standard library's pool gives its workers one pipe of tasks and one of results, each
with a ``multiprocessing.Lock`` (a POSIX semaphore) that a worker holds while it reads a task
or writes a result. An idle worker waits for the next task inside that lock; killed there
(the out-of-memory killer, ``kill``), it never releases it, and every other worker, and every
new one, waits for it forever: the pool hangs, however many workers are left.

Here both locks are POSIX record locks (``fcntl.lockf``) on one byte each of a ``memfd``
(:class:`PoolTable`), which the kernel releases when their holder exits, however it exits.
The same ``memfd`` holds the table a dying worker is judged by:

- one slot per worker (taken as it starts, freed when the pool reaps it): its pid and what
  it holds: :data:`STARTING` while the pool's initializer runs, ``0`` nothing (it waits for
  a task, or has sent the result of the last), ``-1`` a task being read (from the moment
  its first bytes are there until its job's number is read), else the number of the job
  (plus one) whose task it runs, until its result is written;
- the jobs the pool failed when a worker died (a ring of the last :data:`RING` numbers, and
  a number below which every job failed): a worker that takes a task of one of them does
  not run it (:func:`not_run`).

The table answers, when the pool finds a worker dead (:meth:`PoolTable.reap`), whether it
ran a task and of which job: only that job fails (:class:`~sharedarrays.api.pool._Workers`).
"""

from __future__ import annotations

import fcntl
import io
import mmap
import multiprocessing.queues
import os
import pickle
import select
import struct
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from sharedarrays.errors import SharedArrayError, TaskNotLoaded, WorkerLost
from sharedarrays.process import running

__all__ = [
    "MESSAGE_STALL",
    "STARTING",
    "died_of",
    "started",
    "PipeCut",
    "PoolTable",
    "RING",
    "ResultQueue",
    "TaskQueue",
    "not_run",
    "read_message",
    "start_worker",
]

RING = 64
"""How many of the last jobs failed by a dead worker the table names (their tasks are not
run); older ones are not run if below the table's mark, else run and their results
dropped."""

_MARK = 0  # the cells of the number below which every job failed, and the dead worker's
# pid and exit code; then the ring, RING entries of (job + 1, pid, exit code)
_RING = 3
_SLOTS = _RING + 3 * RING  # the first worker slot: (pid, state)
_TAKING = -1  # a slot's state: a task being read, its job not yet known
STARTING = -2  # a slot's state: the pool's initializer has not returned yet
_TASKS_LOCK, _RESULTS_LOCK, _SLOTS_LOCK = 0, 1, 2  # the locks' bytes, past the cells


class PoolTable:
    """One pool's shared table and locks: a ``memfd`` of int64 cells that the pool and each
    of its workers map, and on which they take POSIX record locks (see the module's notes).

    It pickles as the fd (multiprocessing's ``DupFd``: as a new worker's start arguments);
    a worker keeps the fd open, since its locks are held through it. :meth:`close` lets go
    of the mapping and the fd.

    Parameters
    ----------
    slots
        How many workers the table can tell about (the pool's size).
    """

    __slots__ = ("fd", "slots", "_map", "_cells", "_ring_next")

    def __init__(self, slots: int, fd: int | None = None) -> None:
        made = fd is None
        if fd is None:
            fd = os.memfd_create("sharedarrays-pool", os.MFD_CLOEXEC)
        size = 8 * (_SLOTS + 2 * slots)
        try:
            if made:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.slots = slots
        self._cells = memoryview(self._map).cast("q")
        self._ring_next = 0  # (the pool's own: the next ring cell it writes)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _mapped_table, (self.slots, reduction.DupFd(self.fd))

    def close(self) -> None:
        """Unmap the table and close its fd (idempotent; also when it is collected)."""
        cells = getattr(self, "_cells", None)
        if cells is None or self._map.closed:  # (construction failed, or closed)
            return
        cells.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1

    __del__ = close

    def lock(self, which: int) -> RecordLock:
        """The lock of byte ``which`` past the cells."""
        return RecordLock(self, len(self._map) + which)

    def _slot_cells(self) -> range:
        """The first cell (the pid) of each worker slot."""
        return range(_SLOTS, _SLOTS + 2 * self.slots, 2)

    # the pool's side ---------------------------------------------------------------------
    def reap(self, pid: int) -> int | None:
        """Free the slot of worker ``pid``, found dead or ended: what it held
        (:data:`STARTING`, ``0``, ``-1`` or a job's number plus one), or ``None`` when it had
        no slot."""
        cells = self._cells
        for cell in self._slot_cells():
            if cells[cell] == pid:
                state = int(cells[cell + 1])
                cells[cell + 1] = 0
                cells[cell] = 0
                return state
        return None

    def lose(self, job: int, pid: int, code: int) -> None:
        """Job ``job`` failed when worker ``pid`` died (exit code ``code``): its tasks that
        no worker took yet are not run."""
        cell = _RING + 3 * self._ring_next
        self._cells[cell + 1] = pid
        self._cells[cell + 2] = code
        self._cells[cell] = job + 1
        self._ring_next = (self._ring_next + 1) % RING

    def lose_below(self, job: int, pid: int, code: int) -> None:
        """Every job numbered below ``job`` failed (see :meth:`lose`)."""
        self._cells[_MARK + 1] = pid
        self._cells[_MARK + 2] = code
        self._cells[_MARK] = job

    # a worker's side ---------------------------------------------------------------------
    def claim(self, pid: int) -> int:
        """A slot for worker ``pid``: its state cell's index. A slot is freed when the pool
        reaps its worker, before it starts the next; one whose worker is gone unreaped is
        taken too.

        Raises
        ------
        SharedArrayError
            No slot is free (the pool has more workers than its table has slots).
        """
        cells = self._cells
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

    def hold(self, cell: int, state: int) -> None:
        """Say what this worker holds (see the module's notes) in its slot's ``cell``."""
        self._cells[cell] = state

    def lost(self, job: int) -> tuple[int, int] | None:
        """The pid and exit code of the worker whose death failed job ``job``, or ``None``
        where it did not fail."""
        cells = self._cells
        if job < cells[_MARK]:
            return int(cells[_MARK + 1]), int(cells[_MARK + 2])
        for cell in range(_RING, _SLOTS, 3):
            if cells[cell] == job + 1:
                return int(cells[cell + 1]), int(cells[cell + 2])
        return None


def _mapped_table(slots: int, dup: Any) -> PoolTable:
    return PoolTable(slots, dup.detach())


class RecordLock:
    """A lock between processes that its holder's exit releases: a POSIX record lock
    (``fcntl.lockf``) on one byte of a :class:`PoolTable`'s fd. It excludes other
    processes, not other threads of the holder's (the queues' locks are taken by one
    thread in each worker)."""

    __slots__ = ("table", "byte")

    def __init__(self, table: PoolTable, byte: int) -> None:
        self.table = table
        self.byte = byte

    def acquire(self, block: bool = True, timeout: float | None = None) -> bool:
        """Take the lock (waiting, unless ``block`` is false); whether it was taken.
        (``timeout`` is not supported: as ``block``.) Once the table is closed (its pool's
        workers are gone) there is no one to exclude: taken at once."""
        fd = self.table.fd
        if fd < 0:  # (the standard library's pool takes its task lock as it ends, at last)
            return True
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB, 1, self.byte)
        except (BlockingIOError, PermissionError):
            return False
        return True

    def release(self) -> None:
        fd = self.table.fd
        if fd >= 0:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, self.byte)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return RecordLock, (self.table, self.byte)


class _Worker:
    """This process's slot, where it is a pool's worker (:func:`start_worker`)."""

    __slots__ = ("table", "cell")

    def __init__(self, table: PoolTable, cell: int) -> None:
        self.table = table
        self.cell = cell


_worker: _Worker | None = None


def start_worker(table: PoolTable) -> None:
    """In a new worker of the pool of ``table``: claim a slot (where the tasks it takes are
    said by :class:`TaskQueue`, and their end by :class:`ResultQueue`), saying that the
    pool's initializer runs (:func:`started`)."""
    global _worker
    _worker = _Worker(table, table.claim(os.getpid()))
    _worker.table.hold(_worker.cell, STARTING)


def started() -> None:
    """The pool's initializer returned: this worker waits for tasks."""
    if _worker is not None:
        _worker.table.hold(_worker.cell, 0)


MESSAGE_STALL = 30.0
"""Seconds a worker waits for more of a task message it has begun to read, before it takes
the task pipe for cut (see :func:`read_message`)."""


class PipeCut(EOFError):
    """A pool's task pipe holds the rest of a message a dead reader began (see
    :func:`read_message`)."""


def read_message(fd: int, before_read: Callable[[], None] | None = None) -> bytes:
    """One message of a pool's task pipe ``fd`` (as ``Connection.recv_bytes`` reads it: a
    4-byte size, or -1 and an 8-byte size, then a pickle), in a worker that holds the
    pipe's read lock; ``EOFError`` when the writer closed it.

    A reader that died in the middle of a message (its lock is released at its exit, see
    :class:`RecordLock`: a process killed as it read takes the bytes its last read copied)
    leaves the rest of that message first in the pipe. Read as a size, a pickle's first byte
    (0x80) makes a negative one; a size whose bytes do not come within
    :data:`MESSAGE_STALL` seconds, or a body that is not a pickle, is the same. Then what
    the pipe holds is read and dropped, so that the next reader starts at a message, and
    :class:`PipeCut` ends this worker: its slot says it took a task of no known job, and the
    pool fails every job pending (:class:`~sharedarrays.api.pool._Workers`).

    ``before_read`` is called once the first bytes are there, before they are read.
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    header = _read(poller, fd, 4, first=True, before_read=before_read)
    (size,) = struct.unpack("!i", header) if len(header) == 4 else (0,)
    if size == -1:
        big = _read(poller, fd, 8)
        (size,) = struct.unpack("!Q", big) if len(big) == 8 else (0,)
    body = _read(poller, fd, size) if size > 0 else b""
    if len(body) != size or body[:1] != b"\x80":
        _drain(fd)
        raise PipeCut("the pool's task pipe was cut in the middle of a message")
    return body


def _read(
    poller: select.poll,
    fd: int,
    n: int,
    first: bool = False,
    before_read: Callable[[], None] | None = None,
) -> bytes:
    """``n`` bytes of ``fd`` (``poller``: one that waits for it), or fewer where the rest
    does not come within :data:`MESSAGE_STALL` seconds of the last (``first``: the first
    part may take forever: a worker waiting for a task). ``EOFError`` when the writer
    closed it."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        if not poller.poll(-1 if first and not got else int(MESSAGE_STALL * 1000)):
            break  # (stalled: a size read from the middle of a message)
        if before_read is not None:
            before_read()
            before_read = None
        part = os.read(fd, min(n - got, 1 << 20))
        if not part:
            raise EOFError
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _drain(fd: int) -> None:
    """Read and drop what ``fd`` holds now."""
    os.set_blocking(fd, False)
    try:
        while os.read(fd, 1 << 16):
            pass
    except BlockingIOError:
        pass
    finally:
        os.set_blocking(fd, True)


def not_run(pid: int, code: int) -> None:
    """What a worker calls instead of a task of a job the pool failed when worker ``pid``
    died (exit code ``code``)."""
    raise WorkerLost(
        f"not run: its job failed when a worker of the pool (pid {pid}) died "
        f"({died_of(code)}); submit it again once that is mended"
    )


def died_of(code: int) -> str:
    """A dead process's exit code in words."""
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"


class _TaskUnpickler(pickle.Unpickler):
    """multiprocessing's unpickler of a task, which loads a task whose function (or other
    global) this worker cannot find as one that raises :class:`~sharedarrays.TaskNotLoaded`
    when run: that job's error, where the worker died before (and every worker after it
    that took one of that job's tasks, failing every job pending each time)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (AttributeError, ImportError) as e:
            return _Unloadable(module, name, e)


class _Unloadable:
    """What a task names and this worker cannot find: raises when called."""

    def __init__(self, module: str, name: str, error: BaseException) -> None:
        self.what = f"{module}.{name}"
        self.error = f"{type(error).__name__}: {error}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TaskNotLoaded(
            f"a worker cannot find {self.what} ({self.error}): a function a pool runs must be "
            "importable by the worker, at the top level of a module or script (not inside "
            "`if __name__ == '__main__':`), or defined in a notebook cell"
        )


class TaskQueue(multiprocessing.queues.SimpleQueue):  # type: ignore[type-arg]
    """A pool's queue of tasks (the standard library's ``SimpleQueue``, with its read lock
    a :class:`RecordLock`): in a worker, the slot says what it took, and a task of a job the
    pool failed is replaced by :func:`not_run`."""

    def __init__(self, *, ctx: Any, table: PoolTable) -> None:
        super().__init__(ctx=ctx)
        self._rlock = table.lock(_TASKS_LOCK)

    def get(self) -> Any:
        worker = _worker
        if worker is None or worker.table is not self._rlock.table:
            return super().get()  # (not this pool's worker: the parent's terminate)
        table, cell = worker.table, worker.cell
        with self._rlock:
            # (the slot says a task is taken before the first byte is read: killed after
            # that, the pool fails every job pending, never none with a task lost)
            res = read_message(
                self._reader.fileno(),  # type: ignore[attr-defined]
                lambda: table.hold(cell, _TAKING),
            )
        try:
            task = reduction.ForkingPickler.loads(res)
        except (AttributeError, ImportError):  # (a name this worker cannot find: again,
            task = _TaskUnpickler(io.BytesIO(res)).load()  # with a stand-in for it)
        if type(task) is not tuple or len(task) != 5 or type(task[0]) is not int:
            table.hold(cell, 0)  # (the sentinel that ends the worker)
            return task
        job = task[0]
        table.hold(cell, job + 1)
        lost = table.lost(job)
        if lost is not None:
            return (job, task[1], not_run, lost, {})
        return task


class ResultQueue(multiprocessing.queues.SimpleQueue):  # type: ignore[type-arg]
    """A pool's queue of results (the standard library's ``SimpleQueue``, with its write
    lock a :class:`RecordLock`): in a worker, once a result is written, the slot says the
    worker holds nothing."""

    def __init__(self, *, ctx: Any, table: PoolTable) -> None:
        super().__init__(ctx=ctx)
        self._wlock = table.lock(_RESULTS_LOCK)

    def put(self, obj: Any) -> None:
        super().put(obj)
        worker = _worker
        if worker is not None and worker.table is self._wlock.table:
            worker.table.hold(worker.cell, 0)
