"""What the conformance suite's spawned processes run (importable by name; importing it
registers the ``host-pointer`` test backend, so children can load its arrays)."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import time
from typing import Any

import numpy as np
import pointer_backend  # noqa: F401 - registers host-pointer in this process too


def to_host(native: Any) -> np.ndarray[Any, Any]:
    get = getattr(native, "get", None)
    return np.asarray(get() if callable(get) and not isinstance(native, np.ndarray) else native)


def double_row(args: tuple[Any, int]) -> float:
    a, i = args
    row = a.array[i]
    row *= 2
    return float(to_host(row).astype(np.float64).sum())


def checksum(a: Any) -> float:
    return float(a.get().astype(np.float64).sum())


def checksums(arrays: list[Any]) -> tuple[float, int]:
    """Sums of many arrays in one task, and how many allocations they came in."""
    ids = {a.allocation.id for a in arrays}
    return float(sum(a.get().astype(np.float64).sum() for a in arrays)), len(ids)


def hold_then_read(blob: bytes, ready: Any, go: Any, result: Any) -> None:
    """Load an array, say so, wait, then read it (its exporter released it meanwhile)."""
    a = pickle.loads(blob)
    ready.set()
    go.wait(60)
    result.put(float(a.get().astype(np.float64).sum()))
    a.close()
    del a
    gc.collect()
    import sharedarrays.memory.registry as sa_registry

    sa_registry.drop_parked()
    time.sleep(0.5)  # the close notice is sent off-thread


def exporter_main(path: str, device: str, backend: str, go: str) -> None:
    """Run as a script: make an array, write its pickle to ``path``, wait for ``go`` to
    exist, then exit with the array still alive (interpreter exit frees it)."""
    import sharedarrays as sa

    a = sa.from_array(np.arange(4096, dtype=np.float32), device=device, backend=backend)
    with open(path + ".tmp", "wb") as f:
        pickle.dump(a, f)
    os.replace(path + ".tmp", path)
    while not os.path.exists(go):
        time.sleep(0.02)
    print("exporter exiting", flush=True)


def start_exporter(
    path: Any, device: str, backend: str, go: Any, exit_wait: float
) -> tuple[subprocess.Popen[str], Any]:
    """Run :func:`exporter_main` in a fresh interpreter (``SHAREDARRAYS_EXIT_WAIT`` =
    ``exit_wait``) and load the array it writes to ``path``. Returns the process and the
    array; the exporter exits once ``go`` exists."""
    here = os.path.dirname(os.path.abspath(__file__))
    exporter = subprocess.Popen(
        [sys.executable, os.path.join(here, "conformance_workers.py"), str(path), device,
         backend, str(go)],
        cwd=here, env=dict(os.environ, SHAREDARRAYS_EXIT_WAIT=str(exit_wait)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        with open(path, "rb") as f:
            return exporter, pickle.load(f)
    except BaseException:
        exporter.kill()
        exporter.communicate()
        raise


if __name__ == "__main__":
    exporter_main(*sys.argv[1:5])
