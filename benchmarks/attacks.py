"""Attacks on sharedarrays (issue 15, "Hardening"), each run a few times, as one table.

    python benchmarks/attacks.py                          # every attack, default counts
    python benchmarks/attacks.py --markdown /tmp/attacks.md
    python benchmarks/attacks.py --tries 1 --only pid-2-31 # one attack, once
    python benchmarks/attacks.py --list                   # the attacks' names

Each attack is one small function below. Victims and attackers are separate processes
(fresh interpreters started here, each with a time limit; every wait here has one too, and
each attack as a whole runs under an alarm), so a hang is a failed row, never a hung script.
The attacker is another process of the same user unless the attack is about other users:
then, as root, a second OS user (``sa-test-other``, made with ``useradd`` if missing, as
tests/test_transport.py does); not root, those rows are skipped with the reason.

Every attack runs in a runtime directory of its own (``XDG_RUNTIME_DIR`` a fresh private
directory under /tmp), so it starts its own keeper, which is stopped at the end.

``--tries N`` sets every attack's count: repetitions; for an attack of several variants (the
forged server paths, the ways to write a read-only array, ...) each repetition runs each
variant once and the row counts every variant; for the stopped exporter the number of
concurrent loads, for the load flood the number of loads (a multiple of 8 processes).

The table's columns: attack | tries | outcome (counted) | lost or leaked (open fds of the
victim before/after, counted in /proc/<pid>/fd; memfds the keeper still holds; whether the
victim's data is unchanged). The script exits 1 if any row's outcome is not the defended one
(2 for a usage error). Rows that were skipped do not count as failures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import random
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol.handles import Kind, Request

OTHER_USER = "sa-test-other"
CHILD_TIMEOUT = 60.0  # seconds any one child process may run, unless an attack says more
ATTACK_TIMEOUT = 240  # seconds one attack may take in all (an alarm), unless it says more


# ---------------------------------------------------------------------------------------------
# shared helpers: rows, children with a time limit, fd counts, runtime directories


class Hang(Exception):
    """An attack ran past its alarm."""


@dataclass
class Row:
    """One line of the table."""

    name: str
    attack: str
    defended: set[str]  # the outcomes that count as defended (after any "what: " prefix)
    tries: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    leaked: list[str] = field(default_factory=list)
    clean: bool = True  # set False when something was lost or leaked
    skipped: str = ""

    def add(self, outcome: str) -> None:
        self.outcomes[outcome] += 1

    def lost(self, text: str, ok: bool) -> None:
        """Record what was (not) lost or leaked; ``ok`` False fails the row."""
        self.leaked.append(text)
        self.clean = self.clean and ok

    @property
    def ok(self) -> bool:
        if self.skipped:
            return True
        counted = sum(self.outcomes.values())
        return (
            counted == self.tries > 0
            and {k.rsplit(": ", 1)[-1] for k in self.outcomes} <= self.defended
            and self.clean
        )

    def cells(self) -> list[str]:
        if self.skipped:
            return [self.attack, "0", f"skipped: {self.skipped}", ""]
        outcome = ", ".join(f"{n}/{self.tries} {k}" for k, n in self.outcomes.most_common())
        if not self.outcomes:
            outcome = "no outcome"
        elif sum(self.outcomes.values()) != self.tries:
            outcome += f" ({self.tries - sum(self.outcomes.values())} without an outcome)"
        if not self.ok:
            outcome = f"**NOT DEFENDED** (defended: {' or '.join(sorted(self.defended))}): " + (
                outcome or "no outcome"
            )
        seen = Counter(self.leaked)  # each text once, with how many tries said it
        leaked = [t if seen[t] == 1 else f"{t} (x{seen[t]})" for t in dict.fromkeys(self.leaked)]
        return [self.attack, str(self.tries), outcome, "; ".join(leaked)]


@dataclass
class Ran:
    """What a child process did: exit status (None: killed at its time limit), its stdout
    lines parsed as JSON where they are JSON, and its stderr."""

    rc: int | None
    lines: list[Any]
    err: str

    @property
    def last(self) -> dict[str, Any]:
        dicts = [x for x in self.lines if isinstance(x, dict)]
        if not dicts:
            why = "timed out" if self.rc is None else f"exit {self.rc}"
            raise RuntimeError(f"child said nothing ({why}): {self.err.strip()[-400:]}")
        return dicts[-1]


def _json_lines(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def run_child(
    code: str,
    env: dict[str, str],
    stdin: str = "",
    timeout: float = CHILD_TIMEOUT,
    args: tuple[str, ...] = (),
    **kw: Any,
) -> Ran:
    """Run ``code`` in a fresh interpreter with ``args``, killed after ``timeout`` seconds."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            **kw,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        return Ran(None, _json_lines(out), err + f"\n(killed after {timeout:g} s)")
    return Ran(r.returncode, _json_lines(r.stdout), r.stderr)


class Child:
    """A long-running child (an exporter, a holder) that says JSON lines on stdout and reads
    commands on stdin; killed (after SIGCONT) when the block ends."""

    def __init__(self, code: str, env: dict[str, str], *args: str, **kw: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            **kw,
        )
        self.pid = self.proc.pid

    def line(self, timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
        """The child's next stdout line (JSON), waiting at most ``timeout`` seconds."""
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RuntimeError(f"child {self.pid} said nothing within {timeout:g} s")
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(5)
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"child {self.pid} ended early: {err.strip()[-400:]}")
        return json.loads(text)  # type: ignore[no-any-return]

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def ask(self, text: str, timeout: float = CHILD_TIMEOUT) -> dict[str, Any]:
        self.send(text)
        return self.line(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def signed(n: int | None) -> str:
    """A change in a count as the table shows it: +0, -1, +3; ? when it was not counted."""
    return "?" if n is None else f"{n:+d}"


def _count(row: Row, r: Ran, label: str) -> None:
    """Add the child's outcomes to ``row``, and its ``leaked`` fds (lost unless 0)."""
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    leaked = r.last.get("leaked")
    row.lost(f"{label}{signed(leaked)}", leaked == 0)


def fd_count(pid: int) -> int:
    """Open fds of process ``pid`` (/proc/<pid>/fd)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pid: int, target: int, timeout: float = 10.0) -> int:
    """``pid``'s open fds once they are back to ``target`` or fewer, or after ``timeout``."""
    deadline = time.monotonic() + timeout
    n = fd_count(pid)
    while n > target and time.monotonic() < deadline:
        time.sleep(0.05)
        n = fd_count(pid)
    return n


def memfds(pid: int) -> int:
    """Chunk memfds process ``pid`` holds (the keeper holds nothing else of the kind)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            # (a chunk's name: not the pool's queues nor the take table, sharedarrays-*)
            n += os.readlink(f"/proc/{pid}/fd/{fd}").split(" ")[0] == "/memfd:sharedarrays"
    return n


def keeper_pid(rdir: Path) -> int | None:
    """The pid in ``rdir``'s keeper.lock, if that process runs."""
    try:
        pid = int((rdir / "keeper.lock").read_text().strip())
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return None
    except (OSError, ValueError):
        return None
    return pid


def settled_memfds(pid: int | None, target: int = 0, timeout: float = 10.0) -> int:
    """The keeper's memfds once back to ``target`` or fewer (or after ``timeout``); 0 when
    no keeper runs."""
    if pid is None:
        return 0
    deadline = time.monotonic() + timeout
    while True:
        try:
            n = memfds(pid)
        except OSError:
            return 0
        if n <= target or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


@contextlib.contextmanager
def runtime(tmp: str | None = None) -> Iterator[tuple[dict[str, str], Path]]:
    """A child environment with a fresh private ``XDG_RUNTIME_DIR`` (mode 0711, as the
    runtime directory's parent usually is) and a keeper that exits 2 s after it holds
    nothing; its keeper is stopped and the directory removed at the end. Yields the
    environment and the library's runtime directory in it (``<base>/sharedarrays``)."""
    base = Path(tempfile.mkdtemp(prefix="sa-atk-", dir=tmp or "/tmp"))  # short: socket paths
    os.chmod(base, 0o711)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(base), SHAREDARRAYS_KEEPER_IDLE="2")
    rdir = base / "sharedarrays"
    try:
        yield env, rdir
    finally:
        stop_keeper(rdir)
        shutil.rmtree(base, ignore_errors=True)


def stop_keeper(rdir: Path) -> None:
    pid = keeper_pid(rdir)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while keeper_pid(rdir) == pid and time.monotonic() < deadline:
        time.sleep(0.05)
    if keeper_pid(rdir) == pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def raw_connect(path: str, timeout: float = 5.0) -> socket.socket:
    """A plain Unix SOCK_SEQPACKET connection (what any process of the user can open)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except BaseException:
        s.close()
        raise
    return s


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (after what it had queued)."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 16):
            pass
    except BlockingIOError:
        return False
    except OSError:
        pass
    return True


def other_user() -> tuple[str | None, str]:
    """A second OS user (made with useradd as root if missing), or None and why not."""
    if os.getuid() != 0:
        return None, "needs root to act as a second OS user"
    try:
        pwd.getpwnam(OTHER_USER)
        return OTHER_USER, ""
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        return None, "useradd not found"
    r = subprocess.run(
        [useradd, "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        return None, f"useradd failed: {r.stderr.strip()}"
    return OTHER_USER, ""


def dead_pid() -> int:
    """A pid no process has now (one that just exited)."""
    r = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(r.stdout)


# ---------------------------------------------------------------------------------------------
# code the children run

PRELUDE = r"""
import gc, json, os, pickle, sys, time
import numpy as np
import sharedarrays as sa
from sharedarrays.memory import registry
from sharedarrays.transport import client, handles as transport
from sharedarrays.transport import keeper
from sharedarrays.protocol import keeper as wire
from sharedarrays.protocol.handles import Reply, Status
from sharedarrays.protocol.payload import MAGIC, TAG_BYTES, _tag
from sharedarrays.protocol.unix import runtime_dir

def say(**kw):
    print(json.dumps(kw), flush=True)

def fds():
    # open fds, after a collection and with parked mappings dropped, less the connections
    # to handle servers kept on purpose (one per peer, bounded)
    gc.collect()
    registry.drop_parked()
    time.sleep(0.05)
    return len(os.listdir("/proc/self/fd")) - transport.open_connections()

def reseal(payload, **fields):
    # a payload with fields changed and a valid tag: what any holder of it can make, since
    # the secret travels in it
    doc = json.loads(payload[len(MAGIC) + TAG_BYTES:])
    doc.update(fields)
    body = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + _tag(body, bytes.fromhex(doc["secret"])) + body

def err(e):
    name = type(e).__name__
    return name if isinstance(e, sa.SharedArrayError) else f"raw {name}"
"""

EXPORTER = (
    PRELUDE
    + r"""
import resource
a = sa.from_array(np.arange(1000.0), device="cpu", pack=False)
blob = pickle.dumps(a)
spare = int(sys.argv[1])
if spare:  # room for ``spare`` more fds: its handle server runs out first
    n = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
say(blob=blob.hex(), payload=a.payload().to_bytes().hex(), server=transport.server_address(),
    id=a.allocation.id, secret=a.allocation.secret.hex())
for line in sys.stdin:  # "check": is the data as it was made?
    say(same=bool((a.get() == np.arange(1000.0)).all()))
"""
)

LOADER = (
    PRELUDE
    + r"""
blob = bytes.fromhex(sys.stdin.readline())
transport.server_address()
sa.zeros(1, device="cpu").payload()  # (this process's take table: one memfd for its life)
before = fds()
t = time.monotonic()
try:
    b = pickle.loads(blob)
    total = float(b.get().sum())
    took = time.monotonic() - t
    b.close()
    del b
    say(outcome="loaded" if total == 499500.0 else "wrong data", took=took, leaked=fds() - before)
except Exception as e:
    say(outcome=err(e), took=time.monotonic() - t, leaked=fds() - before, message=str(e))
"""
)


def exporter(env: dict[str, str], spare_fds: int = 0) -> tuple[Child, dict[str, Any]]:
    child = Child(EXPORTER, env, str(spare_fds))
    try:
        return child, child.line()
    except BaseException:
        child.close()
        raise


def load_in_child(env: dict[str, str], blob: str, timeout: float = 30) -> dict[str, Any]:
    r = run_child(LOADER, env, stdin=blob + "\n", timeout=timeout)
    try:
        return r.last
    except RuntimeError as e:
        return {"outcome": "no answer (hung or crashed)", "message": str(e), "leaked": None}


def data_same(child: Child) -> bool:
    return bool(child.ask("check")["same"])


# ---------------------------------------------------------------------------------------------
# the attacks: one function each, taking the row to fill


PLANTED = (
    "import os, pathlib\n"
    "pathlib.Path({marker!r}).write_text(f'{{__name__}} ran in pid {{os.getpid()}}')\n"
    "raise ImportError('a planted module ran')\n"
)


def planted_modules(row: Row) -> None:
    """The keeper is started from a directory where json.py, secrets.py and selectors.py were
    planted, with an empty PYTHONPATH entry (the working directory again)."""
    for _ in range(row.tries):
        with runtime() as (env, rdir):
            work = Path(tempfile.mkdtemp(prefix="sa-atk-cwd-"))
            try:
                shared = work / "shared"
                shared.mkdir()
                os.chmod(shared, 0o1777)  # a shared folder others can write
                marker = work / "planted-ran"
                for module in ("json", "secrets", "selectors"):
                    (shared / f"{module}.py").write_text(PLANTED.format(marker=str(marker)))
                code = (
                    "import os, secrets, sharedarrays as sa; "
                    f"os.chdir({str(shared)!r}); "
                    "sa.zeros(4, device='cpu', name='planted'); from sharedarrays.transport import keeper; print(keeper.running_pid())"
                )
                env = dict(env, PYTHONPATH=os.pathsep + env.get("PYTHONPATH", ""))
                r = run_child(code, env, cwd=str(work), timeout=30)
                kpid = keeper_pid(rdir)
                if marker.exists():
                    row.add("planted module ran")
                    row.lost(marker.read_text(), False)
                elif r.rc != 0 or kpid is None:
                    row.add(f"no keeper (exit {r.rc})")
                else:
                    cwd = os.readlink(f"/proc/{kpid}/cwd")
                    row.add("nothing planted ran")
                    if cwd == str(rdir):
                        row.lost("keeper's cwd is the runtime dir", True)
                    else:
                        row.lost(f"keeper's cwd is {cwd}", False)
            finally:
                shutil.rmtree(work, ignore_errors=True)


def handle_server_emfile(row: Row) -> None:
    """An exporter with 8 spare fds; 40 idle connections to its handle server; then a load."""
    before_after = []
    leaks = []
    closed_total = 0
    with runtime() as (env, _):
        for _ in range(row.tries):
            exp, out = exporter(env, spare_fds=8)
            with exp:
                base = fd_count(exp.pid)
                flood: list[socket.socket] = []
                try:
                    for _ in range(40):  # more than the exporter has fds for
                        with contextlib.suppress(OSError):
                            flood.append(raw_connect(out["server"]))
                    res = load_in_child(env, out["blob"])
                    closed_total += sum(closed_by_peer(s) for s in flood)
                finally:
                    for s in flood:
                        s.close()
                ok = res["outcome"] == "loaded" and res["took"] < 5
                row.add("loaded" if ok else f"{res['outcome']} ({res.get('took', 0):.1f} s)")
                before_after.append((base, settled_fds(exp.pid, base)))
                same = data_same(exp)
                row.lost("exporter data unchanged" if same else "exporter data CHANGED", same)
                leaks.append(res.get("leaked"))
    grew = sum(after > before for before, after in before_after)
    row.lost(
        f"{closed_total} flood connections closed by the server; exporter fds "
        + ", ".join(f"{b}->{a}" for b, a in before_after),
        grew == 0,
    )
    row.lost(f"loader fds {', '.join(map(signed, leaks))}", all(x == 0 for x in leaks))
    if closed_total == 0:
        row.lost("the server never ran out of fds: the attack did not test", False)


def slow_readers(row: Row) -> None:
    """Five connections queue requests and never read the replies; then a load."""
    with runtime() as (env, _):
        for _ in range(row.tries):
            exp, out = exporter(env)
            with exp:
                base = fd_count(exp.pid)
                request = Request(Kind.FETCH, out["id"], bytes.fromhex(out["secret"])).encode()
                floods = [raw_connect(out["server"], timeout=15) for _ in range(5)]

                def flood(sock: socket.socket, request: bytes) -> None:
                    with contextlib.suppress(OSError):  # dropped (EPIPE) or not read (15 s)
                        for _ in range(1000):
                            sock.send(request)

                threads = [
                    threading.Thread(target=flood, args=(s, request), daemon=True) for s in floods
                ]
                try:
                    for t in threads:
                        t.start()
                    time.sleep(0.5)  # the requests are queued
                    res = load_in_child(env, out["blob"])
                finally:
                    for t in threads:
                        t.join(20)
                    dropped = sum(closed_by_peer(s) for s in floods)
                    for s in floods:
                        s.close()
                ok = res["outcome"] == "loaded" and res["took"] < 5 and dropped == 5
                row.add(
                    "loaded quickly, 5/5 flooders dropped"
                    if ok
                    else f"{res['outcome']} in {res.get('took', 0):.1f} s, {dropped}/5 dropped"
                )
                after = settled_fds(exp.pid, base)
                row.lost(f"exporter fds {base}->{after}", after <= base)
                same = data_same(exp)
                row.lost("exporter data unchanged" if same else "exporter data CHANGED", same)


STOPPED_LOADS = (
    PRELUDE
    + r"""
from concurrent.futures import ThreadPoolExecutor
client.TIMEOUT = 2.0  # no setting for it: the module constant, lowered in this process
blob = bytes.fromhex(sys.stdin.readline())
n = int(sys.argv[1])
def load(_):
    try:
        pickle.loads(blob)
    except Exception as e:
        return err(e)
    return "loaded"
t = time.monotonic()
with ThreadPoolExecutor(n) as pool:
    outcomes = list(pool.map(load, range(n)))
say(outcomes=outcomes, took=time.monotonic() - t)
"""
)


def stopped_exporter(row: Row) -> None:
    """``tries`` concurrent loads from an exporter stopped with SIGSTOP (listen queue 64),
    each asking its handle server (``SHAREDARRAYS_TAKE_FDS=0``: one that takes the fds out
    of the exporter itself asks nothing, and loads)."""
    with runtime() as (env, _):
        exp, out = exporter(env)
        with exp:
            os.kill(exp.pid, signal.SIGSTOP)
            try:
                r = Child(STOPPED_LOADS, {**env, "SHAREDARRAYS_TAKE_FDS": "0"}, str(row.tries))
                with r:
                    r.send(out["blob"])
                    res = r.line(timeout=60)
            finally:
                os.kill(exp.pid, signal.SIGCONT)
            for o in res["outcomes"]:
                row.add(o)
            same = data_same(exp)
    row.lost(
        f"all answered in {res['took']:.1f} s (client.TIMEOUT lowered to 2 s in the "
        "loader; no environment setting for it); data unchanged: " + ("yes" if same else "NO"),
        same,
    )


FORGED_SERVER = (
    PRELUDE
    + r"""
import socket, tempfile, pathlib
tmp = pathlib.Path(tempfile.mkdtemp(dir=os.environ["XDG_RUNTIME_DIR"]))  # (removed with it)
a = sa.zeros(8, device="cpu", pack=False)
payload = a.payload().to_bytes()
regular = tmp / "file"; regular.write_text("not a socket")
loop = tmp / "loop"; loop.symlink_to(loop)
dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); dgram.bind(str(tmp / "dgram"))
kinds = {"regular file": regular, "path through a file": regular / "x.sock",
         "symlink loop": loop, "datagram socket": tmp / "dgram"}
transport.server_address()
before = fds()
for _ in range(int(sys.argv[1])):
    for kind, server in kinds.items():
        try:
            sa.load(reseal(payload, id=os.urandom(16).hex(), server=str(server)))
            say(kind=kind, outcome="loaded")
        except Exception as e:
            say(kind=kind, outcome=err(e), message=str(e))
say(leaked=fds() - before)
"""
)


def forged_server_paths(row: Row) -> None:
    """A payload's ``server`` replaced (and resealed) with a regular file, a path through a
    file, a symlink loop and a datagram socket."""
    row.tries *= 4
    with runtime() as (env, _):
        r = run_child(FORGED_SERVER, env, timeout=60, args=(str(row.tries // 4),))
    _count(row, r, "loader fds ")


def _flood_keeper(path: str, n: int) -> list[socket.socket]:
    """``n`` connections to a keeper that each said hello (answered or not)."""
    out = []
    for _ in range(n):
        try:
            s = raw_connect(path, timeout=5)
        except OSError:
            continue
        with contextlib.suppress(OSError):
            s.send(wire.MAGIC + b'{"op":"hello"}')
        out.append(s)
    return out


HOLDER = (
    PRELUDE
    + r"""
a = sa.from_array(np.arange(5.0), device="cpu", name=sys.argv[1])
say(keeper=keeper.running_pid())
sys.stdin.readline()
sa.unlink(sys.argv[1])
a.close()
say(done=True)
"""
)

ATTACHER = (
    PRELUDE
    + r"""
t = time.monotonic()
try:
    b = sa.attach(sys.argv[1])
    ok = b.get().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    took = time.monotonic() - t
    status = keeper.request(wire.Status(), start=False)[1]
    b.close()
    say(outcome="attached" if ok else "wrong data", took=took, connections=status.get("connections"))
except Exception as e:
    say(outcome=err(e), took=time.monotonic() - t, message=str(e))
"""
)


def keeper_connection_flood(row: Row) -> None:
    """60 idle connections to a keeper capped at 16 (SHAREDARRAYS_KEEPER_CONNECTIONS)."""
    closed = []
    with runtime() as (env, rdir):
        env = dict(env, SHAREDARRAYS_KEEPER_CONNECTIONS="16")
        for i in range(row.tries):
            with Child(HOLDER, env, f"capped{i}") as holder:
                kpid = holder.line()["keeper"]
                idle = _flood_keeper(str(rdir / "keeper.sock"), 60)
                try:
                    r = run_child(ATTACHER, env, timeout=30, args=(f"capped{i}",))
                    res = r.last
                    row.add(res["outcome"])
                    closed.append(sum(closed_by_peer(s) for s in idle))
                finally:
                    for s in idle:
                        s.close()
                holder.ask("unlink")
            row.lost(
                f"keeper memfds after unlink {settled_memfds(kpid)}", settled_memfds(kpid) == 0
            )
    row.lost(f"idle connections closed by the keeper: {closed} of 60", all(c >= 44 for c in closed))


def keeper_emfile(row: Row) -> None:
    """A keeper at RLIMIT_NOFILE 64 flooded with 100 connections; then an attach."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    with runtime() as (env, rdir):
        for i in range(row.tries):
            proc = subprocess.Popen(
                [sys.executable, "-m", "sharedarrays", "keeper", "--foreground"],
                preexec_fn=limit,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            flood: list[socket.socket] = []
            try:
                deadline = time.monotonic() + 30
                while keeper_pid(rdir) != proc.pid and time.monotonic() < deadline:
                    time.sleep(0.05)
                with Child(HOLDER, env, f"crowded{i}") as holder:
                    holder.line()
                    flood = _flood_keeper(str(rdir / "keeper.sock"), 100)
                    res = run_child(ATTACHER, env, timeout=30, args=(f"crowded{i}",)).last
                    row.add(res["outcome"])
                    closed = sum(closed_by_peer(s) for s in flood)
                    for s in flood:
                        s.close()
                    flood = []
                    holder.ask("unlink")
                n = settled_memfds(proc.pid)
                row.lost(
                    f"{closed} of 100 closed by the keeper, attach in {res['took'] * 1000:.0f} ms, "
                    f"keeper memfds after unlink {n}",
                    n == 0 and closed > 0,
                )
            finally:
                for s in flood:
                    s.close()
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


SILENT_ASKER = (
    PRELUDE
    + r"""
keeper.TIMEOUT = 1.0  # no setting for it: the module constant, lowered in this process
for op in ("attach", "list_named"):
    try:
        got = sa.attach("x") if op == "attach" else sa.list_named()
        say(outcome=f"{op} returned {got!r}")
    except Exception as e:
        say(outcome=err(e), message=str(e))
"""
)


def silent_keeper(row: Row) -> None:
    """A keeper socket that accepts nothing (then one whose listen queue is full)."""
    row.tries *= 4
    with runtime() as (env, rdir):
        rdir.mkdir(mode=0o700)
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        silent.bind(str(rdir / "keeper.sock"))
        silent.listen(4)
        queued: list[socket.socket] = []
        try:
            for mode in ("never accepts", "listen queue full"):
                if mode == "listen queue full":
                    while True:
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                        s.setblocking(False)
                        try:
                            s.connect(str(rdir / "keeper.sock"))
                        except BlockingIOError:
                            s.close()
                            break
                        queued.append(s)
                for _ in range(row.tries // 4):
                    r = run_child(SILENT_ASKER, env, timeout=30)
                    got = [x["outcome"] for x in r.lines if "outcome" in x]
                    for o in got:
                        row.add(o)
                    if r.rc is None:
                        row.lost("a request hung", False)
        finally:
            for s in queued:
                s.close()
            silent.close()
    row.lost("nothing held, nothing to leak", True)


def foreign_pid_socket(row: Row) -> None:
    """A live server socket named after a pid that does not run here (another pid
    namespace) survives the stale-socket cleanup of a process starting its server."""
    removed = 0
    with runtime() as (env, rdir):
        rdir.mkdir(mode=0o700)
        for i in range(row.tries):
            pid = dead_pid()
            live = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            live.bind(str(rdir / f"{pid}-1111111{i}.sock"))
            live.listen(1)
            stale = rdir / f"{pid}-3333333{i}.sock"
            stale.touch()
            try:
                code = "import pickle, sharedarrays as sa; pickle.dumps(sa.zeros(4, device='cpu', pack=False))"
                r = run_child(code, env, timeout=30)
                if r.rc != 0:
                    row.add(f"exporter failed (exit {r.rc})")
                    continue
                kept = (rdir / f"{pid}-1111111{i}.sock").exists()
                if kept:
                    raw_connect(str(rdir / f"{pid}-1111111{i}.sock")).close()
                row.add("kept (and connectable)" if kept else "removed")
                removed += not stale.exists()
            finally:
                live.close()
                with contextlib.suppress(OSError):
                    os.unlink(rdir / f"{pid}-1111111{i}.sock")
    row.lost(
        f"socket files of nothing listening removed: {removed}/{row.tries}", removed == row.tries
    )


SQUATTED_EXPORTER = (
    PRELUDE
    + r"""
a = sa.from_array(np.arange(10.0), device="cpu", name="squatted")
b = sa.from_array(np.arange(20.0), device="cpu", pack=False)
say(blob=pickle.dumps(b).hex(), server=transport.server_address())
sys.stdin.readline()
"""
)

SQUATTED_IMPORTER = (
    PRELUDE
    + r"""
try:
    a = sa.attach("squatted")
    b = pickle.loads(bytes.fromhex(sys.stdin.readline()))
    ok = [float(a.get().sum()), float(b.get().sum())] == [45.0, 190.0]
    say(outcome="shared by name and pickle" if ok else "wrong data", dir=str(runtime_dir()))
    sa.unlink("squatted")
except Exception as e:
    say(outcome=err(e), message=str(e))
"""
)


def squatted_runtime_dir(row: Row) -> None:
    """Another user made /tmp/sharedarrays-<uid> first (here: in a private 1777 /tmp)."""
    user, why = other_user()
    if user is None:
        row.skipped = why
        return
    pw = pwd.getpwnam(user)
    uid = os.getuid()
    for _ in range(row.tries):
        tmp = Path(tempfile.mkdtemp(prefix="sa-atk-", dir="/tmp"))
        os.chmod(tmp, 0o1777)
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        env.update(TMPDIR=str(tmp), SHAREDARRAYS_KEEPER_IDLE="2")
        try:
            squat = tmp / f"sharedarrays-{uid}"
            squat.mkdir(mode=0o700)
            os.chown(squat, pw.pw_uid, pw.pw_gid)
            with Child(SQUATTED_EXPORTER, env) as exp:
                out = exp.line()
                res = run_child(SQUATTED_IMPORTER, env, stdin=out["blob"] + "\n", timeout=30).last
            row.add(res["outcome"])
            used = res.get("dir") == str(tmp / f"sharedarrays-{uid}-1")
            st = os.lstat(squat)
            untouched = st.st_uid == pw.pw_uid and not os.listdir(squat)
            row.lost(
                f"both used `<tmp>/sharedarrays-{uid}-1`"
                if used
                else f"runtime dir {res.get('dir')}",
                used,
            )
            row.lost(
                "the squatter's dir untouched" if untouched else "the squatter's dir CHANGED",
                untouched,
            )
        finally:
            stop_keeper(tmp / f"sharedarrays-{uid}-1")
            shutil.rmtree(tmp, ignore_errors=True)


RO_CREATOR = (
    PRELUDE
    + r"""
want = (np.arange(16384) % 251).astype(np.uint8)
a = sa.from_array(want, device="cpu", readonly=True, pack=False)
say(blob=pickle.dumps(a).hex())
for line in sys.stdin:
    say(same=bool((a.get() == want).all()))
"""
)

RO_WRITER = (
    PRELUDE
    + r"""
import ctypes, errno, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
v = pickle.loads(bytes.fromhex(sys.stdin.readline()))
arr = np.asarray(v.array)
addr = arr.__array_interface__["data"][0]
size = 16384
first = int(arr[0])
chunk_fds = []
for fd in os.listdir("/proc/self/fd"):
    try:
        if os.readlink(f"/proc/self/fd/{fd}").split(" ")[0] == "/memfd:sharedarrays":  # (a chunk)
            chunk_fds.append(int(fd))
    except OSError:
        pass  # (listdir's own fd)
results = {}
def refused(what, fn):
    try:
        fn()
        results[what] = "ALLOWED"
    except OSError as e:
        results[what] = "refused " + errno.errorcode.get(e.errno, str(e.errno))
def oserr():
    e = ctypes.get_errno(); raise OSError(e, os.strerror(e))
fd = chunk_fds[0]
try:
    rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # (opening is no write: what follows is)
    reopened = "opened"
except OSError as e:
    rw = fd
    reopened = "refused " + errno.errorcode.get(e.errno, str(e.errno))
refused("mmap PROT_WRITE of /proc/self/fd reopened O_RDWR",
        lambda: mmap.mmap(rw, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
refused("pwrite", lambda: os.pwrite(rw, b"X", 0))
refused("fallocate punch hole",
        lambda: libc.fallocate(rw, 3, 0, size) == 0 or oserr())  # PUNCH_HOLE|KEEP_SIZE
refused("ftruncate to 0", lambda: os.ftruncate(rw, 0))
refused("mprotect PROT_WRITE", lambda: libc.mprotect(addr, size, 3) == 0 or oserr())
refused("madvise MADV_REMOVE", lambda: libc.madvise(addr, size, 9) == 0 or oserr())
def procmem():
    with open("/proc/self/mem", "r+b", buffering=0) as m:
        m.seek(addr); m.write(b"X")
refused("write /proc/self/mem", procmem)
say(results=results, reopened=reopened, first=first, now=int(np.asarray(v.array)[0]))
"""
)


def readonly_writes(row: Row) -> None:
    """An importer of a readonly=True host array tries every way to write it."""
    row.tries *= 7
    with runtime() as (env, _):
        for _ in range(row.tries // 7):
            with Child(RO_CREATOR, env) as creator:
                blob = creator.line()["blob"]
                r = run_child(RO_WRITER, env, stdin=blob + "\n", timeout=30)
                if r.rc is None or not any("results" in x for x in r.lines):
                    row.lost(f"writer died or hung: {r.err.strip()[-200:]}", False)
                    continue
                res = r.last
                for what, outcome in res["results"].items():
                    row.add("refused" if outcome.startswith("refused") else f"{what}: {outcome}")
                same = creator.ask("check")["same"] and res["first"] == res["now"]
                row.lost("creator's data unchanged" if same else "creator's data CHANGED", same)
                how = ", ".join(
                    f"{k.split(' of ')[0]}: {v.split(' ', 1)[-1]}"
                    for k, v in res["results"].items()
                )
                row.lost(f"reopen O_RDWR {res['reopened']}, then {how}", True)


FAKE_SERVER = (
    PRELUDE
    + r"""
import socket, tempfile, threading
a = sa.zeros(4096, "uint8", device="cpu", pack=False)
size = a.allocation.size
path = tempfile.mkdtemp(dir=os.environ["XDG_RUNTIME_DIR"]) + "/fake.sock"  # (removed with it)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); srv.bind(path); srv.listen(8)
blob = reseal(a.payload().to_bytes(), id=os.urandom(16).hex(), server=path, pid=os.getpid())
say(blob=blob.hex())
srv.settimeout(30)
conn, _ = srv.accept()  # one victim: answer its request with an unsealed memfd
conn.settimeout(30)
conn.recv(4096)
fd = os.memfd_create("sharedarrays", os.MFD_CLOEXEC)  # no seals
os.ftruncate(fd, size)
reply = Reply(Status.OK, 1, json.dumps([size]).encode()).encode()
socket.send_fds(conn, [reply], [fd])
time.sleep(0.2)
os.ftruncate(fd, 0)  # then shrink it: a mapping of it would SIGBUS at the first touch
say(shrunk=True)
sys.stdin.readline()
"""
)

UNSEALED_VICTIM = (
    PRELUDE
    + r"""
class Handed:  # what multiprocessing's DupFd hands to sa.load
    def __init__(self, fd): self.fd = fd
    def detach(self): return self.fd
blob = bytes.fromhex(sys.stdin.readline())
transport.server_address()
sa.zeros(1, device="cpu").payload()  # (this process's take table: one memfd for its life)
before = fds()
try:
    v = sa.load(blob)
    time.sleep(0.5)  # the sender shrinks it now
    s = int(np.asarray(v.array).sum())  # SIGBUS here if an unsealed memfd was mapped
    say(outcome="loaded")
except Exception as e:
    say(outcome=err(e), message=str(e))
# directly: an unsealed memfd handed with the payload (as DupFd would)
a = sa.zeros(4096, "uint8", device="cpu", pack=False)
size = a.allocation.size
direct = reseal(a.payload().to_bytes(), id=os.urandom(16).hex())
fd = os.memfd_create("sharedarrays", os.MFD_CLOEXEC)
os.ftruncate(fd, size)
keep = os.dup(fd)
try:
    v = sa.load(direct, None, (Handed(fd),))
    os.ftruncate(keep, 0)
    s = int(np.asarray(v.array).sum())
    say(outcome="loaded")
except Exception as e:
    say(outcome=err(e), message=str(e))
os.close(keep)
a.close(); del a
from sharedarrays.memory import empty_cache
empty_cache()  # (the closed array's chunk is kept for reuse, its memfd open: not a leak)
say(alive=True, leaked=fds() - before)
"""
)


def unsealed_memfd(row: Row) -> None:
    """A same-user fake handle server (and a direct load with handed fds) gives an unsealed
    memfd, then shrinks it."""
    row.tries *= 2
    with runtime() as (env, _):
        for _ in range(row.tries // 2):
            with Child(FAKE_SERVER, env) as fake:
                blob = fake.line()["blob"]
                r = run_child(UNSEALED_VICTIM, env, stdin=blob + "\n", timeout=60)
            for x in r.lines:
                if "outcome" in x:
                    row.add(x["outcome"])
            if r.rc != 0:
                sig = -r.rc if r.rc is not None and r.rc < 0 else None
                what = signal.Signals(sig).name if sig else f"exit {r.rc}"
                row.lost(f"victim died: {what}", False)
            else:
                leaked = r.last.get("leaked")
                row.lost(f"victim alive, fds {signed(leaked)}", leaked == 0)


KEEP_UNSEALED = (
    PRELUDE
    + r"""
import socket
sa.zeros(4, device="cpu", name="real")  # starts the keeper; one sealed chunk kept
kpid = keeper.running_pid()
def memfds():
    n = 0
    for fd in os.listdir(f"/proc/{kpid}/fd"):
        try:
            n += os.readlink(f"/proc/{kpid}/fd/{fd}").split(" ")[0] == "/memfd:sharedarrays"
        except OSError:
            pass
    return n
before = memfds()
for i in range(int(sys.argv[1])):
    fd = os.memfd_create("sharedarrays", os.MFD_CLOEXEC)  # no seals
    os.ftruncate(fd, 4096)
    req = {"op": "keep", "id": os.urandom(16).hex(), "secret": os.urandom(32).hex(),
           "name": f"unsealed{i}", "sizes": [4096], "doc": {"backend": "host"}, "allow_pids": None}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    s.connect(str(keeper.socket_path()))
    socket.send_fds(s, [wire.MAGIC + json.dumps(req).encode()], [fd])
    os.close(fd)
    reply = s.recv(1 << 16)
    s.close()
    status = reply[len(wire.MAGIC)]
    kept = f"unsealed{i}" in [n.name for n in sa.list_named()]
    say(outcome="error reply, nothing kept" if status == wire.ERROR and not kept
        else f"status {status}, kept {kept}", message=reply[len(wire.MAGIC) + 1:].decode())
time.sleep(0.2)
say(before=before, after=memfds())
sa.unlink("real")
"""
)


def keeper_unsealed(row: Row) -> None:
    """``keep`` with an unsealed memfd, on a raw connection to the keeper."""
    with runtime() as (env, _):
        r = run_child(KEEP_UNSEALED, env, args=(str(row.tries),), timeout=60)
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    last = r.last
    row.lost(
        f"keeper memfds {last['before']}->{last['after']} (a real named array's chunk)",
        last["before"] == last["after"],
    )


HUGE = (
    PRELUDE
    + r"""
before = fds()
for _ in range(int(sys.argv[1])):
    try:
        a = sa.empty(2**40, "uint8", device="cpu")
        say(outcome="made")
        a.close()
    except Exception as e:
        say(outcome=err(e), message=str(e))
say(leaked=fds() - before)
"""
)


def huge_empty(row: Row) -> None:
    """``sa.empty(2**40, "uint8", device="cpu")`` (1 TiB) on a small machine."""
    with runtime() as (env, _):
        r = run_child(HUGE, env, args=(str(row.tries),), timeout=60)
    _count(row, r, "fds ")


RESEALER = (
    PRELUDE
    + r"""
payload = bytes.fromhex(sys.stdin.readline())
forged = reseal(payload, readonly=False)
transport.server_address()
before = fds()
for _ in range(int(sys.argv[1])):
    try:
        v = sa.load(forged)
        say(outcome="loaded writable")
    except Exception as e:
        say(outcome=err(e), message=str(e))
say(leaked=fds() - before, mapped=len(registry.live_allocations()))
"""
)


def readonly_resealed(row: Row) -> None:
    """An importer reseals a readonly=True payload with ``readonly`` false."""
    with (
        runtime() as (env, _),
        Child(
            RO_CREATOR.replace(
                "say(blob=pickle.dumps(a).hex())", "say(blob=a.payload().to_bytes().hex())"
            ),
            env,
        ) as creator,
    ):
        payload = creator.line()["blob"]
        r = run_child(RESEALER, env, stdin=payload + "\n", args=(str(row.tries),))
        same = creator.ask("check")["same"]
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    last = r.last
    row.lost(
        f"importer fds {signed(last['leaked'])}, mappings left {last['mapped']}; creator's data "
        f"unchanged: {'yes' if same else 'NO'}",
        last["leaked"] == 0 and last["mapped"] == 0 and same,
    )


PID_FORGER = (
    PRELUDE
    + r"""
a = sa.zeros(8, device="cpu", pack=False)
forged = reseal(a.payload().to_bytes(), id=os.urandom(16).hex(), pid=2**31)
before = fds()
for _ in range(int(sys.argv[1])):
    try:
        sa.load(forged)
        say(outcome="loaded")
    except Exception as e:
        say(outcome=err(e), message=str(e))
say(leaked=fds() - before)
"""
)


def pid_2_31(row: Row) -> None:
    """A resealed payload whose ``pid`` is 2**31."""
    with runtime() as (env, _):
        r = run_child(PID_FORGER, env, args=(str(row.tries),))
    _count(row, r, "fds ")


SECRET_FORGER = (
    PRELUDE
    + r"""
# the id of an array mapped here (its exporter, or an importer that holds it warm) with
# another secret: the id is no secret (sa top lists it), the 32-byte secret is
where = sys.argv[2]
if where == "exporter":
    a = sa.zeros(8, device="cpu", pack=False)
    payload = a.payload().to_bytes()
else:  # an importer: the real payload loaded once, its mapping kept (view open, then parked)
    payload = bytes.fromhex(sys.stdin.readline())
    a = sa.load(payload)
forged = reseal(payload, secret=os.urandom(32).hex())
before = fds() if where == "exporter" else None
for _ in range(int(sys.argv[1])):
    try:
        v = sa.load(forged)
        v.close()
        say(outcome=f"{where}: loaded")
    except Exception as e:
        say(outcome=f"{where}: {err(e)}", message=str(e))
say(leaked=0 if before is None else fds() - before)
"""
)


def forged_secret(row: Row) -> None:
    """A payload naming an array mapped in the loading process, resealed with another secret:
    in its exporter, and in an importer that maps it already (a warm load)."""
    tries = row.tries
    row.tries = 2 * tries
    with runtime() as (env, _):
        r = run_child(SECRET_FORGER, env, args=(str(tries), "exporter"))
        victim, first = exporter(env)
        with victim:
            i = run_child(
                SECRET_FORGER, env, stdin=first["payload"] + "\n", args=(str(tries), "importer")
            )
            same = data_same(victim)
    for ran in (r, i):
        for x in ran.lines:
            if "outcome" in x:
                row.add(x["outcome"])
    leaked = r.last.get("leaked")
    row.lost(
        f"exporter's fds {signed(leaked)}; data unchanged: {'yes' if same else 'NO'}",
        leaked == 0 and same,
    )


AS_OTHER = r"""
import json, os, pickle, socket, sys
import sharedarrays as sa
import ctypes, fcntl, hmac, mmap, resource, selectors, threading  # noqa
from sharedarrays import importing  # noqa
from sharedarrays.api import keeping, named  # noqa
from sharedarrays.transport import client, handles as transport, keeper, server  # noqa
from sharedarrays.protocol import handles as handle_wire, keeper as wire, unix  # noqa
from sharedarrays.backends import host  # (all imported while this user can read them)
# a fresh interpreter of this user drops to the other user before it does anything: the
# interpreter lives under /root, which the other user could not even start
uid, gid, runtime, what = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
os.environ["XDG_RUNTIME_DIR"] = runtime
os.chdir("/")
def say(outcome, message=""):
    print(json.dumps({"outcome": outcome, "message": message}), flush=True)
try:
    if what == "load":
        pickle.loads(bytes.fromhex(sys.stdin.readline()))
        say("LOADED")
    elif what == "load-resealed":  # the payload claims this user's node (it holds the secret)
        import dataclasses, io
        from sharedarrays.node import this_node
        from sharedarrays.protocol.payload import Payload
        class Grab(pickle.Unpickler):
            def find_class(self, module, name):
                if name == "_rebuild_view":  # called for the part (with the payload's
                    # bytes) and then the view (with the part): the payload either way
                    return lambda part, view=None, fds=None: part
                return super().find_class(module, name)
        data = Grab(io.BytesIO(bytes.fromhex(sys.stdin.readline()))).load()
        forged = dataclasses.replace(Payload.from_bytes(data), node=this_node())
        sa.load(forged.to_bytes())
        say("LOADED")
    elif what == "attach":
        sa.attach("victim")
        say("ATTACHED")
    else:  # a raw request to the keeper socket named on stdin
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(10)
        try:
            s.connect(sys.stdin.readline().strip())
        except PermissionError:
            say("EACCES at connect")
            sys.exit(0)
        try:  # (the keeper may have answered and closed before this is sent)
            s.send(wire.MAGIC + b'{"op":"attach","name":"victim"}')
        except OSError:
            pass
        try:
            reply = s.recv(4096)
        except OSError:
            reply = b""
        if not reply:
            say("closed by the keeper")
        elif reply[len(wire.MAGIC)] == wire.DENIED:
            say("DENIED reply", reply.decode(errors="replace"))
        else:
            say(f"ANSWERED status {reply[len(wire.MAGIC)]}", reply.decode(errors="replace"))
except Exception as e:
    say(type(e).__name__ if isinstance(e, sa.SharedArrayError) else "raw " + type(e).__name__,
        str(e))
"""


def other_user_access(row: Row) -> None:
    """Another OS user loads a payload, attaches a name (pointing XDG_RUNTIME_DIR at ours),
    and asks the keeper socket directly; with the runtime directory private (0700), then
    with it and its sockets opened to everyone (then only SO_PEERCRED stands)."""
    user, why = other_user()
    if user is None:
        row.skipped = why
        return
    pw = pwd.getpwnam(user)
    ids = (str(pw.pw_uid), str(pw.pw_gid))
    row.tries *= 8
    with runtime() as (env, rdir):
        theirs = Path(tempfile.mkdtemp(prefix="sa-atk-other-"))
        os.chmod(theirs, 0o711)
        os.chown(theirs, pw.pw_uid, pw.pw_gid)
        try:
            with Child(HOLDER, env, "victim") as holder:
                holder.line()
                exp, out = exporter(env)
                with exp:
                    base = fd_count(exp.pid)
                    for _ in range(row.tries // 8):
                        for opened in (False, True):
                            modes = (0o711, 0o777) if opened else (0o700, 0o600)
                            os.chmod(rdir, modes[0])
                            for sock in rdir.glob("*.sock"):
                                os.chmod(sock, modes[1])
                            for what, xdg, stdin in (
                                ("load", str(theirs), out["blob"]),
                                ("load-resealed", str(theirs), out["blob"]),
                                ("attach", env["XDG_RUNTIME_DIR"], ""),
                                ("keeper", str(theirs), str(rdir / "keeper.sock")),
                            ):
                                r = run_child(AS_OTHER, env, stdin + "\n", 30, (*ids, xdg, what))
                                row.add(f"{what}: {r.last['outcome']}")
                    os.chmod(rdir, 0o700)
                    for sock in rdir.glob("*.sock"):
                        os.chmod(sock, 0o600)
                    same = data_same(exp)
                    after = settled_fds(exp.pid, base)
                holder.ask("unlink")
        finally:
            os.chmod(rdir, 0o700)
            stop_keeper(theirs / "sharedarrays")
            shutil.rmtree(theirs, ignore_errors=True)
    row.lost(
        f"exporter fds {base}->{after}; data unchanged: {'yes' if same else 'NO'}",
        same and after <= base,
    )


FUZZER = (
    PRELUDE
    + r"""
import random
from sharedarrays.protocol.payload import view_extent
rng = random.Random(15)
base = sa.from_array(np.arange(64, dtype=np.int32).reshape(8, 8), device="cpu", pack=False)
good = base[2:, 1::3].payload().to_bytes()
doc = json.loads(good[len(MAGIC) + TAG_BYTES:])
keys = sorted(set(doc) - {"secret"})
def junk(depth=0):
    r = rng.random()
    if r < 0.15: return None
    if r < 0.25: return rng.random() < 0.5
    if r < 0.5: return rng.choice([0, -1, 1, 2**31, 2**63, 2**70, -(2**70), rng.randint(-1000, 10**6)])
    if r < 0.6: return rng.choice([float("nan"), float("inf"), -0.0, 1.5])
    if r < 0.8: return "".join(rng.choice("abc/.:\\x00é0123") for _ in range(rng.randint(0, 12)))
    if depth > 2: return []
    if r < 0.9: return [junk(depth + 1) for _ in range(rng.randint(0, 4))]
    return {str(junk(3)): junk(depth + 1) for _ in range(rng.randint(0, 3))}
def forged():
    kind = rng.choice(["bytes", "flip", "splice", "field", "fields", "drop"])
    b = bytearray(good)
    if kind == "bytes":
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= rng.randint(1, 255)
        return bytes(b)
    if kind == "splice":
        i = rng.randint(0, len(b)); j = rng.randint(i, len(b))
        return bytes(b[:i]) + os.urandom(rng.randint(0, 40)) + bytes(b[j:])
    d = dict(doc)
    if kind == "drop":
        del d[rng.choice(keys)]
    else:
        for k in rng.sample(keys, 1 if kind == "field" else rng.randint(2, 4)):
            d[k] = junk()
    body = json.dumps(d, separators=(",", ":")).encode()
    return MAGIC + _tag(body, bytes.fromhex(doc["secret"])) + body
transport.server_address()
before = fds()
for _ in range(int(sys.argv[1])):
    blob = forged()
    try:
        v = sa.load(blob)
    except sa.SharedArrayError as e:
        say(outcome="SharedArrayError")
        continue
    except Exception as e:
        say(outcome=f"raw {type(e).__name__}", message=str(e)[:200], blob=blob.hex())
        continue
    low, high = view_extent(v.itemsize, v.shape, v.strides)
    inside = v.allocation is base.allocation and v.offset + low >= 0 and v.offset + high <= base.allocation.size
    say(outcome="view inside the allocation" if inside else "VIEW OUTSIDE", blob=blob.hex())
    v.close()
say(leaked=fds() - before)
"""
)


def fuzz_payloads(row: Row) -> None:
    """Forged payloads: random bytes, bit flips, splices, fields replaced or dropped (those
    resealed with the payload's secret); seeded."""
    with runtime() as (env, _):
        r = run_child(FUZZER, env, args=(str(row.tries),), timeout=170)
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    if r.rc is None:
        row.lost("the fuzzer hung", False)
    leaked = r.last.get("leaked")
    row.lost(f"loader fds {signed(leaked)}", leaked == 0)


IN_FLIGHT_EXPORTER = (
    PRELUDE
    + r"""
a = sa.from_array(np.full(64, 7, dtype=np.int64), device="cpu", pack=False)
say(blob=pickle.dumps(a).hex())
sys.stdin.readline()  # then exit (normally) or be killed
"""
)

IN_FLIGHT_LOADER = (
    PRELUDE
    + r"""
try:
    v = pickle.loads(bytes.fromhex(sys.stdin.readline()))
    say(outcome="loaded" if (v.get() == 7).all() else "wrong data")
    v.close()
except Exception as e:
    say(outcome=err(e), message=str(e))
"""
)


def _in_flight(row: Row, kill: bool, in_flight: str | None, wait: float = 0.0) -> None:
    keeper_left = []
    with runtime() as (env, rdir):
        if in_flight is not None:
            env = dict(env, SHAREDARRAYS_IN_FLIGHT=in_flight)
        for _ in range(row.tries):
            with Child(IN_FLIGHT_EXPORTER, env) as exp:
                blob = exp.line()["blob"]
                if kill:
                    exp.proc.kill()
                else:
                    exp.send("exit")
                try:
                    exp.proc.wait(30)
                except subprocess.TimeoutExpired:
                    row.lost("exporter did not exit", False)
            time.sleep(wait)
            r = run_child(IN_FLIGHT_LOADER, env, stdin=blob + "\n", timeout=30)
            try:
                row.add(r.last["outcome"])
            except RuntimeError as e:
                row.add(f"no answer: {e}")
            keeper_left.append(settled_memfds(keeper_pid(rdir)))
    row.lost(
        "keeper memfds after the loads: " + ", ".join(map(str, keeper_left)),
        not any(keeper_left),
    )


def in_flight_exit(row: Row) -> None:
    """The exporter exits normally right after pickling (a plain array, not named)."""
    _in_flight(row, kill=False, in_flight=None)


def in_flight_exit_off(row: Row) -> None:
    """The same with SHAREDARRAYS_IN_FLIGHT=0."""
    _in_flight(row, kill=False, in_flight="0")


def in_flight_expired(row: Row) -> None:
    """The exporter exits normally right after pickling; the load comes after the bound
    (SHAREDARRAYS_IN_FLIGHT=1, loaded 3 s later)."""
    _in_flight(row, kill=False, in_flight="1", wait=3.0)


def in_flight_sigkill(row: Row) -> None:
    """The exporter is SIGKILLed right after pickling: no exit hook runs, so nothing hands
    its handles to the keeper."""
    _in_flight(row, kill=True, in_flight=None)


LOOP_IMPORTS = (
    PRELUDE
    + r"""
blob = bytes.fromhex(sys.stdin.readline())
say(ready=True)
while True:
    a = pickle.loads(blob); a.close(); del a
    registry.drop_parked()
"""
)


def sigkill_consumer(row: Row) -> None:
    """A consumer looping ``pickle.loads`` + close is SIGKILLed at a random moment."""
    rng = random.Random(15)
    with runtime() as (env, _):
        exp, out = exporter(env)
        with exp:
            base = fd_count(exp.pid)
            for _ in range(row.tries):
                with Child(LOOP_IMPORTS, env) as c:
                    c.send(out["blob"])
                    c.line()
                    time.sleep(rng.uniform(0, 0.05))  # inside connect / recv_fds / mmap
                    c.proc.kill()
                    c.proc.wait(10)
                row.add("killed mid-import, exporter serving")
            after = settled_fds(exp.pid, base)
            res = load_in_child(env, out["blob"])
            if res["outcome"] != "loaded":
                row.lost(f"a load after the kills: {res['outcome']}", False)
            same = data_same(exp)
    row.lost(
        f"exporter fds {base}->{after}; data unchanged: {'yes' if same else 'NO'}",
        after <= base and same,
    )


FLOOD_EXPORTER = (
    PRELUDE
    + r"""
n = int(sys.argv[1])
arrays = [sa.from_array(np.full(512, i, dtype=np.int64), device="cpu", pack=False) for i in range(n)]
say(blobs=[pickle.dumps(a).hex() for a in arrays])
for line in sys.stdin:
    say(same=all(bool((a.get() == i).all()) for i, a in enumerate(arrays)))
"""
)

FLOOD_LOADER = (
    PRELUDE
    + r"""
import random
blobs = [bytes.fromhex(b) for b in json.loads(sys.stdin.readline())]
order = list(range(len(blobs)))
random.Random(os.getpid()).shuffle(order)
transport.server_address()
before = fds()
bad = 0
for i in order:
    v = pickle.loads(blobs[i])
    bad += int(v.get().sum()) != 512 * i
    v.close()
    del v
say(loads=len(order), bad=bad, leaked=fds() - before)
"""
)


def load_flood(row: Row) -> None:
    """``tries`` payload loads from 8 processes at once (each loads a different array per
    load, so each is a request to the exporter's handle server)."""
    procs = 8
    per = max(1, -(-row.tries // procs))
    row.tries = per * procs
    with runtime() as (env, _), Child(FLOOD_EXPORTER, env, str(per)) as exp:
        blobs = exp.line()["blobs"]
        base = fd_count(exp.pid)
        loaders = [Child(FLOOD_LOADER, env) for _ in range(procs)]
        leaks = []
        try:
            for c in loaders:
                c.send(json.dumps(blobs))
            for c in loaders:
                try:
                    res = c.line(timeout=150)
                except RuntimeError as e:
                    row.lost(str(e), False)
                    continue
                row.outcomes["right checksum"] += res["loads"] - res["bad"]
                if res["bad"]:
                    row.outcomes["WRONG checksum"] += res["bad"]
                leaks.append(res["leaked"])
        finally:
            for c in loaders:
                c.close()
        after = settled_fds(exp.pid, base)
        same = data_same(exp)
    row.lost(
        f"loader fds {'/'.join(map(signed, leaks))}; exporter fds {base}->{after}; "
        f"data unchanged: {'yes' if same else 'NO'}",
        all(x == 0 for x in leaks) and after <= base and same,
    )


# ---------------------------------------------------------------------------------------------
# the table


INTERRUPTED_ATTACH = (
    PRELUDE
    + r"""
import signal, threading
a = sa.from_array(np.full(10, 1.0), device="cpu", name="a")
b = sa.from_array(np.full(10, 2.0), device="cpu", name="b")
kpid = keeper.running_pid()
for _ in range(int(sys.argv[1])):
    before = fds()
    os.kill(kpid, signal.SIGSTOP)  # (its reply to attach('a') comes after the Ctrl-C)
    def later():
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)
        os.kill(kpid, signal.SIGCONT)
    t = threading.Thread(target=later)
    t.start()
    try:
        sa.attach("a").close()
        outcome = "not interrupted"
    except KeyboardInterrupt:
        outcome = None
    t.join()
    if outcome is None:
        time.sleep(0.3)  # (the keeper's reply to the interrupted attach is there by now)
        try:
            x = sa.attach("b")
            outcome = "right array" if x.get()[0] == 2.0 else "wrong array"
            x.close()
            del x
        except Exception as e:
            outcome = err(e)
    say(outcome=outcome, leaked=fds() - before)
"""
)


def interrupted_attach(row: Row) -> None:
    """A Ctrl-C while ``attach("a")`` waits for the keeper's reply; then ``attach("b")``."""
    with runtime() as (env, _):
        r = run_child(INTERRUPTED_ATTACH, env, timeout=60, args=(str(row.tries),))
    _outcomes_and_fds(row, r, "the child", "fds")


def _outcomes_and_fds(row: Row, r: Ran, who: str, fds: str) -> None:
    """Add each outcome a child printed, and the fds it left (its lines' ``leaked``)."""
    leaked = 0
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
            leaked += x["leaked"]
    if r.rc is None:
        row.lost(f"{who} hung", False)
    row.lost(f"{fds} {signed(leaked)}", leaked <= 0)


DRIPPING_SERVER = (
    PRELUDE
    + r"""
import socket, threading
client.TIMEOUT = 2.0
a = sa.from_array(np.arange(10.0), device="cpu", pack=False)
payload = a.payload().to_bytes()
r, w = os.pipe()
for i in range(int(sys.argv[1])):
    path = str(runtime_dir() / f"drip-{i}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    def drip():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            n = 1000
            try:  # 1000 fds said; one sent every 0.1 s (each well within the timeout)
                socket.send_fds(conn, [Reply(Status.OK, n, json.dumps([4096] * n).encode()).encode()], [r])
                for _ in range(n - 1):
                    time.sleep(0.1)
                    socket.send_fds(conn, [b"+"], [r])
            except OSError:
                pass
    t = threading.Thread(target=drip, daemon=True)
    t.start()
    forged = reseal(payload, server=path, id=os.urandom(16).hex())  # (not mapped here)
    before = fds()
    start = time.monotonic()
    try:
        sa.load(forged)
        outcome = "loaded"
    except Exception as e:
        outcome = err(e)
    took = time.monotonic() - start
    t.join(30)
    listener.close()
    say(outcome=outcome if took < 10 else f"waited {took:.0f} s", leaked=fds() - before)
"""
)


def dripping_server(row: Row) -> None:
    """A same-user server named by a resealed payload says 1000 fds and sends one every
    0.1 s (each message within the client's timeout of 2 s here)."""
    with runtime() as (env, _):
        r = run_child(DRIPPING_SERVER, env, timeout=120, args=(str(row.tries),))
    _outcomes_and_fds(row, r, "the loader", "loader fds")


FULL_RUNTIME_DIR = (
    PRELUDE
    + r"""
import errno
real = os.open
def full(path, *args, **kwargs):  # (as on a tmpfs with no inode left: keeper.log)
    if str(path).endswith("keeper.log"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return real(path, *args, **kwargs)
os.open = full
for i in range(int(sys.argv[1])):
    for what, fn in (
        ("name", lambda: sa.zeros(4, device="cpu", name=f"n{i}")),
        ("park", lambda: sa.zeros(4, device="cpu").park()),
    ):
        try:
            fn()
            outcome = "kept"
        except Exception as e:
            outcome = err(e)
        say(outcome=f"{what}: {outcome}")
"""
)


def full_runtime_dir(row: Row) -> None:
    """Naming and parking where keeper.log cannot be made (ENOSPC: a full tmpfs, simulated
    in the child by its ``os.open``), no keeper running."""
    row.tries *= 2
    with runtime() as (env, _):
        r = run_child(FULL_RUNTIME_DIR, env, timeout=60, args=(str(row.tries // 2),))
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    row.lost("no keeper started, nothing held", r.rc == 0)


NOTICE_FLOODER = r"""
import signal, socket, sys
signal.alarm(120)  # (killed long before)
sock = socket.socket(fileno=int(sys.argv[1]))
sock.setblocking(True)  # (waits while the server's queue is full)
notice = bytes.fromhex(sys.argv[2])
for _ in range(100):
    sock.send(notice)
print("flooding", flush=True)
while True:
    sock.send(notice)
"""


def loaded_notice_flood(row: Row) -> None:
    """24 processes send LOADED notices (zero id, zero secret) without end on one connection
    to an exporter's handle server; then a load (client timeout 10 s)."""
    notice = Request(Kind.LOADED, "00" * 16, bytes(32), 1).encode()
    with runtime() as (env, _):
        for _ in range(row.tries):
            exp, out = exporter(env)
            with exp:
                base = fd_count(exp.pid)
                flood = raw_connect(out["server"])
                flood.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
                cmd = [
                    sys.executable,
                    "-I",
                    "-c",
                    NOTICE_FLOODER,
                    str(flood.fileno()),
                    notice.hex(),
                ]
                flooders: list[subprocess.Popen[str]] = []
                try:
                    for _ in range(24):
                        flooders.append(
                            subprocess.Popen(
                                cmd,
                                pass_fds=[flood.fileno()],
                                stdout=subprocess.PIPE,
                                text=True,
                            )
                        )
                    started = sum(
                        p.stdout is not None and p.stdout.readline() == "flooding\n"
                        for p in flooders
                    )
                    res = load_in_child(env, out["blob"])
                    flooding = sum(p.poll() is None for p in flooders)
                finally:
                    for p in flooders:
                        with contextlib.suppress(ProcessLookupError):
                            p.kill()
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            p.wait(10)
                        if p.stdout is not None:
                            p.stdout.close()
                    flood.close()
                ok = res["outcome"] == "loaded"
                row.add("loaded" if ok else f"{res['outcome']} ({res.get('took', 0):.1f} s)")
                row.lost(f"{started}/24 flooding at the load, {flooding}/24 after", flooding == 24)
                after = settled_fds(exp.pid, base)
                row.lost(f"exporter fds {base}->{after}", after <= base)
                same = data_same(exp)
                row.lost("exporter data unchanged" if same else "exporter data CHANGED", same)


IDLE_0_NAMER = (
    PRELUDE
    + r"""
try:
    a = sa.from_array(np.arange(5.0), device="cpu", name=sys.argv[1])
except Exception as e:
    say(outcome=err(e), message=str(e))
    sys.exit()
say(outcome="named")
sys.stdin.readline()
sa.unlink(sys.argv[1])
a.close()
say(done=True)
"""
)


def keeper_idle_0(row: Row) -> None:
    """SHAREDARRAYS_KEEPER_IDLE=0: name an array and attach it from another process; and an
    exporter exits right after pickling, then a load (its handles handed to the keeper)."""
    row.tries *= 2
    with runtime() as (env, rdir):
        env = dict(env, SHAREDARRAYS_KEEPER_IDLE="0")
        for i in range(row.tries // 2):
            with Child(IDLE_0_NAMER, env, f"idle0-{i}") as namer:
                named = namer.line()
                if named["outcome"] != "named":
                    row.add(f"name: {named['outcome']}")
                else:
                    r = run_child(ATTACHER, env, timeout=30, args=(f"idle0-{i}",))
                    try:
                        row.add(f"name: {r.last['outcome']}")
                    except RuntimeError as e:
                        row.add(f"name: no answer: {e}")
                    namer.ask("unlink")
            with Child(IN_FLIGHT_EXPORTER, env) as exp:
                blob = exp.line()["blob"]
                exp.send("exit")
                try:
                    exp.proc.wait(30)
                except subprocess.TimeoutExpired:
                    row.lost("exporter did not exit", False)
            r = run_child(IN_FLIGHT_LOADER, env, stdin=blob + "\n", timeout=30)
            try:
                row.add(f"in flight: {r.last['outcome']}")
            except RuntimeError as e:
                row.add(f"in flight: no answer: {e}")
        deadline = time.monotonic() + 10
        while keeper_pid(rdir) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = keeper_pid(rdir) is None
        row.lost("the keeper exited, holding nothing" if gone else "the keeper still runs", gone)


NODE_AT_FD_LIMIT = (
    PRELUDE
    + r"""
import resource
blob = bytes.fromhex(sys.stdin.readline())
transport.server_address()
sa.zeros(1, device="cpu").payload()  # (this process's take table: one memfd for its life)
before = fds()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:  # the first load of this process reads its node id (the boot id): no fd for it
    pickle.loads(blob).close()
    first = "loaded"
except Exception as e:
    first = err(e)
for fd in held:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    pickle.loads(blob).close()
    then = "loaded"
except Exception as e:
    then = err(e)
say(outcome=f"{first}, then {then}", leaked=fds() - before)
"""
)


def node_at_fd_limit(row: Row) -> None:
    """A process's first load at the fd limit (its node id unread), then a load with fds
    free again: a fresh process per try (the node id is read once per process)."""
    leaks = []
    with runtime() as (env, _):
        victim, first = exporter(env)
        with victim:
            for _ in range(row.tries):
                r = run_child(NODE_AT_FD_LIMIT, env, stdin=first["blob"] + "\n")
                row.add(r.last["outcome"])
                leaks.append(r.last["leaked"])
            same = data_same(victim)
    row.lost(f"loader fds {', '.join(signed(n) for n in leaks)}", set(leaks) == {0})
    row.lost(f"exporter data {'unchanged' if same else 'CHANGED'}", same)


NO_THREADS = (
    PRELUDE
    + r"""
import glob, resource, threading
blob = bytes.fromhex(sys.stdin.readline())
mine = sa.from_array(np.arange(4.0), device="cpu", pack=False)
threading.stack_size(64 << 20)  # (a thread then needs more address space than is left)

def vm_size():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))

def sockets():
    return len(glob.glob(f"{runtime_dir()}/{os.getpid()}-*"))

before = len(os.listdir("/proc/self/fd")), sockets()
resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (16 << 20), resource.RLIM_INFINITY))
for _ in range(int(sys.argv[1])):
    for what, fn in (("dumps", lambda: pickle.dumps(mine)), ("loads", lambda: pickle.loads(blob))):
        try:
            fn()
            outcome = "no error"
        except Exception as e:
            outcome = err(e)
        say(outcome=f"{what}: {outcome}")
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
after = len(os.listdir("/proc/self/fd")), sockets()
say(leaked=after[0] - before[0], sockets=after[1] - before[1])
"""
)


def no_threads(row: Row) -> None:
    """``pickle.dumps`` and ``pickle.loads`` where no thread can start (``ulimit -v`` just
    above the interpreter's size): the handle server's thread cannot start."""
    row.tries *= 2
    with runtime() as (env, _):
        victim, first = exporter(env)
        with victim:
            r = run_child(NO_THREADS, env, stdin=first["blob"] + "\n", args=(str(row.tries // 2),))
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    leaked, sockets = r.last.get("leaked"), r.last.get("sockets")
    row.lost(f"fds {signed(leaked)}, socket files {signed(sockets)}", leaked == sockets == 0)


READONLY_AT_FD_LIMIT = (
    PRELUDE
    + r"""
import resource
a = sa.from_array(np.arange(4.0), device="cpu", readonly=True, pack=False)
a.payload()  # (the handle server runs)
before = len(os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (before + 8, hard))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
for i in range(int(sys.argv[1])):
    for what, fn in (
        ("park", a.park),  # no fd free: none to reopen its memfd read-only
        ("name", lambda: sa.from_array(np.arange(4.0), device="cpu", readonly=True,
                                       pack=False, name=f"ro{i}")),
    ):
        if what == "name":
            os.close(held.pop())  # one fd: the new memfd, none to reopen it read-only
        try:
            fn()
            outcome = "kept"
        except Exception as e:
            outcome = err(e)
        if what == "name":
            held.append(os.open("/dev/null", os.O_RDONLY))  # (full again)
        say(outcome=f"{what}: {outcome}")
for fd in held:
    os.close(fd)
say(leaked=len(os.listdir("/proc/self/fd")) - before, mapped=len(registry.live_allocations()))
"""
)


def readonly_at_fd_limit(row: Row) -> None:
    """Parking a ``readonly=True`` array, and making one with ``name=``, at the fd limit
    (its handles are opened again read-only to hand them on)."""
    row.tries *= 2
    with runtime() as (env, _):
        r = run_child(READONLY_AT_FD_LIMIT, env, args=(str(row.tries // 2),))
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    leaked, mapped = r.last.get("leaked"), r.last.get("mapped")
    row.lost(
        f"fds {signed(leaked)}, arrays mapped {mapped} (1 expected)", leaked == 0 and mapped == 1
    )


RECONSTRUCTOR_CALL = r"""
from sharedarrays.api.array import _rebuild_view

class Call:  # a pickle that names only the view reconstructor, with these arguments
    def __init__(self, *args):
        self.args = args
    def __reduce__(self):
        return _rebuild_view, self.args
"""

CRAFTED_RECONSTRUCTOR = (
    PRELUDE
    + RECONSTRUCTOR_CALL
    + r"""
from sharedarrays.api.array import allocation_bytes

a = sa.from_array(np.arange(8.0), device="cpu", pack=False)
blob, view = allocation_bytes(a.allocation), a._view_tuple()
transport.server_address()
before = fds()
shapes = [(), (None,), ("x",), (1,), (blob, None, None, None), (None, view), (blob, "x"),
          (Call(blob), None), (Call(blob), "x"), (Call(blob), (0, (8,), (8,))),
          (Call(blob), (0, "x", (8,), "<f8", False)), (Call(blob, None, ("x",)), view),
          (Call(blob, None, (1,)), view), (Call(blob, None, []), view), (blob, None, "x")]
for _ in range(int(sys.argv[1])):
    outcomes = set()
    for args in shapes:
        try:
            pickle.loads(pickle.dumps(Call(*args)))
            outcomes.add("loaded")
        except Exception as e:
            outcomes.add(err(e))
    say(outcome=" and ".join(sorted(outcomes)))
say(leaked=fds() - before)
"""
)


def crafted_reconstructor(row: Row) -> None:
    """Pickles naming only the view reconstructor with malformed arguments (too few, too
    many, a str or None for the part or the view, carried handles that are not handles):
    each try loads 15 such pickles."""
    with runtime() as (env, _):
        r = run_child(CRAFTED_RECONSTRUCTOR, env, args=(str(row.tries),))
    _count(row, r, "loader fds ")


MISALIGNED_VIEWS = (
    PRELUDE
    + RECONSTRUCTOR_CALL
    + r"""
from sharedarrays.api.array import message_part

a = sa.zeros(4096, "uint8", device="hip:0", pack=False)
part = message_part(a.allocation, False)
views = [(255, (4,), (8,), "<f8", False), (0, (4,), (247,), "<f8", False),
         (1, (4,), (4,), "<f4", False), (0, (4,), (3,), "<f2", False)]
for _ in range(int(sys.argv[1])):
    outcomes = set()
    for view in views:
        try:
            pickle.loads(pickle.dumps(Call(part, view)))
            outcomes.add("loaded")
        except Exception as e:
            outcomes.add(err(e))
    say(outcome=" and ".join(sorted(outcomes)))
"""
)


def misaligned_views(row: Row) -> None:
    """Views of device memory misaligned for their dtype (float64 at offset 255 or with
    stride 247, float32 at offset 1, float16 with stride 3), on the simulated HIP runtime
    of tests/simulated (device memory on any machine): on a GPU the first kernel would fail
    with a misaligned address and end the process's GPU work."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    with runtime() as (env, _):
        env["SHAREDARRAYS_HIP_MODULE"] = "simulated.hip"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tests), env.get("PYTHONPATH")) if p)
        r = run_child(MISALIGNED_VIEWS, env, args=(str(row.tries),))
    for x in r.lines:
        if "outcome" in x:
            row.add(x["outcome"])
    row.lost("the loader ran to the end", r.rc == 0)


STALLED_SENDER = (
    PRELUDE
    + r"""
from sharedarrays.process import STATE

def said(hook):  # (what each hand-over raises, as its type)
    def wrapped(alloc, count, seconds):
        try:
            hook(alloc, count, seconds)
        except Exception as e:
            say(failed=err(e))
            raise
    return wrapped

STATE.memory.hand_over_hooks[:] = [said(hook) for hook in STATE.memory.hand_over_hooks]
arrays = [sa.from_array(np.full(1000, i, dtype=np.int64), device="cpu", pack=False)
          for i in range(3)]
say(ready=True, blobs=[pickle.dumps(a).hex() for a in arrays])
arrays[0].close()  # its payload is handed over now, the others' at the exit
"""
)

BLOBS_LOADER = (
    PRELUDE
    + r"""
outcomes = []
for i, blob in enumerate(json.loads(sys.stdin.read())):
    try:
        v = pickle.loads(bytes.fromhex(blob))
        outcomes.append("loaded" if (v.get() == i).all() else "wrong data")
        v.close()
    except Exception as e:
        outcomes.append(err(e))
say(outcomes=outcomes)
"""
)


def stalled_keeper(row: Row) -> None:
    """A sender closes one of 3 arrays in flight and exits with the keeper stopped
    (SIGSTOP): the close and the exit wait less than 1.5 x the keeper's TIMEOUT in all, and
    what failed is said as a library error; with the keeper killed (SIGKILL: its socket file
    left, nothing listening), a new one starts and every payload loads, in as little time."""
    from sharedarrays.transport.keeper import TIMEOUT

    row.tries *= 2
    for _ in range(row.tries // 2):
        for how in (signal.SIGSTOP, signal.SIGKILL):
            with runtime() as (env, rdir):
                run_child("import sharedarrays.transport.keeper as k; k.ensure_running()", env)
                kpid = keeper_pid(rdir)
                if kpid is None:
                    row.add("no keeper started")
                    continue
                os.kill(kpid, how)
                try:
                    with Child(STALLED_SENDER, env) as sender:
                        blobs = sender.line()["blobs"]
                        began = time.monotonic()
                        try:
                            out, err = sender.proc.communicate(timeout=120)
                        except subprocess.TimeoutExpired:
                            out, err = "", "(hung)"
                        took = time.monotonic() - began
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(kpid, signal.SIGCONT)
                said = [x for x in err.splitlines() if "could not be handed" in x]
                failed = [x["failed"] for x in _json_lines(out) if "failed" in x]
                raw = "Traceback" in err or any(f.startswith("raw ") for f in failed)
                if how == signal.SIGKILL:
                    r = run_child(BLOBS_LOADER, env, stdin=json.dumps(blobs), timeout=60)
                    loads = Counter(r.last["outcomes"]) if r.lines else Counter(["no answer"])
                    ok = loads == Counter(loaded=3) and not said
                    what = "loaded" if ok else f"{dict(loads)} {err.strip()[-200:]}"
                else:  # (each said line names one allocation, and "N more" alike)
                    named = sum(1 + int(m) for m in _more_allocations(said))
                    ok = named == 3 and len(failed) == 3 and not raw
                    what = "bounded, said as KeeperError" if ok else f"{failed} {err[-300:]}"
                verdict = what if took < 1.5 * TIMEOUT else f"waited {took:.0f} s"
                row.add(f"keeper {signal.Signals(how).name}: {verdict}")
    row.lost("nothing held, nothing to leak", True)


def _more_allocations(lines: list[str]) -> list[str]:
    """Per line said at exit, how many more allocations it names "alike" ("0" if none)."""
    found = [re.search(r"of (\d+) more allocation\(s\), alike", line) for line in lines]
    return [m.group(1) if m else "0" for m in found]


MANY_CHUNKS = (
    PRELUDE
    + r"""
n = 300 * 4096  # (300 chunks: more fds than one SCM_RIGHTS message carries)
name = sys.argv[1] if len(sys.argv) > 1 else None
a = sa.from_array(np.arange(n, dtype=np.uint8), device="cpu", chunk_bytes=4096, pack=False,
                  name=name)
say(chunks=len(a.allocation.chunk_sizes()), blob=None if name else pickle.dumps(a).hex())
"""  # (then exits: in flight at a normal exit, or named)
)

MANY_CHUNKS_LOADER = (
    PRELUDE
    + r"""
try:
    name = sys.argv[1]
    v = sa.attach(name) if name != "-" else pickle.loads(bytes.fromhex(sys.stdin.read()))
    ok = (v.get() == np.arange(300 * 4096, dtype=np.uint8)).all()
    v.close()
    if name != "-":
        sa.unlink(name)
    say(outcome="loaded" if ok else "wrong data")
except Exception as e:
    say(outcome=err(e), message=str(e))
"""
)


def many_chunks(row: Row) -> None:
    """Arrays of 300 chunks (past one SCM_RIGHTS message, whose limit is 253 fds): one in
    flight at its sender's normal exit, one named by a process that then exits; loaded and
    attached afterwards."""
    row.tries *= 2
    held = []
    with runtime() as (env, rdir):
        for i in range(row.tries // 2):
            for what, args in (("in flight", ()), ("named", (f"many{i}",))):
                made = run_child(MANY_CHUNKS, env, args=args)
                try:
                    blob = made.last["blob"] or ""
                except RuntimeError as e:
                    row.add(f"{what}: not made ({str(e)[-200:]})")
                    continue
                name = args[0] if args else "-"
                r = run_child(MANY_CHUNKS_LOADER, env, stdin=blob, args=(name,))
                row.add(f"{what}: {r.last['outcome'] if r.lines else 'no answer'}")
        held.append(settled_memfds(keeper_pid(rdir)))
    row.lost(f"keeper memfds after the loads: {held[0]}", held == [0])


REMOVED_DIR_EXPORTER = (
    PRELUDE
    + r"""
named = sa.from_array(np.arange(10.0), device="cpu", name="kept")
a = sa.from_array(np.arange(1000.0), device="cpu", pack=False)
say(blob=pickle.dumps(a).hex())
sys.stdin.readline()  # (the runtime directory is removed meanwhile)
b = sa.from_array(np.arange(100.0), device="cpu", pack=False)
say(blob=pickle.dumps(b).hex())
sys.stdin.readline()
"""
)

REMOVED_DIR_USER = (
    PRELUDE
    + r"""
try:
    sums = [float(pickle.loads(bytes.fromhex(line)).get().sum()) for line in sys.stdin]
    sums.append(float(sa.attach("kept").get().sum()))
    listed = [info.name for info in sa.list_named()]
    ok = sums == [499500.0, 4950.0, 45.0] and listed == ["kept"]
    say(outcome="shared again" if ok else f"wrong: {sums} {listed}")
except Exception as e:
    say(outcome=err(e), message=str(e))
"""
)


def removed_runtime_dir(row: Row) -> None:
    """The runtime directory removed (``rm -rf``, as systemd does to /run/user/<uid> at the
    last logout) while an exporter and the keeper run: a payload pickled before and one
    pickled after load, the named array attaches and is listed, and one keeper runs."""
    for _ in range(row.tries):
        with runtime() as (env, rdir), Child(REMOVED_DIR_EXPORTER, env) as exp:
            first = exp.line()["blob"]
            kpid = keeper_pid(rdir)
            shutil.rmtree(rdir)
            second = exp.ask("")["blob"]
            r = run_child(REMOVED_DIR_USER, env, stdin=f"{first}\n{second}\n", timeout=60)
            outcome = r.last["outcome"] if r.lines else f"no answer: {r.err.strip()[-200:]}"
            keepers = [
                p
                for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                if _runs_keeper_of(p, env["XDG_RUNTIME_DIR"])
            ]
            if keepers != [kpid]:
                outcome = f"keepers {keepers}, first {kpid}"
            row.add(outcome)
    row.lost("nothing held, nothing to leak", True)


def _runs_keeper_of(pid: int, base: str) -> bool:
    """Whether process ``pid`` is a keeper with ``base`` as its XDG_RUNTIME_DIR."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"sharedarrays.keeper.daemon" not in f.read():
                return False
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"XDG_RUNTIME_DIR={base}".encode() in f.read().split(b"\0")
    except OSError:
        return False


HU = {"HandleUnavailable"}

# name, function, default tries, attack (as the table says it), defended outcomes
ATTACKS: list[tuple[str, Callable[[Row], None], int, str, set[str]]] = [
    (
        "planted-modules",
        planted_modules,
        5,
        "keeper started from a dir with planted json.py/secrets.py/selectors.py and an empty "
        "PYTHONPATH entry",
        {"nothing planted ran"},
    ),
    (
        "handle-server-emfile",
        handle_server_emfile,
        5,
        "exporter at RLIMIT_NOFILE (8 spare fds): 40 idle connections to its handle server, "
        "then a load",
        {"loaded"},
    ),
    (
        "slow-readers",
        slow_readers,
        3,
        "5 connections queue requests and never read the replies, then a load",
        {"loaded quickly, 5/5 flooders dropped"},
    ),
    (
        "stopped-exporter",
        stopped_exporter,
        100,
        "concurrent loads from a SIGSTOPped exporter, asking its handle server (one load per try)",
        HU,
    ),
    (
        "forged-server-path",
        forged_server_paths,
        5,
        "payload's `server` forged (resealed): regular file, path through a file, symlink loop, "
        "datagram socket",
        HU,
    ),
    (
        "keeper-connection-flood",
        keeper_connection_flood,
        3,
        "60 idle connections to a keeper capped at 16 (SHAREDARRAYS_KEEPER_CONNECTIONS), "
        "then an attach",
        {"attached"},
    ),
    (
        "keeper-emfile",
        keeper_emfile,
        3,
        "keeper at RLIMIT_NOFILE 64 flooded with 100 connections, then an attach",
        {"attached"},
    ),
    (
        "silent-keeper",
        silent_keeper,
        2,
        "a keeper socket that never accepts, then one with a full listen queue: attach and "
        "list_named",
        {"KeeperError"},
    ),
    (
        "foreign-pid-socket",
        foreign_pid_socket,
        10,
        "live handle-server socket named after a pid not running here (another pid namespace) "
        "vs another process's stale-socket cleanup",
        {"kept (and connectable)"},
    ),
    (
        "squatted-runtime-dir",
        squatted_runtime_dir,
        3,
        "another OS user made `<tmp>/sharedarrays-<uid>` first (`TMPDIR` a fresh 1777 dir, standing "
        "for /tmp); share by name and by pickle",
        {"shared by name and pickle"},
    ),
    (
        "readonly-writes",
        readonly_writes,
        5,
        "importer of a readonly=True host array: /proc/self/fd reopened O_RDWR + mmap "
        "PROT_WRITE, pwrite, fallocate punch hole, ftruncate, mprotect, madvise MADV_REMOVE, "
        "write /proc/self/mem",
        {"refused"},
    ),
    (
        "unsealed-memfd",
        unsealed_memfd,
        5,
        "same-user fake handle server, and a direct load with handed fds: an unsealed memfd, "
        "shrunk after sending",
        {"PayloadError"},
    ),
    (
        "keeper-unsealed-keep",
        keeper_unsealed,
        10,
        "keeper `keep` with an unsealed memfd (raw connection)",
        {"error reply, nothing kept"},
    ),
    ("huge-empty", huge_empty, 5, '`sa.empty(2**40, "uint8", device="cpu")`', {"OutOfMemory"}),
    (
        "readonly-resealed",
        readonly_resealed,
        10,
        "importer reseals a readonly=True payload with readonly false",
        {"PermissionDenied"},
    ),
    ("pid-2-31", pid_2_31, 10, "payload resealed with pid `2**31`", {"PayloadError"}),
    (
        "forged-secret",
        forged_secret,
        5,
        "payload of an array mapped in the loader (its exporter; an importer holding it warm) "
        "resealed with another secret",
        {"PermissionDenied"},
    ),
    (
        "other-user",
        other_user_access,
        3,
        "another OS user: loads a payload (as pickled, and resealed to claim its own node), "
        "attaches a name (with our XDG_RUNTIME_DIR), asks the keeper socket; dir private, then "
        "dir and sockets opened to all",
        {
            "PermissionDenied",
            "WrongNode",
            "EACCES at connect",
            "DENIED reply",
            "closed by the keeper",
        },
    ),
    (
        "fuzz-payloads",
        fuzz_payloads,
        5000,
        "forged payloads: random bytes, bit flips, splices, fields replaced/dropped and resealed",
        {"SharedArrayError", "view inside the allocation"},
    ),
    (
        "in-flight-exit",
        in_flight_exit,
        5,
        "exporter exits normally right after pickling a plain array; then a load",
        {"loaded"},
    ),
    ("in-flight-off", in_flight_exit_off, 5, "the same with SHAREDARRAYS_IN_FLIGHT=0", HU),
    (
        "in-flight-expired",
        in_flight_expired,
        2,
        "the same with SHAREDARRAYS_IN_FLIGHT=1, loaded 3 s after the exit",
        HU,
    ),
    (
        "in-flight-sigkill",
        in_flight_sigkill,
        5,
        "exporter SIGKILLed right after pickling a plain array; then a load "
        "(no exit hook runs: nothing is handed to the keeper)",
        HU,
    ),
    (
        "sigkill-consumer",
        sigkill_consumer,
        8,
        "consumer looping pickle.loads + close, SIGKILLed at a random moment",
        {"killed mid-import, exporter serving"},
    ),
    (
        "load-flood",
        load_flood,
        1000,
        "payload loads from 8 processes at once (a different array each load)",
        {"right checksum"},
    ),
    (
        "interrupted-attach",
        interrupted_attach,
        3,
        'Ctrl-C while `attach("a")` waits for the (stopped) keeper\'s reply; then '
        '`attach("b")` on the same connection',
        {"right array"},
    ),
    (
        "dripping-server",
        dripping_server,
        2,
        "same-user server named by a resealed payload says 1000 fds and sends one every 0.1 s "
        "(client timeout 2 s)",
        HU,
    ),
    (
        "full-runtime-dir",
        full_runtime_dir,
        2,
        "name and park where keeper.log cannot be made (ENOSPC, simulated), no keeper running",
        HU,
    ),
    (
        "loaded-notice-flood",
        loaded_notice_flood,
        3,
        "24 processes send LOADED notices (zero id, zero secret) without end on one "
        "connection to an exporter's handle server, then a load",
        {"loaded"},
    ),
    (
        "keeper-idle-0",
        keeper_idle_0,
        3,
        "SHAREDARRAYS_KEEPER_IDLE=0 (its least): name an array, attach it from another "
        "process; an exporter exits right after pickling, then a load",
        {"attached", "loaded"},
    ),
    (
        "node-at-fd-limit",
        node_at_fd_limit,
        3,
        "a process's first load at the fd limit (its node id unread), then with fds free",
        {"HandleUnavailable, then loaded"},
    ),
    (
        "no-threads",
        no_threads,
        3,
        "`pickle.dumps` and `pickle.loads` where no thread can start (ulimit -v)",
        {"ThreadUnavailable"},
    ),
    (
        "readonly-at-fd-limit",
        readonly_at_fd_limit,
        3,
        "park a `readonly=True` array, and make one with `name=`, at the fd limit",
        HU,
    ),
    (
        "crafted-reconstructor",
        crafted_reconstructor,
        3,
        "pickles naming only the view reconstructor with malformed arguments (15 each try)",
        {"PayloadError"},
    ),
    (
        "misaligned-views",
        misaligned_views,
        3,
        "views of device memory misaligned for float16/32/64 (simulated HIP)",
        {"PayloadError"},
    ),
    (
        "stalled-keeper",
        stalled_keeper,
        2,
        "a close and the exit of a sender with 3 arrays in flight, the keeper SIGSTOPped; and "
        "SIGKILLed (socket file left)",
        {"bounded, said as KeeperError", "loaded"},
    ),
    (
        "many-chunks",
        many_chunks,
        2,
        "arrays of 300 chunks (past SCM_MAX_FD 253) in flight at a normal exit, and named",
        {"loaded"},
    ),
    (
        "removed-runtime-dir",
        removed_runtime_dir,
        2,
        "rm -rf of the runtime directory while an exporter and the keeper (a named array) run",
        {"shared again"},
    ),
]


def run_attack(
    name: str, fn: Callable[[Row], None], tries: int, attack: str, defended: set[str]
) -> Row:
    row = Row(name, attack, set(defended), tries)

    def alarm(*_: object) -> None:
        raise Hang(f"the attack ran past {ATTACK_TIMEOUT} s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(ATTACK_TIMEOUT)
    start = time.monotonic()
    try:
        fn(row)
    except Exception as e:  # a failed attack is a failed row, never the end of the script
        row.lost(f"attack failed: {type(e).__name__}: {str(e)[:300]}", False)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    took = time.monotonic() - start
    verdict = "skipped" if row.skipped else ("ok" if row.ok else "NOT DEFENDED")
    print(f"  {name}: {verdict} in {took:.1f} s", file=sys.stderr, flush=True)
    return row


def table(rows: list[Row]) -> str:
    lines = [
        "| attack | tries | outcome | lost or leaked |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        cells = [re.sub(r"\s+", " ", c).replace("|", "\\|") for c in row.cells()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, help="tries of every attack (default: each its own)")
    parser.add_argument("--only", help="comma-separated attack names (see --list)")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    parser.add_argument("--list", action="store_true", help="list the attacks and exit")
    args = parser.parse_args(argv)
    names = [a[0] for a in ATTACKS]
    if args.list:
        print("\n".join(names))
        return 0
    only = args.only.split(",") if args.only else names
    unknown = sorted(set(only) - set(names))
    if unknown:
        parser.error(f"unknown attack(s) {', '.join(unknown)}; --list names them")
    if args.tries is not None and args.tries < 1:
        parser.error("--tries must be at least 1")
    start = time.monotonic()
    rows = [
        run_attack(name, fn, args.tries or tries, attack, defended)
        for name, fn, tries, attack, defended in ATTACKS
        if name in only
    ]
    text = table(rows)
    print(text)
    failed = [r.name for r in rows if not r.ok]
    print(
        f"{len(rows)} attacks in {time.monotonic() - start:.0f} s; "
        + (f"NOT DEFENDED: {', '.join(failed)}" if failed else "all defended"),
        file=sys.stderr,
    )
    if args.markdown:
        args.markdown.write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
