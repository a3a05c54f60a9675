"""``import sharedarrays``: what it loads, and the public names it offers.

The package imports the arrays and what they stand on; the names that live in heavier
modules (pools, the memory map, Dask, the node map, timelines) come on first use
(``sharedarrays.__getattr__``). Each check runs a fresh interpreter: this one has imported
everything already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import sharedarrays as sa
from sharedarrays import errors

# modules (and their submodules) that ``import sharedarrays`` must not load; ``*``: any name
# that starts so (``sharedarrays.api.pool*``: ``pool`` and ``poolqueues``)
NOT_AT_IMPORT = (
    "sharedarrays.api.widgets*",
    "sharedarrays.api.pool*",
    "sharedarrays.api.dask*",
    "sharedarrays.bench*",
    "sharedarrays.backends.cuda.device",  # the accelerators: registered when first asked for
    "sharedarrays.backends.cuda.sync",
    "sharedarrays.backends.hip*",
    "sharedarrays.backends.ascend*",
    "dask",
    "distributed",
    "matplotlib",
    "ipywidgets",
    "cupy",
    "torch",
    "concurrent.futures",  # (it loads logging: some 10 ms; the node map's asking needs it)
    "logging",
)


def _fresh(code: str) -> object:
    """Run ``code`` in a new interpreter; what it prints is JSON."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loads(module: str, pattern: str) -> bool:
    if pattern.endswith("*"):
        return module.startswith(pattern[:-1])
    return module == pattern or module.startswith(pattern + ".")


def test_import_loads_no_heavy_module() -> None:
    loaded = _fresh("import sys, json, sharedarrays; print(json.dumps(sorted(sys.modules)))")
    assert isinstance(loaded, list)
    found = [m for m in loaded for pattern in NOT_AT_IMPORT if _loads(m, pattern)]
    assert found == [], f"import sharedarrays loaded {found}"


def test_lazy_names_load_their_module_on_first_use() -> None:
    code = (
        "import sys, json, sharedarrays as sa\n"
        "before = 'sharedarrays.api.pool' in sys.modules\n"
        "pool = sa.Pool\n"
        "print(json.dumps([before, 'sharedarrays.api.pool' in sys.modules,\n"
        "                  pool.__module__, 'Pool' in vars(sa)]))\n"
    )
    assert _fresh(code) == [False, True, "sharedarrays.api.pool", True]


def test_accelerator_backends_register_when_first_asked_for() -> None:
    code = (
        "import sys, json, sharedarrays as sa\n"
        "from sharedarrays.backends import registry\n"
        "before = [m in sys.modules for m in registry.ACCELERATORS]\n"
        "reg = registry.registration('hip-pool')\n"  # (a name not registered yet)
        "after = [m in sys.modules for m in registry.ACCELERATORS]\n"
        "print(json.dumps([before, after, reg.kind, registry.names(), sa.no_sync.__name__]))\n"
    )
    before, after, kind, names, no_sync = _fresh(code)  # type: ignore[misc]
    assert not any(before) and all(after) and kind == "hip" and no_sync == "no_sync"
    assert names == ["host", "cuda-vmm", "cuda-ipc", "cuda-pool", "hip-vmm", "hip-pool", "ascend"]


def test_all_is_small_and_every_name_resolves() -> None:
    assert len(sa.__all__) <= 35
    assert len(set(sa.__all__)) == len(sa.__all__)
    for name in sa.__all__:
        assert getattr(sa, name) is not None, name
    assert set(sa.__all__) <= set(dir(sa))


def test_star_import_gives_all() -> None:
    namespace: dict[str, object] = {}
    exec("from sharedarrays import *", namespace)
    assert set(sa.__all__) <= set(namespace)
    assert namespace["Pool"] is sa.Pool and namespace["show"] is sa.show


def test_internals_are_not_public_but_stay_importable() -> None:
    from sharedarrays.memory import Allocation, live_allocations

    assert "Allocation" not in sa.__all__ and "live_allocations" not in sa.__all__
    assert sa.Allocation is Allocation and sa.live_allocations is live_allocations


def test_every_error_is_an_attribute_of_the_package() -> None:
    from sharedarrays.api.pool import ExecutorBroken, ForkAfterCudaError

    names = [*errors.__all__, "DriverError"]
    for name in names:
        assert getattr(sa, name) is getattr(errors, name), name
    assert sa.ExecutorBroken is ExecutorBroken and sa.ForkAfterCudaError is ForkAfterCudaError
    assert issubclass(sa.ExecutorBroken, sa.SharedArrayError)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        sa.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(sa, "no_such_name")
