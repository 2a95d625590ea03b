"""Sphinx configuration of the linattn_nb API reference.

Build: ``python -m sphinx -W -b html docs docs/_build/html`` (needs the
``docs`` extra: ``pip install -e ".[docs]"``).  The test suite builds it the
same way (tests/test_docs.py), warnings as errors and without network access:
no intersphinx, no remote images.
"""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)  # document this checkout, not an installed copy

import linattn_nb  # noqa: E402

project = "linattn_nb"
author = "linattn_nb developers"
copyright = "linattn_nb developers"
release = version = linattn_nb.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",   # formulas are rendered by the browser; the build needs no network
    "numpydoc",
    "myst_parser",
]
try:  # linattn_nb.torch documents without torch installed (the docs extra does not pull it in)
    import torch  # noqa: F401
except ImportError:
    autodoc_mock_imports = ["torch"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# autodoc / numpydoc
autodoc_member_order = "bysource"
autodoc_typehints = "none"           # the numpydoc Parameters sections say the types
autodoc_default_options = {"members": True, "show-inheritance": True}
numpydoc_show_class_members = False  # members are documented by autodoc, once
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = True
numpydoc_xref_param_type = False

# MyST: the README and the design notes are Markdown
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

html_theme = "alabaster"
html_static_path = []
html_theme_options = {"description": "Numba-accelerated kernel-based linear attention"}
