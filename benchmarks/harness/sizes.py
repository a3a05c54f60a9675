"""Sizes as the command line takes them: ``"256M"``, ``"1G"``, ``"4096"`` (binary units)."""

from __future__ import annotations

try:
    from sharedarrays.cli import parse_size  # (the demo's --size, the same units)
except ImportError:  # a tree from before the harness left the package (ab.sh's A side)
    from sharedarrays.bench.sizes import parse_size  # type: ignore[no-redef]

__all__ = ["parse_size", "size_label"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def size_label(n: int) -> str:
    """``1048576`` -> ``"1M"`` (binary units, as the command line takes them)."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
