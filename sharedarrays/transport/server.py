"""The handle server: a thread of every process that pickles an array, listening in the
private runtime directory. It checks each request's peer uid (same user only) and secret,
then sends the chunks' fds or acts on a notice (:mod:`sharedarrays.protocol.handles`)."""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import queue
import selectors
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from sharedarrays.errors import PayloadError, thread_error
from sharedarrays.memory import allocation, registry
from sharedarrays.memory.cache import block_id
from sharedarrays.process import STATE, command_line, running, start_thread
from sharedarrays.protocol.handles import (
    COUNTED_SIZE,
    MAX_REQUEST,
    Growth,
    Handles,
    HeldAllocation,
    Kind,
    Reply,
    Request,
    Snapshot,
    Status,
)
from sharedarrays.protocol.payload import remember
from sharedarrays.protocol.unix import (
    Credentials,
    peer_credentials,
    runtime_dir,
    send_fds,
    socket_pid,
)
from sharedarrays.transport import client

MAX_CONNECTIONS = 256  # importer connections kept open at most (the longest idle closed)
HOUSEKEEPING = 5.0  # seconds between checks for parked mappings whose source process died
BACKOFF = 0.05  # seconds waited after an error no connection is to blame for (EMFILE)
READ_AHEAD = 16  # most notices read on one connection per round: none starves
_ASKED_LIMIT = 256  # block tokens remembered as asked DONE for before they were listed
_NOTICES = tuple(kind.value for kind in Kind if not kind.replied)  # (read ahead)


class HandleServer:
    """Serves this process's allocations' fds to authenticated importers; ``conns``: the open
    connections' peers, the longest idle first (closed first past :data:`MAX_CONNECTIONS`)."""

    def __init__(self) -> None:
        directory = runtime_dir()
        _remove_stale_sockets(directory)
        self.path = str(directory / f"{os.getpid()}-{os.urandom(4).hex()}.sock")
        self._sock = _listen(self.path)
        self._pid = os.getpid()
        self._stopped = False
        self.silent: set[str] = set()  # servers (this one too) that left SETTLE or TELL unanswered
        self.conns: dict[socket.socket, Credentials] = {}
        # each kind's handler is the method named after it (each sends its own reply, if any)
        self._handlers: dict[Kind, Callable[[socket.socket, Credentials, Request], None]] = {
            kind: getattr(self, f"_{kind.name.lower()}") for kind in Kind
        }
        self.thread = threading.Thread(target=self._serve, name="sharedarrays-handles", daemon=True)
        try:
            self.thread.start()
        except RuntimeError as e:  # no thread can start: no socket is left behind
            self._sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise thread_error("cannot start the handle server's thread", e) from None

    def _serve(self) -> None:
        sel = self._sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        next_housekeeping = time.monotonic() + HOUSEKEEPING
        failing = False  # reported the current run of errors already
        try:
            while not self._stopped:
                try:
                    events = sel.select(max(next_housekeeping - time.monotonic(), 0.0))
                    if time.monotonic() >= next_housekeeping:
                        registry.drop_parked(only_orphans=True)
                        registry.reap_draining()
                        next_housekeeping = time.monotonic() + HOUSEKEEPING
                        self._listen_again(sel)
                    for key, _ in events:
                        if key.fileobj is self._sock:
                            self._accept(sel)
                        else:
                            self._request(sel, key.fileobj)  # type: ignore[arg-type]
                    failing = False
                except Exception as e:  # EMFILE and the like (or closed under the selector)
                    if not (failing or self._stopped):
                        print(f"sharedarrays: handle server: {e!r}; retrying", file=sys.stderr)
                    failing = True
                    time.sleep(BACKOFF)
        finally:
            for conn in list(self.conns):
                conn.close()
            self.conns.clear()
            sel.close()

    def _listen_again(self, sel: selectors.BaseSelector) -> None:
        """Listen again where the runtime directory was removed, at the same path if possible."""
        if os.path.exists(self.path):
            return
        directory = runtime_dir()  # (made again)
        path = self.path
        if Path(path).parent != directory:
            path = str(directory / f"{os.getpid()}-{os.urandom(4).hex()}.sock")
        listener = _listen(path)
        if self._stopped:  # (closed meanwhile, at exit)
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            return
        sel.unregister(self._sock)
        self._sock.close()
        self._sock, self.path = listener, path
        sel.register(listener, selectors.EVENT_READ)

    def _accept(self, sel: selectors.BaseSelector) -> bool:
        """Accept one importer (whether one was waiting); one that does not read its replies
        is dropped."""
        try:
            conn, _ = self._sock.accept()
        except BlockingIOError:
            return False
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE) or not self.conns:
                raise
            self._hang_up(sel, next(iter(self.conns)))  # no fd left: the longest idle goes
            return False  # and the next round accepts
        try:
            conn.setblocking(False)
            peer = peer_credentials(conn)
        except OSError:
            conn.close()
            return True
        while len(self.conns) >= MAX_CONNECTIONS:  # the longest idle goes
            self._hang_up(sel, next(iter(self.conns)))
        self.conns[conn] = peer
        sel.register(conn, selectors.EVENT_READ)
        return True

    def _hang_up(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        self.conns.pop(conn, None)
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(conn)
        conn.close()

    def _request(self, sel: selectors.BaseSelector, conn: socket.socket) -> None:
        peer = self.conns.pop(conn, None)
        if peer is None:
            self._hang_up(sel, conn)
            return
        request: bytes | None
        try:
            request = conn.recv(MAX_REQUEST + 1)
        except BlockingIOError:
            request = None  # nothing to read after all: kept
        except OSError:
            request = b""  # the client went away; nothing to clean up beyond the socket
        try:
            if request and peer.uid != os.getuid():
                _reply(conn, Status.BAD_UID)
            elif request:
                try:
                    decoded = Request.decode(request)
                    handler = self._handlers[decoded.kind]
                except (PayloadError, KeyError):  # (a kind without a handler: refused too)
                    _reply(conn, Status.BAD_REQUEST)
                else:
                    handler(conn, peer, decoded)
        except OSError:
            request = b""  # gone, or not reading its replies (its socket buffer is full)
        except Exception as e:  # a bug must not stop the server: this client gets EOF
            print(f"sharedarrays: handle server: {e!r} answering pid {peer.pid}", file=sys.stderr)
            request = b""
        if request is None or (request and peer.uid == os.getuid()):
            self.conns[conn] = peer  # most recently used last
        else:  # hung up, or another user (told so once)
            self._hang_up(sel, conn)

    def _closed(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``CLOSED``: the peer freed its import (maybe the memory can go now)."""
        alloc = _found(request)
        _reply(conn, Status.GONE if alloc is None else Status.OK)
        if alloc is not None:
            alloc.closed_by(peer.pid)

    def _released(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``RELEASED``: the process that served us released the allocation (or block)."""
        alloc = STATE.memory.blocks.get(request.secret)
        if alloc is None or request.alloc_id != block_id(request.secret):
            alloc = _found(request, conn)
        if alloc is None:
            return
        _reply(conn, Status.OK)
        alloc.flight.note_loaded(request.count)  # its payloads that came back to their exporter
        _off_thread(alloc.orphan)  # a release may hand over to the keeper: not here

    def _ask(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``ASK``: a block's exporter released it and waits for this process's ``DONE``."""
        _reply(conn, Status.OK)
        memory = STATE.memory
        with memory.lock:
            alloc = memory.blocks.get(request.secret)
            if alloc is None:
                remember(memory.asked, request.secret, None, _ASKED_LIMIT)
        if alloc is not None and request.alloc_id == block_id(request.secret):
            alloc.flight.note_loaded(request.count)  # its payloads that came back to us
            _off_thread(alloc.ask_done)

    def _fetch(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``FETCH`` and ``GROW``: send the chunk handles (``GROW``: from ``request.count``)."""
        alloc = _found(request, conn)
        if alloc is None:
            return
        pid = peer.pid
        if alloc.allow_pids is not None and pid not in alloc.allow_pids and pid != self._pid:
            _reply(conn, Status.NOT_ALLOWED)
            return
        with alloc.growth_lock:  # a shrink or a release waits: the fds stay open until sent
            if registry.lookup(alloc.id, draining=True) is not alloc:  # freed since
                _reply(conn, Status.GONE)
                return
            sizes = alloc.chunk_sizes()
            fds, temporary = alloc.handles_for_importers()
            try:
                body: Handles | Growth
                if request.kind is Kind.GROW:  # a growable array's importer: from ``count``
                    fds = fds[request.count :]
                    body = Growth(sizes, alloc.capacity, alloc.used)
                elif alloc.backend.maps:
                    body = Handles(sizes)
                else:  # a pointer backend: its portable handle, only after the checks above
                    body = Handles(sizes, alloc.exports_for(pid))
                header = Reply(Status.OK, len(fds), body.encode()).encode()
                # (recorded before the fds go: a release must know whom to tell)
                _record_served(alloc, pid, request.reply_to, len(sizes))
                send_fds(conn, header, fds)
            finally:
                for fd in temporary:
                    os.close(fd)

    _grow = _fetch

    def _notice(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``LOADED``, ``DONE`` and ``TOOK`` (no reply): fewer payloads in flight, a block's
        importer closed its last view after ``count`` loads, or an importer took the chunks'
        fds itself (as if served); up to :data:`READ_AHEAD` more are read."""
        for ahead in range(READ_AHEAD + 1):
            if ahead:  # the next message, if it is a notice too
                try:
                    peek = conn.recv(COUNTED_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    if len(peek) < COUNTED_SIZE or peek[:4] not in _NOTICES:
                        return
                    request = Request.decode(conn.recv(MAX_REQUEST))
                except (OSError, PayloadError):
                    return
            alloc = _found(request)
            if alloc is None:  # (a wrong secret: ignored)
                if request.kind is Kind.TOOK and request.reply_to.startswith("/"):
                    # released before its TOOK came: told as the served were (it checks)
                    client.queue_notice(
                        [request.reply_to], Kind.RELEASED, request.alloc_id, request.secret
                    )
                continue
            if request.kind is Kind.LOADED:
                alloc.flight.note_loaded(request.count)
            elif request.kind is Kind.TOOK:
                _record_served(alloc, peer.pid, request.reply_to, request.count)
            else:
                servers = [s for s in alloc.served_servers() if socket_pid(s) == peer.pid]
                alloc.done_by_importers(request.count, servers)

    _loaded = _done = _took = _notice

    def _settle(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``SETTLE``: read what every other connection sent before this one, then answer.
        (This process, about to hand memory with payloads in flight to the keeper: the
        ``TOOK`` of an importer that took the fds was sent before the importer's answer.)"""
        while self._accept(self._sel):  # (connections made before this one's come first)
            pass
        for other in list(self.conns):
            if other in self.conns:  # (reads nothing where nothing was sent)
                self._request(self._sel, other)
        _reply(conn, Status.OK)

    def _tell(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``TELL``: send the asker (its server ``reply_to``) ``LOADED`` for the warm loads here
        of its payloads, then answer (it is about to hand memory with payloads in flight to
        the keeper, or its pool's workers are about to stop)."""
        asker = request.reply_to
        if socket_pid(asker) != peer.pid:
            _reply(conn, Status.BAD_REQUEST)
            return
        tell_loads(asker)
        _reply(conn, Status.OK)

    def _snapshot(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``SNAPSHOT``: what this process holds; metadata only, no handle or secret."""
        _reply(conn, Status.OK, snapshot().encode())

    def _drop(self, conn: socket.socket, peer: Credentials, request: Request) -> None:
        """``DROP``: release this process's parked mapping (``GONE``, ``NOT_ALLOWED`` if used)."""
        if STATE.memory.cache.drop(request.alloc_id):  # (kept for reuse: freed now)
            _reply(conn, Status.OK)
            return
        alloc = registry.lookup(request.alloc_id)
        draining = registry.lookup(request.alloc_id, draining=True) if alloc is None else None
        if draining is not None:
            draining.closed_by(None)  # forgets the holders that exited; frees if none is left
            gone = registry.lookup(request.alloc_id, draining=True) is None
            _reply(conn, Status.OK if gone else Status.NOT_ALLOWED)
        elif alloc is None or alloc.pid != self._pid:
            _reply(conn, Status.GONE)
        elif not alloc.parked:  # (parked: idle, no view lease)
            _reply(conn, Status.NOT_ALLOWED)
        else:
            _reply(conn, Status.OK)
            _off_thread(alloc.release)  # (a release may tell other processes: not here)

    def forget_in_child(self) -> None:
        """In a forked child: close the parent's socket and connections, keeping the file."""
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self.close()  # (not this process's: the file stays)

    def close(self) -> None:
        """Stop serving and remove the socket file. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._pid == os.getpid():
            Path(self.path).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def snapshot() -> Snapshot:
    """What this process holds (parked and draining too), largest first."""
    rows = [_held(a, draining=False) for a in registry.live_allocations()]
    rows += [_held(a, draining=True) for a in registry.draining_allocations()]
    rows += [_held(a, draining=False, cached=True) for a in STATE.memory.cache.kept()]
    rows.sort(key=lambda r: r.size, reverse=True)
    return Snapshot(os.getpid(), command_line(os.getpid()), tuple(rows))


def _held(alloc: allocation.Allocation, draining: bool, cached: bool = False) -> HeldAllocation:
    origin = alloc.origin
    return HeldAllocation(
        alloc.id,
        alloc.backend.name,
        str(alloc.device),
        alloc.size,
        min(alloc.used, alloc.size) if origin.created_here else alloc.size,
        origin.created_here,
        origin.pid,
        origin.time,
        alloc.view_leases,
        alloc.parked,
        draining,
        _served(alloc, draining),
        alloc.in_flight()[0],
        cached,
    )


def _served(alloc: allocation.Allocation, draining: bool) -> tuple[tuple[int, float], ...]:
    """The running processes ``alloc`` was served to (pid, when); if draining, its holders."""
    if not draining:
        return tuple((s.pid, s.time) for s in alloc.served if running(s.pid))
    holders = alloc.holders  # (running ones only)
    rows = [(s.pid, s.time) for s in alloc.served if s.pid in holders]
    listed = {pid for pid, _ in rows}
    rows += [(pid, alloc.origin.time) for pid in holders if pid not in listed]
    return tuple(rows)


def _record_served(alloc: allocation.Allocation, pid: int, reply_to: str, chunks: int) -> None:
    """Record that process ``pid`` (handle server ``reply_to``) has ``chunks`` chunk fds."""
    server = reply_to if reply_to.startswith("/") else None
    alloc.record_served(pid, server, chunks)
    if server and alloc.block is not None and alloc.released:
        for hook in STATE.memory.ask_hooks:  # (it waits to reuse the memory)
            hook(alloc, [server])


def tell_loads(asker: str | None = None) -> None:
    """Send ``LOADED`` now for the warm loads here of other processes' payloads (only of the
    process of server ``asker``, if given): each counts them in flight until told, and hands
    its memory to the keeper at its release or exit for those. (Exporter-owned memory's
    warm loads were told as they came: :func:`client.report_load`; a forked child's CUDA or
    growable allocations, which it did not adopt, are the parent's to tell.)"""
    pid = os.getpid()
    for alloc in registry.live_allocations():
        if alloc.backend.exporter_owned or alloc.pid != pid:
            continue
        for server in [asker] if asker else alloc.flight.returned_from():
            if count := min(alloc.flight.take_returned(server), 1 << 31):
                client.send_notice(server, Kind.LOADED, alloc.id, alloc.secret, count, "")


def _reply(conn: socket.socket, status: Status, body: bytes = b"") -> None:
    conn.send(Reply(status, 0, body).encode())


def _found(request: Request, conn: socket.socket | None = None) -> allocation.Allocation | None:
    """The allocation ``request`` names (draining too) if its secret is right; else ``None``,
    and ``GONE`` or ``BAD_SECRET`` replied on ``conn`` if given."""
    alloc = registry.lookup(request.alloc_id, draining=True)
    if alloc is not None and hmac.compare_digest(request.secret, alloc.secret):
        return alloc
    if conn is not None:
        _reply(conn, Status.GONE if alloc is None else Status.BAD_SECRET)
    return None


def _off_thread(fn: Callable[[], object]) -> None:
    """Run ``fn`` in the server's one helper thread (started on first use, fed in order) so
    that serving goes on; inline at shutdown or where no thread can start."""
    state = STATE.server
    state.jobs.put(fn)
    if state.helper is not None and state.helper.is_alive():
        return
    state.helper = start_thread(_run_jobs, "sharedarrays-release", state.jobs, True)
    if state.helper is None:
        _run_jobs(state.jobs, False)


def _run_jobs(jobs: queue.SimpleQueue[Callable[[], object]], block: bool) -> None:
    while True:
        try:
            fn = jobs.get(block)
        except queue.Empty:
            return
        try:
            fn()
        except Exception:  # (said, as a thread of its own would: serving goes on)
            traceback.print_exc()


def _listen(path: str) -> socket.socket:
    """A ``SOCK_SEQPACKET`` socket listening at ``path`` (0600), renamed once it listens."""
    new = path.removesuffix(".sock") + ".new"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.bind(new)
        os.chmod(new, 0o600)
        sock.listen(64)
        sock.setblocking(False)  # (accepted only while one waits: SETTLE accepts them all)
        os.rename(new, path)
    except BaseException:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(new)
        raise
    return sock


def _remove_stale_sockets(directory: Path) -> None:
    """Remove sockets of dead processes whose connect is refused (other namespaces' stay)."""
    for entry in directory.glob("*.sock"):
        pid = socket_pid(entry)
        if pid is None or running(pid):
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
            probe.setblocking(False)
            try:
                probe.connect(str(entry))
            except ConnectionRefusedError:
                entry.unlink(missing_ok=True)
            except OSError:
                pass  # it listens with a full queue, is gone already, or is not ours to judge
