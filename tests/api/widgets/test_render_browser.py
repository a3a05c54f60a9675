"""The memory map's HTML in a real browser (Debian's headless chromium through Playwright):
every label is drawn inside the picture."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import sharedarrays as sa
from sharedarrays.api.widgets import build_maps, render_html

pytestmark = [pytest.mark.browser, pytest.mark.timeout(120)]

CHROMIUM = os.environ.get("SHAREDARRAYS_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


@pytest.fixture(scope="module")
def page() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield browser.new_page(viewport={"width": 1000, "height": 800})
        finally:
            browser.close()


def _texts_outside(page: Any, html: str) -> list[str]:
    """The SVG texts whose drawn box runs past the SVG's left or right edge."""
    page.set_content(f"<html><body>{html}</body></html>")
    outside: list[str] = page.evaluate(
        """() => {
        const svg = document.querySelector('.sa-memory-map svg');
        const width = svg.viewBox.baseVal.width;
        return Array.from(svg.querySelectorAll('text'))
            .filter(t => { const b = t.getBBox(); return b.x < 0 || b.x + b.width > width; })
            .map(t => t.textContent);
        }"""
    )
    return outside


def test_a_narrow_views_label_at_either_end_stays_inside_the_picture(page: Any) -> None:
    # (a growable array's first rows under a large capacity: the label, centred over a
    # bracket a few pixels wide at the left edge, was cut to ")0×128 float32")
    g = sa.empty((0, 128), "float32", capacity=64 << 20)
    g.append(np.ones((5000, 128), "float32"))
    b = sa.zeros(1 << 20, dtype="uint8", device="cpu")
    tail = b[-100:]  # a narrow view at the right end
    try:
        html = render_html(build_maps([g, b]))
        assert _texts_outside(page, html) == []
    finally:
        del tail
        g.close()
        b.close()
