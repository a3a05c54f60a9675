"""GPU memory cross-check: what the driver (NVML) reports per process against what
sharedarrays holds there in the node-wide map (:mod:`sharedarrays.api.nodemap`).

Needs ``nvidia-ml-py`` (the ``nvml`` extra). The driver's figure is a process's whole CUDA
context (its pools too); the rest beyond sharedarrays' is not sharedarrays' to answer for.
Devices match by index: set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and no
``CUDA_VISIBLE_DEVICES``) so that CUDA counts GPUs in NVML's order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sharedarrays.api.nodemap import NodeMap
from sharedarrays.api.widgets.model import fmt_bytes
from sharedarrays.backends.device import parse_name

__all__ = ["ProcessGpuMemory", "available", "driver_usage", "cross_check", "render_text"]


@dataclass(frozen=True)
class ProcessGpuMemory:
    """One process on one GPU (``"cuda:N"``, NVML's index N): the bytes the driver says it
    uses there (``None``: NVML does not say) and those of sharedarrays allocations it maps."""

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
        return asdict(self)


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


def driver_usage() -> dict[tuple[int, str], int | None]:
    """Per (pid, ``"cuda:N"``), the bytes the driver reports (empty where NVML cannot be
    asked)."""
    try:
        import pynvml as nv

        nv.nvmlInit()
    except Exception:
        return {}
    usage: dict[tuple[int, str], int | None] = {}
    try:
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory
                ok = isinstance(used, int) and used >= 0
                usage[(int(proc.pid), f"cuda:{index}")] = int(used) if ok else None
    finally:
        nv.nvmlShutdown()
    return usage


def cross_check(node: NodeMap) -> list[ProcessGpuMemory]:
    """Each process NVML or the map knows on each GPU: driver bytes against sharedarrays'
    (empty where NVML cannot be asked)."""
    driver = driver_usage()
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
        driver = "?" if c.driver is None else fmt_bytes(c.driver)
        other = "?" if c.other is None else fmt_bytes(max(c.other, 0))
        lines.append(
            f"{c.pid:>8}  {c.device:<7} {driver:>10} {fmt_bytes(c.sharedarrays):>13} {other:>10}"
        )
    return "GPU memory by process (driver vs sharedarrays)\n" + "\n".join(lines)
