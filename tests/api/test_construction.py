"""Construction like NumPy's: the ``*_like`` functions, asarray, from_array's dtype and copy,
device arguments of other libraries, device equality, synchronize, and load's argument check.

CuPy inputs are gpu-marked (they skip without a CUDA device)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.backends.device import CPU, Device, parse_name

LIKE = [sa.empty_like, sa.zeros_like, sa.ones_like]


class _TorchDevice:
    """What a ``torch.device`` looks like to sharedarrays (torch is not installed here)."""

    def __init__(self, kind: str, index: int | None = None) -> None:
        self.type = kind
        self.index = index


_TorchDevice.__module__ = "torch"
_TorchDevice.__name__ = _TorchDevice.__qualname__ = "device"


class _CupyDevice:
    """What a ``cupy.cuda.Device`` looks like to sharedarrays."""

    def __init__(self, index: int) -> None:
        self.id = index


_CupyDevice.__module__ = "cupy.cuda.device"
_CupyDevice.__name__ = _CupyDevice.__qualname__ = "Device"


# *_like ---------------------------------------------------------------------------------
@pytest.mark.parametrize("like", LIKE)
@pytest.mark.parametrize("dtype", ["int8", "uint16", "float32", "complex128", "bool"])
def test_like_takes_shape_dtype_and_cpu_from_numpy(like: Any, dtype: str) -> None:
    x = np.arange(12).reshape(3, 4).astype(dtype)
    a = like(x)
    assert isinstance(a, sa.SharedDeviceArray)
    assert a.shape == (3, 4) and a.dtype == np.dtype(dtype) and a.device == "cpu"
    assert a.array.flags.c_contiguous
    assert a.address != x.ctypes.data


def test_zeros_ones_full_like_values() -> None:
    x = np.arange(6, dtype="int16").reshape(2, 3)
    np.testing.assert_array_equal(sa.zeros_like(x).get(), np.zeros_like(x))
    np.testing.assert_array_equal(sa.ones_like(x).get(), np.ones_like(x))
    f = sa.full_like(x, 2.7)  # NumPy's rule: x's dtype, the value cast to it
    assert f.dtype == np.int16
    np.testing.assert_array_equal(f.get(), np.full_like(x, 2.7))
    g = sa.full_like(x, 2.5, dtype="float32")
    assert g.dtype == np.float32 and g.get().tolist() == [[2.5] * 3] * 2


def test_zeros_and_ones_share_the_signature_of_empty_and_empty_like() -> None:
    assert inspect.signature(sa.zeros) == inspect.signature(sa.ones) == inspect.signature(sa.empty)
    like = inspect.signature(sa.empty_like)
    assert inspect.signature(sa.zeros_like) == inspect.signature(sa.ones_like) == like
    assert sa.zeros.__name__ == "zeros" and sa.ones_like.__qualname__ == "ones_like"
    for make in (sa.zeros, sa.ones):  # dtype=None is float64, as in NumPy
        a = make(3, None, device="cpu")  # type: ignore[arg-type]
        assert a.dtype == np.float64 and a.get().tolist() == make(3, device="cpu").get().tolist()


def test_like_keywords_override_the_source() -> None:
    x = np.zeros((3, 4), dtype="float64")
    a = sa.zeros_like(x, dtype="int32", shape=(5,), device="cpu", pack=False)
    assert a.shape == (5,) and a.dtype == np.int32 and a.get().tolist() == [0] * 5
    b = sa.ones_like(x, shape=7)
    assert b.shape == (7,) and b.dtype == np.float64


def test_like_keeps_a_fortran_layout_with_k_and_a() -> None:
    x = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    for order in ("K", "A", "F"):
        assert sa.empty_like(x, order=order).array.flags.f_contiguous
    assert sa.empty_like(x, order="C").array.flags.c_contiguous
    assert sa.empty_like(x, shape=(2, 2, 3)).array.flags.c_contiguous  # other ndim: C
    assert sa.empty_like(x, capacity=1 << 20).array.flags.c_contiguous  # growable: C
    with pytest.raises(ValueError, match="order must be"):
        sa.empty_like(x, order="X")


def test_like_from_a_shared_array_a_view_and_objects_with_array() -> None:
    base = sa.full((4, 6), 3.0, dtype="float32", device="cpu")
    a = sa.zeros_like(base[:, ::2])
    assert a.shape == (4, 3) and a.dtype == np.float32 and a.device == base.device
    assert a.address != base.address
    np.testing.assert_array_equal(a.get(), 0)
    assert base.get().sum() == 3.0 * 24  # the source is not touched

    class OnlyArray:
        def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
            return np.ones((2, 2), dtype="uint8")

    b = sa.full_like(OnlyArray(), 9)
    assert b.shape == (2, 2) and b.dtype == np.uint8 and b.get().tolist() == [[9, 9], [9, 9]]
    c = sa.zeros_like([[1, 2, 3]])
    assert c.shape == (1, 3) and c.dtype == np.array([1]).dtype


def test_like_refuses_what_cannot_be_shared() -> None:
    with pytest.raises(TypeError, match="not supported"):
        sa.zeros_like(np.array(["a", "b"]))


@pytest.mark.gpu
def test_like_cupy_array_takes_its_device() -> None:
    cupy = pytest.importorskip("cupy")
    x = cupy.arange(10, dtype="float32")
    a = sa.zeros_like(x)
    assert a.device == f"cuda:{x.device.id}" and a.shape == (10,) and a.dtype == np.float32
    assert int(cupy.asarray(a).sum()) == 0
    b = sa.full_like(x, 4, device="cpu")
    assert b.device == "cpu" and b.get().tolist() == [4.0] * 10


# asarray --------------------------------------------------------------------------------
def test_asarray_returns_the_same_shared_array_when_it_fits() -> None:
    a = sa.full(5, 1.5, device="cpu")
    assert sa.asarray(a) is a
    assert sa.asarray(a, dtype="float64", device="cpu") is a
    assert sa.asarray(a, device=Device("cpu")) is a
    assert sa.asarray(a, backend="host") is a
    v = a[1:3]
    assert sa.asarray(v) is v


def test_asarray_copies_otherwise() -> None:
    a = sa.full(5, 1.5, device="cpu")
    b = sa.asarray(a, dtype="float32")
    assert b is not a and b.dtype == np.float32 and b.device == "cpu"
    assert b.get().tolist() == [1.5] * 5
    x = np.arange(4)
    c = sa.asarray(x)
    assert isinstance(c, sa.SharedDeviceArray) and c.address != x.ctypes.data
    np.testing.assert_array_equal(c.get(), x)
    d = sa.asarray(a.array)  # a native array is copied, even over shared memory
    assert d is not a and d.address != a.address
    assert sa.asarray([1, 2], dtype="int8").get().tolist() == [1, 2]


# from_array -----------------------------------------------------------------------------
def test_from_array_dtype_converts_like_numpy() -> None:
    x = np.array([1.7, -2.2, 3.9])
    a = sa.from_array(x, dtype="int32", device="cpu")
    assert a.dtype == np.int32
    np.testing.assert_array_equal(a.get(), np.array(x, dtype="int32"))
    f = np.asfortranarray(np.arange(6.0).reshape(2, 3))
    b = sa.from_array(f, dtype="float32", device="cpu")
    assert b.dtype == np.float32 and b.array.flags.f_contiguous
    with pytest.raises(TypeError, match="not supported"):
        sa.from_array(x, dtype="datetime64[s]", device="cpu")


@pytest.mark.parametrize("copy", [None, True])
def test_from_array_copy_none_and_true_copy(copy: bool | None) -> None:
    x = np.arange(5.0)
    a = sa.from_array(x, copy=copy, device="cpu")
    assert a.address != x.ctypes.data
    x[0] = 99
    assert a.get()[0] == 0
    s = sa.zeros(3, device="cpu")
    assert sa.from_array(s, copy=copy, device="cpu") is not s


def test_from_array_copy_false_refuses_with_the_reason() -> None:
    with pytest.raises(ValueError, match="cannot become shared without a copy") as err:
        sa.from_array(np.arange(3), copy=False)
    assert "sa.share" in str(err.value) and "copy=None" in str(err.value)
    s = sa.zeros(3, device="cpu")
    assert sa.from_array(s, copy=False) is s  # already shared: nothing to copy
    with pytest.raises(ValueError, match="without a copy"):
        sa.from_array(s, copy=False, dtype="int8")
    with pytest.raises(TypeError, match="copy must be"):
        sa.from_array(s, copy="no")  # type: ignore[arg-type]


# device arguments -----------------------------------------------------------------------
def test_device_compares_equal_to_its_name_and_hashes_alike() -> None:
    a = sa.zeros(3, device="cpu")
    assert a.device == "cpu"
    assert "cpu" == a.device  # noqa: SIM300 - the str on the left
    assert a.device != "cuda:0" and a.device != 0
    assert Device("cuda", 0) == "cuda:0" and Device("cuda", 1) != "cuda:0"
    assert Device("cuda", 0) != "cuda"  # only the exact name: equal objects hash alike
    for dev in (Device("cpu"), Device("cuda", 3)):
        assert hash(dev) == hash(str(dev))
    assert {Device("cuda", 2): 1}["cuda:2"] == 1
    assert Device("cuda", 2) == Device("cuda", 2) and Device("cuda", 2) != Device("cuda", 1)
    with pytest.raises(AttributeError):
        Device("cpu").index = 1  # type: ignore[misc]  # frozen


def test_device_accepts_torch_cupy_devices_and_numpy_integers() -> None:
    assert parse_name(_TorchDevice("cpu")) == CPU
    assert parse_name(_TorchDevice("cuda", 1)) == Device("cuda", 1)
    assert parse_name(_TorchDevice("cuda")) == Device("cuda", 0)
    assert parse_name(_CupyDevice(2)) == Device("cuda", 2)
    assert parse_name(np.int64(1)) == Device("cuda", 1)
    assert parse_name(np.uint8(0)) == Device("cuda", 0)
    with pytest.raises(TypeError, match="not a bool"):
        parse_name(np.True_)
    with pytest.raises(ValueError, match=">= 0"):
        parse_name(np.int32(-1))
    with pytest.raises(TypeError, match="not float"):
        parse_name(1.0)  # type: ignore[arg-type]
    a = sa.zeros(2, device=_TorchDevice("cpu"))  # type: ignore[arg-type]
    assert a.device == "cpu"
    assert sa.zeros_like(np.zeros(2), device=_TorchDevice("cpu")).device == "cpu"


@pytest.mark.gpu
def test_cupy_device_objects_pick_the_device() -> None:
    cupy = pytest.importorskip("cupy")
    a = sa.zeros(4, device=cupy.cuda.Device(0))
    assert a.device == "cuda:0"
    b = sa.from_array(np.arange(3), device=np.int64(0))
    assert b.device == "cuda:0" and b.get().tolist() == [0, 1, 2]


# synchronize ----------------------------------------------------------------------------
def test_synchronize_calls_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    a = sa.zeros(4, device="cpu")
    calls: list[str] = []
    backend = a.allocation.backend
    monkeypatch.setattr(type(backend), "synchronize", lambda self: calls.append(self.name))
    a.synchronize()
    assert calls == ["host"]
    sa.synchronize("cpu")
    assert calls == ["host", "host"]
    sa.synchronize()  # every device with live allocations, each backend once
    assert calls.count("host") == 3


# load -----------------------------------------------------------------------------------
def test_load_of_a_str_or_path_says_it_takes_a_payload(tmp_path: Path) -> None:
    with pytest.raises(sa.PayloadError, match="takes a payload") as err:
        sa.load("not-a-file")  # type: ignore[arg-type]
    assert "numpy.load" not in str(err.value)
    path = tmp_path / "x.npy"
    np.save(path, np.arange(3))
    for arg in (path, str(path)):
        with pytest.raises(sa.PayloadError, match=r"sa.from_array\(numpy.load\(path\)\)"):
            sa.load(arg)  # type: ignore[arg-type]
    # (an allocation of its own: a load here of a payload that was never pickled counts one
    # load and no send, which leaves a slab's in-flight count one short for later tests)
    a = sa.zeros(3, device="cpu", pack=False)
    assert sa.load(a.payload().to_bytes()).shape == (3,)


def test_load_takes_a_payload_object_and_says_what_a_pickle_is() -> None:
    # (a.payload() was refused as "not bytes", and pickle.dumps(a) as "made by another
    # version of sharedarrays?", though the docstring named both)
    import pickle

    a = sa.full(3, 2.0, device="cpu")
    b = sa.load(a.payload())
    assert b.allocation is a.allocation and b.get().tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(sa.PayloadError, match=r"a pickle.*pickle\.loads\(data\)"):
        sa.load(pickle.dumps(a))
    b.close()
    a.close()
