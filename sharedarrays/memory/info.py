"""Read-only records of an allocation, as ``describe``, the widgets and the CLI show it."""

from __future__ import annotations

from dataclasses import dataclass

from sharedarrays.backends import Access

__all__ = ["Origin", "Served", "ChunkInfo", "MappingInfo", "format_bytes"]


@dataclass(frozen=True)
class Origin:
    """Where an allocation in this process came from.

    Attributes
    ----------
    created_here : bool
        True in the exporter, False in importers.
    pid : int
        The process that created it, or that an importer imported it from.
    time : float
        When it was created or imported (``time.time()``).
    """

    created_here: bool
    pid: int
    time: float

    @property
    def role(self) -> str:
        """This process's part, e.g. ``"importer of pid 123's allocation"``."""
        if self.created_here:
            return "exporter: this process"
        return f"importer of pid {self.pid}'s allocation"


@dataclass(frozen=True)
class Served:
    """One time this process handed an allocation's handles to another process."""

    pid: int
    time: float


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk of an allocation, as seen from this process."""

    index: int
    size: int
    fd: int


@dataclass(frozen=True)
class MappingInfo:
    """One mapping: ``size`` bytes of chunk ``chunk`` at ``offset`` in the reservation."""

    offset: int
    size: int
    chunk: int
    chunk_offset: int
    access: Access


def format_bytes(n: int) -> str:
    """Bytes as a short human-readable size (binary units)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{n} B"
