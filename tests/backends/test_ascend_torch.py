"""Ascend's native array as a torch_npu tensor, on the simulated CANN runtime with a stand-in
``torch_npu`` (no torch_npu, and no NPU, ran this).

The stand-in's ``from_dlpack`` consumes the capsule as torch_npu's does (``__dlpack__()``
with no arguments, a legacy ``dltensor`` capsule, only ``kDLCPU`` or ``kDLExtDev`` accepted,
``data`` taken as the first element: its ``fromDLPack`` ignores ``byte_offset``) and reads the
memory at the pointer the capsule carries, which the simulated driver lets the CPU address;
its tensor calls the capsule's deleter when freed, as torch's storage does."""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.backends.ascend import runtime
from sharedarrays.backends.ascend.vmm import torch_npu_from_dlpack
from sharedarrays.backends.base import NativeView

dl = pytest.importorskip("ctypes_dlpack")

_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_SetName.restype = ctypes.c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_char_p]

_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}


class _Cpu:
    def __init__(self, data: np.ndarray[Any, Any]) -> None:
        self._data = data

    def numpy(self) -> np.ndarray[Any, Any]:
        return self._data


class _Held:
    """Memory at a pointer whose NumPy view keeps this object (and so its finalizer) alive."""

    def __init__(self, memory: Any) -> None:
        self.__array_interface__ = memory.__array_interface__


class FakeNpuTensor:
    """The part of a torch tensor on ``npu:N`` that the library and these tests use."""

    def __init__(self, data: np.ndarray[Any, Any], index: int, free: Any) -> None:
        self._data = data
        self.device = types.SimpleNamespace(type="npu", index=index)
        self.shape = data.shape
        weakref.finalize(self, free)

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._data[key] = value

    def detach(self) -> FakeNpuTensor:
        return self

    def cpu(self) -> _Cpu:
        return _Cpu(self._data.copy())


class FakeTorchNpu:
    """``torch.utils.dlpack.from_dlpack`` as torch_npu patches it; records what it saw."""

    def __init__(self, torch: Any = None) -> None:
        self.seen: list[dict[str, Any]] = []
        self.torch = torch  # real torch: its CPU tensors stand in for torch_npu's

    def from_dlpack(self, ext: Any) -> Any:
        capsule = ext.__dlpack__()  # torch_npu's _from_dlpack passes no arguments
        assert _api.PyCapsule_GetName(capsule) == b"dltensor"
        pointer = ctypes.cast(
            _api.PyCapsule_GetPointer(capsule, b"dltensor"), ctypes.POINTER(dl.DLManagedTensor)
        )
        t = pointer.contents.dl_tensor
        device = (t.device.device_type.value, t.device.device_id)
        if device[0] not in (1, 12):  # torch_npu's getATenDevice
            raise RuntimeError(f"Unsupported device_type: {device[0]}")
        dtype = np.dtype(f"{_KINDS[t.dtype.code]}{t.dtype.bits // 8}")
        shape = tuple(t.shape[i] for i in range(t.ndim))
        strides = tuple(t.strides[i] * dtype.itemsize for i in range(t.ndim))
        self.seen.append({"device": device, "data": t.data, "shape": shape, "strides": strides})
        _api.PyCapsule_SetName(capsule, b"used_dltensor")
        memory = types.SimpleNamespace(
            __array_interface__={
                "data": (t.data, False),
                "shape": shape,
                "strides": strides,
                "typestr": dtype.str,
                "version": 3,
            }
        )
        data = np.asarray(memory)

        def free() -> None:
            pointer.contents.deleter(pointer)

        if self.torch is not None:  # a real tensor over the memory, freed as torch frees
            held = _Held(memory)  # (the tensor -> data -> held)
            weakref.finalize(held, free)
            return self.torch.from_numpy(np.asarray(held))
        return FakeNpuTensor(data, device[1], free)


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if runtime.MODULE_SETTING not in os.environ:
        monkeypatch.setenv(runtime.MODULE_SETTING, "simulated.ascend")
    yield


def _install(monkeypatch: pytest.MonkeyPatch) -> FakeTorchNpu:
    fake = FakeTorchNpu()
    dlpack = types.ModuleType("torch.utils.dlpack")
    dlpack.from_dlpack = fake.from_dlpack  # type: ignore[attr-defined]
    for name, module in [
        ("torch_npu", types.ModuleType("torch_npu")),
        ("torch", types.ModuleType("torch")),
        ("torch.utils", types.ModuleType("torch.utils")),
        ("torch.utils.dlpack", dlpack),
    ]:
        monkeypatch.setitem(sys.modules, name, module)
    return fake


def test_without_torch_npu_there_is_no_consumer() -> None:
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is imported here")
    assert torch_npu_from_dlpack() is None


@pytest.mark.timeout(120)
def test_the_native_array_is_a_torch_npu_tensor_over_the_mapping(
    simulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = sa.full((4, 6), 2.5, "float32", device="npu:0", backend="ascend", pack=False)
    alloc = a.allocation
    fake = _install(monkeypatch)
    assert torch_npu_from_dlpack() == fake.from_dlpack
    v = a[1:3, 2:]
    t = v.array
    assert isinstance(t, FakeNpuTensor) and t.device.index == 0
    (seen,) = fake.seen
    assert seen["device"] == (12, 0)  # kDLExtDev, as torch_npu reports its tensors
    assert seen["data"] == v.address == alloc.address + 1 * 24 + 2 * 4
    assert seen["shape"] == (2, 4) and seen["strides"] == (24, 4)
    t[0, 1] = -1.0  # a write through the tensor is seen by the array
    a.array[2, 5] = 7.0  # and the other way
    assert a.get()[1, 3] == -1.0 and t[1, 3] == 7.0
    np.testing.assert_array_equal(v.get(), a.get()[1:3, 2:])  # get() through .cpu()
    leases = alloc.leases
    v.close()
    gc.collect()
    assert alloc.leases == leases  # the tensor holds the view's lease
    del t
    gc.collect()
    assert alloc.leases == leases - 1  # released when torch frees the tensor
    a.close()
    assert alloc.released


@pytest.mark.timeout(120)
def test_layouts_torch_cannot_have_stay_numpy(
    simulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = sa.from_array(np.arange(12.0).reshape(3, 4), device="npu:0", backend="ascend")
    fake = _install(monkeypatch)
    reversed_ = a[::-1]
    assert isinstance(reversed_.array, np.ndarray)  # negative strides
    np.testing.assert_array_equal(reversed_.get(), np.arange(12.0).reshape(3, 4)[::-1])
    alloc = a.allocation
    n = a.array
    readonly = alloc.backend.as_native(
        NativeView(alloc.address, alloc.size, 0, object(), n.dtype, n.shape, n.strides, True)
    )
    assert isinstance(readonly, np.ndarray) and not readonly.flags.writeable
    assert fake.seen == []
    assert isinstance(a[1:].array, FakeNpuTensor)  # while a plain view is a tensor


@pytest.mark.torch
@pytest.mark.timeout(120)
def test_numpy_values_are_written_into_a_torch_native(
    simulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch tensor takes no NumPy array in ``t[key] = value``: assignment and
    ``from_array`` convert the values first (Ascend memory cannot grow: no ``append``).
    Real torch here, its CPU tensors standing in for torch_npu's (the stand-in consumes
    the capsule as above)."""
    torch = pytest.importorskip(
        "torch",
        reason="torch is not installed here (pip install torch): needed to check "
        "writes into real torch tensors",
    )
    fake = FakeTorchNpu(torch)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch.utils.dlpack, "from_dlpack", fake.from_dlpack)
    a = sa.zeros((4, 6), "float32", device="npu:0", backend="ascend", pack=False)
    assert isinstance(a.array, torch.Tensor)
    a[1] = np.arange(6, dtype=np.float64)  # NumPy (another dtype) into the tensor
    a[2:, :2] = np.float32(5)
    a[3, 5] = 9
    expected = np.zeros((4, 6), "float32")
    expected[1], expected[2:, :2], expected[3, 5] = np.arange(6), 5, 9
    np.testing.assert_array_equal(a.get(), expected)
    src = np.arange(24.0).reshape(4, 6)
    b = sa.from_array(src, device="npu:0", backend="ascend", pack=False)
    assert isinstance(b.array, torch.Tensor)
    np.testing.assert_array_equal(b.get(), src)
    assert len(fake.seen) >= 2
    for x in (a, b):
        x.close()
