"""A live view's auto-refresh stops when the notebook cell that made it runs again, in a
real kernel (jupyter_client), with the cell ids JupyterLab sends."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

import pytest

import sharedarrays as sa

pytestmark = pytest.mark.timeout(180)

THREADS = (
    "import threading\n"
    "print(sorted(t.name for t in threading.enumerate() if t.name.startswith('sharedarrays-')"
    " and 'ask' not in t.name))"
)


@pytest.fixture
def kernel() -> Iterator[Any]:
    pytest.importorskip("ipywidgets")
    manager_module = pytest.importorskip("jupyter_client.manager")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(sa.__file__).parents[1])
    km, kc = manager_module.start_new_kernel(kernel_name="python3", env=env)
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run(kc: Any, code: str, cell: str) -> str:
    """Run ``code`` as the notebook cell ``cell`` (JupyterLab's ``cellId``); its stdout."""
    msg = kc.session.msg(
        "execute_request",
        {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        metadata={"cellId": cell},
    )
    kc.shell_channel.send(msg)
    out = []
    while True:
        try:
            reply = kc.get_iopub_msg(timeout=60)
        except Empty:
            raise AssertionError(f"cell {cell} did not finish: {''.join(out)}") from None
        if reply["parent_header"].get("msg_id") != msg["header"]["msg_id"]:
            continue
        kind, content = reply["msg_type"], reply["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            raise AssertionError("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(out)


def test_running_a_cell_again_stops_the_auto_refresh_it_started(kernel: Any) -> None:
    # (each run of the cell left one more thread refreshing a widget no longer on the page)
    _run(kernel, "import sharedarrays as sa\na = sa.zeros(100_000, pack=False)", "setup")
    show = "m = a.show(auto_refresh=True)\nn = sa.show(scope='node', auto_refresh=True)"
    _run(kernel, show, "map")
    assert _run(kernel, THREADS, "count") == (
        "['sharedarrays-memory-map', 'sharedarrays-node-map']\n"
    )
    for _ in range(3):
        _run(kernel, show, "map")  # the same cell again
    assert _run(kernel, THREADS, "count") == (
        "['sharedarrays-memory-map', 'sharedarrays-node-map']\n"
    )
    _run(kernel, "m.close(); n.close()", "end")
    assert _run(kernel, THREADS, "count") == "[]\n"


def test_a_map_of_closed_arrays_stops_refreshing(kernel: Any) -> None:
    # (its thread went on redrawing an empty map every interval for as long as the kernel ran)
    _run(kernel, "import sharedarrays as sa\na = sa.zeros(100_000, pack=False)", "setup")
    _run(kernel, "m = a.show(interval=0.2, auto_refresh=True)", "map")
    _run(kernel, "t = m.memory_map._thread\na.close()\nt.join(30)", "close")
    out = _run(kernel, "print(t.is_alive(), m.auto_toggle.value, m.status.value)", "check")
    alive, toggle, status = out.split(" ", 2)
    assert (alive, toggle) == ("False", "False") and "auto-refresh stopped" in status
