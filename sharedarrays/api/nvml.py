"""GPU memory cross-check: what the driver reports per process (NVML) against what
sharedarrays accounts for in the node-wide map (:mod:`sharedarrays.api.nodemap`).

Needs ``nvidia-ml-py`` (``import pynvml``; the ``nvml`` extra). Where it is missing, or no
NVIDIA driver answers, :func:`cross_check` returns nothing and :func:`available` says why.

What NVML calls a process's used GPU memory is every allocation of its CUDA context (its
own ``cudaMalloc``, CuPy's pool, torch's caching allocator, the context itself), so a
process's driver figure minus what sharedarrays holds there is the memory sharedarrays is
not answerable for. Devices are matched by index: NVML counts GPUs in PCI bus order, CUDA
in the order ``CUDA_DEVICE_ORDER`` and ``CUDA_VISIBLE_DEVICES`` give, so set
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and no ``CUDA_VISIBLE_DEVICES``) for the two to agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sharedarrays.api.nodemap import NodeMap
from sharedarrays.api.widgets.model import fmt_bytes
from sharedarrays.backends.device import parse_name

__all__ = ["ProcessGpuMemory", "available", "driver_usage", "cross_check", "render_text"]


@dataclass(frozen=True)
class ProcessGpuMemory:
    """One process on one GPU.

    Attributes
    ----------
    pid : int
        The process.
    device : str
        ``"cuda:N"`` (NVML's index N).
    driver : int or None
        Bytes the driver says the process uses there (``None``: NVML does not say).
    sharedarrays : int
        Bytes of sharedarrays allocations on that device the process maps (made or
        imported).
    """

    pid: int
    device: str
    driver: int | None
    sharedarrays: int

    @property
    def other(self) -> int | None:
        """Bytes the driver reports beyond sharedarrays' (``None`` where it reports none)."""
        return None if self.driver is None else self.driver - self.sharedarrays

    def to_doc(self) -> dict[str, Any]:
        """The row as a JSON object."""
        return {
            "pid": self.pid,
            "device": self.device,
            "driver": self.driver,
            "sharedarrays": self.sharedarrays,
        }


def _pynvml() -> Any:
    import pynvml

    return pynvml


def available() -> str | None:
    """``None`` when NVML can be asked, else why not."""
    try:
        nv = _pynvml()
    except ImportError:
        return "nvidia-ml-py is not installed (pip install 'sharedarrays[nvml]')"
    try:
        nv.nvmlInit()
    except Exception as e:  # pynvml.NVMLError: no driver, no library
        return f"NVML is not usable here: {e}"
    nv.nvmlShutdown()
    return None


def driver_usage() -> dict[tuple[int, str], int | None]:
    """Per (pid, ``"cuda:N"``), the bytes the driver reports (empty where NVML cannot be
    asked)."""
    try:
        nv = _pynvml()
        nv.nvmlInit()
    except Exception:
        return {}
    usage: dict[tuple[int, str], int | None] = {}
    try:
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory
                usage[(int(proc.pid), f"cuda:{index}")] = (
                    int(used) if isinstance(used, int) and used >= 0 else None
                )
    finally:
        nv.nvmlShutdown()
    return usage


def cross_check(node: NodeMap) -> list[ProcessGpuMemory]:
    """Each process NVML or the map knows on each GPU: driver bytes against
    sharedarrays' (empty where NVML cannot be asked)."""
    driver = driver_usage()
    if not driver:
        return []
    mine: dict[tuple[int, str], int] = {}
    for row in node.allocations:
        if not parse_name(row.device).is_cuda:  # NVML knows NVIDIA's devices only
            continue
        for h in row.holders:
            if h.role in ("exporter", "importer"):
                key = (h.pid, row.device)
                mine[key] = mine.get(key, 0) + row.size
    keys = sorted(set(driver) | set(mine))
    return [
        ProcessGpuMemory(pid, dev, driver.get((pid, dev)), mine.get((pid, dev), 0))
        for pid, dev in keys
    ]


def render_text(checks: list[ProcessGpuMemory]) -> str:
    """The cross-check as a small table (or why there is none)."""
    if not checks:
        why = available()
        return f"GPU memory by process: {why or 'no process uses a GPU'}"
    lines = [f"{'PID':>8}  {'DEVICE':<7} {'DRIVER':>10} {'SHAREDARRAYS':>13} {'OTHER':>10}"]
    for c in checks:
        driver = "?" if c.driver is None else fmt_bytes(c.driver)
        other = "?" if c.other is None else fmt_bytes(max(c.other, 0))
        lines.append(
            f"{c.pid:>8}  {c.device:<7} {driver:>10} {fmt_bytes(c.sharedarrays):>13} {other:>10}"
        )
    return "GPU memory by process (driver vs sharedarrays)\n" + "\n".join(lines)
