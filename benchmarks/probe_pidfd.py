"""Probe: can a spawn child take its parent's exported chunk fds with pidfd_getfd (no round trip
to the handle server), and do the fds have distinct (st_dev, st_ino) to check their identity?

Run: ``python benchmarks/probe_pidfd.py [cuda:0|cpu]``.
"""

import ctypes
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import sharedarrays as sa


def child(pid, entries):
    libc = ctypes.CDLL(None, use_errno=True)
    out = []
    pfd = os.pidfd_open(pid)
    ts = []
    for fd, dev, ino in entries:
        t = time.perf_counter()
        r = libc.syscall(438, pfd, fd, 0)
        ts.append(time.perf_counter() - t)
        if r < 0:
            out.append(("err", os.strerror(ctypes.get_errno())))
            continue
        st = os.fstat(r)
        out.append(("ok", (st.st_dev, st.st_ino) == (dev, ino), st.st_mode))
        os.close(r)
    os.close(pfd)
    return out, statistics.median(ts) * 1e6


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"
    arrs = [sa.empty(1 << 18, "float32", device=dev, pack=False) for _ in range(5)]
    entries = []
    for a in arrs:
        fd = a.allocation.chunk_fds()[0]
        st = os.fstat(fd)
        entries.append((fd, st.st_dev, st.st_ino))
        print(
            "fd",
            fd,
            "dev",
            st.st_dev,
            "ino",
            st.st_ino,
            "mode",
            oct(st.st_mode),
            os.readlink(f"/proc/self/fd/{fd}"),
        )
    print("distinct inodes:", len({e[1:] for e in entries}))
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    print("yama:", yama.read_text().strip() if yama.exists() else "none", "uid", os.getuid())
    with mp.get_context("spawn").Pool(1) as p:
        print(p.apply(child, (os.getpid(), entries)))
