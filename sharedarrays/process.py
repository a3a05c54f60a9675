"""Facts about processes, and THE per-process state of the package: one object, one fork
reset, one exit sequence.

Other processes: is a pid running (:func:`running`), since when (:func:`start_time`), with
which command line (:func:`command_line`).

This process: all the package keeps per process is in :data:`STATE` (a
:class:`ProcessState`), in sections by concern; modules read and write
``STATE.<section>.<field>`` (never a section kept in a name of their own: a forked child
gets new ones). This module makes the package's only ``os.register_at_fork`` call and its
only ``atexit`` registration:

- **fork**: the child runs :meth:`ProcessState.reset_in_child` (each section, bottom layer
  first, says what a child keeps), then the ``after_in_child`` hooks of :func:`at_fork`.
  Hooks are for behaviour, not state.
- **exit**: the hooks of :func:`at_exit`, top layer first: hand payloads in flight to the
  keeper, wait for importers of exporter-owned memory, stop the handle server, close the
  connections, then free the memory kept for reuse.

Hooks run by layer (:data:`LAYERS`; before a fork and at exit top layer first, after a
fork bottom layer first), then by their ``order``, module and name: never by import order.

The cache policy: a cache of process state is a field of a section of :data:`STATE`, keyed
by what it is a fact of, bounded (``protocol.payload.remember``, or by what it is keyed
on), and dropped in a forked child unless true in any process. Facts about the machine or
the code may be cached with ``functools.cache``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import util

from sharedarrays.sections import (
    BackendsState,
    ConnectionsState,
    KeeperState,
    MemoryState,
    NoticesState,
    PicklingState,
    PoolsState,
    ServerState,
    ViewsState,
)

__all__ = [
    "PID_MAX_LIMIT",
    "STATE",
    "ProcessState",
    "LAYERS",
    "running",
    "start_time",
    "command_line",
    "at_fork",
    "at_exit",
]

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


def command_line(pid: int, limit: int = 200) -> str:
    """Process ``pid``'s command line as one string (``/proc/<pid>/cmdline``, arguments
    joined by spaces, cut to ``limit`` characters), or ``""`` where it cannot be read (gone,
    a kernel thread, or hidden from this user)."""
    if not 0 < pid <= PID_MAX_LIMIT:
        return ""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(limit * 4)
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")[:limit]


LAYERS = ("foundation", "protocol", "backends", "memory", "transport", "importing", "api")
"""The layers that may register hooks, bottom to top (``tests/test_layers.py`` draws them)."""

Hook = Callable[[], None]


@dataclass(frozen=True)
class _ForkHooks:
    """One :func:`at_fork` registration."""

    layer: str
    order: int
    before: Hook | None
    after_in_child: Hook | None
    after_in_parent: Hook | None

    def functions(self) -> list[Hook]:
        return [f for f in (self.before, self.after_in_child, self.after_in_parent) if f]

    def key(self) -> tuple[int, int, str]:
        return LAYERS.index(self.layer), self.order, _name(self.functions()[0])


@dataclass(frozen=True)
class _ExitHook:
    """One :func:`at_exit` registration."""

    layer: str
    order: int
    fn: Hook
    processes: bool

    def key(self) -> tuple[int, int, str]:
        return -LAYERS.index(self.layer), self.order, _name(self.fn)


def _name(fn: Hook | None) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}"


class _Hooks:
    """The table: every fork and exit hook registered in this process, in running order.

    One instance (``STATE.hooks``) lives as long as the process; multiprocessing keeps its
    after-fork callbacks by weak reference to it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fork: list[_ForkHooks] = []
        self.exit: list[_ExitHook] = []

    def add_fork(self, hooks: _ForkHooks) -> None:
        with self.lock:
            if hooks in self.fork:
                return
            mine = hooks.functions()
            if any(fn in mine for h in self.fork for fn in h.functions()):
                raise ValueError(f"{_name(hooks.functions()[0])} is registered at fork already")
            self.fork = sorted([*self.fork, hooks], key=_ForkHooks.key)

    def add_exit(self, hook: _ExitHook) -> None:
        with self.lock:
            if hook in self.exit:
                return
            if any(h.fn == hook.fn for h in self.exit):
                raise ValueError(f"{_name(hook.fn)} is registered to run at exit already")
            self.exit = sorted([*self.exit, hook], key=_ExitHook.key)

    def before_fork(self) -> None:
        for hooks in reversed(self.fork):  # top layer first
            _call(hooks.before, "before fork")

    def after_fork_in_child(self) -> None:
        self.lock = threading.Lock()  # another thread of the parent may have held it
        for hooks in self.fork:
            _call(hooks.after_in_child, "in a forked child")

    def after_fork_in_parent(self) -> None:
        for hooks in self.fork:
            _call(hooks.after_in_parent, "after fork")

    def run_exit(self, processes_only: bool = False) -> None:
        for hook in self.exit:
            if hook.processes or not processes_only:
                _call(hook.fn, "at exit")

    def finalize_in_process(self) -> None:
        """In each ``multiprocessing.Process`` (which clears the finalizers it inherited):
        run the exit hooks at its end too, below a Queue's priority (-5)."""
        util.Finalize(None, self.run_exit, args=(True,), exitpriority=-20)


def _call(fn: Hook | None, when: str) -> None:
    """Run one hook; a failure is said on stderr and the next hook runs all the same."""
    if fn is None:
        return
    try:
        fn()
    except Exception:
        print(f"sharedarrays: the hook {_name(fn)} failed {when}:", file=sys.stderr)
        traceback.print_exc()


class ProcessState:
    """THE per-process state of the package (one instance: :data:`STATE`).

    Attributes
    ----------
    pid : int
        This process's id, kept current across ``os.fork`` (set anew in a forked child
        first). Read it as ``STATE.pid``: the warm handoff's paths do, where ``os.getpid()``,
        a system call, costs microseconds when it runs cold (docs/performance.md).
    hooks : _Hooks
        The fork and exit hooks (:func:`at_fork`, :func:`at_exit`), in running order.
    backends : BackendsState
        Registrations, backend objects, driver probes, CUDA events (``backends/``).
    memory : MemoryState
        The memory layer: registry, parked, draining, slabs (``memory/``).
    server : ServerState
        This process's handle server and its exit drain (``transport/handles.py``).
    connections : ConnectionsState
        Kept connections to other handle servers (``transport/client.py``).
    notices : NoticesState
        The notifier thread's queue (``transport/client.py``).
    keeper : KeeperState
        The connection to the keeper (``transport/keeper.py``).
    pickling : PicklingState
        The warm handoff's caches (``protocol/payload.py``, ``api/message.py``).
    pools : PoolsState
        Pool workers' slots, functions loaded by value, Dask's registration (``api/pool*``,
        ``api/dask.py``).
    views : ViewsState
        The live views and the notebook cells of the memory maps (``api/views.py``).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.hooks = _Hooks()
        self.backends = BackendsState()
        self.memory = MemoryState()
        self.server = ServerState()
        self.connections = ConnectionsState()
        self.notices = NoticesState()
        self.keeper = KeeperState()
        self.pickling = PicklingState()
        self.pools = PoolsState()
        self.views = ViewsState()

    def reset_in_child(self) -> None:
        """In a forked child: the pid first, then every section bottom layer first (each
        says what the child keeps), then the ``after_in_child`` hooks of :func:`at_fork`.
        A section whose reset fails is said on stderr; the others reset all the same."""
        self.pid = os.getpid()
        for section in (
            self.backends,
            self.memory,
            self.server,
            self.connections,
            self.notices,
            self.keeper,
            self.pickling,
            self.pools,
            self.views,
        ):
            _call(section.reset_in_child, "in a forked child")
        self.hooks.after_fork_in_child()


STATE = ProcessState()
"""This process's state."""


def at_fork(
    layer: str,
    *,
    order: int = 0,
    before: Hook | None = None,
    after_in_child: Hook | None = None,
    after_in_parent: Hook | None = None,
) -> None:
    """Run these hooks around every ``os.fork`` of this process (as ``os.register_at_fork``).

    Parameters
    ----------
    layer : str
        The registering module's layer (one of :data:`LAYERS`): sets the order (see the
        module's docstring).
    order : int
        Order within the layer (smaller first).
    before, after_in_child, after_in_parent : callable, optional
        Called with no argument just before a fork, in the child after it, in the parent
        after it. A hook that raises is said on stderr; the others run all the same.

    Registering the same hooks again does nothing.

    Raises
    ------
    ValueError
        An unknown layer, or no hook given.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {', '.join(LAYERS)}, not {layer!r}")
    if before is None and after_in_child is None and after_in_parent is None:
        raise ValueError("at_fork needs at least one hook")
    STATE.hooks.add_fork(_ForkHooks(layer, order, before, after_in_child, after_in_parent))


def at_exit(fn: Hook, layer: str, *, order: int = 0, processes: bool = True) -> None:
    """Run ``fn`` when this process exits, also when it is a ``multiprocessing.Process``.

    ``atexit`` covers the interpreter's own exit; a Process runs multiprocessing's
    finalizers instead (a forked one ends with ``os._exit``, which runs no atexit handler,
    and a Process clears the finalizers it inherited when it starts): the exit hooks are
    registered there too, anew in each Process, at a priority below a Queue's (-5), so that
    its feeder thread has pickled every item first. ``fn`` may run twice (at a Process's end
    and then at its interpreter's exit): it must be idempotent.

    Parameters
    ----------
    fn : callable
        Called with no argument.
    layer : str
        The registering module's layer (one of :data:`LAYERS`): exit hooks run top layer
        first.
    order : int
        Order within the layer (smaller first).
    processes : bool
        Also at the end of a ``multiprocessing.Process`` (False: at the interpreter's exit
        only).

    Registering the same hook again with the same arguments does nothing.

    Raises
    ------
    ValueError
        An unknown layer, or ``fn`` registered already with other arguments.
    """
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {', '.join(LAYERS)}, not {layer!r}")
    STATE.hooks.add_exit(_ExitHook(layer, order, fn, processes))


os.register_at_fork(
    before=STATE.hooks.before_fork,
    after_in_child=STATE.reset_in_child,
    after_in_parent=STATE.hooks.after_fork_in_parent,
)
atexit.register(STATE.hooks.run_exit)
STATE.hooks.finalize_in_process()
util.register_after_fork(STATE.hooks, _Hooks.finalize_in_process)
