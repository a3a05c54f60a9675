"""joblib (loky): shared arrays go to the workers and back as payloads, never memmapped."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import sharedarrays as sa

joblib = pytest.importorskip("joblib", reason="pip install 'sharedarrays[test]' (joblib)")

import dask_workers as w  # noqa: E402  (tests/: importable in the workers too)
from joblib.externals.loky import get_reusable_executor  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _run(value: object, folder: Path) -> list[tuple]:
    # a fresh pool, whose memmapping folder is ``folder`` (loky reuses its workers and the
    # folder of the call that started them)
    get_reusable_executor().shutdown(wait=True)
    # max_nbytes=0: joblib would memmap every NumPy array argument into ``folder``
    with joblib.Parallel(
        n_jobs=2, backend="loky", max_nbytes=0, mmap_mode="r+", temp_folder=folder
    ) as par:
        return par(joblib.delayed(w.joblib_task)(value, i, str(folder)) for i in range(4))


def test_parallel_passes_and_returns_shared_arrays_without_copies(tmp_path: Path) -> None:
    a = sa.zeros(1 << 18, device="cpu")  # 2 MiB, above joblib's default memmapping size too
    results = _run(a, tmp_path)
    assert all(pid != os.getpid() for pid, *_ in results)
    assert {kind for _, kind, *_ in results} == {"SharedDeviceArray"}
    assert {alloc for _, _, alloc, *_ in results} == {a.allocation.id}
    assert [files for *_, files, _ in results] == [[]] * 4  # nothing memmapped
    assert a[:4].get().tolist() == [100.0, 101.0, 102.0, 103.0]  # the workers' writes
    for i, (*_, view) in enumerate(results):  # returned views: the same memory
        assert isinstance(view, sa.SharedDeviceArray) and view.allocation is a.allocation
        assert view.offset == i * 8
        view.close()
    a.close()


def test_a_numpy_array_is_memmapped_and_its_writes_are_lost(tmp_path: Path) -> None:
    """The control: the same tasks on a NumPy array see a memmap (the measure above sees
    one when there is one), and the parent sees none of their writes."""
    plain = np.zeros(1 << 18)
    results = _run(plain, tmp_path)
    assert {kind for _, kind, *_ in results} == {"memmap"}
    assert all(files for *_, files, _ in results)
    assert plain[:4].tolist() == [0.0] * 4
