"""Functions that spawned worker processes run (they must be importable by name)."""

from __future__ import annotations

import gc
import os
import pickle
import sys
from typing import Any

import numpy as np


def double_slice(args: tuple[Any, int]) -> float:
    a, i = args
    a.array[i] = a.array[i] * 2 + 1
    return float(a.array[i].sum())


def add_one(a: Any) -> Any:
    a.array[...] += 1
    return a


def fill_value(a: Any, value: float) -> tuple[int, str]:
    a.array[...] = value
    return os.getpid(), a.allocation.id


def checksum(a: Any) -> float:
    return float(a.get().astype(np.float64).sum())


def echo(a: Any) -> Any:
    return a


def num_fds(_: object = None) -> int:
    import psutil

    from sharedarrays.transport import handles as transport

    gc.collect()
    return psutil.Process().num_fds() - transport.open_connections()


def queue_consumer(q: Any, done: Any) -> None:
    a = q.get()
    a.array[...] = 5
    done.put(float(a.array.sum()))


def pipe_consumer(conn: Any) -> None:
    a = conn.recv()
    a.array[...] *= 3
    conn.send(a.allocation.id)
    conn.close()


def process_arg_consumer(a: Any, q: Any) -> None:
    a.array[...] = np.arange(a.size).reshape(a.shape)
    q.put((a.allocation.origin.pid, a.allocation.id))


def import_twice(blob: bytes) -> tuple[bool, int]:
    """Load one payload twice in a fresh process: one mapping, same address."""
    x = pickle.loads(blob)
    y = pickle.loads(blob)
    import sharedarrays.memory.registry as sa_registry

    same = x.allocation is y.allocation and x.address == y.address
    return same, len(sa_registry.live_allocations())


def exporter_main(path: str, ready: str, go: str) -> None:
    """Run as a script: create an array, write its payload to ``path``, wait, exit."""
    import time

    import sharedarrays as sa

    a = sa.from_array(np.arange(1000, dtype=np.int64), device="cpu", pack=False)
    with open(path, "wb") as f:
        pickle.dump(a, f)
    open(ready, "w").close()
    deadline = time.time() + 60
    while not os.path.exists(go) and time.time() < deadline:
        time.sleep(0.01)
    sys.exit(0)


_held: list[Any] = []


def hold(a: Any) -> str:
    """Keep a view alive in this worker (so later tasks find the allocation mapped)."""
    _held.append(a)
    return a.allocation.id


def hold_and_view(a: Any) -> Any:
    """Keep ``a`` alive here and return a view of it (which goes back to its exporter)."""
    _held.append(a)
    return a[1:3]


def held_values(_: object = None) -> list[float]:
    return [float(x) for a in _held for x in (a.get().min(), a.get().max())]


def release_held(_: object = None) -> int:
    n = len(_held)
    _held.clear()
    gc.collect()
    return n


def parked_ids(_: object = None) -> list[str]:
    from sharedarrays.memory.registry import parked_allocations

    gc.collect()
    return [a.id for a in parked_allocations()]


def mapped_ids(_: object = None) -> list[str]:
    from sharedarrays.memory.registry import live_allocations

    gc.collect()
    return [a.id for a in live_allocations()]


def increment(a: Any) -> None:
    a.array[...] += 1


def fd_targets(_: object = None) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return sorted(out)


# -- CUDA workers (cupy is imported inside, so CPU-only runs never need it) ---------------------


def cuda_write_slice(args: tuple[Any, int]) -> tuple[str, int, float]:
    """Write ``i + 1`` into row ``i`` of a CUDA array; report the module and device used."""
    import cupy

    a, i = args
    x = a.array
    row = x[i]
    row[...] = i + 1
    cupy.cuda.get_current_stream().synchronize()
    return type(x).__module__.split(".")[0], int(x.device.id), float(row.sum().get())


def cuda_read_sum(a: Any) -> float:
    import cupy

    value = float(a.array.astype(cupy.float64).sum().get())
    return value


def cuda_min_max(a: Any) -> tuple[float, float]:
    """Min and max of a CUDA array as it is the moment the worker reads it."""
    x = a.array
    return float(x.min().get()), float(x.max().get())


def cuda_sample(a: Any, step: int) -> tuple[float, float, float]:
    """Read a strided sample of a huge array and write its last element."""
    import cupy

    x = a.array
    sample = float(x[::step].astype(cupy.float64).sum().get())
    x[-1] = -1
    cupy.cuda.get_current_stream().synchronize()
    return sample, float(x[0].get()), float(x[-1].get())


def cuda_fork_child_load(blob: bytes) -> str:
    """In a forked child of a CUDA parent: loading and using a CUDA payload must say why not."""
    import pickle

    import sharedarrays as sa

    try:
        a = pickle.loads(blob)
        a.array  # noqa: B018 - touching the memory is the point
    except sa.BackendUnavailable as e:
        return "BackendUnavailable: " + str(e)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def checksum_list(arrays: list[Any]) -> float:
    return float(sum(float(a.array[0]) for a in arrays))


def inplace_ops(a: Any) -> tuple[float, ...]:
    """Write ``a`` (a 2-D float SharedDeviceArray) with operators and NumPy dispatch only:
    ``a += 1``, ``np.multiply(a, 2, out=a)``, ``a.T[0] -= 1`` (a shared view), ``a.fill``
    of a reshaped view. Returns what the child saw."""
    a += 1
    np.multiply(a, 2, out=a)
    col = a.T[0]
    col -= 1
    a.reshape(-1)[-1:].fill(42.0)
    return float(a.sum()), float(a[0, 0]), a.shape[0]


_last_base: Any = None


def reuses_native_base(a: Any) -> tuple[bool, bool, int]:
    """Touch ``.array`` of a handed-off view, then close it: whether the allocation's native
    base is the one the last call saw (kept while the allocation was parked), whether the
    allocation is parked after the close, and its view leases then. (The last base is held
    here: a CuPy ``MemoryPointer`` takes no weak reference; a base let go between calls is
    then still a different object from the next one.)"""
    global _last_base
    native = a.array
    alloc = a.allocation
    base = alloc.native_base()
    same = _last_base is base
    _last_base = base
    del native, base
    a.close()
    return same, alloc.parked, alloc.view_leases


def takes_the_kept_lease(a: Any) -> tuple[int, int, bool, int]:
    """Close a handed-off view: the id of the lease it held, the id of the lease its
    allocation keeps after the close (0: none), whether the allocation is parked then, and
    its leases then. (Ids only: a reference held here would hold the kept lease too.)"""
    held = id(a._lease)
    alloc = a.allocation
    a.close()
    kept = id(alloc.kept_lease) if alloc.kept_lease is not None else 0
    return held, kept, alloc.parked, alloc.leases


def evicted_while_a_native_lives(a: Any) -> dict[str, Any]:
    """Close a handed-off view while its native array lives on, release the parked
    allocation (as an eviction does), read through the native, then drop it."""
    native = a.array
    alloc = a.allocation
    a.close()
    out: dict[str, Any] = {"parked": alloc.parked, "released": alloc.release()}
    out["after"] = (alloc.parked, alloc.released, alloc.leases)
    out["value"] = float(native[0])
    del native
    gc.collect()
    out["end"] = (alloc.parked, alloc.released, alloc.leases)
    return out


def die_on(x: Any) -> Any:
    """``x``, or the worker killed (SIGKILL, as the out-of-memory killer does) when it is
    ``"die"``."""
    if x == "die":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if x == "exit":  # (a task that calls sys.exit(): the standard library's worker ends)
        sys.exit()
    if x == "exit 3":
        sys.exit(3)
    if x == "_exit":
        os._exit(0)
    return x


def made_here(n: int) -> Any:
    """A new array of ``n`` float64 values ``n``, made in this worker and returned."""
    import sharedarrays as sa

    return sa.full(n, float(n), device="cpu", pack=False)


def small_made_here(n: int) -> Any:
    """A new array of ``n`` float64 values ``n``, made in this worker's slab (with the rest)."""
    import sharedarrays as sa

    return sa.full(n, float(n), device="cpu")


def made_here_pickled(n: int) -> bytes:
    """:func:`made_here`'s array pickled, and dropped here before the bytes are returned."""
    import pickle

    return pickle.dumps(made_here(n))


def limit_address_space(nbytes: int) -> None:
    """A Pool initializer: this worker may map at most ``nbytes`` of address space."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


def first_value(a: Any) -> float:
    return float(a.array.flat[0])


def wait_for_file(path: str, x: Any, limit: float = 60.0) -> Any:
    """``x``, once ``path`` exists (or after ``limit`` seconds): a task that stays running
    until the test lets it go."""
    import time

    end = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.01)
    return x


def add_one_at(a: Any, i: int) -> int:
    """Add 1 to ``a[i]`` in place (a shared array); ``i``."""
    a[i] += 1
    return i


def die_or_add_one(a: Any, i: int, path: str) -> int:
    """:func:`die_when_file` of ``path`` when ``i`` is -1, else :func:`add_one_at`."""
    if i == -1:
        die_when_file(path)
    return add_one_at(a, i)


def die_when_file(path: str, limit: float = 60.0) -> None:
    """Wait until ``path`` exists (at most ``limit`` seconds), then kill this worker
    (SIGKILL)."""
    import signal

    wait_for_file(path, None, limit)
    os.kill(os.getpid(), signal.SIGKILL)


def die_in_initializer() -> None:
    """A pool initializer that ends its worker."""
    os._exit(3)


def die_after_reading_a_task() -> None:
    """A pool initializer that makes its worker die (SIGKILL) right after it has read its
    first task message, before it can say of which job it is: a kill at the worst moment."""
    import signal

    from sharedarrays.api import poolqueues

    read = poolqueues.read_message

    def read_then_die(*args: Any, **kwargs: Any) -> bytes:
        message = read(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
        return message

    poolqueues.read_message = read_then_die


def read_twice(a: Any, out: Any, go: Any) -> None:
    """Put ``a``'s first value, wait for ``go``, put it again (the view held meanwhile)."""
    out.put(float(a.array[0]))
    go.wait(60)
    out.put(float(a.array[0]))


def load_and_read_twice(blob: bytes, out: Any, go: Any, close_first: bool) -> None:
    """:func:`read_twice` of ``blob`` (a pickle, or a payload's bytes for ``sa.load``);
    ``close_first``: close the view after the first read, put ``"closed"`` and wait for
    ``go`` (alive: its ``DONE`` is said as its view closes, not at its exit)."""
    import pickle

    import sharedarrays as sa

    a = pickle.loads(blob) if blob[:1] == b"\x80" else sa.load(blob)
    if close_first:
        out.put(float(a.array[0]))
        a.close()
        out.put("closed")
        go.wait(60)
        return
    read_twice(a, out, go)


def forward_then_close(received: Any, forward: Any, told: Any, out: Any, go: Any) -> None:
    """Take an array from queue ``received``, put it on queue ``forward``, close it when
    ``told`` (then put ``"closed"`` on ``out``), and stay alive until ``go``."""
    a = received.get(timeout=60)
    forward.put(a)
    told.get(timeout=60)
    a.close()
    out.put("closed")
    go.wait(60)


def read_twice_from(queue: Any, out: Any, go: Any) -> None:
    """:func:`read_twice` of the array taken from ``queue``."""
    read_twice(queue.get(timeout=60), out, go)


def listed_by_block_around_a_plain_pickle(a: Any) -> tuple[bool, bool]:
    """Whether this import of ``a`` is listed by its block before and after a plain pickle
    of it (which takes its memory out of reuse)."""
    import pickle

    from sharedarrays.process import STATE

    alloc = a.allocation
    before = any(x is alloc for x in STATE.memory.blocks.values())
    pickle.dumps(a)
    return before, any(x is alloc for x in STATE.memory.blocks.values())


def new_filled(args: tuple[int, int]) -> Any:
    """A new host array of ``n`` float64 filled with ``value`` (a result made in a worker)."""
    import sharedarrays as sa

    n, value = args
    return sa.full(n, float(value), device="cpu", pack=False)


def count_notices() -> None:
    """A Pool initializer: count the notices this worker queues, by kind
    (:func:`notice_counts`)."""
    import collections

    from sharedarrays.transport import client

    counts: collections.Counter[str] = collections.Counter()
    queue = client.queue_notice

    def counting(servers: list[str], kind: Any, *args: Any, **kwargs: Any) -> None:
        counts[kind.name] += 1
        queue(servers, kind, *args, **kwargs)

    client.queue_notice = counting  # type: ignore[assignment]
    globals()["_notices"] = counts


def notice_counts(_: object = None) -> tuple[int, dict[str, int]]:
    """(this worker's pid, the notices it queued so far by kind) after :func:`count_notices`."""
    return os.getpid(), dict(globals()["_notices"])


def cache_counts(_: object = None) -> tuple[int, int]:
    """(arrays made on cached memory so far, bytes cached now) in this worker."""
    from sharedarrays.process import STATE

    return STATE.memory.cache.hits, STATE.memory.cache.nbytes


def new_filled_cuda(args: tuple[int, int]) -> Any:
    """A new CUDA array of ``n`` float32 filled with ``value`` (a result made in a worker)."""
    import sharedarrays as sa

    n, value = args
    return sa.full(n, float(value), "float32", device="cuda:0", pack=False)
