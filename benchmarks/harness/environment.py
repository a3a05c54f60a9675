"""The machine a run measured on: date, host, GPU and package versions (for the JSON)."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import socket
import subprocess
import sys
from typing import Any

import numpy as np

from sharedarrays.backends.device import parse_name

__all__ = ["environment", "device_slug", "today", "utc_now"]


def utc_now() -> str:
    """Now, UTC, to the second (``2026-11-29T12:38:45Z``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def today() -> str:
    """Today's date, UTC (``2026-11-29``)."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpu_info(index: int) -> dict[str, Any]:
    info: dict[str, Any] = {}
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={index}",
                "--query-gpu=name,driver_version,memory.total",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout.strip()
        name, driver, memory = (s.strip() for s in out.split(",", 2))
        info.update(name=name, driver=driver, memory=memory, source="nvidia-smi")
    except Exception:
        try:
            from cuda.bindings import driver as cu

            cu.cuInit(0)
            _, dev = cu.cuDeviceGet(index)
            _, raw = cu.cuDeviceGetName(64, dev)
            _, version = cu.cuDriverGetVersion()
            info.update(
                name=raw.split(b"\0", 1)[0].decode(),
                driver_cuda_version=f"{version // 1000}.{version % 1000 // 10}",
                source="cuda.bindings",
            )
        except Exception as e:
            info["error"] = f"{type(e).__name__}: {e}"
    return info


def environment(is_cuda: bool, index: int) -> dict[str, Any]:
    """Date (UTC), machine, GPU (CUDA device ``index`` when ``is_cuda``) and package
    versions, for the JSON."""
    from sharedarrays import __version__

    meta: dict[str, Any] = {
        "date_utc": utc_now(),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "argv": sys.argv,
        "versions": {
            "sharedarrays": __version__,
            "numpy": np.__version__,
            "cupy": _version("cupy-cuda13x") or _version("cupy-cuda12x") or _version("cupy"),
            "torch": _version("torch"),
            "cuda-core": _version("cuda-core"),
            "cuda-bindings": _version("cuda-bindings"),
            "matplotlib": _version("matplotlib"),
        },
        "start_method": "spawn",
    }
    if is_cuda:
        meta["gpu"] = _gpu_info(index)
    return meta


def device_slug(device: str) -> str:
    """``"cpu"``, or the GPU's name as a file name part (``"nvidia-h200"``)."""
    if not parse_name(device).is_cuda:
        return "cpu"
    name = str(_gpu_info(int(device.split(":")[1])).get("name", "cuda"))
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "cuda"
