"""The sections of the package's per-process state (:data:`sharedarrays.process.STATE`), one
class per concern, each saying in ``reset_in_child`` what a forked child keeps of it."""

from __future__ import annotations

import queue
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "Member",
    "BackendsState",
    "MemoryState",
    "ConnectionsState",
    "NoticesState",
    "ServerState",
    "KeeperState",
    "PicklingState",
    "PoolsState",
    "ViewsState",
]


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
    ``api/widgets/view.py``). A forked child keeps them (its views are copies of the
    parent's), with a new lock.

    ``tracking``: whether views are tracked (from the first ``live_views``), then ``live``
    holds them weakly by id (``lock`` guards the start);
    ``cells``: per notebook cell id, the live maps made there (weakly), stopped when it runs
    again; ``shells``: the IPython shells whose ``pre_run_cell`` hook is registered.
    """

    def __init__(self) -> None:
        self.tracking = False
        self.live: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.cells: dict[str, list[Any]] = {}
        self.shells: list[Any] = []

    def reset_in_child(self) -> None:
        self.lock = threading.Lock()
