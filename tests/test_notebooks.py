"""Every notebook in notebooks/ runs as it is, in a kernel of this interpreter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_the_four_notebooks_are_there():
    assert NAMES == [
        "01-quickstart.ipynb",
        "02-pool-workers.ipynb",
        "03-memory-map.ipynb",
        "04-between-notebooks.ipynb",
    ]


@pytest.mark.parametrize("name", NAMES)
def test_saved_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, name


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name, tmp_path, monkeypatch):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The kernel "python3" is started with this interpreter: jupyter_client runs a kernel
    # whose command starts with "python" as sys.executable.
    monkeypatch.setenv(
        "PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=240,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out.output_type == "error"
    ]
    assert not errors
    last = nb.cells[-1].outputs
    data = [o.get("data", {}) for o in last if o.output_type in ("execute_result", "display_data")]
    if name.startswith(("01", "03", "04")):
        assert any("image/png" in d and "text/html" in d for d in data), name
        html = next(d["text/html"] for d in data if "text/html" in d)
        assert 'class="sa-memory-map"' in html
    if name.startswith("03"):
        assert 'data-allocations="4"' in html
        assert "imported from pid" in html
    if name.startswith("04"):
        assert "handles served to" in html and "nobody yet" not in html
