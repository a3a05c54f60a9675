from __future__ import annotations

import pytest

from sharedarrays.backends.device import Device, parse_device


def test_cpu_names() -> None:
    assert parse_device("cpu") == Device("cpu", 0)
    assert parse_device(" CPU ") == Device("cpu", 0)
    assert str(Device("cuda", 2)) == "cuda:2"
    assert parse_device(Device("cpu")) is not None


@pytest.mark.parametrize(
    "bad", ["cuda:", "cuda:-1", "cuda0", "gpu", "", "cuda:\u0663", "cuda:1\nx"]
)
def test_bad_names(bad: str) -> None:
    with pytest.raises(ValueError, match="use 'cpu', 'cuda', 'cuda:N'"):
        parse_device(bad)


def test_negative_index() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        parse_device(-2)


def test_backends_lists_every_memory_system_and_why() -> None:
    import sharedarrays as sa
    from sharedarrays.backends import names, why_unusable

    listed = sa.list_backends()
    assert list(listed) == list(names())
    assert {"host", "cuda-vmm", "cuda-ipc", "cuda-pool"} <= set(listed)
    assert set(listed) - {"host", "cuda-vmm", "cuda-ipc", "cuda-pool"} <= {
        "host-pointer",
        "hip-vmm",
        "hip-pool",
        "ascend",
    }
    assert listed["host"] is None
    for name in ("cuda-vmm", "cuda-ipc", "cuda-pool", "hip-vmm", "hip-pool", "ascend"):
        assert listed[name] == why_unusable(name, 0)
        if listed[name] is not None:
            assert isinstance(listed[name], str) and listed[name]
