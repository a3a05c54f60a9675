"""Importing a payload: each resolver of the chain on the host backend, and the chain's end.

The exporter is another process (a fresh interpreter), so that the allocation is not mapped
here until a resolver maps it.
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from keeper_helpers import private_keeper, py, spawn, takes_refused

import sharedarrays as sa
from sharedarrays import importing
from sharedarrays.api import keeping
from sharedarrays.importing import (
    RESOLVERS,
    Request,
    from_exporter,
    from_exporter_fds,
    from_keeper,
    in_message,
    mapped_here,
    resolve,
    reused_block,
)
from sharedarrays.memory.allocation import Allocation
from sharedarrays.memory.registry import lookup
from sharedarrays.protocol.payload import Payload
from sharedarrays.protocol.unix import take_fds
from sharedarrays.transport import client
from sharedarrays.transport import node as transport_node
from sharedarrays.transport.growth import catch_up

__all__ = ["private_keeper"]  # a fixture, used by name

_EXPORTER = """
import sys
import numpy as np
import sharedarrays as sa
a = sa.from_array(np.arange(16.0), device="cpu"{options})
{before}
print(a.payload().to_bytes().hex(), flush=True)
for line in sys.stdin:
    if line.strip() == "grow":
        a.append(np.arange(1_000_000.0))
        print(len(a.allocation.chunks), a.allocation.used, flush=True)
    elif line.strip() == "replace":  # a new array, likely on the fd numbers a had
        fds, alloc = a.allocation.chunk_fds(), a.allocation
        a.close()
        a = sa.from_array(np.full(16, 7.0), device="cpu", pack=False)
        print(alloc.released, a.allocation.chunk_fds() == fds, flush=True)
    else:
        break
"""


def _payload_of_exited(before: str = "", options: str = "") -> Payload:
    """The payload of an array whose exporter exited."""
    out = py(_EXPORTER.format(before=before, options=options), input="exit\n")
    return Payload.from_bytes(bytes.fromhex(out.stdout.split()[0]))


class _Exporter:
    """A running exporter of one array, driven line by line over its stdin."""

    def __init__(self, options: str = "") -> None:
        self.proc = spawn(_EXPORTER.format(before="", options=options))
        assert self.proc.stdout is not None
        self.payload = Payload.from_bytes(bytes.fromhex(self.proc.stdout.readline().strip()))

    def ask(self, line: str) -> list[str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def exporter() -> Iterator[_Exporter]:
    e = _Exporter()
    try:
        yield e
    finally:
        e.stop()


def _data(alloc: Allocation, p: Payload) -> np.ndarray[Any, Any]:
    with sa.SharedDeviceArray(alloc, p.dtype, p.shape, p.strides, p.offset) as view:
        return view.get()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_the_chain_asks_in_order() -> None:
    chain = (mapped_here, reused_block, in_message, from_exporter_fds, from_exporter, from_keeper)
    assert chain == RESOLVERS


def test_resolve_stops_at_the_first_answer() -> None:
    asked: list[str] = []
    found: Any = object()

    def passes(req: Request) -> Allocation | None:
        asked.append("passes")
        return None

    def answers(req: Request) -> Allocation | None:
        asked.append("answers")
        return found  # type: ignore[no-any-return]

    def never(req: Request) -> Allocation | None:
        raise AssertionError("asked after an answer")

    a = sa.zeros(4, device="cpu")
    assert resolve(Request(a.payload()), (passes, answers, never)) is found
    assert asked == ["passes", "answers"]


def test_mapped_here_finds_this_process_s_allocation_and_closes_carried_fds() -> None:
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    carried = [os.dup(fd) for fd in a.allocation.chunk_fds()]
    req = Request(a.payload(), carried)
    assert mapped_here(req) is a.allocation
    assert not any(_is_open(fd) for fd in carried)


def test_mapped_here_passes_for_an_allocation_not_mapped_here(exporter: _Exporter) -> None:
    req = Request(exporter.payload)
    assert mapped_here(req) is None
    assert req.failures == ()


def test_in_message_passes_when_no_fds_travelled(exporter: _Exporter) -> None:
    req = Request(exporter.payload)
    assert in_message(req) is None
    assert req.failures == ()


def test_in_message_maps_fds_that_travelled(exporter: _Exporter) -> None:
    p = exporter.payload
    sizes, fds, _ = client.fetch_handles(p.server, p.pid, p.alloc_id, p.secret)
    assert sizes == list(p.chunks)
    exporter.stop()  # from here on nobody serves it: the fds alone map it
    alloc = in_message(Request(p, fds))
    assert alloc is not None
    assert alloc.origin.pid == p.pid and not alloc.origin.created_here
    np.testing.assert_array_equal(_data(alloc, p), np.arange(16.0))


def test_from_exporter_asks_the_exporter_s_handle_server(exporter: _Exporter) -> None:
    p = exporter.payload
    req = Request(p)
    alloc = from_exporter(req)
    assert alloc is not None and req.failures == ()
    assert alloc.chunk_sizes() == list(p.chunks)
    np.testing.assert_array_equal(_data(alloc, p), np.arange(16.0))


def _never(*args: object, **kwargs: object) -> Any:
    raise AssertionError("the exporter's handle server was asked")


def test_from_exporter_fds_takes_them_and_the_exporter_hears_of_it(
    exporter: _Exporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    if why := takes_refused():
        pytest.skip(why)
    p = exporter.payload
    assert p.fds is not None and len(p.fds.chunks) == len(p.chunks)
    monkeypatch.setattr(client, "fetch_handles", _never)
    req = Request(p)
    alloc = from_exporter_fds(req)
    assert alloc is not None and req.failures == ()
    np.testing.assert_array_equal(_data(alloc, p), np.arange(16.0))
    for _ in range(300):  # (TOOK travels without a reply: the exporter records it served)
        answer = transport_node.ask(p.pid, p.server)
        rows = answer.snapshot.allocations if answer.snapshot else ()
        if any(r.alloc_id == p.alloc_id and os.getpid() in dict(r.served) for r in rows):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the exporter never recorded this process as served: {answer}")


def test_from_exporter_fds_needs_the_slot_intact(exporter: _Exporter) -> None:
    if why := takes_refused():
        pytest.skip(why)
    p = exporter.payload
    assert p.fds is not None
    wrong = [
        dataclasses.replace(p, secret=bytes(32)),  # (not the allocation's secret)
        dataclasses.replace(p, fds=p.fds._replace(slot=p.fds.slot + 1)),  # (another's slot)
        dataclasses.replace(p, fds=p.fds._replace(table=0)),  # (not the table: its stdin)
        dataclasses.replace(p, fds=None),
    ]
    for payload in wrong:
        before = sorted(os.listdir("/proc/self/fd"))
        assert from_exporter_fds(Request(payload)) is None
        assert sorted(os.listdir("/proc/self/fd")) == before  # (what it took, closed)
    alloc = from_exporter(Request(p))  # (the next resolver answers)
    assert alloc is not None
    np.testing.assert_array_equal(_data(alloc, p), np.arange(16.0))


def test_fds_of_a_released_allocation_are_not_taken_for_it() -> None:
    if why := takes_refused():
        pytest.skip(why)
    e = _Exporter(", pack=False")  # (not in a slab, which other arrays keep)
    try:
        p = e.payload
        released, reused = e.ask("replace")  # (its slot cleared before its fds closed)
        assert released == "True"
        if reused != "True":
            pytest.skip("the new array did not get the released one's fd numbers")
        assert from_exporter_fds(Request(p)) is None  # (else: the new array's memory)
    finally:
        e.stop()


def test_take_fds_refuses_a_process_that_is_gone() -> None:
    p = _payload_of_exited()
    assert take_fds(p.pid, [0]) is None
    assert from_exporter_fds(Request(p)) is None


@pytest.mark.parametrize("options", [", readonly=True", ", capacity=1 << 20"])
def test_read_only_and_growable_exports_name_no_fds(options: str) -> None:
    out = py(_EXPORTER.format(before="", options=options), input="exit\n")
    p = Payload.from_bytes(bytes.fromhex(out.stdout.split()[0]))
    assert p.fds is None  # (their server checks what each importer may map)


def test_from_exporter_records_why_it_passes() -> None:
    p = _payload_of_exited()
    req = Request(p)
    assert from_exporter(req) is None
    (gone,) = req.failures
    assert isinstance(gone, sa.HandleUnavailable) and f"pid {p.pid}" in str(gone)


def test_from_keeper_maps_a_parked_array_after_its_exporter_exited(private_keeper: Path) -> None:
    p = _payload_of_exited(before="a.park()")
    req = Request(p)
    assert from_exporter(req) is None  # the exporter is gone ...
    alloc = from_keeper(req)  # ... the keeper holds it
    assert alloc is not None
    np.testing.assert_array_equal(_data(alloc, p), np.arange(16.0))
    keeping.unpark(alloc)


def test_from_keeper_passes_without_a_failure_before_it(exporter: _Exporter) -> None:
    req = Request(exporter.payload)
    assert from_keeper(req) is None  # the exporter was not asked: nothing to fall back from
    assert req.failures == ()


def test_none_left_raises_what_was_tried(private_keeper: Path) -> None:
    p = _payload_of_exited()
    with pytest.raises(sa.HandleUnavailable) as caught:
        importing.load_payload(p)
    text = str(caught.value)
    assert f"pid {p.pid}" in text  # the exporter was asked ...
    assert "no keeper holds it either (see a.park())" in text  # ... then the keeper


def test_a_growable_array_is_never_asked_of_the_keeper(private_keeper: Path) -> None:
    p = _payload_of_exited(options=", capacity=1 << 20")
    req = Request(p)
    with pytest.raises(sa.HandleUnavailable) as caught:
        resolve(req)
    assert req.failures == (caught.value,)  # the exporter's answer, the keeper not asked
    assert "no keeper holds it" not in str(caught.value)  # (as the keeper's answer says)


def test_load_payload_maps_the_allocation_once(exporter: _Exporter) -> None:
    alloc = importing.load_payload(exporter.payload)
    assert alloc.id == exporter.payload.alloc_id and alloc.access == "rw"
    assert importing.load_payload(exporter.payload) is alloc  # a warm load: mapped here


def test_a_payload_with_the_wrong_secret_is_refused_where_it_is_mapped(
    exporter: _Exporter,
) -> None:
    """A payload naming an allocation mapped here (a warm load, or one back at its exporter)
    must still hold its secret, as the handle server demands: the id alone opens nothing."""
    alloc = importing.load_payload(exporter.payload)  # mapped here now
    forged = dataclasses.replace(exporter.payload, secret=bytes(32))
    with pytest.raises(sa.PermissionDenied, match="secret"):
        importing.load_payload(forged)
    with pytest.raises(sa.PermissionDenied, match="secret"):
        sa.load(forged.to_bytes())  # re-tagged with the forged secret: a well-formed payload
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)  # in its exporter
    carried = [os.dup(fd) for fd in a.allocation.chunk_fds()]
    mine = dataclasses.replace(a.payload(), secret=b"\x01" * 32)
    with pytest.raises(sa.PermissionDenied, match="secret"):
        mapped_here(Request(mine, carried))
    assert not any(_is_open(fd) for fd in carried)  # closed on the refusal too
    assert importing.load_payload(exporter.payload) is alloc  # the right one still loads


def test_load_payload_refuses_a_malformed_token_or_handles(exporter: _Exporter) -> None:
    with pytest.raises(sa.PayloadError, match="ordering token"):
        importing.load_payload(exporter.payload, sync=b"")
    with pytest.raises(sa.PayloadError, match="handles that travelled"):
        importing.load_payload(exporter.payload, fds=())


def test_catch_up_maps_the_chunks_a_growable_array_added() -> None:
    e = _Exporter(options=", capacity=1 << 26")
    try:
        p = e.payload
        alloc = from_exporter(Request(p))
        assert alloc is not None and alloc.growable
        before = len(alloc.chunks)
        chunks, used = (int(n) for n in e.ask("grow"))
        assert chunks > before
        catch_up(alloc)
        assert len(alloc.chunks) == chunks and alloc.used == used
        # a payload of the older generation loads from the mapping as it is
        assert mapped_here(Request(p)) is alloc
    finally:
        e.stop()


class _Travelled:
    """What multiprocessing's DupFd is to :func:`importing.load_payload`: ``detach()``
    gives the fd (or fails, as a resource sharer's does in a process at its fd limit)."""

    def __init__(self, fd: int | None) -> None:
        self.fd = fd

    def detach(self) -> int:
        if self.fd is None:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.fd


def test_carried_handles_that_cannot_all_be_received_are_closed() -> None:
    a = sa.zeros(2 * mmap.PAGESIZE, "uint8", device="cpu", pack=False, chunk_bytes=mmap.PAGESIZE)
    assert len(a.allocation.chunks) == 2
    p = dataclasses.replace(a.payload(), alloc_id="cd" * 16)  # (not mapped here)
    first = os.dup(a.allocation.chunk_fds()[0])
    with pytest.raises(sa.HandleUnavailable, match=r"Too many open files.*ulimit -n"):
        importing.load_payload(p, fds=(_Travelled(first), _Travelled(None)))
    assert not _is_open(first)  # (it was left open)
    assert lookup(p.alloc_id) is None


def test_a_fresh_import_whose_token_fails_is_not_left_mapped_unused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a = sa.from_array(np.arange(4.0), device="cpu", pack=False)
    p = dataclasses.replace(a.payload(), alloc_id="ce" * 16)  # (not mapped here)
    fds = tuple(_Travelled(os.dup(fd)) for fd in a.allocation.chunk_fds())

    def refuse(self: object, token: bytes) -> None:
        raise sa.PayloadError("the sync token names an event this process never exported")

    monkeypatch.setattr(type(a.allocation.backend), "import_sync", refuse)
    with pytest.raises(sa.PayloadError, match="never exported"):
        importing.load_payload(p, sync=b"t" * 40, fds=fds)
    alloc = lookup(p.alloc_id)
    # it was left registered with no lease, neither parked nor ever released (until exit)
    assert alloc is None or alloc.parked
    if alloc is not None:
        assert alloc.release() and lookup(p.alloc_id) is None
