"""Payloads in flight and the processes an allocation was served to (:class:`InFlight`)."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from sharedarrays.process import running
from sharedarrays.settings import env_number

IN_FLIGHT_SECONDS = 60.0
"""Default bound on how long a payload in flight keeps its memory alive (seconds)."""


@dataclass(frozen=True)
class Served:
    """One time this process handed an allocation's handles to another process."""

    pid: int
    time: float


def in_flight_seconds() -> float:
    """How long a payload in flight keeps its memory alive: ``SHAREDARRAYS_IN_FLIGHT`` (60 s)."""
    return env_number("SHAREDARRAYS_IN_FLIGHT", IN_FLIGHT_SECONDS, 0.0)


def _within_bound(count: int, sent_at: float) -> tuple[int, float]:
    """``(count, seconds left)`` of payloads pickled until ``sent_at``; ``(0, 0.0)`` past it."""
    left = sent_at + in_flight_seconds() - time.monotonic() if count > 0 else 0.0
    return (count, left) if left > 0 else (0, 0.0)


class InFlight:
    """One allocation's record here: payloads pickled here that may still be loaded, the
    processes served its handles (holders), payloads loaded here, a block's ``DONE`` counts."""

    def __init__(self) -> None:
        self.was_handed_over = False
        self._sent_at = 0.0  # time.monotonic() of the last payload sent
        self._lock = threading.Lock()
        self._sent = 0  # payloads pickled here that name this process's handle server
        self._fetched = 0  # handle requests for it this process answered
        self._returned: dict[str, int] = {}  # payloads loaded here, by sender's server
        self._served: deque[Served] = deque(maxlen=256)
        self.servers: set[str] = set()  # handle servers served (read without the lock)
        # (a block's exporter) servers of importers that said DONE for it: their mapping,
        # asked once, says DONE at each later load's end unasked (memory/lease.py)
        self.reporting: set[str] = set()
        self._done = 0  # payloads of a block pickled here that importers closed (DONE)
        self._loads = 0  # (block importer) loads whose view took a lease, since the last DONE
        self._holders: set[int] = set()  # exporter-owned memory: importers not done yet
        self._served_chunks: dict[int, int] = {}  # pid -> chunks it may map

    def note_sent(self) -> None:
        """A payload naming this process's handle server was pickled (one per message)."""
        with self._lock:
            self._sent += 1
            self._sent_at = time.monotonic()

    def note_loaded(self, count: int = 1) -> None:
        """``count`` payloads pickled here were loaded: no longer in flight."""
        with self._lock:  # (never more than were sent)
            self._fetched = min(self._fetched + count, self._sent)

    def handed_over(self) -> None:
        """The keeper answers for every payload in flight from now on."""
        with self._lock:
            self._fetched = self._sent
            self.was_handed_over = True

    def note_done(self, count: int) -> None:
        """(The exporter of a block) an importer closed ``count`` payloads it loaded."""
        with self._lock:
            self._done += count

    def all_done(self) -> bool:
        """Whether every payload pickled here was loaded and closed (reported ``DONE``)."""
        with self._lock:
            return self._done >= self._sent

    def undone(self) -> tuple[int, float]:
        """Payloads not reported done and seconds left of their bound, or ``(0, 0.0)``."""
        with self._lock:
            return _within_bound(self._sent - self._done, self._sent_at)

    def note_block_renamed(self) -> None:
        """(An importer of a block) its exporter reused the memory under a new id: every
        load of the old one was reported, and none of them is the new one's to tell."""
        with self._lock:
            self._loads = 0
            self._returned.clear()

    def note_block_lease(self) -> None:
        """(An importer of a block) a load's first view took a lease: one more to report."""
        with self._lock:
            self._loads += 1

    def take_block_loads(self) -> int:
        """(An importer of a block) the loads to report ``DONE`` now (0 while not yet)."""
        with self._lock:
            in_flight = _within_bound(self._sent - self._fetched, self._sent_at)[0]
            if in_flight or self.servers:
                return 0
            loads, self._loads = self._loads, 0
            return loads

    def note_returned(self, server: str) -> None:
        """A payload from the process of handle server ``server`` loaded here (counted also
        before that process is known as served: its ``TOOK`` may come after its payloads)."""
        with self._lock:
            self._returned[server] = self._returned.get(server, 0) + 1

    def returned(self, server: str) -> int:
        """How many payloads from the process of handle server ``server`` were loaded here."""
        with self._lock:
            return self._returned.get(server, 0)

    def returned_from(self) -> list[str]:
        """The handle servers whose processes' payloads were loaded here and not told yet."""
        with self._lock:
            return list(self._returned)

    def take_returned(self, server: str) -> int:
        """:meth:`returned`, counted from zero again (told once: not told twice)."""
        with self._lock:
            return self._returned.pop(server, 0)

    def in_flight(self) -> tuple[int, float]:
        """Payloads that may still be loaded and seconds left of their bound, or ``(0, 0.0)``."""
        with self._lock:
            return _within_bound(self._sent - self._fetched, self._sent_at)

    def record_served(self, pid: int, server: str | None, chunks: int, holder: bool) -> None:
        """The handles (``chunks`` of them) were sent to ``pid``; ``holder``: it holds them."""
        with self._lock:
            self._fetched += 1
            self._served.append(Served(pid, time.time()))
            if server:
                self.servers.add(server)
                self.reporting.discard(server)  # (a new mapping there: not asked yet)
            if holder:
                self._holders.add(pid)
            if chunks > self._served_chunks.get(pid, 0):
                self._served_chunks[pid] = chunks

    def served(self) -> tuple[Served, ...]:
        """The most recent processes served (pid, time)."""
        with self._lock:
            return tuple(self._served)

    def served_servers(self) -> list[str]:
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
