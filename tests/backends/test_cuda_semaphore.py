"""The driver-level external semaphore (``sharedarrays.backends.cuda.device``) on the CPU,
with a fake driver: released once, by ``close`` or when freed (``weakref.finalize``), never
in a fork child. The real driver's side runs in ``api/test_semaphore.py`` on a GPU."""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

import pytest

from sharedarrays.backends.cuda import device as semaphore
from sharedarrays.backends.device import Device
from sharedarrays.errors import BackendUnavailable, ClosedArrayError


class _FakeDriver:
    def __init__(self) -> None:
        self.destroyed: list[Any] = []

    def cuDestroyExternalSemaphore(self, handle: Any) -> tuple[int]:
        self.destroyed.append(handle)
        return (0,)


class _On:
    device = Device("cuda", 0)

    def context(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> _FakeDriver:
    fake = _FakeDriver()
    monkeypatch.setattr(semaphore, "load_driver", lambda: fake)
    return fake


def test_close_releases_once(driver: _FakeDriver) -> None:
    sem = semaphore.ImportedSemaphore(_On(), "handle-1")
    assert sem.live() == "handle-1" and sem._finalizer.alive
    sem.close()
    sem.close()
    assert driver.destroyed == ["handle-1"] and not sem._finalizer.alive
    with pytest.raises(ClosedArrayError, match="closed"):
        sem.live()


def test_freeing_releases(driver: _FakeDriver) -> None:
    sem = semaphore.ImportedSemaphore(_On(), "handle-2")
    del sem
    gc.collect()
    assert driver.destroyed == ["handle-2"]


def test_a_fork_child_never_releases_its_parent_semaphore(
    driver: _FakeDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    sem = semaphore.ImportedSemaphore(_On(), "handle-3")
    parent = os.getpid()
    monkeypatch.setattr(semaphore.os, "getpid", lambda: parent + 1)
    with pytest.raises(BackendUnavailable, match="after fork"):
        sem.live()
    sem.close()
    assert driver.destroyed == []
