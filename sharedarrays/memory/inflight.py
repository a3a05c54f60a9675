"""Payloads in flight and the processes an allocation was served to.

An :class:`InFlight` is one allocation's record, in this process, of the payloads pickled
here that may still be loaded elsewhere (:meth:`InFlight.in_flight`), of the processes its
handles were served to (and, for exporter-owned memory, those that still hold it), and of
payloads of it from other processes loaded here. The allocation keeps one and answers its
``note_sent`` / ``note_loaded`` / ``note_returned`` / ``record_served`` / ``holders`` calls
from it; the hand-over of payloads in flight to the keeper (:meth:`Allocation.hand_over`)
reads it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from sharedarrays.memory.info import Served
from sharedarrays.process import running
from sharedarrays.settings import env_number

__all__ = ["IN_FLIGHT_SECONDS", "InFlight", "in_flight_seconds"]

IN_FLIGHT_SECONDS = 60.0
"""Default bound on how long a payload in flight keeps its memory alive (seconds)."""

_SERVED_HISTORY = 256


def in_flight_seconds() -> float:
    """How long a payload in flight (pickled here, not yet loaded) keeps its memory alive
    after this process let go of it: ``SHAREDARRAYS_IN_FLIGHT`` seconds (default 60).

    Within the bound a payload loads even when its sender closed its last view or exited
    in the meantime; a payload loaded later raises :class:`~sharedarrays.HandleUnavailable`
    (park or name the array to keep it longer)."""
    return env_number("SHAREDARRAYS_IN_FLIGHT", IN_FLIGHT_SECONDS, 0.0)


class InFlight:
    """One allocation's payloads in flight and the processes it was served to, here."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent = 0  # payloads pickled here that name this process's handle server
        self._sent_at = 0.0  # time.monotonic() of the last
        self._fetched = 0  # handle requests for it this process answered
        self._returned: dict[str, int] = {}  # payloads of it loaded here, by their sender's
        # handle server (one this process served): told to that process when released here
        self._served: deque[Served] = deque(maxlen=_SERVED_HISTORY)
        # processes this one served it to, by handle server (read without the lock by a
        # warm load, :func:`sharedarrays.api.message.import_part`: a membership test)
        self.servers: set[str] = set()
        self._done = 0  # payloads of a block pickled here that importers closed (DONE)
        self._loads = 0  # (an importer of a block) payloads loaded and leased since the last DONE
        self._unleased = 0  # (an importer of a block) payloads loaded whose view has no lease yet
        self.was_handed_over = False
        self._holders: set[int] = set()  # exporter-owned memory: importers not done yet
        self._served_chunks: dict[int, int] = {}  # pid -> chunks it may map

    def forget(self) -> None:
        """In a forked child: a new lock, and no record of what the parent served or sent."""
        self._lock = threading.Lock()
        self._served.clear()
        self.servers.clear()
        self._holders.clear()
        self._served_chunks.clear()
        self._returned.clear()
        self._sent = self._fetched = self._done = self._loads = self._unleased = 0

    # payloads in flight ----------------------------------------------------------------
    def note_sent(self) -> None:
        """A payload naming this process's handle server was pickled (and may be loaded by
        another process later): one per message that carries views of the allocation,
        however many (:class:`sharedarrays.api.message.MessagePart`)."""
        with self._lock:
            self._sent += 1
            self._sent_at = time.monotonic()

    def note_loaded(self, count: int = 1) -> None:
        """``count`` payloads pickled here were loaded (here, or where the process they came
        back to said so): no longer in flight."""
        with self._lock:  # (never more than were sent: a load of a payload counted
            # nowhere, or one loaded twice, must not hide the next one in flight)
            self._fetched = min(self._fetched + count, self._sent)

    def handed_over(self) -> None:
        """The keeper answers for every payload in flight from now on."""
        with self._lock:
            self._fetched = self._sent
            self.was_handed_over = True

    # blocks (memory/cache.py) ------------------------------------------------------------
    def note_done(self, count: int) -> None:
        """(The exporter of a block) an importer closed ``count`` payloads it loaded."""
        with self._lock:
            self._done += count

    def all_done(self) -> bool:
        """Whether every payload pickled here was loaded and closed (reported ``DONE``)."""
        with self._lock:
            return self._done >= self._sent

    def undone(self) -> tuple[int, float]:
        """Payloads pickled here not reported done, and the seconds left of their bound;
        ``(0, 0.0)`` when none, or when the bound passed."""
        with self._lock:
            count, sent_at = self._sent - self._done, self._sent_at
        left = sent_at + in_flight_seconds() - time.monotonic() if count > 0 else 0.0
        return (count, left) if left > 0 else (0, 0.0)

    def note_block_load(self, first: bool = False) -> None:
        """(An importer of a block) a payload of it was loaded here (``first``: on memory
        taken under a new id: what was counted before was its last array's)."""
        with self._lock:
            if first:
                self._loads = self._unleased = 0
            self._unleased += 1

    def note_block_lease(self) -> None:
        """(An importer of a block) a lease was taken: a load's view holds it from now on."""
        with self._lock:
            if self._unleased:
                self._unleased -= 1
                self._loads += 1

    def take_block_loads(self) -> int:
        """(An importer of a block) the loads to report ``DONE`` now: 0 while a load has no
        lease yet (its view is being made), or where this process handed the allocation on
        (others may hold it through this one)."""
        with self._lock:
            if self._unleased or self._sent or self.servers:
                return 0
            loads, self._loads = self._loads, 0
            return loads

    def note_returned(self, server: str) -> None:
        """A payload from the process whose handle server is ``server`` was loaded here.
        Counted only for processes this one served (those it tells when it releases the
        allocation: :meth:`returned`), so that they need not keep it in flight."""
        if server not in self.servers:  # (the common case, a warm load: no lock taken)
            return
        with self._lock:
            if server in self.servers:
                self._returned[server] = self._returned.get(server, 0) + 1

    def returned(self, server: str) -> int:
        """How many payloads from the process of handle server ``server`` were loaded here."""
        with self._lock:
            return self._returned.get(server, 0)

    def in_flight(self) -> tuple[int, float]:
        """Payloads pickled here that may still be loaded, and the seconds left of their
        bound (:func:`in_flight_seconds`, from the last one pickled); ``(0, 0.0)`` when none."""
        with self._lock:
            count, sent_at = self._sent - self._fetched, self._sent_at
        left = sent_at + in_flight_seconds() - time.monotonic() if count > 0 else 0.0
        return (count, left) if left > 0 else (0, 0.0)

    # served processes ------------------------------------------------------------------
    def record_served(self, pid: int, server: str | None, chunks: int, holder: bool) -> None:
        """The handles were sent to process ``pid`` (with its handle server, if given);
        ``chunks``: how many chunks it may map now; ``holder``: it holds exporter-owned
        memory until it says it closed it or exits."""
        with self._lock:
            self._fetched += 1
            self._served.append(Served(pid, time.time()))
            if server:
                self.servers.add(server)
            if holder:
                self._holders.add(pid)
            if chunks > self._served_chunks.get(pid, 0):
                self._served_chunks[pid] = chunks

    def served(self) -> tuple[Served, ...]:
        """The most recent processes served (pid, time)."""
        with self._lock:
            return tuple(self._served)

    def served_servers(self) -> list[str]:
        """Handle servers of the processes served."""
        with self._lock:
            return sorted(self.servers)

    def holders(self) -> tuple[int, ...]:
        """The running processes that hold the memory (forgetting those that exited)."""
        with self._lock:
            alive = {pid for pid in self._holders if running(pid)}
            self._holders = alive
        return tuple(sorted(alive))

    def closed_by(self, pid: int | None) -> None:
        """Process ``pid`` no longer holds the memory (``None``: nobody new)."""
        with self._lock:
            self._holders.discard(-1 if pid is None else pid)

    def mapping_past(self, chunks: int) -> list[int]:
        """The running processes (but this one) served more than ``chunks`` chunks."""
        with self._lock:
            return sorted(
                pid
                for pid, n in self._served_chunks.items()
                if n > chunks and pid != os.getpid() and running(pid)
            )
