"""Execute every notebook in notebooks/ (nbclient + ipykernel, the `test` extra).

Each runs top to bottom in a fresh kernel started in an empty temporary
folder, so it imports the *installed* linattn_nb, as a user's notebook would
(the README's test command installs this checkout editable): a broken
installation fails here instead of being hidden by the checkout on the path
(no PYTHONPATH, and not the repository root as working directory, which
Jupyter kernels put on sys.path).  A cell that raises fails the test.
The kernel inherits this process's environment, so NUMBA_ENABLE_CUDASIM
(set by conftest.py on machines without a GPU) reaches the GPU notebook.
Notebooks are sized to run in well under a minute; the per-cell timeout only
catches hangs.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    assert any(p.name.startswith("01_quickstart") for p in NOTEBOOKS)
    for prefix in ("02_approximation_error", "03_rank_and_recall", "04_gpu_and_interop", "05_training",
                   "06_learned_maps"):
        assert any(p.name.startswith(prefix) for p in NOTEBOOKS), prefix


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_stored_without_outputs(path):
    """Notebooks are committed clean: no outputs, no execution counts (small diffs, no stale results)."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)


def _run(nb, tmp_path, monkeypatch):
    """Execute ``nb`` in a fresh kernel whose working directory is ``tmp_path``."""
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("LINATTN_NB_TRAIN_STEPS", "2")  # 05_training: two steps per rule (a full run takes minutes)
    client = nbclient.NotebookClient(nb, timeout=180, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()


def _installed_package(tmp_path, monkeypatch):
    """What ``import linattn_nb`` finds in a notebook kernel: [file, version, source hash]."""
    nbformat = pytest.importorskip("nbformat")
    code = ("import json, linattn_nb, linattn_nb._cache as c\n"
            "print(json.dumps([linattn_nb.__file__, linattn_nb.__version__, c.source_hash()]))")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    nbclient = pytest.importorskip("nbclient")
    try:
        _run(nb, tmp_path, monkeypatch)
    except nbclient.exceptions.CellExecutionError as exc:
        pytest.fail("`import linattn_nb` fails in a notebook kernel: the installed package is broken or "
                    f"older than this checkout (reinstall with `pip install -e .`):\n{exc}")
    out = "".join(o.get("text", "") for o in nb.cells[0].outputs if o.get("output_type") == "stream")
    return json.loads(out.strip().splitlines()[-1])


def test_installed_package_is_this_checkout(tmp_path, monkeypatch):
    """The notebooks below test the installed package: it must be importable and hold these sources."""
    from linattn_nb._cache import source_hash

    path, _version, digest = _installed_package(tmp_path, monkeypatch)
    assert path is not None, "linattn_nb is installed as an empty namespace package (stale site-packages folder)"
    assert digest == source_hash(str(ROOT / "linattn_nb")), (
        f"the installed linattn_nb ({path}) does not hold this checkout's sources: install it with "
        "`pip install -e .` (in a virtual environment when another checkout is installed)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    if path.stem.startswith("05_training"):
        pytest.importorskip("torch")
    nb = nbformat.read(path, as_version=4)
    _run(nb, tmp_path, monkeypatch)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # the notebook really ran: every code cell executed, in order
    counts = [c.get("execution_count") for c in nb.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1))


def _text(stem):
    nb = json.loads(next(p for p in NOTEBOOKS if p.stem.startswith(stem)).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"])


def test_notebook_statements_match_the_library():
    """What the notebooks say the library lacks, it has: fitting, training through the kernels, autograd."""
    assert "outside this library" not in _text("02_approximation_error") and "linattn_nb.fitting.fit" in _text("02_")
    assert "outside this library" not in _text("03_rank_and_recall")
    assert "no autograd" not in _text("04_gpu_and_interop") and "linattn_nb.torch" in _text("04_")
    nb05 = _text("05_training")
    # evaluation every K steps (and after the last), not after every step of a short run
    assert 'EVAL_EVERY = int(os.environ.get("LINATTN_NB_EVAL_EVERY", "50"))' in nb05
    assert "STEPS // 12" not in nb05 and "about 8 min" not in nb05
