"""The seam memory systems plug into, one :class:`Registration` per backend: everything above
the backends asks it what ``backend="auto"`` means, a payload's device, why a backend is
unusable, and for the process-wide backend object."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sharedarrays.backends.base import Backend
from sharedarrays.backends.device import Device, add_kind, kinds, parse_name
from sharedarrays.errors import BackendUnavailable, PayloadError
from sharedarrays.process import STATE

__all__ = [
    "Registration",
    "register",
    "load_accelerators",
    "registration",
    "registrations",
    "names",
    "device_of",
    "why_unusable",
    "kind_unusable",
    "handle_check",
    "choose_backend",
    "get_backend",
    "list_backends",
]


def _usable(index: int) -> str | None:
    return None


ACCELERATORS = (
    "sharedarrays.backends.cuda.device",
    "sharedarrays.backends.cuda.ipc",
    "sharedarrays.backends.cuda.pool",
    "sharedarrays.backends.hip.device",
    "sharedarrays.backends.ascend.vmm",
)
"""The modules registering the accelerator backends, imported when a name this process has
not registered, or the whole list, is first asked for (not by ``import sharedarrays``)."""


def load_accelerators() -> None:
    """Import (once) every module of :data:`ACCELERATORS`, each registering its backends."""
    state = STATE.backends
    if not state.accelerators_loaded:  # (checked first: registrations() runs per sa.empty)
        for module in ACCELERATORS:
            importlib.import_module(module)
        state.accelerators_loaded = True


def _registered(name: object) -> Registration | None:
    if not isinstance(name, str):
        return None
    reg = STATE.backends.registrations.get(name)
    if reg is None:
        load_accelerators()
        reg = STATE.backends.registrations.get(name)
    return reg


@dataclass(frozen=True)
class Registration:
    """What a backend declares: its ``name``, the device ``kind`` it serves, the
    ``factory(device)`` making it, its ``preference`` for ``backend="auto"`` (lowest first),
    its flags, ``why_unusable(index)`` (never raises) and ``check_handle(fd, size)``, which
    refuses (``PayloadError``) a received handle it cannot safely map (keeps ``fd``)."""

    name: str
    kind: str
    factory: Callable[[Device], Backend]
    preference: int
    maps: bool
    exporter_owned: bool
    why_unusable: Callable[[int], str | None] = _usable
    check_handle: Callable[[int, int], None] | None = None

    @classmethod
    def of(
        cls,
        backend: Callable[[Device], Backend],
        kind: str,
        preference: int,
        why_unusable: Callable[[int], str | None] = _usable,
        check_handle: Callable[[int, int], None] | None = None,
    ) -> Registration:
        """The registration of backend class ``backend`` (its name and flags)."""
        b: Any = backend
        flags = (b.maps, b.exporter_owned)
        return cls(b.name, kind, backend, preference, *flags, why_unusable, check_handle)


def register(reg: Registration) -> None:
    """Add a backend (and its device kind); ``ValueError`` if the name is taken."""
    known = STATE.backends.registrations.get(reg.name)
    if known is not None and known != reg:
        raise ValueError(f"a backend named {reg.name!r} is already registered")
    if reg.kind != "cpu":
        add_kind(reg.kind, functools.partial(kind_unusable, reg.kind))
    STATE.backends.registrations[reg.name] = reg


def registration(name: str) -> Registration:
    """The registration of backend ``name`` (``ValueError`` if none)."""
    reg = _registered(name)
    if reg is None:
        raise ValueError(f"unknown backend {name!r}; choose 'auto' or one of {', '.join(names())}")
    return reg


def registrations(kind: str | None = None) -> list[Registration]:
    """The registered backends (of one kind) in ``backend="auto"``'s order."""
    load_accelerators()
    order = {k: i for i, k in enumerate(kinds())}
    regs = [r for r in STATE.backends.registrations.values() if kind is None or r.kind == kind]
    return sorted(regs, key=lambda r: (order[r.kind], r.preference))


def names() -> tuple[str, ...]:
    """Every registered backend's name, in :func:`registrations`' order."""
    return tuple(r.name for r in registrations())


def device_of(name: str, index: int) -> Device:
    """The device of a payload's memory, usable or not (``PayloadError``: unknown backend)."""
    reg = _registered(name)
    if reg is None:
        raise PayloadError(
            f"unknown backend {name!r} in payload; the backends here are {', '.join(names())} "
            "(import the module that registers it first)"
        )
    return Device(reg.kind, 0 if reg.kind == "cpu" else int(index))


def why_unusable(name: str, index: int = 0) -> str | None:
    """Why backend ``name`` cannot be used on device ``index`` of its kind here, or ``None``."""
    reg = _registered(name)
    if reg is None:
        return f"unknown backend {name!r}; the backends are {', '.join(names())}"
    return reg.why_unusable(index)


def kind_unusable(kind: str, index: int = 0) -> str | None:
    """Why no backend of ``kind`` can be used on device ``index`` (the first one's reason)."""
    reasons = [r.why_unusable(index) for r in registrations(kind)]
    if not reasons:
        return f"no backend serves {kind} devices"
    return None if None in reasons else reasons[0]


def handle_check(name: object) -> Callable[[int, int], None] | None:
    """:attr:`Registration.check_handle` of backend ``name``, or ``None``."""
    reg = _registered(name)
    return None if reg is None else reg.check_handle


def choose_backend(device: Device, name: str = "auto") -> str:
    """The backend ``name`` means on ``device``: ``"auto"`` is the first of its kind usable
    here (on CUDA: cuda-vmm, cuda-ipc, cuda-pool). ``ValueError``: an unknown name;
    ``BackendUnavailable``: none of its kind can use ``device`` (each says why)."""
    if name != "auto":
        return registration(name).name
    reasons = {r.name: r.why_unusable(device.index) for r in registrations(device.kind)}
    for n, why in reasons.items():
        if why is None:
            return n
    detail = "; ".join(f"{n}: {why}" for n, why in reasons.items())
    raise BackendUnavailable(f"no {device.kind.upper()} backend can use {device} here ({detail})")


def get_backend(device: Device, name: str | None = None) -> Backend:
    """The process-wide backend ``name`` (default ``"auto"``) for ``device``, made on first
    use (``BackendUnavailable``: why it cannot run here)."""
    if name is None:
        name = choose_backend(device)
    state = STATE.backends
    key = (name, device)
    backend: Backend | None = state.objects.get(key)
    if backend is not None:
        return backend
    with state.lock:
        backend = state.objects.get(key)
        if backend is None:
            reg = _registered(name)
            if reg is None:
                raise BackendUnavailable(
                    f"unknown backend {name!r}; available names: {', '.join(names())}"
                )
            if device.kind != reg.kind and reg.kind == "cpu":
                others = ", ".join(f"'{r.name}'" for r in registrations(device.kind))
                raise BackendUnavailable(
                    f"the {reg.name} backend only serves device 'cpu', not {device}; for a "
                    f"{device.kind.upper()} device use backend='auto'"
                    + (f" or {others}" if others else "")
                )
            if device.kind != reg.kind:
                why = reg.why_unusable(0)
                because = f", and {reg.kind.upper()} cannot be used here: {why}" if why else ""
                raise BackendUnavailable(
                    f"the {reg.name} backend needs a {reg.kind.upper()} device "
                    f"(device='{reg.kind}:N'), not {device}{because}"
                )
            backend = reg.factory(device)
            declared = (reg.name, reg.maps, reg.exporter_owned)
            if (backend.name, backend.maps, backend.exporter_owned) != declared:
                raise TypeError(f"the {name} backend object does not match its registration")
            state.objects[key] = backend
    return backend


def list_backends(device: str | int | Device | None = None) -> dict[str, str | None]:
    """Every memory system sharedarrays knows: name -> ``None`` if usable here, else why not.

    Parameters
    ----------
    device : str, int or Device, optional
        The accelerator device to check its kind's backends on (default: device 0 of each).

    Raises
    ------
    ValueError
        ``device`` is ``cpu`` or not a device name.
    """
    dev = None
    if device is not None:
        dev = parse_name(device)
        if not dev.needs_context:
            raise ValueError(f"list_backends(device=...) takes an accelerator device, not {dev}")
    return {
        r.name: r.why_unusable(dev.index if dev is not None and r.kind == dev.kind else 0)
        for r in registrations()
    }
