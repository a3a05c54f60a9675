"""The node-wide view's pictures in docs/notebooks.md, made from real processes.

An exporter and an importer share an array, a third process parks one and exits, and the
process that shows the view holds a named array. Then:

* ``test_top_terminal_screenshot``: ``python -m sharedarrays top --once`` runs, its output
  is checked and drawn as a terminal would show it (matplotlib, a monospace font, light text
  on a dark background) into ``artifacts/screenshots/top.png``;
* ``test_node_widget_screenshot_in_jupyterlab`` (marker ``browser``): a notebook that starts
  the same processes and ends with ``sa.show(scope="node")`` runs in JupyterLab, driven by
  Playwright with Debian's chromium as ``tests/test_browser.py`` does; the widget is checked
  against the map this process reads and screenshotted to
  ``artifacts/screenshots/node-widget.png``.

With ``SA_UPDATE_SCREENSHOT=1`` each also refreshes the copy the docs show in
``docs/img/`` (``top.png``, ``node-widget.png``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import node_workers
import pytest

import sharedarrays as sa
from sharedarrays.api import nodemap

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts" / "screenshots"
DOCS_IMG = ROOT / "docs" / "img"
TIMEOUT = 60
ctx = mp.get_context("spawn")


def _update(shot: Path) -> None:
    """Copy ``shot`` over the docs' picture when asked to (``SA_UPDATE_SCREENSHOT=1``)."""
    if os.environ.get("SA_UPDATE_SCREENSHOT") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, DOCS_IMG / shot.name)


@contextlib.contextmanager
def _scene() -> Iterator[dict[str, Any]]:
    """Real processes holding arrays: an exporter and an importer of it (both running), a
    parked allocation whose process exited; the pids and ids, cleaned up afterwards."""
    stop, stop_importer, ready = ctx.Event(), ctx.Event(), ctx.Event()
    out = ctx.Queue()
    procs: list[Any] = []
    parked_id = None
    try:
        exp = ctx.Process(target=node_workers.exporter, args=(out, stop), daemon=True)
        exp.start()
        procs.append(exp)
        shared_id, blob = out.get(timeout=TIMEOUT)
        imp = ctx.Process(
            target=node_workers.importer, args=(blob, ready, stop_importer), daemon=True
        )
        imp.start()
        procs.append(imp)
        assert ready.wait(TIMEOUT)
        park = ctx.Process(target=node_workers.parker, args=(out,))
        park.start()
        procs.append(park)
        parked_id = out.get(timeout=TIMEOUT)
        park.join(TIMEOUT)
        yield {"exporter": exp.pid, "importer": imp.pid, "shared": shared_id, "parked": parked_id}
    finally:
        stop_importer.set()
        stop.set()
        for p in procs:
            p.join(TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)
        if parked_id is not None:
            with contextlib.suppress(sa.SharedArrayError):
                nodemap.free(nodemap.find(nodemap.node_map(), parked_id), lambda q: True)


def render_terminal(text: str, path: Path, title: str) -> None:
    """Draw ``text`` as a terminal shows it (a prompt line ``title`` first) into ``path``."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    lines = [f"$ {title}", *text.splitlines()]
    columns = max(len(line) for line in lines) + 2
    size = 11  # points; a DejaVu Sans Mono cell is 0.6 em wide
    width = columns * size * 0.6 / 72 + 0.4
    height = (len(lines) + 1) * size * 1.35 / 72 + 0.3
    fig = plt.figure(figsize=(width, height), dpi=120)
    fig.patch.set_facecolor("#1e1e1e")
    fig.text(
        0.2 / width,
        1 - 0.15 / height,
        "\n".join(lines),
        family="DejaVu Sans Mono",
        size=size,
        color="#d4d4d4",
        va="top",
        ha="left",
        linespacing=1.35,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, facecolor=fig.get_facecolor())
    plt.close(fig)


@pytest.mark.timeout(240)
def test_top_terminal_screenshot() -> None:
    pytest.importorskip("matplotlib")
    name = f"features-{os.getpid()}"
    features = sa.zeros((300, 500), dtype="float64", device="cpu", pack=False, name=name)
    try:
        with _scene() as scene:
            env = dict(os.environ)
            env["PYTHONPATH"] = str(ROOT)
            out = subprocess.run(
                [sys.executable, "-m", "sharedarrays", "top", "--once"],
                capture_output=True,
                text=True,
                timeout=TIMEOUT,
                env=env,
            )
            assert out.returncode == 0, out.stderr
            text = out.stdout.rstrip("\n")
            lines = text.splitlines()
            table = lines[next(i for i, line in enumerate(lines) if line.startswith("ID ")) + 1 :]
            rows = {line.split()[0]: line for line in table}
            shared = rows[scene["shared"][:12]]
            assert "live" in shared and re.search(rf"\b{scene['exporter']}E\d+v", shared)
            assert re.search(rf"\b{scene['importer']}I\d+v", shared)
            assert "parked" in rows[scene["parked"][:12]]
            named = rows[features.allocation.id[:12]]
            assert name in named and re.search(rf"\b{os.getpid()}E\d+v", named)
            shot = ARTIFACTS / "top.png"
            render_terminal(text, shot, "python -m sharedarrays top --once")
            assert shot.stat().st_size > 10_000
            _update(shot)
    finally:
        features.close()
        sa.unlink(name)


NOTEBOOK_CELLS = [
    """\
import multiprocessing as mp
import sys

sys.path.insert(0, {tests!r})  # the workers of tests/node_workers.py
import node_workers
import sharedarrays as sa

ctx = mp.get_context("spawn")
out, stop, stop_importer, ready = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event()
exporter = ctx.Process(target=node_workers.exporter, args=(out, stop), daemon=True)
exporter.start()
shared_id, blob = out.get(timeout=60)
importer = ctx.Process(
    target=node_workers.importer, args=(blob, ready, stop_importer), daemon=True
)
importer.start()
assert ready.wait(60)
parker = ctx.Process(target=node_workers.parker, args=(out,))
parker.start()
parked_id = out.get(timeout=60)
parker.join(60)
features = sa.zeros((300, 500), device="cpu", pack=False, name={name!r})""",
    'sa.show(scope="node")',
]


@pytest.mark.browser
@pytest.mark.timeout(400)
def test_node_widget_screenshot_in_jupyterlab(tmp_path: Path) -> None:
    pytest.importorskip("jupyterlab")
    nbformat = pytest.importorskip("nbformat")
    sync_api = pytest.importorskip("playwright.sync_api")
    from test_browser import CHROMIUM, CHROMIUM_FLAGS, _settle_kernel, jupyterlab_server

    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    name = f"features-nb-{os.getpid()}"
    notebook = tmp_path / "node-map.ipynb"
    nb = nbformat.v4.new_notebook()
    tests = str(ROOT / "tests")
    nb.cells = [nbformat.v4.new_code_cell(c.format(tests=tests, name=name)) for c in NOTEBOOK_CELLS]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3 (ipykernel)",
        "language": "python",
    }
    nbformat.write(nb, notebook)
    before = {r.alloc_id for r in nodemap.node_map().allocations}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    try:
        with (
            jupyterlab_server(tmp_path, [notebook]) as url,
            sync_api.sync_playwright() as p,
        ):
            browser = p.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS
            )
            try:
                page = browser.new_page(viewport={"width": 1800, "height": 1000})
                page.set_default_timeout(120_000)
                try:
                    page.goto(f"{url}/lab/tree/node-map.ipynb")
                    page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
                    _settle_kernel(page)
                    page.get_by_role("menuitem", name="Run", exact=True).click()
                    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
                    marker = page.locator(".sharedarrays-node-map", has_text="parked")
                    marker.wait_for(state="visible", timeout=120_000)
                    text = marker.inner_text()
                    # the widget lists what this process sees the notebook's processes hold
                    new = [r for r in nodemap.node_map().allocations if r.alloc_id not in before]
                    states = {r.state for r in new}
                    assert {"live", "parked"} <= states, states
                    assert any(r.importers for r in new), "no importer in the picture"
                    # (named in the notebook's namespace, its folder's: here qualified)
                    assert any(r.name and r.name.rsplit("/", 1)[-1] == name for r in new)
                    for r in new:
                        assert r.alloc_id[:12] in text
                    for button in ("refresh", "auto-refresh", "free"):
                        assert page.get_by_role("button", name=button).count() >= 1
                    widget = page.locator(".jp-OutputArea-output", has=marker).last
                    widget.scroll_into_view_if_needed()
                    shot = ARTIFACTS / "node-widget.png"
                    widget.screenshot(path=str(shot))
                    _update(shot)
                finally:
                    page.screenshot(path=str(ARTIFACTS / "node-page.png"), full_page=True)
            finally:
                browser.close()
    finally:
        with contextlib.suppress(sa.SharedArrayError):
            sa.unlink(name)
        for r in nodemap.node_map().allocations:
            if r.alloc_id not in before and r.state == "parked":
                with contextlib.suppress(sa.SharedArrayError):
                    nodemap.free(r, lambda q: True)
