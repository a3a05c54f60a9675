"""The node-wide memory map: what this user's processes and keeper hold (:func:`node_map`),
:func:`free` for what no view uses, and :func:`cross_check` against NVML's per-process figures
(devices match by index: set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` and no ``CUDA_VISIBLE_DEVICES``)."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sharedarrays.backends import device_of
from sharedarrays.backends.device import parse_name
from sharedarrays.errors import InUse, KeeperError, NameNotFound, SharedArrayError
from sharedarrays.memory.info import format_bytes
from sharedarrays.process import command_line, running
from sharedarrays.protocol.handles import HeldAllocation, Status
from sharedarrays.protocol.keeper import NOT_FOUND, OK, Unlink
from sharedarrays.settings import seconds
from sharedarrays.transport import keeper, server
from sharedarrays.transport import node as transport_node

__all__ = ["LEFT_ALONE", "MAX_TIMEOUT", "STATES", "Holder", "NodeAllocation", "NodeProcess"]
__all__ += ["DeviceSummary", "NodeMap", "node_map", "find", "free"]
__all__ += ["ProcessGpuMemory", "available", "cross_check", "render_text"]

STATES = ("live", "draining", "cached", "named", "parked", "orphaned")
"""An allocation's states, strongest first: a view uses it; exporter-owned memory its exporter
released while importers map it; kept by its exporter for its next array of that size; the
keeper holds it under a name, or for ``a.park()``; only a handle keeps it (parked, in flight)."""

MAX_TIMEOUT = 86_400.0  # the longest timeout of node_map (a day, as ``top --timeout``)
LEFT_ALONE = "left alone: payloads in flight"  # what free says when no one confirmed


@dataclass(frozen=True)
class Holder:
    """A process holding an allocation: ``command`` (``""``: unreadable), ``role``
    (``"exporter"``, ``"importer"``, ``"keeper"``), ``since`` when, the ``views`` using it
    (0 in the keeper; -1: not asked), and whether it keeps it ``parked`` (no view)."""

    pid: int
    command: str
    role: str
    since: float
    views: int
    parked: bool = False


@dataclass(frozen=True)
class NodeAllocation:
    """One allocation as the node sees it: keeper ``name``, bytes held (``size``) and not
    asked for (``lost``), exporter (pid 0: unknown), :class:`Holder` s, whether the keeper
    holds it (``kept``), payloads that may still load (``in_flight``), one of :data:`STATES`."""

    alloc_id: str
    name: str | None
    backend: str
    device: str
    size: int
    lost: int
    exporter_pid: int
    exporter_command: str
    exporter_alive: bool
    holders: tuple[Holder, ...]
    kept: bool
    in_flight: int
    state: str
    created: float
    age: float

    @property
    def importers(self) -> tuple[Holder, ...]:
        """The holders that imported it (not the exporter, not the keeper)."""
        return tuple(h for h in self.holders if h.role == "importer")

    def to_doc(self) -> dict[str, Any]:
        """The row as a JSON object (``top --json``)."""
        doc = asdict(self)
        exporter = {k: doc.pop(f"exporter_{k}") for k in ("pid", "command", "alive")}
        return {"id": doc.pop("alloc_id"), **doc, "exporter": exporter}


@dataclass(frozen=True)
class NodeProcess:
    """A process asked, its ``status``: ``"ok"``, ``"gone"``, ``"no answer"``, ``"refused"``."""

    pid: int
    command: str
    status: str
    allocations: int
    bytes: int


@dataclass(frozen=True)
class DeviceSummary:
    """What sharedarrays holds on one device: allocations, bytes, bytes lost to granularity."""

    device: str
    allocations: int
    bytes: int
    lost: int


@dataclass(frozen=True)
class NodeMap:
    """The node at one ``time``: allocations largest first, processes asked by pid, a summary
    per device, the keeper's status (as a process's, or ``"none"``: none runs)."""

    time: float
    allocations: tuple[NodeAllocation, ...]
    processes: tuple[NodeProcess, ...]
    devices: tuple[DeviceSummary, ...]
    keeper: str

    def to_doc(self) -> dict[str, Any]:
        """The map as a JSON object (``top --json``)."""
        return {**asdict(self), "allocations": [a.to_doc() for a in self.allocations]}


_Held = list[tuple[int, str, HeldAllocation]]  # (pid, command, what it said) per reporter


def node_map(timeout: float = transport_node.ASK_TIMEOUT) -> NodeMap:
    """Ask this user's processes and keeper what they hold, and join it; one that does not
    answer in ``timeout`` seconds (above 0, at most :data:`MAX_TIMEOUT`) is ``"no answer"``."""
    timeout = seconds(timeout, "timeout", 0.0, MAX_TIMEOUT, above=True)
    now = time.time()
    answers = transport_node.ask_all(timeout)
    own = server.snapshot()
    reports = [(a.pid, a.snapshot) for a in answers if a.snapshot is not None]
    if own.allocations:
        reports.append((own.pid, own))
    held: dict[str, _Held] = {}
    unanswered = [a for a in answers if a.snapshot is None]
    processes = [NodeProcess(a.pid, command_line(a.pid), a.status, 0, 0) for a in unanswered]
    for pid, snap in reports:
        for row in snap.allocations:
            held.setdefault(row.alloc_id, []).append((pid, snap.command, row))
        size = sum(r.size for r in snap.allocations if not r.draining)
        processes.append(NodeProcess(pid, snap.command, "ok", len(snap.allocations), size))
    kept = transport_node.ask_keeper(timeout)
    docs = {doc["id"]: doc for doc in kept.arrays if type(doc.get("id")) is str}
    if kept.pid is not None:
        size = sum(int(d.get("size") or 0) for d in kept.arrays)
        command = command_line(kept.pid)
        processes.append(NodeProcess(kept.pid, command, kept.status, len(kept.arrays), size))
    commands = {pid: snap.command for pid, snap in reports}
    rows = [
        _join(i, held.get(i, []), docs.get(i), kept.pid or 0, commands, now) for i in {*held, *docs}
    ]
    rows.sort(key=lambda r: (-r.size, r.alloc_id))
    totals: dict[str, list[int]] = {}
    for r in rows:
        t = totals.setdefault(r.device, [0, 0, 0])
        t[0], t[1], t[2] = t[0] + 1, t[1] + r.size, t[2] + r.lost
    devices = tuple(DeviceSummary(d, *t) for d, t in sorted(totals.items()))
    procs = tuple(sorted(processes, key=lambda p: p.pid))
    return NodeMap(now, tuple(rows), procs, devices, kept.status)


def _join(
    alloc_id: str,
    held: _Held,
    doc: dict[str, Any] | None,
    keeper_pid: int,
    commands: dict[int, str],
    now: float,
) -> NodeAllocation:
    """One allocation's row from what its holders and the keeper (``doc``) said."""
    kept = doc or {}
    exporter_pid, exporter = next(((p, r) for p, _, r in held if r.created_here), (0, None))
    row = exporter or (held[0][2] if held else None)
    holders = [
        Holder(pid, cmd, "exporter" if r.created_here else "importer", r.since, r.views, r.parked)
        for pid, cmd, r in held
    ]

    def add_importer(pid: object, since: float) -> None:  # (one no report names)
        if type(pid) is int and pid not in {h.pid for h in holders} and running(pid):
            holders.append(Holder(pid, command_line(pid), "importer", since, -1))

    if exporter is not None and exporter.draining:
        for pid, when in exporter.served:
            add_importer(pid, when)
    if doc is not None:
        since = _time(doc.get("created"), now)
        holders.append(Holder(keeper_pid, command_line(keeper_pid), "keeper", since, 0))
        for pid in doc.get("pids") or ():
            add_importer(pid, since)
    if row is not None:
        backend, device, size = row.backend, row.device, row.size
    else:
        backend, device, size = str(kept.get("backend") or "?"), "?", int(kept.get("size") or 0)
        if type(kept.get("device")) is int:
            with contextlib.suppress(SharedArrayError):
                device = str(device_of(backend, kept["device"]))
    if exporter is not None:
        lost, created = exporter.size - exporter.used, exporter.since
    else:
        # (a named array's shape, or the bytes its exporter asked for before it handed the
        # payloads in flight over)
        try:
            wanted = int(np.prod(kept["shape"], dtype=np.int64)) * np.dtype(kept["dtype"]).itemsize
        except (KeyError, TypeError, ValueError):
            wanted = 0
        wanted = wanted or kept.get("used")
        lost = max(0, size - wanted) if type(wanted) is int else 0
        created = _time(kept.get("created"), min(h.since for h in holders))
        creator = kept.get("creator")
        exporter_pid = creator if type(creator) is int else (row.origin_pid if row else 0)
    in_flight = sum(r.in_flight for _, _, r in held) + int(kept.get("in_flight") or 0)
    name = kept.get("name")
    alive = exporter is not None or running(exporter_pid)
    command = commands.get(exporter_pid, "") or (command_line(exporter_pid) if alive else "")
    return NodeAllocation(
        alloc_id,
        name if type(name) is str else None,
        backend,
        device,
        size,
        lost,
        exporter_pid,
        command,
        alive,
        tuple(holders),
        doc is not None,
        in_flight,
        _state(held, kept, holders),
        created,
        max(0.0, now - created),
    )


def _time(value: object, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) else default


def _state(held: _Held, kept: dict[str, Any], holders: list[Holder]) -> str:
    """The strongest of :data:`STATES` that holds."""
    if any(h.views > 0 for h in holders):
        return "live"
    if any(row.draining for _, _, row in held):
        return "draining"
    if any(row.cached for _, _, row in held):
        return "cached"
    if kept.get("linked") is True:
        if type(kept.get("name")) is str:
            return "named"
        if not kept.get("in_flight"):
            return "parked"
    return "orphaned"


def find(node: NodeMap, target: str) -> NodeAllocation:
    """The allocation ``target`` names: its name, its id, or a prefix of its id that only it
    has (at least 4 hex digits); NameNotFound where none or several match."""
    for row in node.allocations:
        if target in (row.name, row.alloc_id):
            return row
    matches = [r for r in node.allocations if len(target) >= 4 and r.alloc_id.startswith(target)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise NameNotFound(
            f"{target!r} is the start of {len(matches)} allocation ids; give more of the id"
        )
    raise NameNotFound(
        f"no allocation of this user is named {target!r} or has an id starting so; "
        "python -m sharedarrays top --once lists them"
    )


def free(row: NodeAllocation, confirm: Callable[[str], bool] | None = None) -> list[str]:
    """Release what keeps ``row``'s memory though no view uses it; what was done, in words.

    The keeper lets go (of a name: ``sa.unlink``), parked importers drop their mappings;
    payloads in flight are dropped only if ``confirm(question)`` says yes; a draining exporter
    frees it once its importers are gone. InUse where a view or a running importer of
    draining memory uses it; KeeperError where the keeper holds it but cannot be asked.
    """
    if row.state == "live":
        users = ", ".join(str(h.pid) for h in row.holders if h.views > 0)
        raise InUse(
            f"allocation {row.alloc_id} is in use by views in pid {users}; it cannot be freed "
            "from outside those processes. Close the views there (or end those processes)"
        )
    if row.state == "draining":
        return _drain(row)
    done: list[str] = []
    if row.kept and row.name is not None:
        status, body, fds = keeper.request(Unlink(name=row.name), start=False)
        for fd in fds:
            os.close(fd)
        keeper.raise_for(status, body, f"cannot unlink {row.name!r}")
        done.append(f"unlinked the name {row.name!r}")
    elif row.kept:
        question = (
            f"{row.in_flight} payload(s) of allocation {row.alloc_id} are in flight and "
            "will no longer load. Free it anyway?"
        )
        if row.in_flight and not (confirm is not None and confirm(question)):
            return [LEFT_ALONE]
        status, error = transport_node.drop_kept(row.alloc_id)
        if status == OK:
            done.append("the keeper let go of its handles")
        elif status != NOT_FOUND:
            raise KeeperError(keeper.refusal("the keeper refused", error))
    for h in row.importers:
        if h.parked and transport_node.drop_mapping(h.pid, row.alloc_id) is Status.OK:
            done.append(f"pid {h.pid} dropped its parked mapping")
    attached = [str(h.pid) for h in row.importers if not h.parked and h.views < 0]
    if attached:
        done.append(f"pid {', '.join(attached)} attached it: the memory returns when they close it")
    if os.getpid() in {h.pid for h in row.holders if h.parked}:
        from sharedarrays.memory import registry

        alloc = registry.lookup(row.alloc_id)
        if alloc is not None and alloc.release():
            done.append("this process dropped its parked mapping")
    return done


def _drain(row: NodeAllocation) -> list[str]:
    """Have the exporter free a draining allocation once no importer maps it."""
    users = sorted({h.pid for h in row.importers if running(h.pid)})
    exporter = f"the exporter (pid {row.exporter_pid})"
    if users:
        pids = ", ".join(str(pid) for pid in users)
        raise InUse(
            f"allocation {row.alloc_id} is {row.backend} memory that its exporter (pid "
            f"{row.exporter_pid}) released but pid {pids} still map{'s' if len(users) == 1 else ''}"
            "; CUDA memory its exporter frees under an importer is undefined behaviour there, so "
            "it cannot be freed from outside. Close it in those processes (close the arrays, or "
            "let them exit): the exporter then frees it"
        )
    answer = transport_node.drop_mapping(row.exporter_pid, row.alloc_id)
    if answer is Status.NOT_ALLOWED:
        raise InUse(
            f"allocation {row.alloc_id}: its exporter (pid {row.exporter_pid}) still waits for "
            "a process that maps it or a payload of it in flight; close it there (or end that "
            "process)"
        )
    if answer is Status.OK or answer is Status.GONE:
        already = " already" if answer is Status.GONE else ""
        return [f"its importers are gone: {exporter} freed it{already}"]
    return [f"its importers are gone; {exporter} frees it by itself within seconds"]


@dataclass(frozen=True)
class ProcessGpuMemory:
    """One process on ``"cuda:N"`` (NVML's N): the driver's bytes and sharedarrays'."""

    pid: int
    device: str
    driver: int | None
    sharedarrays: int


def available() -> str | None:
    """``None`` when NVML can be asked, else why not."""
    try:
        import pynvml as nv
    except ImportError:
        return "nvidia-ml-py is not installed (pip install 'sharedarrays[nvml]')"
    try:
        nv.nvmlInit()
    except Exception as e:  # pynvml.NVMLError: no driver, no library
        return f"NVML is not usable here: {e}"
    nv.nvmlShutdown()
    return None


def cross_check(node: NodeMap) -> list[ProcessGpuMemory]:
    """Driver bytes against sharedarrays' per process and GPU (empty without NVML)."""
    try:
        import pynvml as nv

        nv.nvmlInit()
    except Exception:
        return []
    driver: dict[tuple[int, str], int | None] = {}  # (pid, "cuda:N"): bytes, None unknown
    try:
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory
                ok = isinstance(used, int) and used >= 0
                driver[(int(proc.pid), f"cuda:{index}")] = int(used) if ok else None
    finally:
        nv.nvmlShutdown()
    if not driver:
        return []
    mine: dict[tuple[int, str], int] = {}
    for row in node.allocations:
        if parse_name(row.device).is_cuda:  # NVML knows NVIDIA's devices only
            for h in row.holders:
                if h.role in ("exporter", "importer"):
                    mine[(h.pid, row.device)] = mine.get((h.pid, row.device), 0) + row.size
    return [
        ProcessGpuMemory(pid, dev, driver.get((pid, dev)), mine.get((pid, dev), 0))
        for pid, dev in sorted(set(driver) | set(mine))
    ]


def render_text(checks: list[ProcessGpuMemory]) -> str:
    """The cross-check as a small table (or why there is none)."""
    if not checks:
        return f"GPU memory by process: {available() or 'no process uses a GPU'}"
    lines = [f"{'PID':>8}  {'DEVICE':<7} {'DRIVER':>10} {'SHAREDARRAYS':>13} {'OTHER':>10}"]
    for c in checks:
        driver = "?" if c.driver is None else format_bytes(c.driver)
        mine = format_bytes(c.sharedarrays)
        other = "?" if c.driver is None else format_bytes(max(c.driver - c.sharedarrays, 0))
        lines.append(f"{c.pid:>8}  {c.device:<7} {driver:>10} {mine:>13} {other:>10}")
    return "GPU memory by process (driver vs sharedarrays)\n" + "\n".join(lines)
