"""The seam memory systems plug into: one :class:`Registration` per backend.

A backend module ends with one call::

    register(Registration(name="cuda-vmm", kind="cuda", factory=CudaVmmBackend,
                          preference=0, maps=True, exporter_owned=False,
                          why_unusable=lambda index: ...))

and ``sharedarrays/backends/__init__.py`` imports the module. Everything above the backends
asks this registry, never a backend's name: which backend ``backend="auto"`` means on a
device (:func:`choose_backend`), the device a payload's memory belongs to
(:func:`device_of`), why a backend cannot be used here (:func:`why_unusable`), and the
process-wide backend object (:func:`get_backend`). Registering a backend of a new device kind
adds that kind to device parsing (:func:`sharedarrays.backends.device.add_kind`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from sharedarrays.backends.base import Backend
from sharedarrays.backends.device import Device, add_kind, kinds, parse_name
from sharedarrays.errors import BackendUnavailable, PayloadError

__all__ = [
    "Registration",
    "register",
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


@dataclass(frozen=True)
class Registration:
    """What a backend declares of itself.

    Attributes
    ----------
    name : str
        The backend's name in payloads, ``backend=`` and widgets (``"cuda-vmm"``).
    kind : str
        The device kind it serves (``"cpu"``, ``"cuda"``); its memory belongs to a device of
        that kind.
    factory : callable
        ``factory(device)`` makes the backend object for a device of that kind.
    preference : int
        Its place in what ``backend="auto"`` tries on a device of its kind: lowest first
        (ties in registration order).
    maps : bool
        Whether its chunks are mapped into reservations (:class:`~.base.MappingBackend`).
    exporter_owned : bool
        Whether its memory lives only while the exporter keeps it.
    why_unusable : callable
        ``why_unusable(index)``: why it cannot be used on device ``index`` of its kind in
        this process, or ``None`` when it can; must not raise (default: always usable).
    check_handle : callable, optional
        ``check_handle(fd, size)``: refuse (``PayloadError``) a chunk handle received from
        another process that is not a chunk of ``size`` bytes this backend can safely keep
        and map (host: a memfd sealed against shrinking); ``None``: no check. Does not close
        ``fd``.
    """

    name: str
    kind: str
    factory: Callable[[Device], Backend]
    preference: int
    maps: bool
    exporter_owned: bool
    why_unusable: Callable[[int], str | None] = _usable
    check_handle: Callable[[int, int], None] | None = None


_registry: dict[str, Registration] = {}
_lock = threading.Lock()
_backends: dict[tuple[str, Device], Backend] = {}


def register(reg: Registration) -> None:
    """Add a backend (and, the first time, its device kind).

    Raises
    ------
    ValueError
        Another registration already has that name.
    """
    known = _registry.get(reg.name)
    if known is not None and known != reg:
        raise ValueError(f"a backend named {reg.name!r} is already registered")
    if reg.kind != "cpu":
        kind = reg.kind
        add_kind(kind, lambda index: kind_unusable(kind, index))
    _registry[reg.name] = reg


def registration(name: str) -> Registration:
    """The registration of backend ``name``.

    Raises
    ------
    ValueError
        No backend of that name is registered (the message lists those that are).
    """
    reg = _registry.get(name)
    if reg is None:
        raise ValueError(f"unknown backend {name!r}; choose 'auto' or one of {', '.join(names())}")
    return reg


def registrations(kind: str | None = None) -> list[Registration]:
    """The registered backends (of one device kind), in ``backend="auto"``'s order: by
    device kind (``cpu`` first, then the kinds in the order they were registered), then by
    preference (ties in registration order)."""
    order = {k: i for i, k in enumerate(kinds())}
    regs = [r for r in _registry.values() if kind is None or r.kind == kind]
    return sorted(regs, key=lambda r: (order[r.kind], r.preference))


def names() -> tuple[str, ...]:
    """The names of every registered backend, in :func:`registrations`' order."""
    return tuple(r.name for r in registrations())


def device_of(name: str, index: int) -> Device:
    """The device that memory of backend ``name`` on device ``index`` (a payload's
    ``backend`` and ``device``) belongs to. Does not ask whether it can be used here.

    Raises
    ------
    PayloadError
        No backend of that name is registered here (a payload of a backend whose module
        this process has not imported).
    """
    reg = _registry.get(name)
    if reg is None:
        raise PayloadError(
            f"unknown backend {name!r} in payload; the backends here are {', '.join(names())} "
            "(import the module that registers it first)"
        )
    return Device(reg.kind, 0 if reg.kind == "cpu" else int(index))


def why_unusable(name: str, index: int = 0) -> str | None:
    """Why backend ``name`` cannot be used on device ``index`` of its kind here, or ``None``."""
    reg = _registry.get(name)
    if reg is None:
        return f"unknown backend {name!r}; the backends are {', '.join(names())}"
    return reg.why_unusable(index)


def kind_unusable(kind: str, index: int = 0) -> str | None:
    """Why no backend of device kind ``kind`` can be used on device ``index`` here (the
    reason of the one ``backend="auto"`` tries first), or ``None`` when one can."""
    reasons = [r.why_unusable(index) for r in registrations(kind)]
    if not reasons:
        return f"no backend serves {kind} devices"
    return None if None in reasons else reasons[0]


def handle_check(name: object) -> Callable[[int, int], None] | None:
    """The check of chunk handles received for backend ``name`` (see
    :attr:`Registration.check_handle`), or ``None`` where it has none or is unknown."""
    reg = _registry.get(name) if isinstance(name, str) else None
    return None if reg is None else reg.check_handle


def choose_backend(device: Device, name: str = "auto") -> str:
    """The backend ``name`` (``"auto"`` or a registered name) means on ``device``.

    ``"auto"`` is the first backend of the device's kind (by preference) that can be used on
    it here: ``host`` on ``cpu``; on a CUDA device the first of cuda-vmm, cuda-ipc, cuda-pool
    that the device supports.

    Raises
    ------
    ValueError
        An unknown name.
    BackendUnavailable
        ``"auto"`` on a device no backend of its kind can use (the reasons are named).
    """
    if name != "auto":
        return registration(name).name
    reasons = {r.name: r.why_unusable(device.index) for r in registrations(device.kind)}
    for n, why in reasons.items():
        if why is None:
            return n
    detail = "; ".join(f"{n}: {why}" for n, why in reasons.items())
    raise BackendUnavailable(f"no {device.kind.upper()} backend can use {device} here ({detail})")


def get_backend(device: Device, name: str | None = None) -> Backend:
    """Return the process-wide backend ``name`` for ``device`` (default: what ``"auto"``
    chooses, see :func:`choose_backend`); backends are made on first use and live as long
    as the process.

    Raises
    ------
    BackendUnavailable
        The backend cannot run in this process (or is unknown); the message says why.
    """
    if name is None:
        name = choose_backend(device)
    key = (name, device)
    backend = _backends.get(key)
    if backend is not None:
        return backend
    with _lock:
        backend = _backends.get(key)
        if backend is None:
            reg = _registry.get(name)
            if reg is None:
                raise BackendUnavailable(
                    f"unknown backend {name!r}; available names: {', '.join(names())}"
                )
            if device.kind != reg.kind:
                raise BackendUnavailable(_wrong_kind(reg, device))
            backend = reg.factory(device)
            if (backend.name, backend.maps, backend.exporter_owned) != (
                reg.name,
                reg.maps,
                reg.exporter_owned,
            ):
                raise TypeError(f"the {name} backend object does not match its registration")
            _backends[key] = backend
    return backend


def _wrong_kind(reg: Registration, device: Device) -> str:
    """Why backend ``reg`` refuses ``device``, and what to use instead."""
    if reg.kind == "cpu":
        others = ", ".join(f"'{r.name}'" for r in registrations(device.kind))
        return (
            f"the {reg.name} backend only serves device 'cpu', not {device}; for a "
            f"{device.kind.upper()} device use backend='auto'" + (f" or {others}" if others else "")
        )
    kind = reg.kind.upper()
    why = reg.why_unusable(0)
    because = f", and {kind} cannot be used here: {why}" if why else ""
    return (
        f"the {reg.name} backend needs a {kind} device (device='{reg.kind}:N'), not "
        f"{device}{because}"
    )


def list_backends(device: str | int | Device | None = None) -> dict[str, str | None]:
    """Every memory system sharedarrays knows, and why each unusable one cannot be used here.

    Parameters
    ----------
    device : str, int or Device, optional
        The accelerator device to check the backends of its kind on (default: device 0 of
        each kind).

    Returns
    -------
    dict
        Backend name -> ``None`` when it can be used in this process, else the reason.

    Raises
    ------
    ValueError
        ``device`` is ``cpu`` or not a device name.

    Examples
    --------
    >>> sharedarrays.list_backends()  # doctest: +SKIP
    {'host': None, 'cuda-vmm': 'no NVIDIA driver: ...', 'cuda-ipc': '...', 'cuda-pool': '...'}
    """
    dev = None
    if device is not None:
        dev = parse_name(device)
        if not dev.needs_context:
            raise ValueError(f"list_backends(device=...) takes an accelerator device, not {dev}")
    out: dict[str, str | None] = {}
    for reg in registrations():
        index = dev.index if dev is not None and reg.kind == dev.kind else 0
        out[reg.name] = reg.why_unusable(index)
    return out
