"""The Python examples of the README and of the user guide run.

Every fenced ```` ```python ```` block of README.md runs, in file order, in one
namespace (as a reader pasting them into one interpreter would), in a temporary
working directory (files the examples write land there).  Each page of the user
guide (``docs/guide/*.md``) runs the same way in a namespace of its own, so a
page must be self-contained: its first block imports what it needs and makes
its inputs.

A block can be marked by an HTML comment on the line right above its fence
(invisible on GitHub and PyPI):

* ``<!-- readme-test: gpu -->`` -- runs only where a real CUDA GPU is
  present (the simulator does not count), in a copy of the namespace, so
  that its names do not change the blocks after it;
* ``<!-- readme-test: skip: REASON -->`` -- never runs here (REASON is
  required: say why, e.g. "needs a Dask cluster").

Anything else after ``readme-test:`` is an error, so a typo cannot silently
skip a block.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = sorted((ROOT / "docs" / "guide").glob("*.md"))

_FENCE = re.compile(r"^```python\s*$")
_MARK = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")



@pytest.fixture(autouse=True)
def _restore_feature_map_registry():
    """Examples register maps (``softplus``); later tests (the studies sweep every registered map) must not see them."""
    from linattn_nb import feature_maps as fm

    saved = dict(fm._REGISTRY)
    yield
    fm._REGISTRY.clear()
    fm._REGISTRY.update(saved)

def readme_blocks(text: str, name: str = "README") -> list:
    """``(line of the fence, marker or None, source)`` of every python block of ``text`` (lines from 1).

    ``name`` (the file) only labels the errors.
    """
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if _FENCE.match(lines[i]):
            start = i + 1
            j = start
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise ValueError(f"{name} line {i + 1}: unterminated ```python block")
            prev = lines[i - 1] if i > 0 else ""
            m = _MARK.match(prev)
            marker = m.group(1) if m else None
            if marker is not None and not (marker == "gpu" or re.match(r"skip:\s*\S", marker)):
                raise ValueError(f"{name} line {i}: unknown marker {prev.strip()!r} "
                                 "(readme-test: gpu, or readme-test: skip: REASON)")
            blocks.append((start, marker, "\n".join(lines[start:j]) + "\n"))
            i = j + 1
        else:
            i += 1
    return blocks


def run_blocks(blocks, *, gpu: bool, name: str = "README.md") -> list:
    """Run ``blocks`` in one fresh namespace; return ``(line, why)`` of those not run."""
    namespace = {"__name__": "__readme__"}
    not_run = []
    for line, marker, source in blocks:
        if marker is not None and marker.startswith("skip"):
            not_run.append((line, marker))
            continue
        if marker == "gpu" and not gpu:
            not_run.append((line, "needs a GPU"))
            continue
        code = compile(source, f"{name}, block at line {line}", "exec")
        # a GPU block runs on a copy: its names (GPU tensors) do not reach the blocks after it,
        # which then run the same with or without a GPU
        exec(code, dict(namespace) if marker == "gpu" else namespace)  # noqa: S102 - the documentation's examples
    return not_run


def test_markers_are_parsed():
    text = "a\n```python\nx = 1\n```\n<!-- readme-test: gpu -->\n```python\ny = 2\n```\n" \
           "<!-- readme-test: skip: needs a cluster -->\n```python\nz = 3\n```\n```bash\nls\n```\n"
    blocks = readme_blocks(text)
    assert [(b[1], b[2]) for b in blocks] == [(None, "x = 1\n"), ("gpu", "y = 2\n"),
                                              ("skip: needs a cluster", "z = 3\n")]
    assert run_blocks(blocks, gpu=False) == [(6, "needs a GPU"), (10, "skip: needs a cluster")]  # fence lines
    for bad in ("<!-- readme-test: sikp -->", "<!-- readme-test: skip -->"):
        with pytest.raises(ValueError, match="unknown marker"):
            readme_blocks(f"{bad}\n```python\npass\n```\n")


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path, monkeypatch):
    from linattn_nb.device import cuda_status

    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    from linattn_nb import feature_maps

    before = set(feature_maps.available())
    try:
        not_run = run_blocks(blocks, gpu=cuda_status() == "gpu")
    finally:  # maps the README registers do not leak into other tests
        for name in set(feature_maps.available()) - before:
            feature_maps._REGISTRY.pop(name, None)
    assert len(not_run) < len(blocks)
    if not_run:
        print("README blocks not run here:", not_run)


def test_each_guide_page_runs_in_its_own_namespace():
    """A page that uses a name only an earlier page defined fails: the namespaces are separate."""
    first = readme_blocks("```python\nshared = 1\n```\n", "a.md")
    second = readme_blocks("```python\nassert shared == 1\n```\n", "b.md")
    run_blocks(first, gpu=False, name="a.md")
    with pytest.raises(NameError, match="shared"):
        run_blocks(second, gpu=False, name="b.md")
    with pytest.raises(ValueError, match="b.md line 1: unterminated"):
        readme_blocks("```python\nx = 1\n", "b.md")


def test_the_guide_has_pages_with_examples():
    assert len(GUIDE) >= 5, GUIDE
    for page in GUIDE:
        blocks = readme_blocks(page.read_text(encoding="utf-8"), page.name)
        assert blocks, f"{page.name} has no python example"
        assert blocks[0][1] is None, f"{page.name}: the first block must run everywhere (it makes the inputs)"


@pytest.mark.slow
@pytest.mark.parametrize("page", GUIDE, ids=[p.stem for p in GUIDE])
def test_guide_python_blocks_run(page, tmp_path, monkeypatch):
    from linattn_nb import feature_maps
    from linattn_nb.device import cuda_status

    blocks = readme_blocks(page.read_text(encoding="utf-8"), page.name)
    monkeypatch.chdir(tmp_path)
    before = set(feature_maps.available())
    try:
        not_run = run_blocks(blocks, gpu=cuda_status() == "gpu", name=f"docs/guide/{page.name}")
    finally:  # maps a page registers do not leak into other tests
        for name in set(feature_maps.available()) - before:
            feature_maps._REGISTRY.pop(name, None)
    assert len(not_run) < len(blocks)
    if not_run:
        print(f"docs/guide/{page.name} blocks not run here:", not_run)
