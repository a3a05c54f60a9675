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
import queue
import socket
import sys
import threading
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import util
from typing import Any, Protocol

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


class _Device(Protocol):
    @property
    def needs_context(self) -> bool: ...


class Member(Protocol):
    """What the memory section needs of an allocation to reset itself in a forked child."""

    @property
    def id(self) -> str: ...

    @property
    def device(self) -> _Device: ...

    @property
    def growable(self) -> bool: ...

    @property
    def released(self) -> bool: ...

    def adopt(self) -> None: ...

    def disown(self) -> None: ...

    @property
    def parked(self) -> bool: ...


class BackendsState:
    """The backends' section (``STATE.backends``): registrations, backend objects, driver
    probes and CUDA's cross-process events.

    A forked child keeps what is true of the code or the machine, and what tells it that it
    is a child: ``registrations`` (by name), device ``kinds`` (kind -> ``why_unusable``, in
    ``device=None``'s order), the backend ``objects`` by (name, device) (they know they were
    inherited and make no driver calls), the ``reasons`` why a device or feature is unusable
    (by vendor and what was asked), ``cuda_driver``, ``cuda_init_pid`` (where ``cuInit``
    succeeded), ``cuda_count``, ``cupy_stream`` (CuPy's ``get_current_stream``), ``fences``
    (per thread) and ``records``. ``cuda_forked`` becomes true in a child of a process that
    had initialised CUDA (``cuda_parent_had``, set just before the fork). It drops the rest:
    new locks (``lock``: the registry's; ``driver_lock``: probing and loading drivers;
    ``sync_lock``: the events), no loaded CANN runtime (``acl``: ``aclInit`` once per process),
    no event ``rings``, ``own`` or ``opened`` events, streams ``waited`` on, ``start_time``.
    """

    def __init__(self) -> None:
        self.registrations: dict[str, Any] = {}
        self.kinds: dict[str, Callable[[int], str | None]] = {}
        self.objects: dict[tuple[str, Any], Any] = {}
        self.reasons: dict[tuple[Any, ...], str | None] = {}
        self.cuda_driver: Any = None
        self.cuda_init_pid: int | None = None
        self.cuda_count = 0
        self.cuda_parent_had = False
        self.cuda_forked = False
        self.cupy_stream: Callable[[int], Any] | None = None
        self.fences = threading.local()
        self.records = 0
        self._reset()

    def _reset(self) -> None:
        self.lock = threading.Lock()
        self.driver_lock = threading.RLock()
        self.sync_lock = threading.Lock()
        self.acl: dict[str, Any] = {}
        self.rings: dict[int, Any] = {}
        self.own: dict[bytes, Any] = {}
        self.opened: dict[bytes, tuple[int, int, Any]] = {}
        self.waited: dict[tuple[int, int], bytes] = {}
        self.start_time: int | None = None

    def reset_in_child(self) -> None:
        self.cuda_forked = self.cuda_forked or self.cuda_parent_had
        self.cuda_parent_had = False
        self._reset()


class MemoryState:
    """The memory layer's section (``STATE.memory``): the allocations of this process.

    Its values are :class:`~sharedarrays.memory.allocation.Allocation` objects (and their
    leases, for slabs); this module sits below the memory layer, so it names them only by
    what it needs of them (:class:`Member`).

    Attributes
    ----------
    registry : dict of str to Allocation
        Every allocation mapped in this process (parked ones too), by id.
    lock : threading.RLock
        Guards ``registry``, ``parked``, ``draining`` and ``blocks``; ``unregistered`` (a
        condition on it) is notified when a released allocation leaves ``registry``.
    parked : OrderedDict of str to Allocation
        Imports kept mapped with no live view, least recently used first (one leased again
        stays listed until idle again or an eviction passes it).
    draining : dict of str to Allocation
        Released here, still served: held by others, or with payloads in flight.
    slabs : dict of (backend name, Device) to (Lease, int)
        The current slab per memory system and device, with its first free byte (guarded by
        ``slabs_lock``).
    inherited : list
        In a forked child: what it inherited and never releases.
    keep_imports : tuple of (float, int)
        ``SHAREDARRAYS_KEEP_IMPORTS`` and when it was read (``memory.lease.keep_imports``).
    cache, blocks, asked
        Memory kept for reuse (:mod:`sharedarrays.memory.cache`); an importer's allocations
        by block token; tokens asked ``DONE`` for before they were listed.
    release_hooks, hand_over_hooks, done_hooks, ask_hooks : list of callable
        How the transport layer hears of a release (it tells the processes it served), of
        payloads in flight leaving with the process (the keeper takes their handles: a
        failure raises), and of ``DONE`` and ``ASK`` notices to send. A forked child keeps
        them.
    """

    def __init__(self) -> None:
        self.registry: dict[str, Any] = {}
        self.lock = threading.RLock()
        self.unregistered = threading.Condition(self.lock)
        self.parked: OrderedDict[str, Any] = OrderedDict()
        self.draining: dict[str, Any] = {}
        self.slabs: dict[tuple[str, Any], tuple[Any, int]] = {}
        self.slabs_lock = threading.Lock()
        self.inherited: list[object] = []
        self.release_hooks: list[Callable[[Any], None]] = []
        self.hand_over_hooks: list[Callable[[Any, int, float], None]] = []
        self.cache: Any = None  # the ChunkCache (sharedarrays.memory.cache sets it)
        self.done_hooks: list[Callable[[Any, int], None]] = []  # (transport: DONE notices)
        self.ask_hooks: list[Callable[[Any, list[str]], None]] = []  # (transport: ASK)
        self.blocks: dict[bytes, Any] = {}  # an importer's allocations by block token
        self.asked: dict[bytes, None] = {}  # block tokens asked DONE for before listed here
        self.keep_imports: tuple[float, int] = (float("-inf"), 64)

    def wait_unregistered(self, alloc: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until ``alloc`` (being released by another thread:
        it stays registered while the keeper takes its handles) has left ``registry``;
        whether it has."""
        with self.unregistered:
            return self.unregistered.wait_for(
                lambda: self.registry.get(alloc.id) is not alloc, timeout
            )

    def reset_in_child(self) -> None:
        """A forked child starts with its own memory state (in place: the hooks stay).

        It gets new locks (another thread of the parent may have held them), no slab (its
        small arrays never share its parent's or a sibling's free space), no parked mappings
        and no draining allocations. The host allocations it inherited mapped, with the
        views that use them, become its own imports from the parent (it may hand them on and
        serve them); CUDA and growable ones stay the parent's (CUDA cannot be used after
        fork; a growable array's chunks are its creator's to change: the child may not
        resize it).
        """
        self.lock = threading.RLock()
        self.unregistered = threading.Condition(self.lock)
        self.slabs_lock = threading.Lock()
        self.inherited.extend(self.slabs.values())
        self.slabs.clear()
        for alloc in self.parked.values():
            if alloc.parked:  # (idle: no view of it came with the child)
                self.registry.pop(alloc.id, None)
                self.inherited.append(alloc)
        self.parked.clear()
        self.draining.clear()
        self.blocks.clear()
        self.asked.clear()
        if self.cache is not None:  # (the parent's to reuse: never freed or reused here)
            self.inherited.extend(self.cache.kept())
            self.cache.forget()
        for alloc_id in [k for k, a in self.registry.items() if a.released]:
            # being released by a thread of the parent (registered while the keeper took its
            # handles): no thread here finishes it, and a load would wait for it in vain
            self.inherited.append(self.registry.pop(alloc_id))
        for alloc in self.registry.values():
            member: Member = alloc
            if member.growable:
                member.disown()
            elif not member.device.needs_context:
                member.adopt()


class ConnectionsState:
    """The transport client's section (``STATE.connections``): this process's open
    connections to handle servers, by server path: one per exporter, reused by the next
    request. A request takes its connection out while it runs, so two threads never share
    one. A forked child closes its copies (they name the parent's pid)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_server: dict[str, socket.socket] = {}

    def reset_in_child(self) -> None:
        self.lock = threading.Lock()
        for sock in self.by_server.values():
            sock.close()
        self.by_server.clear()


class NoticesState:
    """The notifier's section (``STATE.notices``): release and close notices queued for the
    notifier thread, and warm loads not yet reported. A forked child drops them: what the
    parent queued is the parent's to send.

    ``queue`` holds ``(servers, messages)`` for the notifier ``thread``; ``in_flight`` one
    item per notice not yet sent (append/pop: no lock); ``unreported`` the warm loads by
    (server, allocation id, secret), guarded by ``unreported_lock``.
    """

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[list[str], list[bytes]]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.in_flight: list[None] = []
        self.unreported: dict[tuple[str, str, bytes], int] = {}
        self.unreported_lock = threading.Lock()

    def reset_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]


class ServerState:
    """The handle server's section (``STATE.server``). A forked child has the parent's
    listening socket but not its thread: it drops both.

    ``server`` is the handle server once started (``lock`` guards starting and stopping
    it); ``jobs`` what its ``helper`` thread runs for it (releases, ``DONE``);
    ``drain_bound`` the exit's wait for importers of exporter-owned memory once begun
    (its end, ``time.monotonic()``, and length); ``drain_said`` the allocations whose
    holders at exit were named on stderr.
    """

    def __init__(self) -> None:
        self.server: Any = None
        self.lock = threading.Lock()
        self.jobs: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.helper: threading.Thread | None = None
        self.drain_bound: tuple[float, float] | None = None
        self.drain_said: set[str] = set()

    def reset_in_child(self) -> None:
        server = self.server
        self.__init__()  # type: ignore[misc]
        if server is not None:
            server.forget_in_child()


class KeeperState:
    """The keeper client's section (``STATE.keeper``). A forked child closes its copy of the
    connection (the parent's stays open) and holds nothing in the keeper.

    ``conn`` is the connection to the keeper at ``path`` (``lock`` guards it and ``held``,
    the allocation ids it holds there); ``deferred`` the releases that found the lock taken,
    sent with the next request; ``late`` the socket of a keeper that did not answer in time
    (waited for ``RETRY`` until it does); ``exit_wait`` (start, seconds left) while the exit
    hands payloads over, and ``exit_left`` what is left of that wait for a second run
    (``None``: all of ``TIMEOUT``); ``said`` the hand-overs at exit that failed.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.conn: socket.socket | None = None
        self.path: str | None = None
        self.held: set[str] = set()
        self.deferred: list[str] = []
        self.late: str | None = None
        self.exit_wait: tuple[float, float] | None = None
        self.exit_left: float | None = None
        self.said: set[str] = set()

    def reset_in_child(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the child's copy only: the parent's connection stays open
        self.__init__()  # type: ignore[misc]


class PicklingState:
    """The api layer's section (``STATE.pickling``): the caches of the warm handoff.

    Attributes
    ----------
    parts : threading.local
        Per thread, the parts of the message it is pickling (weakly, by allocation).
    received : dict of bytes to ReceivedPart
        Parts whose allocation was found here, by payload bytes (bounded: the oldest
        forgotten first). Emptied in a forked child: it maps what it inherited anew.
    decoded : dict of bytes to Payload
        Validated payloads by their bytes (bounded; a fact for any process: kept in a
        child).
    dtypes : dict of str to numpy.dtype
        Validated dtype strings (few: the pattern allows few; kept in a child).
    on_device : dict of str to bool
        Whether each registered backend's memory is a device's (kept in a child).
    interned : dict
        Shapes, strides and dtype strings of pickled views, one object each (up to 4,096),
        so that pickle's memo writes each once per message (kept in a child).
    reduce_hooks : dict of str to callable
        ``{module name: hook}``: called once, and dropped, when a view is pickled by a
        pickler other than multiprocessing's and that module is imported (api/dask.py waits
        for distributed's serialization here; kept in a child).
    reconstructor : callable or None
        What a pickled part calls: the api layer's view reconstructor, which takes a part's
        arguments too, so that a message names one function (kept in a child).
    """

    def __init__(self) -> None:
        self.parts = threading.local()
        self.received: dict[bytes, Any] = {}
        self.decoded: dict[bytes, Any] = {}
        self.dtypes: dict[str, Any] = {}
        self.on_device: dict[str, bool] = {}
        self.interned: dict[Any, Any] = {}
        self.reduce_hooks: dict[str, Callable[[], None]] = {}
        self.reconstructor: Callable[..., Any] | None = None

    def reset_in_child(self) -> None:
        self.received.clear()


class PoolsState:
    """The api layer's section for work in other processes (``STATE.pools``).

    ``worker`` is this process's (table, state cell) where it is a pool's worker; a forked
    child is not (it drops it). ``loaded`` holds functions loaded by value, by cloudpickle
    bytes (bounded; guarded by ``lock``), ``main`` the one namespace of those of the
    parent's ``__main__``, ``dask`` whether shared arrays are registered with distributed:
    a child keeps those three.
    """

    def __init__(self) -> None:
        self.worker: tuple[Any, int] | None = None
        self.loaded: dict[bytes, Callable[..., Any]] = {}
        self.lock = threading.Lock()
        self.main: dict[str, Any] = {}
        self.dask = False

    def reset_in_child(self) -> None:
        self.worker = None
        self.lock = threading.Lock()


class ViewsState:
    """The api layer's live views and notebook cells (``STATE.views``: ``api/views.py``,
    ``api/widgets/refresh.py``). A forked child keeps them (its views are copies of the
    parent's), with a new lock.

    ``types``: the view classes; ``tracking``: whether views are tracked (from the first
    ``live_views``), then ``live`` holds them weakly by id (``lock`` guards the start);
    ``cells``: per notebook cell id, the live maps made there (weakly), stopped when it runs
    again; ``shells``: the IPython shells whose ``pre_run_cell`` hook is registered.
    """

    def __init__(self) -> None:
        self.types: tuple[type, ...] = ()
        self.tracking = False
        self.live: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.cells: dict[str, list[Any]] = {}
        self.shells: list[Any] = []

    def reset_in_child(self) -> None:
        self.lock = threading.Lock()


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
        The notifier thread's queue (``transport/notices.py``).
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
