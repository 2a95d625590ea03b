"""Execute every notebook in notebooks/ (nbclient + ipykernel, the `test` extra).

Each runs top to bottom in a fresh kernel started in the repository root, so
it imports this checkout of linattn_nb; a cell that raises fails the test.
The kernel inherits this process's environment, so NUMBA_ENABLE_CUDASIM
(set by conftest.py on machines without a GPU) reaches the GPU notebook.
Notebooks are sized to run in well under a minute; the per-cell timeout only
catches hangs.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert any(p.name.startswith("01_quickstart") for p in NOTEBOOKS)
    for prefix in ("02_approximation_error", "03_rank_and_recall", "04_gpu_and_interop"):
        assert any(p.name.startswith(prefix) for p in NOTEBOOKS), prefix


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_stored_without_outputs(path):
    """Notebooks are committed clean: no outputs, no execution counts (small diffs, no stale results)."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # the notebook really ran: every code cell executed, in order
    counts = [c.get("execution_count") for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1))
