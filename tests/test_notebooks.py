"""The learners' notebooks in examples/notebooks/ run top to bottom; their asserts are
their specification. They are stored without outputs (the docs build runs them)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "examples" / "notebooks"
PATHS = sorted(NOTEBOOKS.glob("*.ipynb"))
# examples/tour.ipynb runs in tests/test_plot.py


@pytest.fixture(scope="module")
def kernel_home(tmp_path_factory):
    """A `python3` kernel spec running this interpreter, so the notebooks import the
    attnkit under test whatever kernels the machine has."""
    home = tmp_path_factory.mktemp("jupyter")
    spec = home / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (attnkit tests)",
                "language": "python",
            }
        )
    )
    return home


def test_the_five_notebooks_are_there_in_order():
    assert [p.name[:3] for p in PATHS] == ["01_", "02_", "03_", "04_", "05_"]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{path.name}: clear the outputs before committing (the docs build runs it)"
            )


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_notebook_runs_top_to_bottom(path, kernel_home, monkeypatch):
    monkeypatch.setenv("JUPYTER_PATH", str(kernel_home))
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=120,  # seconds per cell
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    elapsed = time.perf_counter() - start
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "every notebook draws"
    assert elapsed < 60, f"{path.name} took {elapsed:.0f} s: keep the notebooks small"
