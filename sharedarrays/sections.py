"""The sections of :data:`sharedarrays.process.STATE`, one class per concern, each saying in
``reset_in_child`` what a forked child keeps (a cache: only what is true in any process)."""

from __future__ import annotations

import queue
import socket
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class BackendsState:
    """``STATE.backends``: registrations, backend objects, driver probes, CUDA events. A forked
    child keeps what is true of the code or the machine and gets new ``_reset`` fields."""

    def __init__(self) -> None:
        self.registrations: dict[str, Any] = {}
        self.kinds: dict[str, Callable[[int], str | None]] = {}
        self.accelerators_loaded = False  # (registry.load_accelerators ran)
        self.objects: dict[tuple[str, Any], Any] = {}
        self.reasons: dict[tuple[Any, ...], str | None] = {}
        self.cuda_driver: Any = None
        self.cuda_init_pid: int | None = None
        self.cuda_count = 0
        self.cuda_parent_had = False  # (set just before a fork)
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
    """``STATE.memory``: this process's allocations: ``registry`` by id, ``parked`` (imports
    with no live view, least recently used first), ``draining`` (released, still served),
    ``slabs`` (current slab, first free byte), ``inherited`` (a forked child's, never
    released); the ``*_hooks`` tell the transport layer of releases, hand-overs, notices."""

    def __init__(self) -> None:
        self.registry: dict[str, Any] = {}
        self.lock = threading.RLock()  # registry, parked, draining, blocks
        self.unregistered = threading.Condition(self.lock)  # an allocation left registry
        self.parked: OrderedDict[str, Any] = OrderedDict()
        self.draining: dict[str, Any] = {}
        self.slabs: dict[tuple[str, Any], tuple[Any, int]] = {}
        self.slabs_lock = threading.Lock()
        self.packed: weakref.WeakSet[Any] = weakref.WeakSet()  # slabs: small arrays packed in
        self.inherited: list[object] = []
        self.release_hooks: list[Callable[[Any], None]] = []
        self.hand_over_hooks: list[Callable[[Any, int, float], None]] = []
        self.settle_hooks: list[Callable[[Any], None]] = []  # (before a hand-over)
        self.cache: Any = None  # the ChunkCache (sharedarrays.memory.cache sets it)
        self.takeable: Any = None  # the TakeTable (sharedarrays.memory.takeable sets it)
        self.done_hooks: list[Callable[[Any, int], None]] = []
        self.ask_hooks: list[Callable[[Any, list[str]], None]] = []
        self.blocks: dict[bytes, Any] = {}  # an importer's allocations by block token
        self.asked: dict[bytes, None] = {}  # block tokens asked DONE for before listed here
        self.keep_imports: tuple[float, int] = (float("-inf"), 64)  # (read at, value)

    def wait_unregistered(self, alloc: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` s for ``alloc`` (released elsewhere) to leave ``registry``."""
        with self.unregistered:
            return self.unregistered.wait_for(
                lambda: self.registry.get(alloc.id) is not alloc, timeout
            )

    def reset_in_child(self) -> None:
        """New locks, no slab, parked, draining or cached memory (``inherited``). Host
        allocations with views become imports from the parent; CUDA ones (unusable after
        fork) and growable ones (their creator's to resize) stay the parent's."""
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
        if self.cache is not None:
            self.inherited.extend(self.cache.kept())
            self.cache = type(self.cache)()  # (what the parent keeps is its own)
        if self.takeable is not None:
            self.takeable.reset_in_child()
        for alloc_id in [k for k, a in self.registry.items() if a.released]:
            # being released by a thread of the parent: no thread here finishes it
            self.inherited.append(self.registry.pop(alloc_id))
        for alloc in self.registry.values():
            if alloc.growable:
                alloc.disown()
            elif not alloc.device.needs_context:
                alloc.adopt()


class ConnectionsState:
    """``STATE.connections``: open connections to handle servers by path (taken out while in
    use), libc's ``syscall`` (``False``: no ``pidfd_getfd`` here), the processes that
    ``refused`` it and Yama's ``ptrace_scope``; a forked child closes its copies."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_server: dict[str, socket.socket] = {}
        self.syscall: Any = None
        self.refused: dict[int, None] = {}
        self.yama_scope: int | None = None  # (read once)

    def reset_in_child(self) -> None:
        for sock in self.by_server.values():
            sock.close()
        self.__init__()  # type: ignore[misc]


class NoticesState:
    """``STATE.notices``: ``(servers, messages)`` queued for the notifier ``thread``, those
    ``in_flight`` and warm loads ``unreported``; a forked child drops them (the parent's)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[list[str], list[bytes]]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.in_flight: list[None] = []
        self.unreported: dict[tuple[str, str, bytes], int] = {}
        self.unreported_lock = threading.Lock()

    def reset_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]


class ServerState:
    """``STATE.server``: the handle server, the ``jobs`` of its ``helper`` thread, the exit's
    drain (end and length, holders named). A forked child drops the parent's socket, thread."""

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
    """``STATE.keeper``: the connection to the keeper, the ids it ``held``, releases
    ``deferred``, a ``late`` keeper's socket, the exit's wait; a forked child holds nothing."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.conn: socket.socket | None = None
        self.path: str | None = None
        self.held: set[str] = set()
        self.deferred: list[str] = []
        self.late: str | None = None
        self.exit_wait: tuple[float, float] | None = None  # (start, seconds left)
        self.exit_left: float | None = None  # (None: all of TIMEOUT)
        self.said: set[str] = set()
        # allocations mapped here that the keeper holds -> their name (None: parked)
        self.kept: weakref.WeakKeyDictionary[Any, str | None] = weakref.WeakKeyDictionary()

    def reset_in_child(self) -> None:
        if self.conn is not None:
            self.conn.close()  # the child's copy only
        self.__init__()  # type: ignore[misc]


class PicklingState:
    """``STATE.pickling``: the warm handoff's caches and the ``reduce_hooks`` run when a module
    is imported. A forked child keeps all but ``received`` (the parts found here)."""

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
    """``STATE.pools``: the ``worker`` cell of a pool's worker (not in a forked child),
    functions ``loaded`` by value, the parent's ``main`` namespace, ``dask`` registered."""

    def __init__(self) -> None:
        self.worker: tuple[Any, int] | None = None
        self.loaded: dict[bytes, Callable[..., Any]] = {}
        self.main: dict[str, Any] = {}
        self.dask = False

    def reset_in_child(self) -> None:
        self.worker = None


class ViewsState:
    """``STATE.views``: the ``live`` views (weakly, once ``tracking``), each notebook cell's
    live maps and the ``shells`` hooked. A forked child keeps them, with a new lock."""

    def __init__(self) -> None:
        self.tracking = False
        self.live: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.lock = threading.Lock()
        self.cells: dict[str, weakref.WeakSet[Any]] = {}
        self.shells: list[Any] = []

    def reset_in_child(self) -> None:
        self.lock = threading.Lock()
