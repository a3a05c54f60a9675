"""Facts about processes, and :data:`STATE`, the package's per-process state (read as
``STATE.<section>.<field>``: a forked child gets new ones), with the only fork and exit hooks;
those registered here run by layer (:data:`LAYERS`), then by ``order`` and name."""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing import util
from typing import Any, NamedTuple

from sharedarrays import sections

PID_MAX_LIMIT = 1 << 22  # no Linux process has a larger pid (the kernel's, on 64-bit)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts); False outside 1..PID_MAX_LIMIT."""
    if not 0 < pid <= PID_MAX_LIMIT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def start_thread(target: Callable[..., object], name: str, *args: Any) -> threading.Thread | None:
    """A daemon thread running ``target(*args)``, started; ``None`` where none can start."""
    if sys.is_finalizing():  # (it would hang)
        return None
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # (3.12 starts no thread at shutdown; or no thread is left)
        return None
    return thread


def _proc(pid: int, name: str, size: int = -1) -> bytes | None:
    if not 0 < pid <= PID_MAX_LIMIT:
        return None
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read(size)
    except OSError:
        return None


def _stat_field(pid: int, index: int) -> int | None:
    """Field ``index`` of ``/proc/<pid>/stat`` after the name (0: the state), or ``None``."""
    stat = _proc(pid, "stat") or b""
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the name, which may hold spaces
    return int(fields[index]) if len(fields) > index and fields[index].isdigit() else None


def start_time(pid: int) -> int | None:
    """A process's start time in ticks since boot (with the pid, it names one), or ``None``."""
    return _stat_field(pid, 19)


def parent_pid(pid: int) -> int | None:
    """Process ``pid``'s parent's pid, or ``None``."""
    return _stat_field(pid, 1)


def command_line(pid: int) -> str:
    """Process ``pid``'s arguments joined by spaces (at most 200 characters), or ``""``."""
    raw = _proc(pid, "cmdline", 800) or b""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")[:200]


LAYERS = ("foundation", "protocol", "backends", "memory", "transport", "importing", "api")
"""The layers that may register hooks, bottom to top (``tests/test_layers.py`` draws them)."""

Hook = Callable[[], None]
FORK = ("before fork", "in a forked child", "after fork")  # when at_fork's hooks run
BEFORE_FORK, IN_CHILD, AFTER_FORK = FORK
AT_EXIT = "at exit"


def _name(fn: Hook) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


class _Hook(NamedTuple):
    layer: str
    order: int
    fn: Hook
    when: str = AT_EXIT  # or one of FORK
    processes: bool = True  # (at exit) also at the end of a multiprocessing.Process


def _call(fn: Hook, when: str) -> None:
    # run one hook; a failure is said on stderr and the next hook runs all the same
    try:
        fn()
    except Exception:
        print(f"sharedarrays: the hook {_name(fn)} failed {when}:", file=sys.stderr)
        traceback.print_exc()


class _Hooks:
    """Every fork and exit hook of this process, in running order (``STATE.hooks``: kept for
    the process's life, as multiprocessing holds its after-fork callback weakly)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fork: list[_Hook] = []
        self.exit: list[_Hook] = []

    def add(self, *hooks: _Hook) -> None:
        """Put one registration's ``hooks`` in place: by layer (at exit top first), order, name."""
        if not hooks:
            raise ValueError("at_fork needs at least one hook")
        if hooks[0].layer not in LAYERS:
            raise ValueError(f"layer must be one of {', '.join(LAYERS)}, not {hooks[0].layer!r}")
        table, sign = ("exit", -1) if hooks[0].when == AT_EXIT else ("fork", 1)
        with self.lock:
            entries: list[_Hook] = getattr(self, table)
            if all(h in entries for h in hooks):
                return
            if any(h.fn == e.fn for e in entries for h in hooks):
                taken = "at fork" if sign > 0 else "to run at exit"
                raise ValueError(f"{_name(hooks[0].fn)} is registered {taken} already")
            ordered = sorted(
                [*entries, *hooks],
                key=lambda h: (sign * LAYERS.index(h.layer), h.order, _name(h.fn)),
            )
            setattr(self, table, ordered)

    def run_fork(self, when: str) -> None:
        """Run the fork hooks of ``when``: bottom layer first, but top first before a fork."""
        if when == IN_CHILD:
            self.lock = threading.Lock()  # another thread of the parent may have held it
        for hook in reversed(self.fork) if when == BEFORE_FORK else self.fork:
            if hook.when == when:
                _call(hook.fn, hook.when)

    def run_exit(self, processes_only: bool = False) -> None:
        for hook in self.exit:
            if hook.processes or not processes_only:
                _call(hook.fn, hook.when)

    def finalize_in_process(self) -> None:
        """Run the exit hooks at a ``multiprocessing.Process``'s end too, after a Queue's (-5)."""
        util.Finalize(None, self.run_exit, args=(True,), exitpriority=-20)


class ProcessState:
    """THE per-process state (:data:`STATE`): ``pid`` (``os.getpid()`` costs microseconds
    cold), the ``hooks``, and the sections of :mod:`sharedarrays.sections`, bottom layer first."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.hooks = _Hooks()
        self.backends = sections.BackendsState()
        self.memory = sections.MemoryState()
        self.server = sections.ServerState()
        self.connections = sections.ConnectionsState()
        self.notices = sections.NoticesState()
        self.keeper = sections.KeeperState()
        self.pickling = sections.PicklingState()
        self.pools = sections.PoolsState()
        self.views = sections.ViewsState()

    def reset_in_child(self) -> None:
        """In a forked child: the pid, each section in order, then the ``after_in_child`` hooks."""
        self.pid = os.getpid()
        for section in [s for s in vars(self).values() if hasattr(s, "reset_in_child")]:
            _call(section.reset_in_child, IN_CHILD)
        self.hooks.run_fork(IN_CHILD)


STATE = ProcessState()


def at_fork(
    layer: str,
    *,
    order: int = 0,
    before: Hook | None = None,
    after_in_child: Hook | None = None,
    after_in_parent: Hook | None = None,
) -> None:
    """Run these hooks around every ``os.fork`` of this process, by ``layer`` (top first before
    it, bottom first after) and ``order``; the same hooks again do nothing."""
    hooks = zip(FORK, (before, after_in_child, after_in_parent))
    STATE.hooks.add(*(_Hook(layer, order, fn, when) for when, fn in hooks if fn is not None))


def at_exit(fn: Hook, layer: str, *, order: int = 0, processes: bool = True) -> None:
    """Run ``fn`` (idempotent: it may run twice) when this process exits, top layer first;
    with ``processes``, also at the end of a ``multiprocessing.Process`` (no atexit there)."""
    STATE.hooks.add(_Hook(layer, order, fn, AT_EXIT, processes))


os.register_at_fork(
    before=functools.partial(STATE.hooks.run_fork, BEFORE_FORK),
    after_in_child=STATE.reset_in_child,
    after_in_parent=functools.partial(STATE.hooks.run_fork, AFTER_FORK),
)
atexit.register(STATE.hooks.run_exit)
STATE.hooks.finalize_in_process()
util.register_after_fork(STATE.hooks, _Hooks.finalize_in_process)
