"""Timelines and external semaphores (``sharedarrays.api.semaphore``).

CPU: a host timeline ordering two processes, argument errors, fds closed on failure.
``gpu``: a CUDA timeline ordering a consumer's stream after a producer's in another process
(``cuStreamWaitValue64`` / ``cuStreamWriteValue64``), and Vulkan semaphores (timeline and
binary) exported as fds and driven from CUDA (skipped with the reason where Vulkan is not
available: see ``vulkan_helpers.py``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import time
from typing import Any

import numpy as np
import pytest
from fake_cuda import FakeCuda, fake_cuda

import sharedarrays as sa
from sharedarrays.backends.cuda.driver import CudaDriverError

__all__ = ["fake_cuda"]  # a fixture, used by name

N = 1 << 20


def host_consumer(data: Any, timeline: Any) -> None:
    """Wait for the producer (1), double the data, say done (2)."""
    timeline.wait(1, timeout=60)
    data.array[...] *= 2
    timeline.signal(2)


def cuda_consumer(data: Any, timeline: Any, queued: Any) -> None:
    """Queue: wait for 1, double the data, signal 2; the CPU does not wait for any of it."""
    import cupy

    warm = cupy.ones(16, dtype=data.dtype)  # load the kernel now: a module load waits for
    warm *= 2  # the whole device, which would wait forever behind the blocked stream
    cupy.cuda.get_current_stream().synchronize()
    timeline.wait(1)
    data.array[...] *= 2
    timeline.signal(2)
    queued.set()
    cupy.cuda.get_current_stream().synchronize()  # only so as not to exit with work queued


# --------------------------------------------------------------------------------------------
# CPU


def test_host_timeline_orders_two_processes() -> None:
    ctx = mp.get_context("spawn")
    data = sa.zeros(1000, "float64", device="cpu", pack=False)
    t = sa.Timeline(sa.zeros(4, "uint64", device="cpu", pack=False), 2)
    child = ctx.Process(target=host_consumer, args=(data, t))
    child.start()
    time.sleep(0.3)
    assert t.value == 0  # the consumer is waiting, not doubling zeros
    data.array[...] = 3.0
    t.signal(1)
    t.wait(2, timeout=60)
    child.join(30)
    assert child.exitcode == 0
    np.testing.assert_array_equal(data.get(), 6.0)
    assert t.value == 2


def test_timeline_pickles_with_its_array_and_index() -> None:
    words = sa.zeros((2, 3), "int64", device="cpu", pack=False)
    t = sa.Timeline(words, (1, 2))
    t.signal(41)
    u = pickle.loads(pickle.dumps(t))
    assert u.index == (1, 2) and u.value == 41 and u.address == t.address
    assert words.get()[1, 2] == 41


def test_timeline_arguments() -> None:
    with pytest.raises(TypeError, match="uint64 or int64"):
        sa.Timeline(sa.zeros(2, "float64", device="cpu"))
    words = sa.zeros(4, "uint64", device="cpu")
    with pytest.raises(IndexError, match="one element"):
        sa.Timeline(words[None], 0)
    with pytest.raises(IndexError):
        sa.Timeline(words, 9)


def test_timeline_values_and_timeout() -> None:
    t = sa.Timeline(sa.zeros(1, "uint64", device="cpu"))
    for bad in (-1, 1 << 64):
        with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
            t.signal(bad)
    for wrong in (None, True, 3.7, "5", np.float64(2.0)):  # (3.7 was 3, "5" was 5)
        with pytest.raises(TypeError, match="a timeline value is an int"):
            t.signal(wrong)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="a timeline value is an int"):
            t.wait(wrong, timeout=0)  # type: ignore[arg-type]
    t.signal(np.uint64(7))
    assert t.value == 7
    t.signal((1 << 64) - 1)
    assert t.value == (1 << 64) - 1
    t2 = sa.Timeline(sa.zeros(1, "uint64", device="cpu"))
    start = time.monotonic()
    with pytest.raises(sa.WaitTimeout, match="stayed at 0 < 5") as raised:
        t2.wait(5, timeout=0.2)
    assert isinstance(raised.value, TimeoutError)  # (except TimeoutError still catches it)
    assert time.monotonic() - start < 5


def test_array_wait_for_and_signal_check_their_argument() -> None:
    a = sa.zeros(4, device="cpu")
    t = sa.Timeline(sa.zeros(1, "uint64", device="cpu"))
    a.signal(t, 7)
    a.wait_for(t, 7)  # reached already: returns
    assert t.value == 7
    with pytest.raises(TypeError, match="ExternalSemaphore or a Timeline"):
        a.wait_for(object())  # type: ignore[arg-type]


def test_external_semaphore_refuses_bad_input_and_closes_the_fd() -> None:
    r, w = os.pipe()
    os.close(w)
    with pytest.raises(ValueError, match="'opaque' or 'timeline'"):
        sa.ExternalSemaphore.from_fd(r, kind="binary")  # type: ignore[arg-type]
    with pytest.raises(OSError):
        os.fstat(r)  # closed: the caller never closes it
    with pytest.raises(ValueError, match="open file descriptor"):
        sa.ExternalSemaphore.from_fd(-1)
    if sa.list_backends()["cuda-vmm"] is not None and sa.list_backends()["cuda-ipc"] is not None:
        r, w = os.pipe()
        os.close(w)
        with pytest.raises(sa.BackendUnavailable):
            sa.ExternalSemaphore.from_fd(r, kind="timeline")
        with pytest.raises(OSError):
            os.fstat(r)


def test_external_semaphore_the_driver_refuses_closes_the_fd(fake_cuda: FakeCuda) -> None:
    # (a CudaDriverError is an OSError: it was taken for a closed fd, a ValueError, and the
    # fd was left open)
    r, w = os.pipe()
    os.close(w)
    fake_cuda.fail("cuImportExternalSemaphore", "CUDA_ERROR_INVALID_VALUE")
    with pytest.raises(CudaDriverError, match="cuImportExternalSemaphore"):
        sa.ExternalSemaphore.from_fd(r, kind="timeline")
    with pytest.raises(OSError):
        os.fstat(r)  # closed: the caller never closes it
    r, w = os.pipe()
    os.close(w)
    sem = sa.ExternalSemaphore.from_fd(r)  # taken by the driver
    assert list(fake_cuda.semaphores.values()) == ["imported"]
    sem.close()
    assert fake_cuda.held() == {}


# --------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc", "cuda-pool"])
def test_cuda_timeline_orders_a_consumer_stream_in_another_process(backend: str) -> None:
    why = sa.list_backends()[backend]
    if why is not None:
        pytest.skip(f"{backend}: {why}")
    ctx = mp.get_context("spawn")
    data = sa.zeros(N, "float32", device="cuda:0", backend=backend, pack=False)
    words = sa.zeros(1, "uint64", device="cuda:0", backend=backend, pack=False)
    if backend == "cuda-pool":  # the driver refuses stream memory operations there
        with pytest.raises(ValueError, match="cannot live in a cuda-pool array"):
            sa.Timeline(words)
        words = sa.zeros(1, "uint64", device="cuda:0", backend="cuda-vmm", pack=False)
    t = sa.Timeline(words)
    queued = ctx.Event()
    child = ctx.Process(target=cuda_consumer, args=(data, t, queued))
    child.start()
    try:
        assert queued.wait(60), "the consumer did not queue its work"
        time.sleep(0.3)
        assert t.value == 0  # its stream waits: nothing ran
        data.array[...] = 3.0  # on this process's stream, then
        t.signal(1)
        t.wait_host(2, timeout=60)
        np.testing.assert_array_equal(data.get(), 6.0)  # the consumer doubled the 3s
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            t.signal(1)
            child.join(10)
            child.kill()


def _vulkan() -> Any:
    import vulkan_helpers

    why = vulkan_helpers.vulkan_unavailable()
    if why is not None:
        pytest.skip(f"Vulkan cannot be used here: {why}")
    return vulkan_helpers


def _warm(a: Any) -> None:
    import cupy

    w = cupy.zeros(16, dtype=a.dtype)  # load the kernel before any stream waits (see Timeline)
    w += 1
    cupy.cuda.get_current_stream().synchronize()


@pytest.mark.gpu
def test_vulkan_timeline_semaphore_orders_cuda_work() -> None:
    vh = _vulkan()
    with vh.VulkanDevice() as vk, vk.timeline(0) as sem:
        ext = sa.ExternalSemaphore.from_fd(sem.export_fd(), kind="timeline")
        with ext:
            a = sa.zeros(N, "float32", device="cuda:0", pack=False)
            _warm(a)
            a.wait_for(ext, 1)  # CUDA waits for Vulkan's 1 ...
            a.array[...] += 1
            a.signal(ext, 2)  # ... and tells Vulkan with 2
            time.sleep(0.3)
            assert sem.value() == 0  # nothing ran: CUDA is waiting
            sem.signal(1)  # the host signals through Vulkan
            assert sem.wait(2, timeout_s=30), f"CUDA never signalled 2 (value {sem.value()})"
            np.testing.assert_array_equal(a.get(), 1.0)


@pytest.mark.gpu
def test_vulkan_binary_semaphores_both_ways() -> None:
    vh = _vulkan()
    with vh.VulkanDevice() as vk, vk.binary() as to_cuda, vk.binary() as to_vulkan:
        wait = sa.ExternalSemaphore.from_fd(to_cuda.export_fd(), kind="opaque")
        done = sa.ExternalSemaphore.from_fd(to_vulkan.export_fd(), kind="opaque")
        with wait, done:
            a = sa.zeros(N, "float32", device="cuda:0", pack=False)
            _warm(a)
            to_cuda.queue_signal()  # a Vulkan queue signals ...
            a.wait_for(wait)  # ... CUDA waits for it, works, signals back ...
            a.array[...] += 1
            a.signal(done)
            import cupy

            cupy.cuda.get_current_stream().synchronize()  # Vulkan may only wait on a binary
            assert to_vulkan.queue_wait(timeout_s=30)  # semaphore whose signal is submitted
            np.testing.assert_array_equal(a.get(), 1.0)
            with pytest.raises(ValueError, match="takes no value"):
                a.signal(done, 3)
