"""Facts about other processes of this machine: is a pid running, and since when."""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from multiprocessing import util

__all__ = ["PID_MAX_LIMIT", "running", "start_time", "at_exit"]

PID_MAX_LIMIT = 1 << 22
"""No Linux process has a larger pid (the kernel's ``PID_MAX_LIMIT``, the most that
``/proc/sys/kernel/pid_max`` may be set to on 64-bit machines)."""


def running(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``; another user's process counts).

    Any int is accepted: one outside ``1..PID_MAX_LIMIT`` names no process and gives False
    (``kill`` would take 0 and negative numbers for process groups, and overflow on huge ones).
    """
    if not 0 < pid <= PID_MAX_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot, or ``None`` if it does not exist.

    With the pid it names one process for good: a pid reused later has another start time.
    """
    if not 0 < pid <= PID_MAX_LIMIT:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may hold spaces.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


class _Registrations:
    """What :func:`at_exit` registered (multiprocessing keeps after-fork hooks by weak
    reference to an object: this one lives as long as the module)."""

    def __init__(self) -> None:
        self.functions: list[Callable[[], None]] = []

    def finalize_all(self) -> None:
        for fn in self.functions:
            util.Finalize(None, fn, exitpriority=-20)


_registrations = _Registrations()


def at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` when this process exits, also when it is a ``multiprocessing.Process``.

    ``atexit`` covers the interpreter's own exit; a Process runs multiprocessing's
    finalizers instead (a forked one ends with ``os._exit``, which runs no atexit handler,
    and a Process clears the finalizers it inherited when it starts): ``fn`` is registered
    there too, anew in each Process, at a priority below a Queue's (-5), so that its feeder
    thread has pickled every item first. ``fn`` may run twice: it must be idempotent.
    """
    atexit.register(fn)
    util.Finalize(None, fn, exitpriority=-20)
    if not _registrations.functions:
        util.register_after_fork(_registrations, _Registrations.finalize_all)
    _registrations.functions.append(fn)
