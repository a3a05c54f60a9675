"""Memory systems behind the :class:`~.base.Backend` protocol, one module or folder each.
The host backend registers here; the accelerators' modules register when a backend is first
asked for (:func:`~.registry.load_accelerators`), and none loads a driver until used."""

from __future__ import annotations

import functools

from sharedarrays.backends import host as _host  # noqa: F401 - registers "host"
from sharedarrays.backends import registry as _registry
from sharedarrays.backends.base import (
    Access,
    Backend,
    BorrowingBackend,
    Chunk,
    MappingBackend,
    NativeView,
    StreamBackend,
    round_up,
)
from sharedarrays.backends.device import add_kind as _add_kind
from sharedarrays.backends.registry import *  # noqa: F403

__all__ = [
    "Access",
    "Backend",
    "BorrowingBackend",
    "Chunk",
    "MappingBackend",
    "NativeView",
    "StreamBackend",
    "round_up",
    *_registry.__all__,
]

# the accelerators' device kinds, in the order device=None and sa.list_backends() take them
for _kind in ("cuda", "hip", "npu"):
    _add_kind(_kind, functools.partial(_registry.kind_unusable, _kind))
