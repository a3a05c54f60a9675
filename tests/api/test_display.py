"""Display of an array: repr and str show the values and one line about the allocation, the
Jupyter bundle shows the values, and show() returns widgets that compose with ipywidgets."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api.widgets import view
from sharedarrays.api.widgets.view import WIDGET_MIME, widgets_available


def test_repr_shows_the_values_like_numpy_and_the_allocation() -> None:
    ref = np.arange(12.0).reshape(3, 4)
    a = sa.from_array(ref, device="cpu", pack=False)  # its own allocation, served to nobody
    values, line = repr(a).rsplit("\n", 1)
    assert values == repr(ref)
    assert line == (
        f"SharedDeviceArray on cpu (host), allocation {a.allocation.id[:12]} "
        f"offset {a.offset}, exporter: this process"
    )
    v = a[1, ::2]
    assert repr(v).split("\n")[0] == repr(ref[1, ::2])
    assert f"offset {v.offset}," in repr(v)


def test_str_and_format_show_the_values_like_numpy() -> None:
    ref = np.array([[1.5, 2], [3, 4]], dtype="float32")
    a = sa.from_array(ref, device="cpu")
    assert str(a) == str(ref) and f"{a}" == f"{ref}"  # no line about the allocation
    assert str(a[0, 1]) == str(ref[0, 1]) and f"v={a[0, 0]}" == "v=1.5"
    assert f"{a[1, 0]:.2f}" == "3.00" and format(a[0, 0], "08.3f") == "0001.500"
    with pytest.raises(TypeError, match="unsupported format string"):
        f"{a:.2f}"  # (as NumPy: a format spec only for 0-d arrays)
    assert str(sa.full((), 7, device="cpu")) == "7"


def test_repr_follows_numpy_print_options_and_summarises() -> None:
    a = sa.from_array(np.array([1 / 3, 2 / 3]), device="cpu")
    with np.printoptions(precision=2):
        assert repr(a).startswith("array([0.33, 0.67])")
    big = sa.zeros(100_000, dtype="int8", device="cpu")
    assert repr(big).startswith(repr(np.zeros(100_000, dtype="int8")))
    assert "..." in repr(big) and repr(big).count("\n") == 1


def test_closed_view_says_so_without_touching_memory() -> None:
    a = sa.zeros((2, 3), dtype="float32", device="cpu")
    a.close()
    assert repr(a) == "<SharedDeviceArray shape=(2, 3) dtype=float32 closed>"
    assert str(a) == repr(a) == f"{a}"
    assert a._repr_mimebundle_() == {"text/plain": repr(a)}


def _repr_in_worker(a: sa.SharedDeviceArray) -> tuple[int, str]:
    return os.getpid(), repr(a)


def test_the_line_says_who_shares_the_memory() -> None:
    a = sa.full(100_000, 2.0, device="cpu")
    with sa.Pool(1) as pool:
        pid, text = pool.apply(_repr_in_worker, (a,))
    assert text.endswith(f"importer of pid {os.getpid()}'s allocation")
    assert repr(a).endswith("exporter: this process, served to 1 importer")
    assert pid != os.getpid()


def test_a_read_only_view_says_so() -> None:
    a = sa.zeros(100_000, device="cpu", readonly=True)
    payload = a.payload()
    assert payload.readonly
    b = sa.load(payload.to_bytes())
    assert b.readonly and repr(b).endswith(", read-only view")
    assert not repr(a).endswith("read-only view")


def test_jupyter_bundle_shows_the_values_and_a_compact_line() -> None:
    a = sa.from_array(np.array([1, 2, 3], dtype="uint8"), device="cpu")
    bundle = a._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == repr(a)
    html = bundle["text/html"]
    assert html.startswith('<pre class="sa-values">array([1, 2, 3], dtype=uint8)</pre>')
    assert f"allocation {a.allocation.id[:12]}" in html and ".show()" in html
    assert 'class="sa-memory-map"' not in html  # the map is a.show(), not the array


def test_html_escapes_the_values() -> None:
    a = sa.from_array(np.array([1.0]), device="cpu")
    with np.printoptions(formatter={"float": lambda x: "<b>&"}):
        html = a._repr_mimebundle_()["text/html"]
    assert "&lt;b&gt;&amp;" in html and "<b>" not in html


def test_displaying_an_array_imports_neither_matplotlib_nor_ipywidgets() -> None:
    code = (
        "import sys, sharedarrays as sa; a = sa.zeros(3, device='cpu'); repr(a); str(a); "
        "a._repr_mimebundle_(); "
        "print(sorted(m for m in ('ipywidgets', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


# widgets ----------------------------------------------------------------------------------
_VERSIONS = [("10.0.1", True), ("8.0.0", True), ("8.1.9", True), ("v9", True), ("7.9", False)]


@pytest.mark.parametrize(("version", "ok"), [*_VERSIONS, ("7.8.5", False), ("dev", False)])
def test_widgets_available_compares_major_versions(
    monkeypatch: pytest.MonkeyPatch, version: str, ok: bool
) -> None:
    fake = types.ModuleType("ipywidgets")
    fake.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ipywidgets", fake)
    assert widgets_available() is ok


def test_show_outside_a_kernel_is_the_static_map() -> None:
    a = sa.zeros(100_000, device="cpu")
    m = a.show()
    assert isinstance(m, sa.MemoryMap)
    assert isinstance(sa.show(), sa.MemoryMap)
    assert a.allocation.id[:8] in repr(m)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """As if in a Jupyter kernel with ipywidgets: show() returns the live widget."""
    w = pytest.importorskip("ipywidgets")
    monkeypatch.setattr(view, "in_kernel", lambda: True)
    return w


def test_show_in_a_kernel_returns_widgets_that_compose(kernel: types.ModuleType) -> None:
    w = kernel
    from sharedarrays.api.widgets.live import MemoryMapWidget

    a = sa.zeros(100_000, device="cpu")
    one, every = a.show(), sa.show(interval=0.5)
    assert isinstance(one, MemoryMapWidget) and isinstance(one, w.VBox)
    assert isinstance(one.memory_map, sa.MemoryMap)
    assert one.memory_map.widget is one
    boxes = [w.VBox([one, every]), w.HBox([one, every]), w.Tab(children=[one, every])]
    assert all(box.children == (one, every) for box in boxes)
    assert [m.alloc_id for m in one.maps] == [a.allocation.id]
    assert a.allocation.id in {m.alloc_id for m in every.refresh()}
    assert a.allocation.id[:8] in repr(one)
    for box in boxes:
        box.close()
    one.close()
    every.close()


def test_live_widget_bundle_has_the_static_views_and_the_widget_view(
    kernel: types.ModuleType,
) -> None:
    a = sa.zeros((4, 1000), device="cpu", chunk_bytes=8192)
    live = a.show()
    bundle = live._repr_mimebundle_()
    assert {"text/plain", "text/html", "image/png", WIDGET_MIME} <= set(bundle)
    assert bundle[WIDGET_MIME]["model_id"] == live.model_id
    assert 'data-chunks="4"' in bundle["text/html"]
    assert set(live._repr_mimebundle_(include=["text/plain"])) == {"text/plain"}
    live.close()


def test_live_widget_refreshes_auto_refreshes_and_closes(kernel: types.ModuleType) -> None:
    a = sa.zeros(100_000, device="cpu")
    live = a.show(interval=0.2)
    b = a[1:3]
    live.refresh_button.click()
    assert live.html.value.count('class="sa-view"') == 2
    live.auto_toggle.value = True
    assert live.auto_refreshing
    thread = live.memory_map._thread
    live.interval_text.value = 0.5
    assert live.memory_map._interval == 0.5
    live.stop()
    assert not thread.is_alive() and not live.auto_toggle.value
    live.start(0.2)
    assert live.auto_refreshing and live.auto_toggle.value
    thread = live.memory_map._thread
    live.close()
    assert not thread.is_alive() and not live.auto_refreshing
    assert live.comm is None and live.html.comm is None
    del b


def test_auto_refresh_option_starts_the_live_widget(kernel: types.ModuleType) -> None:
    live = sa.show(interval=0.2, auto_refresh=True)
    assert live.auto_refreshing
    live.memory_map.close()  # closes the widget too
    assert not live.auto_refreshing and live.comm is None


@pytest.mark.gpu
def test_cuda_repr_is_cupys_and_names_the_device() -> None:
    cupy = pytest.importorskip("cupy")
    a = sa.from_array(cupy.arange(6, dtype="float32").reshape(2, 3))
    values, line = repr(a).rsplit("\n", 1)
    assert values == repr(a.array)
    assert line.startswith(f"SharedDeviceArray on {a.device} ({a.backend}), allocation ")
    assert str(a) == str(a.array) and f"{a[1, 2]:.1f}" == "5.0"
    assert a._repr_mimebundle_()["text/plain"] == repr(a)
