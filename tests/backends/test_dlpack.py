"""The DLPack exporter (``backends/dlpack.py``), end to end with NumPy as its consumer: a
``kDLCPU`` capsule over a host mapping, values shared both ways, and the owner released
exactly when the consumer's array goes (or when nothing ever consumed it)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.backends.base import NativeView
from sharedarrays.backends.dlpack import KDL_CPU, KDL_EXT_DEV, dl_dtype, dlpack_view

pytest.importorskip("ctypes_dlpack")


class Owner:
    """Stands for the lease an array's native array holds."""


def _export(a: sa.SharedDeviceArray, owner: object, readonly: bool = False) -> Any:
    n = a.array
    view = NativeView(a.address, n.nbytes, 0, owner, n.dtype, n.shape, n.strides, readonly)
    return dlpack_view(view, KDL_CPU, 0)


def test_values_are_shared_both_ways() -> None:
    a = sa.from_array(np.arange(24, dtype=np.float32).reshape(4, 6), device="cpu")
    exporter = _export(a, Owner())
    assert exporter.__dlpack_device__() == (KDL_CPU, 0)
    b = np.from_dlpack(exporter)
    assert b.ctypes.data == a.address and b.shape == (4, 6)
    np.testing.assert_array_equal(b, a.get())
    b[1, 2] = -7  # a write through the consumer is seen by the array
    assert a.array[1, 2] == -7
    a.array[3, 5] = 42  # and the other way
    assert b[3, 5] == 42


def test_a_strided_view_keeps_its_layout() -> None:
    a = sa.from_array(np.arange(48, dtype=np.int64).reshape(6, 8), device="cpu")
    v = a[1:5:2, ::3]
    b = np.from_dlpack(_export(v, Owner()))
    assert b.strides == v.array.strides and b.ctypes.data == v.address
    np.testing.assert_array_equal(b, v.get())


def test_the_owner_lives_exactly_as_long_as_the_consumers_array() -> None:
    a = sa.zeros(16, "int32", device="cpu")
    owner = Owner()
    alive = weakref.ref(owner)
    exporter = _export(a, owner)
    del owner
    b = np.from_dlpack(exporter)
    del exporter
    gc.collect()
    assert alive() is not None  # the consumer's array holds it
    view = b[2:]  # a view of the consumer's array holds it too
    del b
    gc.collect()
    assert alive() is not None
    view[0] = 3
    del view
    gc.collect()
    assert alive() is None
    assert a.array[2] == 3


def test_an_exporter_never_consumed_releases_its_owner() -> None:
    a = sa.zeros(16, "int32", device="cpu")
    owner = Owner()
    alive = weakref.ref(owner)
    exporter = _export(a, owner)
    del owner, exporter
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("versioned", [True, False])
def test_a_capsule_never_consumed_releases_its_owner(versioned: bool) -> None:
    """The capsule itself (a legacy ``dltensor`` one, as torch_npu asks for, or a versioned
    one) frees the tensor when it is collected unconsumed."""
    a = sa.zeros(16, "int32", device="cpu")
    owner = Owner()
    alive = weakref.ref(owner)
    exporter = _export(a, owner)
    del owner
    capsule = exporter.__dlpack__(max_version=(1, 0) if versioned else None)
    del exporter
    gc.collect()
    assert alive() is not None
    del capsule
    gc.collect()
    assert alive() is None


def test_readonly_sets_the_flag_a_versioned_consumer_sees() -> None:
    a = sa.zeros(8, "float64", device="cpu")
    assert np.from_dlpack(_export(a, Owner())).flags.writeable
    assert not np.from_dlpack(_export(a, Owner(), readonly=True)).flags.writeable


@pytest.mark.parametrize(
    "dtype", ["bool", "int8", "uint16", "int32", "uint64", "float16", "float32", "complex128"]
)
def test_dtypes_round_trip(dtype: str) -> None:
    src = (np.arange(10) % 3).astype(dtype)
    a = sa.from_array(src, device="cpu")
    b = np.from_dlpack(_export(a, Owner()))
    assert b.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(b, src)


def test_what_dlpack_cannot_describe_is_refused() -> None:
    with pytest.raises(TypeError, match="DLPack cannot describe"):
        dl_dtype(np.dtype([("x", "i4")]))
    with pytest.raises(TypeError, match="DLPack cannot describe"):
        dl_dtype(np.dtype(">f8" if np.little_endian else "<f8"))
    with pytest.raises(ValueError, match="multiples of the item size"):
        dlpack_view(
            NativeView(4096, 16, 0, Owner(), np.dtype("int64"), (2,), (4,), False), KDL_CPU, 0
        )


def test_the_device_is_what_was_asked() -> None:
    view = NativeView(4096, 2, 0, Owner(), np.dtype("int8"), (2,), (1,), False)
    exporter = dlpack_view(view, KDL_EXT_DEV, 3)
    assert exporter.__dlpack_device__() == (KDL_EXT_DEV, 3)
