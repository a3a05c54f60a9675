"""Ray on one node: ray.put and task arguments carry the payload (the same memory)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import sharedarrays as sa

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'sharedarrays[ray]'")

import dask_workers as w  # noqa: E402  (tests/: importable in the workers too)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ray_node() -> Iterator[None]:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_put_and_task_carry_the_payload(ray_node: None) -> None:
    a = sa.from_array(np.arange(1 << 16, dtype=np.float64), device="cpu")  # 512 KiB
    ref = ray.put(a)
    got = ray.get(ref)
    assert isinstance(got, sa.SharedDeviceArray) and got.allocation is a.allocation
    task = ray.remote(w.ray_task)
    alloc, total = ray.get(task.remote(ref))  # a worker process maps the same memory
    assert alloc == a.allocation.id
    assert a[0] == 5  # its write, seen here
    assert total == float(a.get().sum())
    alloc, _ = ray.get(task.remote(a[10:]))  # a view as a task argument
    assert alloc == a.allocation.id and a[10] == 5
    got.close()
    a.close()
