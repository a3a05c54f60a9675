"""Choosing a memory system: ``backend=`` on the constructors, ``"auto"``, and the errors."""

from __future__ import annotations

import pytest

import sharedarrays as sa
from sharedarrays.backends import choose_backend, names, registration
from sharedarrays.backends.device import CPU


def test_auto_is_host_on_the_cpu_and_names_pass_through() -> None:
    assert choose_backend(CPU) == "host"
    assert choose_backend(CPU, "auto") == "host"
    for name in ("host", "cuda-vmm", "cuda-ipc", "cuda-pool"):
        assert choose_backend(CPU, name) == name
        assert name in names() and registration(name).name == name


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown backend 'rocm'.*cuda-vmm, cuda-ipc, cuda-pool"):
        choose_backend(CPU, "rocm")
    with pytest.raises(ValueError, match="unknown backend"):
        sa.zeros(4, device="cpu", backend="rocm")


@pytest.mark.parametrize("name", ["cuda-vmm", "cuda-ipc", "cuda-pool"])
def test_a_cuda_backend_on_the_cpu_says_what_to_do(name: str) -> None:
    with pytest.raises(sa.BackendUnavailable, match=f"the {name} backend needs a CUDA device"):
        sa.zeros(4, device="cpu", backend=name)


def test_host_on_a_cuda_device_is_refused() -> None:
    from sharedarrays.backends import get_backend
    from sharedarrays.backends.device import Device

    with pytest.raises(sa.BackendUnavailable, match="only serves device 'cpu'"):
        get_backend(Device("cuda", 0), "host")


def test_the_array_says_its_backend_and_lifetime() -> None:
    a = sa.zeros(4, device="cpu", backend="host")
    assert a.backend == "host"
    assert a.allocation.lifetime == "any holder" and a.allocation.holders == ()
    assert "kept alive by: any holder" in a.allocation.describe()
