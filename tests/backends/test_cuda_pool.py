"""The cuda-pool backend's own rules (the conformance suite covers the rest).

CPU: the size limit's setting. ``gpu``: both sides refuse allocations above the limit, where
importing crashes the importer inside the driver (a spawn child importing one such
allocation dies with a segmentation fault; the probe that found it is in git history).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import sharedarrays as sa
from sharedarrays.backends.cuda import pool as cuda_pool

TESTS = Path(__file__).parents[1]


def test_limit_defaults_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHAREDARRAYS_POOL_MAX_BYTES", raising=False)
    assert cuda_pool.max_bytes() == cuda_pool.MAX_BYTES == 4 << 30
    monkeypatch.setenv("SHAREDARRAYS_POOL_MAX_BYTES", "1048576")
    assert cuda_pool.max_bytes() == 1 << 20
    assert cuda_pool._too_large(1 << 20) is None
    assert "cuda-vmm" in (cuda_pool._too_large((1 << 20) + 512) or "")
    monkeypatch.setenv("SHAREDARRAYS_POOL_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match=r"SHAREDARRAYS_POOL_MAX_BYTES=.lots. is not an integer"):
        cuda_pool.max_bytes()


def _pool_usable() -> None:
    why = sa.list_backends()["cuda-pool"]
    if why is not None:
        pytest.skip(f"cuda-pool: {why}")


@pytest.mark.gpu
def test_exporter_refuses_an_allocation_above_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    _pool_usable()
    monkeypatch.setenv("SHAREDARRAYS_POOL_MAX_BYTES", str(1 << 20))
    with pytest.raises(ValueError, match=r"larger than 1048576.*cuda-vmm"):
        sa.empty(1 << 19, "float32", device="cuda:0", backend="cuda-pool", pack=False)
    small = sa.empty(1 << 10, "float32", device="cuda:0", backend="cuda-pool", pack=False)
    assert small.allocation.size <= 1 << 20


@pytest.mark.gpu
def test_importer_refuses_an_allocation_above_its_limit(tmp_path: Path) -> None:
    _pool_usable()
    a = sa.zeros(1 << 20, "float32", device="cuda:0", backend="cuda-pool", pack=False)  # 4 MiB
    blob = tmp_path / "a.pickle"
    blob.write_bytes(pickle.dumps(a))
    code = (
        "import pickle, sharedarrays as sa\n"
        "try:\n"
        f"    pickle.loads(open({str(blob)!r}, 'rb').read())\n"
        "except sa.PayloadError as e:\n"
        "    print('refused:', e)\n"
    )
    env = {"SHAREDARRAYS_POOL_MAX_BYTES": str(1 << 20)}

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env}, cwd=TESTS,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "refused: refusing to import" in out.stdout
