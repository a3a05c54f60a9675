"""The take table: a slot per allocation that proves fds taken out of this process were its."""

from __future__ import annotations

import os

import pytest

from sharedarrays.memory import takeable
from sharedarrays.memory.takeable import TakeTable, took_what_it_named

_ID, _OTHER = "ab" * 16, "cd" * 16
_SECRET = bytes(range(32))


def test_a_slot_proves_its_allocation_until_cleared() -> None:
    table = TakeTable()
    fds = table.add(_ID, _SECRET, [7, 8])
    assert fds is not None and fds.chunks == (7, 8) and fds.inode == os.fstat(fds.table).st_ino
    assert table.add(_ID, _SECRET, [7, 8]) == fds  # (written once)
    assert took_what_it_named(fds.table, fds, _ID, _SECRET)
    assert not took_what_it_named(fds.table, fds, _ID, bytes(32))  # (another secret)
    assert not took_what_it_named(fds.table, fds, _OTHER, _SECRET)
    table.clear(_ID)
    assert not took_what_it_named(fds.table, fds, _ID, _SECRET)
    other = table.add(_OTHER, _SECRET, [9])  # (the freed slot, now another's)
    assert other is not None and other.slot == fds.slot
    assert not took_what_it_named(fds.table, fds, _ID, _SECRET)
    table.clear(_OTHER)
    table.clear(_OTHER)  # (twice: nothing)


def test_only_the_table_itself_proves_anything() -> None:
    table = TakeTable()
    fds = table.add(_ID, _SECRET, [7])
    assert fds is not None
    r, w = os.pipe()  # (a pipe at the table's number would block a read: refused first)
    try:
        assert not took_what_it_named(r, fds, _ID, _SECRET)
        assert not took_what_it_named(r, fds._replace(inode=os.fstat(r).st_ino), _ID, _SECRET)
    finally:
        os.close(r)
        os.close(w)
    copy = os.memfd_create("copy")  # (the same bytes in another file)
    try:
        os.write(copy, os.pread(fds.table, 1 << 16, 0))
        assert not took_what_it_named(copy, fds, _ID, _SECRET)
    finally:
        os.close(copy)


def test_a_full_table_names_no_fds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(takeable, "MAX_SLOTS", 2)
    table = TakeTable()
    assert table.add("01" * 16, _SECRET, [1]) is not None
    assert table.add("02" * 16, _SECRET, [1]) is not None
    assert table.add("03" * 16, _SECRET, [1]) is None  # (importers ask instead)
    table.clear("01" * 16)
    assert table.add("03" * 16, _SECRET, [1]) is not None


@pytest.mark.timeout(60)
def test_a_forked_child_makes_its_own_table() -> None:
    table = takeable.STATE.memory.takeable
    fds = table.add(_ID, _SECRET, [7])
    assert fds is not None
    pid = os.fork()
    if pid == 0:  # (the child: its copy of the parent's table is closed, a new one made)
        child = takeable.STATE.memory.takeable
        try:
            os.fstat(fds.table)
            inherited = os.readlink(f"/proc/self/fd/{fds.table}").startswith("/memfd:sharedarrays")
        except OSError:
            inherited = False
        mine = child.add(_OTHER, _SECRET, [7])
        os._exit(0 if not inherited and mine is not None and mine.inode != fds.inode else 1)
    _, status = os.waitpid(pid, 0)
    table.clear(_ID)
    assert os.waitstatus_to_exitcode(status) == 0
