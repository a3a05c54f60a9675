"""Display of the memory map: mime bundles, the PNG, the HTML marker, the live widget.

Arrays here are larger than the small-array packing threshold (64 KiB), or pass
``chunk_bytes``, so that each has an allocation of its own."""

from __future__ import annotations

import base64
import io
import os
import re
import time

import pytest

import sharedarrays as sa
from sharedarrays.api.widgets import MemoryMap, render_html, render_png, render_text, table_rows
from sharedarrays.api.widgets.view import WIDGET_MIME

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _decode_png(data: str) -> tuple[int, ...]:
    import matplotlib.image

    raw = base64.b64decode(data)
    assert raw.startswith(PNG_MAGIC)
    return matplotlib.image.imread(io.BytesIO(raw), format="png").shape


def test_array_map_mimebundle_has_three_types():
    a = sa.zeros((4, 1000), device="cpu", chunk_bytes=8192)
    m = a.show()
    bundle = m._repr_mimebundle_()
    assert {"text/plain", "text/html", "image/png"} <= set(bundle)
    assert WIDGET_MIME not in bundle  # not in a kernel
    assert bundle["text/plain"] == repr(m)
    h, w, _ = _decode_png(bundle["image/png"])
    assert w == 900 and h > 50
    html = bundle["text/html"]
    assert 'class="sa-memory-map"' in html
    assert 'data-chunks="4"' in html
    assert html.count('class="sa-chunk"') == 4
    assert 'data-views="1"' in html


def test_mimebundle_include_exclude():
    a = sa.zeros(10, device="cpu")
    assert set(a._repr_mimebundle_(include=["text/plain"])) == {"text/plain"}
    assert set(a._repr_mimebundle_(exclude=["text/plain"])) == {"text/html"}
    m = a.show()
    assert set(m._repr_mimebundle_(include=["text/plain"])) == {"text/plain"}
    assert "image/png" not in m._repr_mimebundle_(exclude=["image/png"])


def test_closed_array_mimebundle_is_text_only():
    a = sa.zeros(10, device="cpu")
    a.close()
    assert set(a._repr_mimebundle_()) == {"text/plain"}


def test_registry_view_counts_rows_and_chunks():
    a = sa.zeros(10_000, device="cpu")
    b = sa.zeros((3, 4096), dtype="uint8", device="cpu", chunk_bytes=4096)
    m = sa.show([a, b])
    html = m._repr_mimebundle_()["text/html"]
    rows = int(re.search(r'data-rows="(\d+)"', html).group(1))
    # a: reservation, mapping, lost to granularity, view; b: reservation, 3 mappings, view
    assert rows == 4 + 5
    assert html.count('class="sa-row"') == rows
    assert html.count('class="sa-chunk"') == 4
    assert html.count('class="sa-lost"') == 1
    # (the map said "waste" where top and ls say "lost to granularity")
    assert "lost to granularity" in html and "lost to granularity" in repr(m)
    assert "waste" not in html + repr(m)
    assert "exporter: this process" in html
    assert a.allocation.id[:8] in repr(m)


def test_empty_map_renders():
    html = render_html([])
    assert 'data-allocations="0"' in html
    assert render_png([]).startswith(PNG_MAGIC)
    assert "no live" in render_text([])


def test_refresh_rereads_registry():
    m = sa.show()
    before = {x.alloc_id for x in m.maps}
    a = sa.zeros(100_000, device="cpu")
    assert a.allocation.id not in before
    after = {x.alloc_id for x in m.refresh()}
    assert a.allocation.id in after
    assert m.updated > 0


def test_array_map_follows_views_and_release():
    a = sa.zeros((8, 4096), device="cpu")
    m = a.show()
    assert len(m.maps) == 1 and len(m.maps[0].views) == 1
    v = a[2:4]
    assert len(m.refresh()[0].views) == 2
    del v
    a.close()
    assert m.refresh() == []  # the map holds no reference to the allocation


def _pid_and_sum(a):
    return os.getpid(), float(a.array.sum())


def test_served_importers_in_provenance():
    a = sa.full(100_000, 2.0, device="cpu")
    with sa.Pool(1) as pool:
        pid, total = pool.apply(_pid_and_sum, (a,))
    assert total == 200_000.0
    m = a.show()
    assert [s.pid for s in m.maps[0].served] == [pid]
    html = render_html(m.maps)
    assert f"pid {pid} at" in html
    assert f"served to 1 importer: pid {pid}" in repr(m)


def _map_text_in_worker(a: sa.SharedDeviceArray) -> tuple[str, str]:
    m = a.show()
    return repr(m), render_html(m.maps)


@pytest.mark.timeout(120)
def test_the_map_says_exporter_and_importer():
    # (it said "created here", "imported from pid N" and "served to": not the words of the
    # design, which top and ls use)
    a = sa.full(100_000, 2.0, device="cpu")
    with sa.Pool(1) as pool:
        text, html = pool.apply(_map_text_in_worker, (a,))
    assert f"importer of pid {os.getpid()}'s allocation" in text
    assert "served to no importer yet" in text
    assert "exporter / importer" in html and "handles served to importers" in html
    mine = repr(a.show())
    assert "exporter: this process" in mine and "served to 1 importer" in mine
    for old in ("created here", "imported from", "came from"):
        assert old not in text + html + mine


def test_widget_refresh_and_auto_refresh_stop_on_close():
    pytest.importorskip("ipywidgets")
    a = sa.zeros(100_000, device="cpu")
    m = MemoryMap(a, interval=0.2)
    box = m.widget
    assert box is m.widget
    html = m.widget.html
    b = a[1:3]
    m.widget.refresh_button.click()
    assert html.value.count('class="sa-view"') == 2
    m.widget.auto_toggle.value = True
    assert m.auto_refreshing
    thread = m._thread
    first = m.updated
    deadline = time.time() + 5
    while m.updated == first and time.time() < deadline:
        time.sleep(0.02)
    assert m.updated > first, "auto-refresh did not refresh"
    m.widget.interval_text.value = 0.5
    assert m._interval == 0.5
    m.close()
    assert not thread.is_alive()
    assert not m.auto_refreshing
    del b


def test_auto_refresh_stops_when_widget_closed_from_outside():
    pytest.importorskip("ipywidgets")
    m = sa.show(interval=0.2)
    box = m.widget
    m.start()
    thread = m._thread
    box.close()  # e.g. Widget.close_all()
    thread.join(5)
    assert not thread.is_alive()
    m.close()


def test_toggle_off_stops_thread():
    pytest.importorskip("ipywidgets")
    m = sa.show(interval=0.2, auto_refresh=True)
    assert m.widget is not None
    assert m.auto_refreshing
    thread = m._thread
    m.widget.auto_toggle.value = False
    assert not thread.is_alive()
    m.close()


def test_auto_refresh_stops_when_the_map_is_collected():
    """A finalizer (weakref.finalize) wakes the thread: it does not sleep out its interval."""
    import gc

    m = sa.show(interval=60.0)
    m.start()
    thread = m._thread
    assert thread is not None and thread.is_alive()
    del m
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_import_is_lazy():
    import subprocess
    import sys

    code = (
        "import sys, sharedarrays as sa; a = sa.zeros(3, device='cpu'); sa.show(a); "
        "print(sorted(m for m in ('ipywidgets', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ},
    ).stdout
    assert out.strip() == "[]"


def _access_in_worker(a: sa.SharedDeviceArray) -> tuple[str, str, list[str]]:
    m = a.show()
    rows = [r.detail for r in table_rows(m.maps) if r.kind.startswith(("chunk", "mapping"))]
    return repr(m), render_html(m.maps), rows


@pytest.mark.timeout(120)
def test_the_map_shows_a_read_only_mapping_as_it_is():
    # (the text form said nothing of the access, and the exporter of a readonly=True array
    # read "cpu: rw" as if its importers could write too)
    a = sa.full(100_000, 2.0, device="cpu", readonly=True)
    b = sa.full(100_000, 2.0, device="cpu")
    with sa.Pool(1) as pool:
        text, html, rows = pool.apply(_access_in_worker, (a,))
        assert "access cpu: r," in text
        assert "access cpu: r<" in html and "access cpu: rw" not in html
        assert rows and all(d.endswith("cpu: r") for d in rows)
        view = b[:10]
        view.flags.writeable = False
        text, html, rows = pool.apply(_access_in_worker, (view,))  # its first view: read-only
        assert "access cpu: r," in text and "10 float64 read-only" in html
    mine = repr(a.show())
    assert "access cpu: rw (importers: r)" in mine
    assert "access cpu: rw," in repr(b.show())


def test_the_table_lists_the_allocations_the_map_draws():
    # (the map drew 24 bars but its table listed every row: 500 allocations were 2,000 rows,
    # some 500 KB of HTML at each auto-refresh)
    from sharedarrays.api.widgets.render import MAX_DRAWN

    arrays = [sa.zeros(20_000, device="cpu", pack=False) for _ in range(MAX_DRAWN + 6)]
    maps = sa.show(arrays).maps
    html = render_html(maps)
    rows = int(re.search(r'data-rows="(\d+)"', html).group(1))
    assert html.count('class="sa-row"') == rows == 4 * MAX_DRAWN  # reservation, mapping, ...
    assert html.count('class="sa-chunk"') == MAX_DRAWN
    assert html.count('class="sa-provenance-row"') == MAX_DRAWN
    assert f'data-allocations="{MAX_DRAWN + 6}" data-shown="{MAX_DRAWN}"' in html
    assert html.count(f"6 more allocations not shown (of {MAX_DRAWN + 6})") == 3
    drawn = {m.short_id for m in maps[:MAX_DRAWN]}
    listed = set(re.findall(r'<tr class="sa-row" data-kind="[^"]*"><td>(\w+)</td>', html))
    assert listed == drawn  # the same allocations as the bars
    for a in arrays:
        a.close()


@pytest.mark.timeout(60)
def test_a_failed_auto_refresh_shows_in_the_status(monkeypatch):
    # (the thread swallowed the error: the map stood still and said nothing)
    pytest.importorskip("ipywidgets")
    a = sa.zeros(100_000, device="cpu")
    m = MemoryMap(a, interval=0.2)
    status = m.widget.status

    def broken():
        raise RuntimeError("the registry is unreadable")

    monkeypatch.setattr(m, "_read", broken)
    m.start()
    deadline = time.monotonic() + 30
    while "refresh failed" not in status.value and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status.value == "refresh failed: the registry is unreadable"
    assert m.auto_refreshing  # it goes on
    m.close()
