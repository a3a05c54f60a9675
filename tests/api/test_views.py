"""The live views of this process (sharedarrays.api.views), as the memory map reads them."""

from __future__ import annotations

import gc

import numpy as np

import sharedarrays as sa
from sharedarrays.api.views import is_view, live_views


def test_every_view_is_tracked_until_it_is_collected() -> None:
    a = sa.zeros(8, device="cpu")
    b = a[2:4]
    assert is_view(a) and is_view(b)
    live = live_views()
    assert any(v is a for v in live) and any(v is b for v in live)
    del live
    b_id = id(b)
    del b
    gc.collect()
    assert all(id(v) != b_id for v in live_views())
    assert any(v is a for v in live_views())


def test_other_objects_are_not_views() -> None:
    a = sa.zeros(8, device="cpu")
    assert not is_view(a.allocation)
    assert not is_view(np.zeros(3))  # weakly referable but unhashable
    assert not is_view(42)
    assert not is_view(None)
