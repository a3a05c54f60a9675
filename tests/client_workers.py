"""What the library-client tests (tests/api/test_clients.py) run in other processes: a torch
Dataset of a shared array's rows (importable in a DataLoader's spawned workers: conftest
puts tests/ on their PYTHONPATH), and the scripts run in a fresh interpreter."""

from __future__ import annotations

from typing import Any

import sharedarrays as sa


class Rows:
    """A map-style torch Dataset (``__getitem__`` and ``__len__``) whose items are the rows
    of a shared array: ``a[i]``, shared views."""

    def __init__(self, a: sa.SharedDeviceArray) -> None:
        self.a = a

    def __len__(self) -> int:
        return len(self.a)

    def __getitem__(self, i: int) -> Any:
        return self.a[i]


SCIPY_ARRAY_API = """
import numpy as np
import scipy.signal

import sharedarrays as sa

a = sa.from_array(np.arange(10.0), device="cpu")
k = np.array([1.0, 2.0, 1.0])
want = scipy.signal.convolve(np.arange(10.0), k)
assert np.allclose(scipy.signal.convolve(a, k), want)
assert np.allclose(scipy.signal.fftconvolve(a, k), want)
assert np.allclose(scipy.signal.convolve(k, a), scipy.signal.convolve(k, np.arange(10.0)))
print("ok")
"""
"""scipy.signal in array-API mode (``SCIPY_ARRAY_API=1`` before scipy is imported) with a
shared array and an ndarray kernel."""

SHUTDOWN = """
import sys

import numpy as np

import sharedarrays as sa

a = sa.from_array(np.arange(10.0), device="cpu")
# Held by sys's own dict, which shutdown clears last: the views and the native array are
# collected after every module's globals are gone (the allocation module's too, kept alive
# here so that its globals are cleared rather than dropped), as where a library (numba's
# typing error) keeps an argument until then.
sys._held_to_the_end = [sys.modules["sharedarrays.memory.allocation"], a, a[2:], a.array]
print("ok")
"""
"""A program whose shared arrays are collected late in interpreter shutdown."""

NUMBA = """
import numba
import numpy as np

import sharedarrays as sa


@numba.njit
def total(x):
    return x.sum()


a = sa.from_array(np.arange(10.0), device="cpu")
try:
    total(a)  # numba types NumPy arrays only: a TypingError on the wrapper
except numba.core.errors.TypingError:
    pass
else:
    raise AssertionError("numba took the wrapper")
assert total(np.asarray(a)) == 45.0  # np.asarray(a): the native array, no copy
print("ok")
"""
"""numba on the host: a TypingError on the wrapper, ``np.asarray(a)`` works."""
