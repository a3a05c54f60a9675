from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import NUMERIC_DTYPES
from keeper_helpers import private_keeper

import sharedarrays as sa
from sharedarrays.backends import kind_unusable

DTYPES = NUMERIC_DTYPES

__all__ = ["private_keeper"]  # a fixture, used by name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("order", ["C", "F"])
def test_every_dtype_and_order(dtype: str, order: str) -> None:
    ref = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    a = sa.empty((2, 3, 4), dtype, device="cpu", order=order)
    a[...] = ref
    assert a.dtype == np.dtype(dtype)
    assert a.shape == (2, 3, 4) and a.ndim == 3 and a.size == 24
    assert a.nbytes == 24 * np.dtype(dtype).itemsize
    assert a.array.flags.c_contiguous == (order == "C")
    assert a.array.flags.f_contiguous == (order == "F")
    assert a.strides == np.empty((2, 3, 4), dtype, order=order).strides
    np.testing.assert_array_equal(a.get(), ref)


def test_zeros_ones_full() -> None:
    np.testing.assert_array_equal(sa.zeros((3, 5), "int32", device="cpu").get(), 0)
    np.testing.assert_array_equal(sa.ones(7, "float32", device="cpu").get(), 1)
    f = sa.full((2, 2), 2.5, device="cpu")
    assert f.dtype == np.float64
    np.testing.assert_array_equal(f.get(), 2.5)
    g = sa.full(4, 3, "uint8", device="cpu")
    assert g.dtype == np.uint8 and g.get().tolist() == [3, 3, 3, 3]


def test_alignment_is_granularity_or_the_packing_alignment() -> None:
    a = sa.empty(3, "complex128", device="cpu", pack=False)
    assert a.address % a.allocation.backend.granularity == 0
    b = sa.empty(3, "complex128", device="cpu")
    assert b.address % 256 == 0


@pytest.mark.parametrize("shape", [0, (0,), (3, 0), (0, 5, 2), ()])
def test_zero_size_and_scalar_shapes(shape: object) -> None:
    a = sa.zeros(shape, device="cpu")  # type: ignore[arg-type]
    ref = np.zeros(shape)  # type: ignore[call-overload]
    assert a.shape == ref.shape and a.size == ref.size and a.nbytes == ref.nbytes
    assert a.get().shape == ref.shape
    assert a.allocation.size >= a.allocation.backend.granularity


def test_from_array_copies_numpy_and_keeps_layout() -> None:
    src = np.asfortranarray(np.random.default_rng(0).random((5, 7)))
    a = sa.from_array(src, device="cpu")
    src[0, 0] = -1  # a copy: the shared array does not change
    assert a.array[0, 0] != -1
    assert a.array.flags.f_contiguous
    np.testing.assert_array_equal(a.get()[1:], src[1:])


def test_from_array_accepts_lists_dlpack_and_array_protocol() -> None:
    assert sa.from_array([[1, 2], [3, 4]], device="cpu").get().tolist() == [[1, 2], [3, 4]]

    class Wrapped:
        def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
            return np.arange(4.0)

    assert sa.from_array(Wrapped(), device="cpu").get().tolist() == [0, 1, 2, 3]

    class OnlyDlpack:
        def __init__(self) -> None:
            self.x = np.arange(3, dtype=np.int16)

        def __dlpack__(self, **kw: object) -> object:
            return self.x.__dlpack__(**kw)

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.x.__dlpack_device__()

    b = sa.from_array(OnlyDlpack(), device="cpu")
    assert b.dtype == np.int16 and b.get().tolist() == [0, 1, 2]


def test_from_shared_array() -> None:
    a = sa.from_array(np.arange(6).reshape(2, 3), device="cpu", pack=False)
    b = sa.from_array(a[:, ::-1], pack=False)
    assert b.allocation is not a.allocation
    assert b.get().tolist() == [[2, 1, 0], [5, 4, 3]]


@pytest.mark.parametrize(
    ("shape", "error"),
    [
        (-1, ValueError),
        ((2, -3), ValueError),
        (2.5, TypeError),
        ("3", TypeError),
        ((True,), TypeError),
        ((1,) * 65, ValueError),
    ],
)
def test_bad_shapes(shape: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        sa.empty(shape, device="cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["object", "U4", "datetime64[s]", [("a", "i4")], "V8"])
def test_unsupported_dtypes_say_why(dtype: object) -> None:
    with pytest.raises(TypeError, match="cannot be shared"):
        sa.empty(3, dtype, device="cpu")  # type: ignore[arg-type]


def test_bad_order() -> None:
    with pytest.raises(ValueError, match="order"):
        sa.empty(3, device="cpu", order="K")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu:0", -1, 1.0, True])
def test_bad_device_names(device: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        sa.empty(3, device=device)  # type: ignore[arg-type]


@pytest.mark.skipif(kind_unusable("cuda", 0) is None, reason="a CUDA device is usable here")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0, "cuda:3"])
def test_cuda_without_cuda_raises_backend_unavailable(device: object) -> None:
    with pytest.raises(sa.BackendUnavailable, match="cannot use cuda") as info:
        sa.empty(3, device=device)  # type: ignore[arg-type]
    assert str(info.value).strip()


@pytest.mark.skipif(kind_unusable("cuda", 0) is None, reason="a CUDA device is usable here")
def test_default_device_is_cpu_without_cuda() -> None:
    a = sa.zeros(3)
    assert str(a.device) == "cpu" and a.backend == "host"


@pytest.mark.timeout(60)
def test_restricted_small_arrays_never_share_a_slab(private_keeper: Path) -> None:
    """A slab's neighbours share its secret and handles: whoever may import one packed array
    can map them all. So an array whose importers are restricted (allow_pids), read-only, or
    named gets an allocation of its own; ordinary small arrays still pack."""
    import os

    ordinary = [sa.zeros(8, device="cpu") for _ in range(2)]
    assert ordinary[0].allocation is ordinary[1].allocation  # packed together
    restricted = [
        sa.zeros(8, device="cpu", allow_pids=[os.getpid()]),
        sa.zeros(8, device="cpu", allow_pids=[]),
        sa.zeros(8, device="cpu", readonly=True),
        sa.zeros(8, device="cpu", name="small-named"),
        sa.from_array(np.arange(3), device="cpu", readonly=True),
    ]
    after = sa.zeros(8, device="cpu")
    assert after.allocation is ordinary[0].allocation  # the slab was not handed to them
    allocations = {id(a.allocation) for a in ordinary + restricted}
    assert len(allocations) == 1 + len(restricted)  # one slab, and one each
    for a in restricted:
        assert a.offset == 0 and a.allocation.size == a.allocation.backend.granularity
    sa.unlink("small-named")


@pytest.mark.parametrize("pids", [[0], [-5], [2**22 + 1], [2**31], [1, 2**64]])
def test_allow_pids_are_process_ids(pids: list[int], fd_baseline: None) -> None:
    with pytest.raises(ValueError, match="allow_pids are process ids"):
        sa.zeros(8, device="cpu", allow_pids=pids)


def test_a_capacity_beyond_what_a_payload_may_name_is_refused(fd_baseline: None) -> None:
    # (OutOfMemory, as the user guide says of a reservation larger than a process can have:
    # it was a plain ValueError, which except sa.OutOfMemory did not catch)
    for capacity in (2**47 + 1, 2**50):
        with pytest.raises(sa.OutOfMemory, match="at most 140737488355328 bytes"):
            sa.zeros(8, device="cpu", capacity=capacity)
