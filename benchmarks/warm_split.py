"""Where a warm handoff's time goes, across the two processes (issue 19's warm goal).

    python benchmarks/warm_split.py [--device cuda:0] [--rounds 301] [--size 1M]

One spawn worker that has started the device. Each round hands the worker, in the bench's
balanced order (``sharedarrays.bench.rounds.round_order``),
one warm sharedarrays array (``task_sharedarrays``'s work: ``.array``, then ``close``), the same
number of plain bytes (the bench's ``control``), nothing (the floor), a :class:`Hook` (the
least any object that runs Python when pickled and loaded costs) and a :class:`FencedHook`
(``hook+fence``: a hook that also takes the library's ordering fence). Every task's
arguments are ``(Stamp(), payload, Stamp())``: a :class:`Stamp` writes the time it is
pickled and reads the time it is unpickled (``time.monotonic``, one clock for every process
of the machine), so the worker's result splits the round trip into

- ``queue``: from ``apply_async`` to the start of the parent's pickling (the Pool's task
  thread picks the task up),
- ``pickle``: the parent's pickling of the arguments,
- ``send``: from the end of the pickling to the start of the worker's unpickling (the pipe,
  the worker waking up, reading the message),
- ``unpickle``: the worker's unpickling of the arguments (the load),
- ``body``: the task (``.array`` and ``close`` for sharedarrays),
- ``back``: from the end of the task to ``get()`` returning in the parent (the result's
  pickling, the pipe, the Pool's result thread, the waiting thread woken).

It prints the median of each part for each kind and the sharedarrays - control difference
per part: the warm overhead over the floor is their sum, and this says in which process and
which step it is.

``--fences none,query,...`` adds a kind ``sa-<name>`` per name: the same array, handed off
with the backend's ordering fence replaced for its rounds (``export_fence`` set around its
task, then put back) by one of :data:`FENCES`: ``none`` (no fence), ``ctx+query`` (the
fence's two driver calls alone, ``cuCtxGetCurrent`` and ``cuStreamQuery`` of the legacy
stream, through cuda-bindings), ``query`` (``cuStreamQuery`` alone), ``cupy-query`` (CuPy's
``runtime.streamQuery`` of the legacy stream). The rows ``fence - <name>`` are what the
fence costs in place beyond each. None of them orders anything (they return no token): a
measurement only.

``--calls P:W,...`` adds a kind ``callsP+W`` per pair: a ``hook+fence`` that also calls ``P``
distinct small Python functions when pickled and ``W`` when loaded (each its own code
object, made here, doing two attribute reads): what so many more frames cost in a handoff,
against the library's own count (``warm_frames.py``). ``--by-neighbour KIND,...`` prints each part's
median for those kinds grouped by the kind just before them in the round. ``--torch`` adds
torch's warm handoff
of a tensor of the same size to the rounds (torch's reductions registered in the parent, torch
started in the worker), the neighbour after which the bench reads sharedarrays slowest.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

from sharedarrays.bench.rounds import round_order
from sharedarrays.bench.sizes import parse_size


class Stamp:
    """Pickles as the time it was pickled; unpickles as (pickled at, unpickled at)."""

    def __reduce__(self) -> tuple[Any, tuple[float]]:
        return _stamped, (time.monotonic(),)


def _stamped(pickled_at: float) -> tuple[float, float]:
    return pickled_at, time.monotonic()


class Hook:
    """The least any object that runs Python when pickled and loaded costs (the ``hook`` kind):
    it pickles as a module function called with bytes of the size of a sharedarrays array's
    payload and a view tuple, loads as a new object, and its task reads a native array kept
    by the worker (``.array``) and drops it (``close``). No lookup, no lease, no check."""

    __slots__ = ("blob", "view", "native")

    def __init__(self, blob: bytes, view: tuple[Any, ...]) -> None:
        self.blob = blob
        self.view = view
        self.native: Any = None

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _hooked, (self.blob, self.view)

    @property
    def array(self) -> Any:
        native = self.native
        if native is None:
            native = self.native = _kept[0]
        return native

    def close(self) -> None:
        self.native = None


class FencedHook(Hook):
    """The ``hook+fence`` kind: a :class:`Hook` that also takes the backend's ordering fence
    when pickled (``export_fence``: the thread's current stream queried, an event recorded
    when busy) and carries its token, as any correct warm handoff must: the least such a
    handoff costs with this library's fence. The worker drops the token (the parent's
    stream is idle between rounds: there is none to wait for)."""

    __slots__ = ("backend",)

    def __init__(self, blob: bytes, view: tuple[Any, ...], backend: Any) -> None:
        super().__init__(blob, view)
        self.backend = backend

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        fence = self.backend.export_fence()
        token = None if fence is None else fence.token
        return _fence_hooked, (self.blob, self.view, token)


def _fence_hooked(blob: bytes, view: tuple[Any, ...], token: Any) -> Hook:
    return Hook(blob, view)


_kept: list[Any] = []  # the worker's native array for Hook.array


def _no_fence(self: Any) -> None:
    return None


def _ctx_and_query(self: Any) -> None:
    from cuda.bindings import driver

    driver.cuCtxGetCurrent()
    driver.cuStreamQuery(0)


def _query(self: Any) -> None:
    from cuda.bindings import driver

    driver.cuStreamQuery(0)


def _cupy_query(self: Any) -> None:
    import cupy

    cupy.cuda.runtime.streamQuery(0)


FENCES = {
    "none": _no_fence,
    "ctx+query": _ctx_and_query,
    "query": _query,
    "cupy-query": _cupy_query,
}
"""Stand-ins for the ordering fence (``--fences``): measurements only, none orders work."""


def _hooked(blob: bytes, view: tuple[Any, ...]) -> Hook:
    return Hook(blob, view)


class _Fields:
    __slots__ = ("a", "b")

    def __init__(self) -> None:
        self.a, self.b = 1, 2


_FIELDS = _Fields()


def _make_calls(count: int, tag: str) -> tuple[Any, ...]:
    """``count`` distinct functions (each its own code object) of two attribute reads."""
    made = []
    for i in range(count):
        space: dict[str, Any] = {}
        name = f"_{tag}{i}"
        exec(f"def {name}(x):\n    y = x.a + {i}\n    return y if y != -1 else x.b\n", space)
        made.append(space[name])
    return tuple(made)


_CALLS: dict[str, tuple[Any, ...]] = {}  # (kind, side) -> functions, made on first use


def _calls(kind: str, side: str, count: int) -> tuple[Any, ...]:
    key = f"{kind}-{side}"
    fns = _CALLS.get(key)
    if fns is None:
        fns = _CALLS[key] = _make_calls(count, f"{side}_{kind.replace('+', '_')}_")
    return fns


class CallingHook(FencedHook):
    """The ``callsP+W`` kinds: a ``hook+fence`` that calls ``P`` distinct functions when
    pickled and ``W`` when loaded."""

    __slots__ = ("kind", "parent_calls", "worker_calls")

    def __init__(
        self, blob: bytes, view: tuple[Any, ...], backend: Any, parent_calls: int, worker_calls: int
    ) -> None:
        super().__init__(blob, view, backend)
        self.kind = f"calls{parent_calls}+{worker_calls}"
        self.parent_calls, self.worker_calls = parent_calls, worker_calls

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        for fn in _calls(self.kind, "p", self.parent_calls):
            fn(_FIELDS)
        fence = self.backend.export_fence()
        token = None if fence is None else fence.token
        return _calling_hooked, (self.blob, self.view, token, self.kind, self.worker_calls)


def _calling_hooked(
    blob: bytes, view: tuple[Any, ...], token: Any, kind: str, worker_calls: int
) -> Hook:
    for fn in _calls(kind, "w", worker_calls):
        fn(_FIELDS)
    return Hook(blob, view)


# --trace: functions timed in each process (their own wall time, calls included)
PARENT_TRACE = (
    "sharedarrays.api.array:SharedDeviceArray.__reduce__",
    "sharedarrays.api.message:message_part",
    "sharedarrays.api.message:allocation_bytes",
    "sharedarrays.api.message:MessagePart.__reduce__",
    "sharedarrays.backends.cuda.sync:export_fence",
    "sharedarrays.backends.cuda.device:CudaDevice.stream_token",
    "sharedarrays.backends.cuda.sync:record",
    # (before 2026-12-02's session 13: what export_fence called per message)
    "sharedarrays.backends.cuda.sync:fence",
    "sharedarrays.backends.cuda.sync:_record",
    "sharedarrays.backends.cuda.device:CudaDevice.is_current",
    "sharedarrays.memory.inflight:InFlight.note_sent",
    "sharedarrays.backends.cuda.sync:export_sync",
    "sharedarrays.backends.cuda.sync:current_stream",
    "sharedarrays.backends.cuda.sync:_next_slot",
    "sharedarrays.protocol.token:encode",
    "cuda.bindings.driver:cuCtxGetCurrent",
    "cuda.bindings.driver:cuCtxSetCurrent",
    "cuda.bindings.driver:cuStreamQuery",
    "cuda.bindings.driver:cuEventQuery",
    "cuda.bindings.driver:cuEventRecord",
    "sharedarrays.backends.cuda.device:CudaDevice.context",
)
WORKER_TRACE = (
    "sharedarrays.api.message:import_part",
    "sharedarrays.protocol.payload:Payload.from_bytes",
    "sharedarrays.api.array:_rebuild_view",
    "sharedarrays.api.message:ReceivedPart.view",
    "sharedarrays.api.message:ReceivedPart.find",
    "sharedarrays.importing:load_payload",
    "sharedarrays.backends.cuda.sync:import_sync",
    "sharedarrays.api.array:SharedDeviceArray._init",
    "sharedarrays.api.array:SharedDeviceArray.array",
    "sharedarrays.memory.allocation:Allocation.native_base",
    "sharedarrays.backends.cuda.device:CudaDevice.native_view",
    "sharedarrays.backends.host:HostBackend.native_view",
    "sharedarrays.api.array:SharedDeviceArray.close",
    "sharedarrays.memory.allocation:Allocation._unlease",
    "cuda.bindings.driver:cuCtxGetCurrent",
    "cuda.bindings.driver:cuStreamWaitEvent",
)
_spent: dict[str, list[float]] = {}


def _trace(names: tuple[str, ...]) -> None:
    """Wrap each named function (``module:attr`` or ``module:Class.attr``, a property's
    getter included) to add its wall time to ``_spent`` (skipped where it does not exist)."""
    import functools
    import importlib
    import inspect

    for name in names:
        module_name, _, path = name.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attr):
            continue
        static = inspect.getattr_static(owner, attr)
        raw = static.fget if isinstance(static, property) else static
        raw = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
        cell = _spent.setdefault(name.partition(":")[2], [0.0, 0])

        def timed(*args: Any, _f: Any = raw, _c: list[float] = cell, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _f(*args, **kw)
            finally:
                _c[0] += time.perf_counter() - t
                _c[1] += 1

        functools.update_wrapper(timed, raw)
        if isinstance(static, property):
            setattr(owner, attr, property(timed, static.fset, static.fdel))
        elif isinstance(static, classmethod):
            setattr(owner, attr, classmethod(timed))
        elif isinstance(static, staticmethod):
            setattr(owner, attr, staticmethod(timed))
        else:
            setattr(owner, attr, timed)


def _taken() -> dict[str, tuple[float, int]]:
    out = {k: (v[0], int(v[1])) for k, v in _spent.items() if v[1]}
    for v in _spent.values():
        v[0], v[1] = 0.0, 0
    return out


def _init(device: str, trace: bool = False, torch: bool = False) -> None:
    import sharedarrays  # noqa: F401

    if torch:
        import torch as _torch

        _torch.zeros(1, device=device if device.startswith("cuda") else "cpu")

    if trace:
        _trace(WORKER_TRACE)

    if device.startswith("cuda"):
        import cupy

        _kept.append(cupy.zeros(1 << 18, dtype="float32"))
    else:
        import numpy

        _kept.append(numpy.zeros(1 << 18, dtype="float32"))


def task(first: tuple[float, float], payload: Any, last: tuple[float, float]) -> dict[str, float]:
    t0 = time.monotonic()
    if hasattr(payload, "array"):
        x = payload.array
        n = x.shape[0]
        del x
        payload.close()
    else:
        n = 0 if payload is None else len(payload)
    t1 = time.monotonic()
    return {
        "pickle_start": first[0],
        "pickle_end": last[0],
        "unpickle_start": first[1],
        "unpickle_end": last[1],
        "body_start": t0,
        "body_end": t1,
        "n": float(n),
        "trace": _taken(),  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=301)
    parser.add_argument("--size", type=parse_size, default=1 << 20)
    parser.add_argument(
        "--fences",
        default="",
        help=f"also hand the array off with the fence replaced by each of {', '.join(FENCES)}",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also time named functions in both processes (a few us of overhead each)",
    )
    parser.add_argument(
        "--calls", default="", help="P:W,... also a hook+fence calling P and W more functions"
    )
    parser.add_argument("--torch", action="store_true", help="also torch's handoff of a tensor")
    parser.add_argument(
        "--by-neighbour",
        default="",
        help="KIND,...: also each part's median for these kinds by the kind just before them",
    )
    args = parser.parse_args()

    import sharedarrays as sa

    if args.trace:
        _trace(PARENT_TRACE)

    a = sa.empty(args.size // 4, "float32", device=args.device)
    import multiprocessing.reduction

    pickled = multiprocessing.reduction.ForkingPickler.dumps(a)
    control = bytes(len(pickled))
    blob = bytes(len(a.allocation.encoded[2]))  # (the payload pickled just now)
    hook = Hook(blob, a._view_tuple())
    kinds: dict[str, Any] = {"floor": None, "control": control, "hook": hook}
    kinds["hook+fence"] = FencedHook(blob, a._view_tuple(), a.allocation.backend)
    kinds["sharedarrays"] = a
    for pair in [c for c in args.calls.split(",") if c]:
        p_calls, w_calls = (int(n) for n in pair.split(":"))
        made = CallingHook(blob, a._view_tuple(), a.allocation.backend, p_calls, w_calls)
        kinds[made.kind] = made
    if args.torch:
        import torch
        import torch.multiprocessing  # (registers torch's reductions)

        on = args.device if args.device.startswith("cuda") else "cpu"
        tensor = torch.zeros(args.size // 4, dtype=torch.float32, device=on)
        kinds["torch"] = tensor.share_memory_() if on == "cpu" else tensor
    backend_type = type(a.allocation.backend)
    fence = backend_type.__dict__.get("export_fence")
    fences = [f for f in args.fences.split(",") if f]
    for f in fences:
        if f not in FENCES:
            parser.error(f"--fences: {f!r} is not one of {', '.join(FENCES)}")
        kinds[f"sa-{f}"] = a
    parts = ("queue", "pickle", "send", "unpickle", "body", "back", "total")
    got: dict[str, dict[str, list[float]]] = {k: {p: [] for p in parts} for k in kinds}
    before: dict[str, list[str]] = {k: [] for k in kinds}  # (the kind before, each round)
    names = list(kinds)
    traced: dict[str, dict[str, list[float]]] = {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(1, initializer=_init, initargs=(args.device, args.trace, args.torch)) as pool:
        for name in names:  # the first (cold) handoff of each, untimed
            pool.apply_async(task, (Stamp(), kinds[name], Stamp())).get(60)
        _taken()
        for r in range(args.rounds):
            order = round_order(names, r)
            for place, name in enumerate(order):
                before[name].append(order[place - 1] if place else "(first)")
                replaced = name.startswith("sa-")
                if replaced:
                    backend_type.export_fence = FENCES[name[3:]]  # type: ignore[method-assign]
                t_submit = time.monotonic()
                s = pool.apply_async(task, (Stamp(), kinds[name], Stamp())).get(60)
                t_done = time.monotonic()
                if replaced:
                    if fence is None:
                        del backend_type.export_fence
                    else:
                        backend_type.export_fence = fence  # type: ignore[method-assign]
                g = got[name]
                g["queue"].append(s["pickle_start"] - t_submit)
                g["pickle"].append(s["pickle_end"] - s["pickle_start"])
                g["send"].append(s["unpickle_start"] - s["pickle_end"])
                g["unpickle"].append(s["unpickle_end"] - s["unpickle_start"])
                g["body"].append(s["body_end"] - s["body_start"])
                g["back"].append(t_done - s["body_end"])
                g["total"].append(t_done - t_submit)
                if args.trace:
                    sides = (("parent", _taken()), ("worker", s["trace"]))
                    for side, spent in sides:
                        for fn, (secs, calls) in spent.items():
                            traced.setdefault(name, {}).setdefault(f"{side} {fn}", []).append(
                                secs / max(calls, 1) * 1e6
                            )
    a.close()
    med = {k: {p: statistics.median(v) * 1e6 for p, v in g.items()} for k, g in got.items()}
    print(f"warm handoff split, {args.device}, {args.size:,} bytes, {args.rounds} rounds (us)")
    print(f"{'':<18}" + "".join(f"{p:>10}" for p in parts))
    rows = [(k, med[k]) for k in names]
    for k in ("control", "hook", "hook+fence", "sharedarrays"):
        rows.append((f"{k[:10]} - floor", {p: med[k][p] - med["floor"][p] for p in parts}))
    rows.append(("sa - control", {p: med["sharedarrays"][p] - med["control"][p] for p in parts}))
    rows.append(("sa - hook", {p: med["sharedarrays"][p] - med["hook"][p] for p in parts}))
    rows.append(
        ("sa - hook+fence", {p: med["sharedarrays"][p] - med["hook+fence"][p] for p in parts})
    )
    for f in fences:
        cost = {p: med["sharedarrays"][p] - med[f"sa-{f}"][p] for p in parts}
        rows.append((f"fence - {f}"[:18], cost))
    for k in [k for k in names if k.startswith("calls") or k == "torch"]:
        rows.append(
            (f"{k} - hook+fence"[:18], {p: med[k][p] - med["hook+fence"][p] for p in parts})
        )
    for label, row in rows:
        sign = "+" if " - " in label else ""
        print(f"{label:<18}" + "".join(f"{row[p]:>{sign}10.1f}" for p in parts))
    for k in [k for k in args.by_neighbour.split(",") if k]:
        print(f"{k}, by the kind before it in the round (medians, us; n rounds)")
        print(f"  {'after':<16}" + "".join(f"{p:>10}" for p in parts) + "       n")
        for prev in sorted(set(before[k])):
            picked = [i for i, b in enumerate(before[k]) if b == prev]
            cells = "".join(
                f"{statistics.median(got[k][p][i] for i in picked) * 1e6:>10.1f}" for p in parts
            )
            print(f"  {prev:<16}{cells}{len(picked):>8}")
    for name, fns in traced.items():
        print(f"traced, {name} (median us per call, timer included; nested calls overlap)")
        for fn, times in fns.items():
            print(f"  {fn:<58}{statistics.median(times):>9.1f}  ({len(times)} rounds)")


if __name__ == "__main__":
    main()
