"""Device names: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``N``."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from sharedarrays.errors import BackendUnavailable

__all__ = ["Device", "DeviceLike", "parse_device"]

DeviceLike = Union["Device", str, int, None]

_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


@dataclass(frozen=True)
class Device:
    """Where an allocation's physical memory lives.

    Attributes
    ----------
    kind : str
        ``"cpu"`` or ``"cuda"``.
    index : int
        The device ordinal (always 0 for ``"cpu"``).
    """

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    @property
    def is_cuda(self) -> bool:
        """Whether this is a CUDA device."""
        return self.kind == "cuda"


CPU = Device("cpu", 0)


def parse_device(device: DeviceLike) -> Device:
    """Turn a user's device argument into a :class:`Device`.

    Parameters
    ----------
    device : Device, str, int or None
        ``None`` picks ``cuda:0`` when a CUDA device is usable, else ``cpu``.

    Raises
    ------
    ValueError
        The name is not one of the accepted forms.
    BackendUnavailable
        CUDA was asked for explicitly and cannot be used here.
    """
    if isinstance(device, Device):
        dev = device
    elif device is None:
        from sharedarrays.backends import cuda_usable

        return Device("cuda", 0) if cuda_usable() is None else CPU
    elif isinstance(device, bool):
        raise TypeError("device must be None, 'cpu', 'cuda', 'cuda:N' or an int, not a bool")
    elif isinstance(device, int):
        dev = Device("cuda", device)
    elif isinstance(device, str):
        name = device.strip().lower()
        if name == "cpu":
            return CPU
        m = _CUDA_RE.match(name)
        if m is None:
            raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' or an int N")
        dev = Device("cuda", int(m.group(1) or 0))
    else:
        raise TypeError(
            f"device must be None, 'cpu', 'cuda', 'cuda:N' or an int, not {type(device).__name__}"
        )
    if dev.kind == "cuda":
        if dev.index < 0:
            raise ValueError(f"device index must be >= 0, got {dev.index}")
        from sharedarrays.backends import cuda_usable

        why = cuda_usable(dev.index)
        if why is not None:
            raise BackendUnavailable(f"cannot use {dev}: {why}")
    return dev
