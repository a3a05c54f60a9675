"""Sizes as the command line takes them: ``"256M"``, ``"1G"``, ``"4096"`` (binary units)."""

from __future__ import annotations

import argparse
import re

__all__ = ["parse_size", "size_label"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Parse ``"256M"``, ``"1G"``, ``"4096"`` (binary units) into bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 256M or 1G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_label(n: int) -> str:
    """``1048576`` -> ``"1M"`` (binary units, as the command line takes them)."""
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
