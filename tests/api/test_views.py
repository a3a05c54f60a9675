"""The live views of this process (sharedarrays.api.views), as the memory map reads them."""

from __future__ import annotations

import gc
import subprocess
import sys

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


_FRESH = """
import gc
import sharedarrays as sa
from sharedarrays.api import views
from sharedarrays.process import STATE

a = sa.zeros(8, device="cpu")
b = a[2:4]
assert not STATE.views.live, "a view was tracked before anyone asked"
live = views.live_views()
assert any(v is a for v in live) and any(v is b for v in live), live
c = a[5:]
assert any(v is c for v in views.live_views())
c_id = id(c)
del c, live
gc.collect()
assert all(id(v) != c_id for v in views.live_views())
print("ok")
"""


def test_views_are_tracked_from_the_first_ask_with_those_alive_then() -> None:
    """Nothing is tracked until someone asks (a worker loading many views pays nothing);
    the first ask finds the views alive then, and views made afterwards are tracked."""
    done = subprocess.run(
        [sys.executable, "-c", _FRESH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


_DEAD_PROXY = """
import gc, weakref, warnings
import sharedarrays as sa
from sharedarrays.api import views

class Thing:
    pass

thing = Thing()
proxy = weakref.proxy(thing)  # (reading its __class__ raises once the thing is gone)
del thing
gc.collect()
a = sa.zeros(8, device="cpu")
with warnings.catch_warnings():
    warnings.simplefilter("error")
    live = views.live_views()
assert any(v is a for v in live), live
print("ok")
"""


def test_the_first_search_reads_no_object_beyond_its_type() -> None:
    """The first ask looks at every object the collector knows: a dead weakref.proxy among
    them (whose ``__class__`` raises) neither breaks it nor is taken for a view."""
    done = subprocess.run(
        [sys.executable, "-c", _DEAD_PROXY], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
