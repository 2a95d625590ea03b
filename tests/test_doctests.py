"""Every docstring example of the package runs.

The Examples sections (and the module docstrings' ``>>>`` lines) are
doctests: this file runs them module by module, with the same options as
``python -m pytest --doctest-modules linattn_nb`` would need
(``ELLIPSIS``, ``NORMALIZE_WHITESPACE``).  A module whose import needs an
optional package that is missing is skipped, not failed.
"""
import doctest
import importlib
import pkgutil

import pytest

import linattn_nb

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE



@pytest.fixture(autouse=True)
def _restore_feature_map_registry():
    """Examples register maps (``softplus``); later tests (the studies sweep every registered map) must not see them."""
    from linattn_nb import feature_maps as fm

    saved = dict(fm._REGISTRY)
    yield
    fm._REGISTRY.clear()
    fm._REGISTRY.update(saved)

def _modules() -> list:
    names = []
    for info in pkgutil.walk_packages(linattn_nb.__path__, "linattn_nb."):
        names.append(info.name)
    return ["linattn_nb"] + sorted(names)


def _has_examples(name: str) -> bool:
    try:
        module = importlib.import_module(name)
    except ImportError:
        return True  # reported (skipped) by the test, not hidden here
    return any(t.examples for t in doctest.DocTestFinder(exclude_empty=True).find(module, name))


MODULES = [name for name in _modules() if _has_examples(name)]


def test_the_examples_are_found():
    # the modules whose examples a reader is pointed at first
    for name in ("linattn_nb.attention", "linattn_nb.feature_maps", "linattn_nb.analysis.error",
                 "linattn_nb.state.linear", "linattn_nb.studies.sweep"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - an optional dependency
        pytest.skip(f"{name} needs an optional package: {exc}")
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (output above)"
