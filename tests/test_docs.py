"""The API reference builds.

``docs/`` is a Sphinx project (numpydoc docstrings, the README as the index
page through myst-parser).  This builds it as a reader would
(``python -m sphinx -W -b html docs docs/_build/html``): warnings are errors,
and any attempt to open a network connection during the build fails the test
(no intersphinx, nothing fetched).  Then every public name must have an entry.
"""
import re
import socket
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("numpydoc", reason="the docs extra: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs extra: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    from sphinx.cmd.build import build_main

    out = tmp_path_factory.mktemp("docs")
    real_connect = socket.socket.connect

    def no_network(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"the docs build opened a network connection to {address!r}")
        return real_connect(self, address)

    mp = pytest.MonkeyPatch()
    mp.setattr(socket.socket, "connect", no_network)
    try:
        status = build_main(["-W", "--keep-going", "-E", "-q", "-b", "html", str(ROOT / "docs"),
                             str(out / "html"), "-d", str(out / "doctrees")])
    finally:
        mp.undo()
    assert status == 0, "sphinx-build -W failed: the warnings are printed above"
    return out / "html"


def _ids(html_dir) -> set:
    ids = set()
    for page in html_dir.rglob("*.html"):
        ids.update(re.findall(r'id="((?:module-)?linattn_nb[\w.]*)"', page.read_text(encoding="utf-8")))
    return ids


@pytest.mark.slow
def test_docs_build_without_warnings_and_document_every_public_name(html):
    import linattn_nb
    from linattn_nb import analysis, feature_maps, rules, studies

    ids = _ids(html)
    modules = {"config", "feature_maps", "fitting", "rules"}  # public modules: their own pages, checked below
    assert modules <= set(linattn_nb.__all__)
    want = [f"linattn_nb.{n}" for n in linattn_nb.__all__ if n != "__version__" and n not in modules]
    want += [f"module-linattn_nb.{n}" for n in sorted(modules)]
    want += [f"linattn_nb.fitting.{n}" for n in ("fit", "objective", "FitResult", "FitHistory")]
    want += [f"linattn_nb.feature_maps.{n}" for n in feature_maps.__all__ if not n.startswith("KERNEL_CODE")]
    want += [f"linattn_nb.analysis.{n}" for n in analysis.__all__]
    want += [f"linattn_nb.rules.{n}" for n in rules.__all__]
    want += [f"linattn_nb.studies.{n}" for n in studies.__all__]
    want += ["module-linattn_nb.config", "module-linattn_nb.device", "module-linattn_nb.cli",
             "linattn_nb.state.StateFileError", "linattn_nb.torch.linear_attention",
             "linattn_nb.torch.LinearAttention"]
    # every built-in study: its module (what it measures) and its functions
    for study in studies.STUDIES:
        module = study.run.__module__
        want += [f"module-{module}", f"{module}.points", f"{module}.run", f"{module}.render"]
    missing = [n for n in want if n not in ids]
    assert not missing, f"not in the API reference: {missing}"
    # the README's tour is the index page
    index = (html / "index.html").read_text(encoding="utf-8")
    assert "A short tour" in index and "api/index.html" in index
