"""A real browser: JupyterLab runs notebook 03 and the memory map renders.

Starts JupyterLab on 127.0.0.1 (a free port, no token, a temporary root holding a copy of
notebook 03), drives Debian's headless chromium with Playwright (never a downloaded
browser), runs all cells, waits for the widget's stable marker, checks the chunk bars and
table rows, and saves a screenshot to ``artifacts/browser/`` (and, with
``SA_UPDATE_SCREENSHOT=1``, the copy the docs show in ``docs/img/``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("SHAREDARRAYS_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = ROOT / "artifacts" / "browser"
SCREENSHOT_COPY = ROOT / "docs" / "img" / "memory-map.png"

# What notebook 03 makes on the host backend (4 KiB pages): a (1 chunk; views a, top,
# every_other), b (3 chunks of 1 MiB; views b, plane), c (1 chunk, bytes lost to
# granularity; view c) and d imported from a worker (1 chunk, bytes lost; view d).
EXPECTED_ALLOCATIONS = 4
EXPECTED_CHUNKS = 1 + 3 + 1 + 1
EXPECTED_ROWS = (1 + 1 + 3) + (1 + 3 + 2) + (1 + 1 + 1 + 1) + (1 + 1 + 1 + 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer at {url} within {timeout} s")


def _settle_kernel(page, timeout: float = 90) -> None:
    """Wait until the notebook's kernel is idle, answering a "Select Kernel" dialog (which
    JupyterLab may show when the kernel specs load after the notebook) with the default."""
    dialog = page.locator(".jp-Dialog")
    idle = page.locator(".jp-NotebookPanel .jp-Notebook-ExecutionIndicator[data-status='idle']")
    deadline = time.monotonic() + timeout
    quiet_since = None
    while time.monotonic() < deadline:
        if dialog.count() and dialog.first.is_visible():
            dialog.first.get_by_role("button", name="Select", exact=True).click()
            quiet_since = None
        elif idle.count():
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 2:
                return
        time.sleep(0.25)
    raise TimeoutError("the notebook's kernel did not become idle")


@contextlib.contextmanager
def jupyterlab_server(tmp_path: Path, notebooks: list[Path]) -> Iterator[str]:
    """JupyterLab on 127.0.0.1 (a free port, no token) with a temporary root holding copies
    of ``notebooks``: its URL. Its log is copied to ``artifacts/browser/`` afterwards."""
    root = tmp_path / "root"
    root.mkdir()
    for notebook in notebooks:
        shutil.copy(notebook, root)
    home = tmp_path / "jupyter"
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    # no "would you like news?" toast over the screenshot
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port = _free_port()
    log = open(tmp_path / "jupyterlab.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={root}",
            "--IdentityProvider.token=",
            "--ServerApp.password=",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--LabApp.extension_manager=readonly",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_http(f"{url}/api/status", proc, 90)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the server shuts its kernels down
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started
                proc.wait(10)
        log.close()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / "jupyterlab.log", ARTIFACTS / "jupyterlab.log")


@pytest.fixture
def jupyterlab(tmp_path: Path) -> Iterator[str]:
    pytest.importorskip("jupyterlab")
    with jupyterlab_server(tmp_path, [ROOT / "notebooks" / "03-memory-map.ipynb"]) as url:
        yield url


def test_memory_map_renders_in_jupyterlab(jupyterlab: str) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1600})
            page.set_default_timeout(120_000)
            try:
                page.goto(f"{jupyterlab}/lab/tree/03-memory-map.ipynb")
                page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
                _settle_kernel(page)
                page.get_by_role("menuitem", name="Run", exact=True).click()
                page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
                marker = page.locator(f".sa-memory-map[data-allocations='{EXPECTED_ALLOCATIONS}']")
                marker.wait_for(state="visible", timeout=120_000)
                assert marker.get_attribute("data-chunks") == str(EXPECTED_CHUNKS)
                assert marker.get_attribute("data-rows") == str(EXPECTED_ROWS)
                assert marker.locator("rect.sa-chunk").count() == EXPECTED_CHUNKS
                assert marker.locator("tr.sa-row").count() == EXPECTED_ROWS
                assert marker.locator("rect.sa-lost").count() == 2
                assert marker.locator("tr.sa-provenance-row").count() == EXPECTED_ALLOCATIONS
                assert "importer of pid" in marker.inner_text()
                widget = page.locator(".jp-OutputArea-output", has=marker).last
                widget.scroll_into_view_if_needed()
                shot = ARTIFACTS / "memory-map.png"
                widget.screenshot(path=str(shot))
                if os.environ.get("SA_UPDATE_SCREENSHOT") == "1":  # refresh the docs' copy
                    SCREENSHOT_COPY.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(shot, SCREENSHOT_COPY)
            finally:
                page.screenshot(path=str(ARTIFACTS / "page.png"), full_page=True)
        finally:
            browser.close()
