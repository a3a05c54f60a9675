"""Every notebook in notebooks/ runs as it is, alone, in a kernel of this interpreter; the
named-array pair (07) also runs as two kernels at the same time."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from keeper_helpers import private_keeper  # noqa: F401 - a fixture

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
PAIR = ("07-named-producer.ipynb", "07-named-consumer.ipynb")
SINGLE = [name for name in NAMES if name not in PAIR]

ALONE_LIMIT = 120  # seconds a 07 notebook run alone may take (it runs its partner itself)

# a time.time() value printed as it is (2001-09-09 to 2286): what a notebook must not show
EPOCH_FLOAT = re.compile(r"(?<![\d.])1\d{9}\.\d+")


def test_the_notebooks_are_there():
    assert NAMES == [
        "01-quickstart.ipynb",
        "02-pool-workers.ipynb",
        "03-memory-map.ipynb",
        "04-between-notebooks.ipynb",
        "05-dask.ipynb",
        "06-workflow.ipynb",
        "07-named-consumer.ipynb",
        "07-named-producer.ipynb",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_saved_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, name


@pytest.mark.parametrize("name", NAMES)
def test_no_backend_internals(name):
    """Notebooks use the public API: a.synchronize(), not the allocation's backend."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    source = "\n".join(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert ".backend.synchronize" not in source and "allocation.backend" not in source, name


def test_epoch_float_pattern():
    assert EPOCH_FLOAT.search("Origin(created_here=False, pid=12, time=1764591234.5)")
    assert not EPOCH_FLOAT.search("pid 1234567890 at 12:00:01, 0.1764591234 s, 21764591234.5")


def _kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel "python3" is started with this interpreter: jupyter_client runs a kernel
    # whose command starts with "python" as sys.executable.
    monkeypatch.setenv(
        "PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )


def _client(nb: Any, directory: Path, timeout: int = 240) -> Any:
    return nbclient.NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(directory)}}
    )


def _check_outputs(nb: Any, name: str) -> list[dict[str, Any]]:
    """No cell failed and no output shows a raw time.time() value; every rich output."""
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors, (name, errors)
    data = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text = out.get("text", "") + json.dumps(out.get("data", {}).get("text/plain", ""))
            assert not EPOCH_FLOAT.search(text), (name, text)
            if out.output_type in ("execute_result", "display_data"):
                data.append(out.get("data", {}))
    return data


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", SINGLE)
def test_notebook_runs(name, tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    _kernel_path(monkeypatch)
    # 06's documented knob: a 20 MB table instead of 300 MB keeps the suite quick
    monkeypatch.setenv("SA_WORKFLOW_ROWS", "80000")
    _client(nb, tmp_path).execute()
    everything = _check_outputs(nb, name)
    last = nb.cells[-1].outputs
    data = [o.get("data", {}) for o in last if o.output_type in ("execute_result", "display_data")]
    if name.startswith(("01", "03", "04", "06")):
        assert any("image/png" in d and "text/html" in d for d in data), name
        html = next(d["text/html"] for d in data if "text/html" in d)
        assert 'class="sa-memory-map"' in html
    if name.startswith("03"):
        assert 'data-allocations="4"' in html
        assert "importer of pid" in html
    if name.startswith(("04", "06")):
        assert "handles served to importers" in html and "no importer yet" not in html
    if name.startswith("06"):
        plots = [d for d in everything if "image/png" in d and "text/html" not in d]
        assert len(plots) == 1, "06 draws one matplotlib figure"
    if name.startswith("05"):  # a worker's array came back as the same memory
        text = "".join(o.get("text", "") for o in last if o.output_type == "stream")
        assert "same memory: True" in text


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_named_pair_runs_at_the_same_time(tmp_path, monkeypatch, private_keeper):  # noqa: F811
    """The producer makes named arrays and waits; the consumer, in another kernel started at
    the same time, attaches them by name and writes; the producer sees the write (it asserts
    that itself). Both wait for each other at most SA_NAMED_TIMEOUT seconds, and neither runs
    the other in the background (SA_NAMED_PARTNER=wait)."""
    _kernel_path(monkeypatch)
    monkeypatch.setenv("SA_NAMED_TIMEOUT", "150")
    monkeypatch.setenv("SA_NAMED_PARTNER", "wait")
    producer, consumer = (nbformat.read(NOTEBOOKS / name, as_version=4) for name in PAIR)

    async def both() -> None:
        await asyncio.wait_for(
            asyncio.gather(
                _client(producer, tmp_path, timeout=200).async_execute(),
                _client(consumer, tmp_path, timeout=200).async_execute(),
            ),
            timeout=270,
        )

    asyncio.run(both())
    produced = _check_outputs(producer, PAIR[0])
    consumed = _check_outputs(consumer, PAIR[1])
    text = "".join(
        out.get("text", "") for cell in producer.cells for out in cell.get("outputs", [])
    )
    assert "largest difference from NumPy" in text
    assert sum("image/png" in d and "text/html" not in d for d in produced) == 1
    assert sum("image/png" in d for d in consumed) == 1
    assert consumer.cells[-1].outputs[0]["data"]["text/plain"] == "(True, True)"


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", PAIR)
def test_a_named_notebook_runs_alone(name, monkeypatch, private_keeper):  # noqa: F811
    """Run All of one 07 notebook, its partner not running: it runs the partner in the
    background and finishes, well within the limit, instead of waiting 600 s for it (and
    then failing). Its folder is the kernel's working directory, as in Jupyter."""
    import sharedarrays as sa

    _kernel_path(monkeypatch)
    monkeypatch.delenv("SA_NAMED_TIMEOUT", raising=False)  # the notebook's own 600 s
    monkeypatch.delenv("SA_NAMED_PARTNER", raising=False)
    monkeypatch.delenv("SHAREDARRAYS_NAMESPACE", raising=False)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    start = time.monotonic()

    async def run() -> None:
        await asyncio.wait_for(_client(nb, NOTEBOOKS).async_execute(), timeout=ALONE_LIMIT)

    asyncio.run(run())
    took = time.monotonic() - start
    _check_outputs(nb, name)
    text = "".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", []))
    partner = next(other for other in PAIR if other != name)
    assert f"{partner} is not running: running it in the background" in text, text
    assert f"{partner} (run in the background) finished without error" in text, text
    assert "Traceback" not in text and "Error" not in text, text
    # the producer unlinked its names: nothing is left behind in the keeper
    assert sa.list_named(all_namespaces=True) == [], took
