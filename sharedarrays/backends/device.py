"""Devices: ``"cpu"`` and the numbered accelerator kinds backends register, each with the
function saying why one of its devices cannot be used. This module imports no backend."""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, SupportsIndex, Union, runtime_checkable

import numpy as np

from sharedarrays.errors import BackendUnavailable
from sharedarrays.process import STATE


@runtime_checkable
class TorchDeviceLike(Protocol):
    """A ``torch.device``."""

    @property
    def type(self) -> str: ...
    @property
    def index(self) -> int | None: ...


@runtime_checkable
class CupyDeviceLike(Protocol):
    """A ``cupy.cuda.Device``."""

    @property
    def id(self) -> int: ...


DeviceLike = Union["Device", str, SupportsIndex, TorchDeviceLike, CupyDeviceLike, None]
"""What ``device=`` takes: a :class:`Device`, a name (``"cpu"``, ``"cuda:1"``), an int
(NumPy integers too), a ``torch.device`` or a ``cupy.cuda.Device``."""

_NAME_RE = re.compile(r"^([a-z][a-z0-9_]*)(?::([0-9]+))?\Z")


def add_kind(kind: str, why_unusable: Callable[[int], str | None]) -> None:
    """Register accelerator kind ``kind`` (lower case) with ``why_unusable(index)``, which
    says why ``kind:index`` cannot be used here (``None``: it can); never raises."""
    if kind == "cpu" or not _NAME_RE.match(kind) or ":" in kind:
        raise ValueError(f"{kind!r} cannot be a device kind")
    STATE.backends.kinds.setdefault(kind, why_unusable)


def kinds() -> tuple[str, ...]:
    """Every device kind: ``"cpu"`` and the registered accelerator kinds."""
    return ("cpu", *STATE.backends.kinds)


@dataclass(frozen=True)
class Device:
    """Where an allocation's physical memory lives: ``kind`` and ``index`` (0 for cpu)."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"{self.kind}:{self.index}"

    def __eq__(self, other: object) -> bool:  # also to its exact name: hashes agree
        if isinstance(other, Device):
            return (self.kind, self.index) == (other.kind, other.index)
        if isinstance(other, str):
            return str(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def is_cuda(self) -> bool:
        """Whether its kind is ``"cuda"``."""
        return self.kind == "cuda"

    @property
    def needs_context(self) -> bool:
        """Whether its memory needs a device context (all but ``cpu``)."""
        return self.kind != "cpu"


CPU = Device("cpu", 0)


def _forms() -> str:
    names = ", ".join(f"'{k}', '{k}:N'" for k in STATE.backends.kinds)
    return "'cpu', " + (names + " or an int N" if names else "or an int N")


def _foreign(device: object) -> str | int | None:  # a torch.device's name, a CuPy ordinal
    module = type(device).__module__.split(".")[0]
    if module == "torch" and isinstance(device, TorchDeviceLike):
        kind, index = str(device.type), device.index
        return kind if index is None else f"{kind}:{operator.index(index)}"
    if module == "cupy" and isinstance(device, CupyDeviceLike):
        return operator.index(device.id)
    return None


def parse_name(device: DeviceLike) -> Device:
    """A device argument (not ``None``) as a :class:`Device`, by its form only (an int is
    device ``N`` of the first accelerator kind); ``ValueError``, ``TypeError``."""
    kinds = STATE.backends.kinds
    foreign = _foreign(device)
    if foreign is not None:
        if isinstance(foreign, int) and "cuda" in kinds:
            dev = Device("cuda", foreign)
        else:
            return parse_name(foreign)
    elif isinstance(device, Device):
        dev = device
    elif isinstance(device, (bool, np.bool_)):
        raise TypeError(f"device must be None, {_forms()}, not a bool")
    elif device is None:
        raise TypeError(f"device must be {_forms()}, not None")
    elif isinstance(device, str):
        name = device.strip().lower()
        if name == "cpu":
            return CPU
        m = _NAME_RE.match(name)
        if m is None or m.group(1) not in kinds:
            raise ValueError(f"unknown device {device!r}: use {_forms()}")
        dev = Device(m.group(1), int(m.group(2) or 0))
    elif isinstance(device, SupportsIndex):
        index = operator.index(device)
        if not kinds:
            raise ValueError(f"no accelerator device kind is registered for device {index}")
        dev = Device(next(iter(kinds)), index)
    else:
        raise TypeError(f"device must be None, {_forms()}, not {type(device).__name__}")
    if dev.kind != "cpu" and dev.kind not in kinds:
        raise ValueError(f"unknown device kind {dev.kind!r}: use {_forms()}")
    if dev.index < 0:
        raise ValueError(f"device index must be >= 0, got {dev.index}")
    return dev


def parse_device(device: DeviceLike) -> Device:
    """A user's device argument as a :class:`Device` usable here (``None``: device 0 of the
    first kind usable here, else ``cpu``); ``BackendUnavailable`` for one that is not."""
    if device is None:
        for kind, why_unusable in STATE.backends.kinds.items():
            if why_unusable(0) is None:
                return Device(kind, 0)
        return CPU
    dev = parse_name(device)
    if dev.kind != "cpu":
        why = STATE.backends.kinds[dev.kind](dev.index)
        if why is not None:
            raise BackendUnavailable(f"cannot use {dev}: {why}")
    return dev
