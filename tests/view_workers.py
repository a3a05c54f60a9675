"""Worker functions for tests/api/test_pickled_views.py (importable by spawned children)."""

from __future__ import annotations

import os
from typing import Any


def describe(views: list[Any]) -> list[dict[str, Any]]:
    """What each loaded view is: its layout, flags, values and its allocation's mapping."""
    return [
        {
            "shape": v.shape,
            "strides": v.strides,
            "offset": v.offset,
            "readonly": v.readonly,
            "values": v.get().tolist(),
            "writeable": bool(v.array.flags.writeable),
            "access": v.allocation.access,
            "alloc": v.allocation.id,
            "origin": v.allocation.origin.pid,
            "same": [v.allocation is w.allocation for w in views],
        }
        for v in views
    ]


def describe_to_queue(views: list[Any], q: Any) -> None:
    """:func:`describe` for a Process's arguments, with the child's pid."""
    q.put((os.getpid(), describe(views)))
