"""Facts about other processes of this machine: is a pid running, and since when."""

from __future__ import annotations

import os

__all__ = ["running", "start_time"]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``; another user's process counts)."""
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
