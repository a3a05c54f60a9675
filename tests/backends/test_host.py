"""The host backend: sealed memfds (read-only for real, no SIGBUS from a shrunk handle),
and a memory check at creation."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
from keeper_helpers import py

import sharedarrays as sa
from sharedarrays.memory import live_allocations
from sharedarrays.protocol.payload import MAGIC, TAG_BYTES

ATTACKS = (
    "import ctypes, errno, json, mmap, os, pickle, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)\n"
    "out = {}\n"
    "def attempt(name, f):\n"
    "    try:\n"
    "        f()\n"
    "        out[name] = 'written'\n"
    "    except OSError as e:\n"
    "        out[name] = errno.errorcode[e.errno] if e.errno else type(e).__name__\n"
    "def attack(fd, size, address):\n"
    "    rw = os.open(f'/proc/self/fd/{fd}', os.O_RDWR)  # opening again is allowed ...\n"
    "    def map_rw():\n"
    "        m = mmap.mmap(rw, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)\n"
    "        m[:8] = b'\\xff' * 8\n"
    "    attempt('reopen O_RDWR + mmap PROT_WRITE', map_rw)\n"
    "    attempt('reopen O_RDWR + pwrite', lambda: os.pwrite(rw, b'\\xff' * 8, 0))\n"
    "    attempt('pwrite on the fd', lambda: os.pwrite(fd, b'\\xff' * 8, 0))\n"
    "    def punch():\n"
    "        if libc.fallocate(rw, 3, 0, size):  # PUNCH_HOLE | KEEP_SIZE: zeroes the data\n"
    "            e = ctypes.get_errno()\n"
    "            raise OSError(e, os.strerror(e))\n"
    "    attempt('fallocate punch hole', punch)\n"
    "    def proc_mem():\n"
    "        with open('/proc/self/mem', 'r+b', buffering=0) as f:\n"
    "            f.seek(address)\n"
    "            f.write(b'\\xff' * 8)\n"
    "    attempt('write /proc/self/mem at the mapping', proc_mem)\n"
    "    os.close(rw)\n"
)

IMPORTER = ATTACKS + (
    "import sharedarrays as sa\n"
    "a = pickle.loads(bytes.fromhex(sys.stdin.readline()))\n"
    "al = a.allocation\n"
    "attempt('mprotect PROT_WRITE', lambda: al.backend.set_access(al.address, al.size, 'rw'))\n"
    "attack(al.chunks[0].fd, al.size, al.address)\n"
    "out['maps'] = [l.split()[1] for l in open('/proc/self/maps')\n"
    "               if l.startswith(format(al.address, 'x') + '-')]\n"
    "out['sum'] = float(a.get().sum())\n"
    "print(json.dumps(out), flush=True)\n"
)

FD_HOLDER = ATTACKS + (
    "libc.mmap.restype = ctypes.c_void_p\n"
    "libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,\n"
    "                      ctypes.c_int, ctypes.c_long)\n"
    "libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)\n"
    "fd, size = int(sys.argv[1]), int(sys.argv[2])\n"
    "address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)\n"
    "def mprotect():\n"
    "    if libc.mprotect(address, size, mmap.PROT_READ | mmap.PROT_WRITE):\n"
    "        e = ctypes.get_errno()\n"
    "        raise OSError(e, os.strerror(e))\n"
    "attempt('mprotect PROT_WRITE', mprotect)\n"
    "attack(fd, size, address)\n"
    "print(json.dumps(out), flush=True)\n"
)

REFUSED = {"EPERM", "EACCES", "EIO", "EBADF", "PermissionDenied"}


@pytest.mark.timeout(120)
def test_readonly_importers_cannot_write_by_any_means() -> None:
    """The attacks of an importer of a readonly=True array: each is refused by the kernel,
    and the creator sees no change (its own view stays writable)."""
    a = sa.from_array(np.arange(512.0), device="cpu", readonly=True)
    a[0] = 10.0  # the creator keeps writing
    expected = a.get().copy()
    r = py(IMPORTER, input=pickle.dumps(a).hex() + "\n", timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out.pop("maps") == ["r--s"]
    assert out.pop("sum") == float(expected.sum())
    assert len(out) == 6 and set(out.values()) <= REFUSED, out
    assert np.array_equal(a.get(), expected)  # nothing was written
    a[1] = 11.0  # and the creator still writes
    assert a.get()[1] == 11.0


@pytest.mark.timeout(120)
def test_readonly_memory_refuses_even_the_creators_own_fd() -> None:
    """A process holding the creator's own (O_RDWR) fd, as multiprocessing's DupFd gives a
    spawned child, cannot write either."""
    a = sa.from_array(np.arange(512.0), device="cpu", readonly=True)
    expected = a.get().copy()
    fd = a.allocation.chunk_fds()[0]
    assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
    r = subprocess.run(
        [sys.executable, "-c", FD_HOLDER, str(fd), str(a.allocation.size)],
        pass_fds=[fd],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out) == 6 and set(out.values()) <= REFUSED, out
    assert np.array_equal(a.get(), expected)


def test_readonly_growable_arrays_seal_new_chunks_and_cannot_move() -> None:
    a = sa.zeros(512, "uint8", device="cpu", readonly=True, capacity=16 * 4096)
    a.resize(8 * 4096)  # a new chunk: mapped here, writable, then sealed
    a[8 * 4096 - 1] = 7
    for fd in a.allocation.chunk_fds():
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & 0x0010  # F_SEAL_FUTURE_WRITE
    with pytest.raises(sa.ResizeRefused, match="larger capacity="):
        a.resize(64 * 4096)  # would map the sealed chunks again
    assert a.shape == (8 * 4096,) and a.get()[-1] == 7


def test_ordinary_arrays_are_not_write_sealed() -> None:
    a = sa.zeros(4096, device="cpu", pack=False)  # (a slab would stay half used after)
    seals = fcntl.fcntl(a.allocation.chunk_fds()[0], fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SEAL and seals & fcntl.F_SEAL_SHRINK and not seals & 0x0010
    assert not a.allocation.write_sealed


class _Handed:
    """Stands for multiprocessing's DupFd: a handle that travelled with a payload."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def detach(self) -> int:
        return self.fd


def _as_another_allocation(a: sa.SharedDeviceArray, **changes: object) -> bytes:
    """``a``'s payload under a fresh allocation id (so loading it imports the handles that
    come with it), with ``changes`` to its fields, and a valid tag."""
    from sharedarrays.protocol.payload import _tag

    doc = json.loads(a.payload().to_bytes()[len(MAGIC) + TAG_BYTES :])
    doc.update(id=os.urandom(16).hex(), **changes)
    body = json.dumps(doc, separators=(",", ":")).encode()
    return MAGIC + _tag(body, bytes.fromhex(doc["secret"])) + body


def _unsealed_memfd(size: int) -> int:
    fd = os.memfd_create("forged", os.MFD_CLOEXEC)  # what a same-user forger could send
    os.ftruncate(fd, size)
    return fd


@pytest.mark.parametrize("seals", [None, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL])
def test_an_unsealed_handle_is_refused_and_closed(seals: int | None, fd_baseline: None) -> None:
    a = sa.zeros(512, device="cpu", pack=False)
    size = a.allocation.size
    if seals is None:
        fd = _unsealed_memfd(size)
    else:  # sealable, sealed against everything but shrinking
        fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    with pytest.raises(sa.PayloadError, match="not sealed against shrinking"):
        sa.load(_as_another_allocation(a), None, (_Handed(fd),))
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    a.close()


@pytest.mark.parametrize("kind", ["pipe", "file"])
def test_a_handle_that_is_not_a_memfd_is_refused_and_closed(
    kind: str, fd_baseline: None, tmp_path: object
) -> None:
    a = sa.zeros(512, device="cpu", pack=False)
    if kind == "pipe":
        fd, w = os.pipe()
        os.close(w)
    else:
        fd = os.open(os.path.join(str(tmp_path), "f"), os.O_RDWR | os.O_CREAT)
        os.ftruncate(fd, a.allocation.size)
    with pytest.raises(sa.PayloadError, match=r"not a memfd|not sealed"):
        sa.load(_as_another_allocation(a), None, (_Handed(fd),))
    with pytest.raises(OSError):
        os.fstat(fd)
    a.close()


UNSEALED = (
    "import json, os, sys\n"
    "import psutil\n"
    "import sharedarrays as sa\n"
    "class Handed:\n"
    "    def __init__(self, fd): self.fd = fd\n"
    "    def detach(self): return self.fd\n"
    "blob, size = bytes.fromhex(sys.argv[1]), int(sys.argv[2])\n"
    "before = psutil.Process().num_fds()\n"
    "fd = os.memfd_create('forged', os.MFD_CLOEXEC)  # a same-user forger: no seals\n"
    "os.ftruncate(fd, size)\n"
    "forger = os.dup(fd)\n"
    "try:\n"
    "    a = sa.load(blob, None, (Handed(fd),))\n"
    "    os.ftruncate(forger, 0)  # shrunk under the mapping\n"
    "    out = {'loaded': True, 'sum': float(a.get().sum())}  # SIGBUS without the check\n"
    "except sa.SharedArrayError as e:\n"
    "    out = {'error': type(e).__name__, 'message': str(e)}\n"
    "os.close(forger)\n"
    "out['leaked'] = psutil.Process().num_fds() - before\n"
    "print(json.dumps(out), flush=True)\n"
)


@pytest.mark.timeout(120)
def test_a_shrinkable_handle_never_crashes_the_importer() -> None:
    """A forger sends an unsealed memfd and shrinks it once mapped: without the seal check
    the importer dies of SIGBUS at the first touch."""
    a = sa.zeros(512, device="cpu", pack=False)
    r = subprocess.run(
        [sys.executable, "-c", UNSEALED, _as_another_allocation(a).hex(), str(a.allocation.size)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, f"the importer died ({r.returncode}): {r.stderr}"
    out = json.loads(r.stdout)
    assert out["error"] == "PayloadError" and "sealed" in out["message"]
    assert out["leaked"] == 0


def test_a_huge_host_array_fails_at_creation(fd_baseline: None) -> None:
    from sharedarrays.backends.host import memory_available

    known = memory_available()
    if known is None:
        pytest.skip("vm.overcommit_memory=1: the administrator asked for no memory check")
    size = 1 << 40  # 1 TiB
    if known[0] >= size:
        pytest.skip(f"this machine has {known[0]} bytes available")
    with pytest.raises(sa.OutOfMemory, match=f"{size} bytes") as err:
        sa.empty(size, "uint8", device="cpu")
    assert isinstance(err.value, MemoryError) and isinstance(err.value, sa.SharedArrayError)
    assert "available" in str(err.value) and "MemAvailable" in str(err.value)
    assert all(al.size < size for al in live_allocations())


@pytest.mark.parametrize("how", ["chunk_bytes", "growth"])
def test_memory_is_checked_for_all_the_chunks_at_once(how: str, fd_baseline: None) -> None:
    """Many chunks that each fit, together too large: refused before any is made."""
    from sharedarrays.backends.host import memory_available

    known = memory_available()
    if known is None:
        pytest.skip("vm.overcommit_memory=1: the administrator asked for no memory check")
    size = max(1 << 40, 2 * known[0])
    if how == "chunk_bytes":
        with pytest.raises(sa.OutOfMemory, match=f"{size} bytes"):
            sa.empty(size, "uint8", device="cpu", chunk_bytes=1 << 30)
        return
    a = sa.zeros(4096, "uint8", device="cpu", capacity=2 * size, chunk_bytes=1 << 30)
    with pytest.raises(sa.OutOfMemory, match="host memory"):
        a.resize(size)
    assert a.shape == (4096,) and len(a.allocation.chunks) == 1
    a.close()


def test_strict_overcommit_counts_the_commit_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from sharedarrays.backends import host

    monkeypatch.setattr(host, "_overcommit_mode", lambda: 2)
    known = host.memory_available()
    assert known is not None
    with open("/proc/meminfo") as f:
        info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":") for line in f)}
    commit = max(info["CommitLimit"] - info["Committed_AS"], 0)
    assert known[0] <= commit + (64 << 20)  # (Committed_AS moves while we read)
    monkeypatch.setattr(host, "_overcommit_mode", lambda: 1)
    assert host.memory_available() is None
    sa.empty(1 << 40, "uint8", device="cpu", pack=False).close()  # asked for: no check


def test_an_overcommit_mode_unread_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # a read that fails (too many open files) answers the default once and is not kept
    import builtins

    from sharedarrays.backends import host

    with open("/proc/sys/vm/overcommit_memory") as f:
        mode = int(f.read())
    real_open = builtins.open

    def emfile(path: object, *args: object, **kwargs: object) -> object:
        if path == "/proc/sys/vm/overcommit_memory":
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)  # type: ignore[call-overload]

    host._read_overcommit.cache_clear()
    monkeypatch.setattr(builtins, "open", emfile)
    assert host._overcommit_mode() == 0
    monkeypatch.setattr(builtins, "open", real_open)
    assert host._overcommit_mode() == mode
    monkeypatch.setattr(builtins, "open", emfile)
    assert host._overcommit_mode() == mode  # (kept)


def test_a_capacity_beyond_the_address_space_is_out_of_memory(fd_baseline: None) -> None:
    with pytest.raises(sa.OutOfMemory, match="address space"):
        sa.empty(8, "uint8", device="cpu", capacity=1 << 47)


@pytest.mark.parametrize("err", [errno.EMFILE, errno.ENFILE])
def test_too_many_open_files_is_a_library_error(err: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def memfd_create(name: str, flags: int = 0) -> int:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "memfd_create", memfd_create)
    with pytest.raises(sa.HandleUnavailable, match="ulimit -n"):
        sa.zeros(10000, device="cpu")
