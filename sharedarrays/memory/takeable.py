"""The take table: what lets another process take an allocation's chunk fds out of this one
(``pidfd_getfd``) without asking, and know what it took.

A memfd of this process holds a slot per allocation whose payload names its fds: the id and
a tag of the secret, written when the payload is made and cleared at release, before any of
its fds can close. A taker takes the chunk fds first and the table last, then reads the slot:
found intact, the allocation was alive, so the fds it took were its chunks (an fd number is
reused only once closed), and the payload's secret is the allocation's."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import stat
import threading

from sharedarrays.process import STATE
from sharedarrays.protocol.payload import Takeable

SLOT_BYTES = 32  # an allocation id (16 bytes) and its secret's tag (16)
MAX_SLOTS = 1 << 16  # allocations listed at once (a sparse 2 MiB file); past it none is


def slot_content(alloc_id: str, secret: bytes) -> bytes:
    """What the slot of ``alloc_id`` holds: the id and a BLAKE2b tag of it keyed by ``secret``."""
    raw_id = bytes.fromhex(alloc_id)
    return raw_id + hashlib.blake2b(raw_id, key=secret, digest_size=16).digest()


class TakeTable:
    """This process's table (``STATE.memory.takeable``), made with its handle server (or its
    first slot); slots by allocation id. A forked child closes its copy and makes its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fd = -1
        self.inode = 0
        self.slots: dict[str, int] = {}
        self.free: list[int] = []
        self.end = 0  # slots ever used

    def open(self) -> bool:
        """Make the table's memfd if not yet made; whether there is one."""
        with self.lock:
            if self.fd < 0:
                with contextlib.suppress(OSError):  # (out of fds: payloads name no fds)
                    self.fd = os.memfd_create("sharedarrays-take-table", os.MFD_CLOEXEC)
                    self.inode = os.fstat(self.fd).st_ino
            return self.fd >= 0

    def add(self, alloc_id: str, secret: bytes, chunk_fds: list[int]) -> Takeable | None:
        """Write the slot of ``alloc_id`` (once) and say where its ``chunk_fds`` may be taken;
        ``None`` where the table is full or cannot be made (importers ask instead)."""
        if not self.open():
            return None
        with self.lock:
            slot = self.slots.get(alloc_id)
            if slot is None:
                slot = self.free.pop() if self.free else self.end
                if slot >= MAX_SLOTS:
                    return None
                try:
                    os.pwrite(self.fd, slot_content(alloc_id, secret), slot * SLOT_BYTES)
                except OSError:  # (out of memory: the payload names no fds)
                    if slot < self.end:
                        self.free.append(slot)
                    return None
                self.end = max(self.end, slot + 1)
                self.slots[alloc_id] = slot
            return Takeable(self.fd, self.inode, slot, tuple(chunk_fds))

    def clear(self, alloc_id: str) -> None:
        """Clear the slot of ``alloc_id``, if it has one: call before its fds may close."""
        with self.lock:
            slot = self.slots.pop(alloc_id, None)
            if slot is None:
                return
            try:
                os.pwrite(self.fd, bytes(SLOT_BYTES), slot * SLOT_BYTES)
            except OSError:  # (never seen) no slot may outlive its fds: a new, empty table
                self.reset_in_child()
            else:
                self.free.append(slot)

    def reset_in_child(self) -> None:
        """Close the table and start a new, empty one (also where a slot cannot be cleared)."""
        if self.fd >= 0:
            os.close(self.fd)
        self.__init__()  # type: ignore[misc]


def took_what_it_named(table: int, fds: Takeable, alloc_id: str, secret: bytes) -> bool:
    """Whether ``table``, taken after the chunk fds that ``fds`` names, is the exporter's
    table with the slot of ``alloc_id`` and ``secret`` intact (then those fds were its)."""
    try:
        st = os.fstat(table)
        if not stat.S_ISREG(st.st_mode) or st.st_ino != fds.inode:  # (pread of a pipe waits)
            return False
        found = os.pread(table, SLOT_BYTES, fds.slot * SLOT_BYTES)
    except OSError:
        return False
    return hmac.compare_digest(found, slot_content(alloc_id, secret))


STATE.memory.takeable = TakeTable()
