"""Real libraries take a shared array where they take the array it wraps (issue 47): each test
names the line of the user guide's table it backs (docs/user-guide.md, "Other libraries").

Host tests skip where their library is missing (``pip install 'sharedarrays[test]'`` has them
all); the ``gpu`` tests at the end run on a CUDA machine (scripts/gpu_check.sh)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Any

import client_workers as cw
import numpy as np
import pytest

import sharedarrays as sa

pytestmark = pytest.mark.timeout(180)  # (some start processes: joblib's, torch's, scripts)

INSTALL = "pip install 'sharedarrays[test]'"


def need(module: str) -> Any:
    """The module, or a skip that says how to install it."""
    return pytest.importorskip(module, reason=f"{module} is not installed: {INSTALL}")


def features(n: int = 40) -> tuple[sa.SharedDeviceArray, np.ndarray, np.ndarray]:
    """A shared array of features, the same values as NumPy's, and targets."""
    ref = np.random.default_rng(0).standard_normal((n, 3))
    return sa.from_array(ref, device="cpu"), ref, ref @ np.array([1.0, -2.0, 0.5])


def run_script(source: str, **env: str) -> str:
    """Run ``source`` in a fresh interpreter (with ``env`` added); its stdout. It must exit
    0 and write nothing to stderr (nothing printed at exit either)."""
    import os

    r = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    return r.stdout


# scikit-learn -------------------------------------------------------------------------------


def test_sklearn_splits_and_cross_validates_a_shared_array() -> None:
    """Table: scikit-learn, as it is (its splits index with integer arrays: copies)."""
    need("sklearn")
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import cross_val_score, train_test_split

    a, ref, y = features()
    got = train_test_split(a, y, random_state=0)
    want = train_test_split(ref, y, random_state=0)
    for g, w in zip(got, want):
        assert type(g) is np.ndarray
        np.testing.assert_array_equal(g, w)
    np.testing.assert_allclose(
        cross_val_score(Ridge(), a, y, cv=3), cross_val_score(Ridge(), ref, y, cv=3)
    )


@pytest.mark.parametrize("n_jobs", [None, 2])
def test_sklearn_grid_search_fits_on_a_shared_array(n_jobs: int | None) -> None:
    """Table: scikit-learn, as it is; with ``n_jobs=2`` joblib's workers get it as a
    payload (the same memory)."""
    need("sklearn")
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import GridSearchCV

    a, ref, y = features()
    grid = {"alpha": [0.01, 1.0, 100.0]}
    got = GridSearchCV(Ridge(), grid, cv=3, n_jobs=n_jobs).fit(a, y)
    want = GridSearchCV(Ridge(), grid, cv=3).fit(ref, y)
    assert got.best_params_ == want.best_params_
    np.testing.assert_allclose(got.predict(a), want.predict(ref))


# xarray -------------------------------------------------------------------------------------


def test_xarray_selects_groups_and_drops_on_a_shared_array() -> None:
    """Table: xarray, as it is (it keeps the shared array as its duck array)."""
    xr = need("xarray")
    ref = np.array([[1.0, 2.0], [np.nan, 4.0], [5.0, 6.0], [7.0, 8.0]])
    a = sa.from_array(ref, device="cpu")
    coords = {"r": [10, 20, 30, 40], "g": ("r", [0, 1, 0, 1])}
    got = xr.DataArray(a, dims=("r", "c"), coords=coords)
    want = xr.DataArray(ref, dims=("r", "c"), coords=coords)
    assert got.data is a  # (no copy: xarray wraps it as it is)
    for select in (
        lambda d: d.isel(r=[0, 2]),
        lambda d: d.sel(r=[10, 30]),
        lambda d: d.sel(r=d.r > 15),
        lambda d: d.isel(r=np.array([True, False, True, True])),
        lambda d: d.groupby("g").mean(),
        lambda d: d.dropna("r"),
        lambda d: d.sum("c"),
    ):
        xr.testing.assert_identical(select(got), select(want))


# torch --------------------------------------------------------------------------------------


@pytest.mark.torch
def test_torch_default_collate_stacks_rows_of_a_shared_array() -> None:
    """Table: torch ``default_collate``, through the collate function sharedarrays
    registers (:mod:`sharedarrays.api.clients`)."""
    torch = need("torch")
    from torch.utils.data import default_collate

    ref = np.arange(12.0).reshape(4, 3)
    a = sa.from_array(ref, device="cpu")
    got = default_collate([a[0], a[2]])
    want = default_collate([ref[0], ref[2]])
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    nested = default_collate([(a[1], 1), (a[3], 0)])  # (a pair per item: the usual dataset)
    assert torch.equal(nested[0], default_collate([ref[1], ref[3]]))


@pytest.mark.torch
def test_torch_collate_registers_whichever_is_imported_first() -> None:
    """``import sharedarrays`` before torch, as isort orders them: registered once torch's
    collate module has run, by the one-shot finder, which then leaves ``sys.meta_path``."""
    need("torch")
    out = run_script(
        "import sys\n"
        "import numpy as np\n"
        "import sharedarrays as sa\n"
        "from sharedarrays.api.clients import _AfterImport\n"
        "assert any(isinstance(f, _AfterImport) for f in sys.meta_path)\n"
        "import inspect, torch\n"
        "from torch.utils.data import default_collate\n"
        "import torch.utils.data._utils.collate as c\n"
        "assert not any(isinstance(f, _AfterImport) for f in sys.meta_path)\n"
        "assert 'def collate' in inspect.getsource(c)  # (its own loader reads its source)\n"
        "a = sa.from_array(np.arange(6.0).reshape(3, 2), device='cpu')\n"
        "print(default_collate([a[0], a[2]]).tolist())\n"
    )
    assert out.strip() == "[[0.0, 1.0], [4.0, 5.0]]"


@pytest.mark.torch
@pytest.mark.parametrize("workers", [0, 2])
def test_torch_dataloader_batches_a_dataset_of_shared_rows(workers: int) -> None:
    """Table: torch ``DataLoader``; with workers, the Dataset goes to them as a payload."""
    torch = need("torch")
    from torch.utils.data import DataLoader

    ref = np.arange(24.0).reshape(8, 3)
    a = sa.from_array(ref, device="cpu")
    loader = DataLoader(cw.Rows(a), batch_size=3, num_workers=workers)
    batches = list(loader)
    assert [b.shape for b in batches] == [(3, 3), (3, 3), (2, 3)]
    assert torch.equal(torch.cat(batches), torch.from_numpy(ref))


@pytest.mark.torch
def test_torch_takes_a_host_shared_array_without_a_copy() -> None:
    """Table: ``torch.from_dlpack(a)`` and ``torch.as_tensor(a)``, the same memory."""
    torch = need("torch")
    a = sa.from_array(np.arange(6.0), device="cpu")
    for t in (torch.from_dlpack(a), torch.as_tensor(a)):
        assert t.data_ptr() == a.address
        t[0] = 7.0
        assert a[0] == 7.0


# the array API: array-api-compat, SciPy in array-API mode ---------------------------------


def test_array_api_compat_resolves_a_shared_array_as_an_ndarray() -> None:
    """Table: array-api-compat's ``array_namespace``, as it is."""
    compat = need("array_api_compat")
    a = sa.from_array(np.arange(3.0), device="cpu")
    x = np.zeros(3)
    assert compat.array_namespace(a, x) is compat.array_namespace(x) is compat.numpy
    assert compat.array_namespace(a) is compat.numpy
    assert compat.array_namespace(a, x, use_compat=False) is np
    assert a.__array_namespace__() is np  # (asked by anyone else: the native's own)


def test_scipy_in_array_api_mode_convolves_a_shared_array() -> None:
    """Table: SciPy with ``SCIPY_ARRAY_API=1`` (its vendored array-api-compat asks)."""
    need("scipy")
    assert run_script(cw.SCIPY_ARRAY_API, SCIPY_ARRAY_API="1").strip() == "ok"


def test_to_device_takes_the_arrays_own_device() -> None:
    """The array API's ``x.to_device(x.device)``, with a shared array's device object."""
    a = sa.from_array(np.arange(3.0), device="cpu")
    assert a.to_device(a.device) is a
    assert a.to_device("cpu") is a
    assert a[1:].to_device(a[1:].device).tolist() == [1.0, 2.0]


# what copies, and what takes np.asarray(a) --------------------------------------------------


def test_pandas_dataframe_copies_as_for_an_ndarray() -> None:
    """Table: pandas ``DataFrame(a)`` copies, as it copies an ndarray (pandas 3)."""
    pd = need("pandas")
    ref = np.arange(6.0).reshape(3, 2)
    a = sa.from_array(ref, device="cpu")
    df = pd.DataFrame(a)
    assert df.equals(pd.DataFrame(ref))
    assert not np.shares_memory(df.to_numpy(), a.array)
    assert not np.shares_memory(pd.DataFrame(ref).to_numpy(), ref)  # (the same for NumPy's)


def test_numba_takes_np_asarray_of_a_shared_array() -> None:
    """Table: numba ``@njit``, through ``np.asarray(a)`` (it types NumPy arrays only); the
    TypingError on the wrapper prints nothing at exit."""
    need("numba")
    assert run_script(cw.NUMBA).strip() == "ok"


# GPU (marker gpu: skipped without a usable CUDA device) ---------------------------------------


def cuda_rows(shape: tuple[int, ...] = (6, 4)) -> tuple[sa.SharedDeviceArray, np.ndarray]:
    ref = np.arange(int(np.prod(shape)), dtype="float32").reshape(shape)
    return sa.from_array(ref, device="cuda:0"), ref


@pytest.mark.gpu
def test_cupy_advanced_indexing_reads_copy_and_writes_in_place() -> None:
    """Table: CuPy's advanced indexing on a CUDA shared array."""
    import cupy

    a, ref = cuda_rows()
    for key in ([0, 2], np.array([1, 3]), ref[:, 0] > 5, (slice(None), [0])):
        got = a[key]
        assert type(got) is cupy.ndarray
        np.testing.assert_array_equal(got.get(), ref[key])
    got = a[cupy.array([1, 3])]  # (an index array on the device)
    np.testing.assert_array_equal(got.get(), ref[[1, 3]])
    mask = a.array > 10
    a[mask] = 0
    a[[0, 1]] += 100
    ref[ref > 10] = 0
    ref[[0, 1]] += 100
    np.testing.assert_array_equal(a.get(), ref)


@pytest.mark.gpu
def test_cupyx_scipy_filters_a_cuda_shared_array() -> None:
    """Table: ``cupyx.scipy`` takes a CUDA shared array through ``a.array`` (the native CuPy
    array over the shared memory, no copy: cupyx checks ``isinstance(x, cupy.ndarray)``)."""
    import cupy
    from cupyx.scipy import ndimage, signal

    a, ref = cuda_rows((16,))
    native = a.array
    assert (
        isinstance(native, cupy.ndarray)
        and native.data.ptr == a.__cuda_array_interface__["data"][0]
    )
    k = cupy.array([1.0, 2.0, 1.0], dtype="float32")
    # (convolve's default picks FFT, whose float32 round-off is about 1e-5 of the largest value)
    expected = np.convolve(ref, k.get())
    np.testing.assert_allclose(
        signal.convolve(native, k).get(), expected, atol=1e-5 * expected.max()
    )
    np.testing.assert_allclose(
        ndimage.uniform_filter(native, 3).get(),
        ndimage.uniform_filter(cupy.asarray(ref), 3).get(),
    )


@pytest.mark.gpu
def test_array_api_compat_resolves_a_cuda_shared_array_as_cupy() -> None:
    """Table: array-api-compat, a CUDA shared array with a CuPy array."""
    compat = need("array_api_compat")
    import cupy

    a, _ = cuda_rows()
    x = cupy.zeros(3)
    assert compat.array_namespace(a, x) is compat.array_namespace(x) is compat.cupy


@pytest.mark.gpu
@pytest.mark.torch
def test_torch_cuda_from_dlpack_is_the_same_memory() -> None:
    """Table: ``torch.from_dlpack(a)`` on CUDA, no copy: a write is seen both ways."""
    torch = need("torch")
    a, _ = cuda_rows()
    t = torch.from_dlpack(a)
    assert t.is_cuda and t.data_ptr() == a.address
    t[0, 0] = -1.0
    torch.cuda.synchronize()
    assert float(a[0, 0]) == -1.0
    a[1, 1] = -2.0
    a.synchronize()
    assert float(t[1, 1]) == -2.0


@pytest.mark.gpu
@pytest.mark.torch
def test_torch_dataloader_batches_a_cuda_shared_array_in_two_workers() -> None:
    """Table: torch ``DataLoader`` of a CUDA shared array (spawned workers get it as a
    payload and collate CUDA tensors through DLPack)."""
    torch = need("torch")
    from torch.utils.data import DataLoader

    a, ref = cuda_rows((8, 4))
    loader = DataLoader(
        cw.Rows(a),
        batch_size=3,
        num_workers=2,
        pin_memory=False,
        multiprocessing_context="spawn",  # (a CUDA parent's fork cannot use the device)
    )
    batches = [b.cpu() for b in loader]
    assert [tuple(b.shape) for b in batches] == [(3, 4), (3, 4), (2, 4)]
    assert torch.equal(torch.cat(batches), torch.from_numpy(ref))


NUMBA_KERNEL = r"""
import pickle, sys
from numba import cuda

@cuda.jit
def double(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] *= 2

try:  # (a numba-cuda built for another NumPy types no kernel at all: not ours to test)
    double[1, 1](cuda.to_device([1.0]))
except Exception as e:
    print("SKIP", repr(e)[:300]); sys.exit(0)
a = pickle.loads(sys.stdin.buffer.read())
seen = cuda.as_cuda_array(a)  # (through __cuda_array_interface__)
same = seen.device_ctypes_pointer.value == a.__cuda_array_interface__["data"][0]
double[1, 64](a)
cuda.synchronize()
print("SAME" if same else "COPY")
"""


@pytest.mark.gpu
def test_numba_cuda_kernel_writes_through_the_cuda_array_interface() -> None:
    """Table: numba.cuda kernels take a CUDA shared array as it is: a kernel in another
    process doubles a shared array in place (no copy: the same pointer), seen here.

    Run in a child, whose ``PYTHONPATH`` starts with ``$SA_NUMBA_SITE`` where set: the lent
    GPU machine's numba-cuda types no kernel with its NumPy 2.5, so scripts/gpu_check.sh
    installs a NumPy it supports there (.whl-numba/)."""
    need("numba")
    a, ref = cuda_rows((64,))
    a.synchronize()
    paths = [os.environ.get("SA_NUMBA_SITE", ""), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    child = subprocess.run(
        [sys.executable, "-c", NUMBA_KERNEL],
        input=pickle.dumps(a),
        capture_output=True,
        env=env,
        timeout=180,
        check=False,
    )
    out = child.stdout.decode()
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    if out.startswith("SKIP"):
        pytest.skip(f"numba.cuda cannot run a kernel on its own array here: {out[5:]}")
    assert out.split() == ["SAME"]
    np.testing.assert_array_equal(a.get(), ref * 2)


@pytest.mark.gpu
def test_jax_from_dlpack_reads_a_cuda_shared_array() -> None:
    """Table: ``jax.dlpack.from_dlpack(a)`` on CUDA."""
    need("jax")
    import jax.dlpack

    a, ref = cuda_rows()
    x = jax.dlpack.from_dlpack(a)
    np.testing.assert_array_equal(np.asarray(x), ref)
