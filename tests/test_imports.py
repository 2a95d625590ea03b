"""The package's import graph: no cycle between modules, no private name imported across modules.

A request flows downward (public module -> front end -> method table ->
launcher -> kernel); a cycle or a private helper borrowed from another module
is where that breaks first.  Every import statement counts, function-level
ones included.  Importing a private *module* (``from . import _validate``) is
fine; importing a private *name* from another module (``from .x import
_helper``) is not.  Tests and benchmarks are exempt.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = "linattn_nb"


def _modules():
    """{dotted module name: path} for every module of the package."""
    mods = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(mod: str) -> bool:
    return MODULES[mod].name == "__init__.py"


def _resolve(mod: str, node: ast.ImportFrom) -> str | None:
    """The absolute module named by ``from <node.module> import ...`` inside ``mod``."""
    if node.level == 0:
        return node.module
    base = mod.split(".") if _is_package(mod) else mod.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _edges_and_private_names():
    """Import edges between package modules, and (module, imported-from, name) for private names."""
    edges = {m: set() for m in MODULES}
    private = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith(PKG) and alias.name in MODULES:
                        edges[mod].add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(mod, node)
                if src is None or not (src == PKG or src.startswith(PKG + ".")):
                    continue
                for alias in node.names:
                    sub = f"{src}.{alias.name}"
                    if sub in MODULES:  # `from pkg import submodule`: an edge to the submodule
                        edges[mod].add(sub)
                        continue
                    if src in MODULES:
                        edges[mod].add(src)
                    if alias.name.startswith("_") and not alias.name.startswith("__") and src != mod:
                        private.append((mod, src, alias.name))
    return edges, private


def _cycles(edges):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walker_sees_function_level_imports_and_private_names(tmp_path):
    """The checks can fail: a planted cycle and a planted private import are found."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    node = ast.parse("def f():\n    from .x import _helper\n").body[0].body[0]
    assert isinstance(node, ast.ImportFrom) and node.level == 1 and node.names[0].name == "_helper"


def test_no_import_cycle_between_modules():
    edges, _ = _edges_and_private_names()
    # ``from .. import config`` is an edge to linattn_nb.config, not to the
    # package's __init__ (which re-exports the public modules)
    assert _cycles(edges) == []


def test_no_private_name_imported_across_modules():
    _, private = _edges_and_private_names()
    assert private == [], "\n".join(f"{m}: from {s} import {n}" for m, s, n in private)


@pytest.mark.parametrize("mod", ["linattn_nb._cuda_dispatch", "linattn_nb.ops.registry"])
def test_lower_layers_do_not_import_the_public_modules(mod):
    """The CUDA side and the method table sit below the front end: they never import upward."""
    edges, _ = _edges_and_private_names()
    upward = {"linattn_nb", "linattn_nb.attention", "linattn_nb._frontend"}
    assert not (edges[mod] & upward)


def _unit(mod: str) -> str:
    """The package-level unit of a module: ``linattn_nb.ops`` for everything under ops/, a top-level module itself."""
    parts = mod.split(".")
    return ".".join(parts[:2])


def _unit_edges():
    edges, _ = _edges_and_private_names()
    units = {}
    for a, targets in edges.items():
        units.setdefault(_unit(a), set())
        for b in targets:
            units.setdefault(_unit(b), set())
            if _unit(b) != _unit(a):
                units[_unit(a)].add(_unit(b))
    return units


def test_no_import_cycle_between_package_units():
    """Subpackages and top-level modules, taken as units, import each other without a cycle (function-level
    imports count): a request flows only downward."""
    units = _unit_edges()
    assert _cycles(units) == []


def test_the_kernel_layer_imports_no_front_end():
    """Nothing under ops/ imports a front-end module: only ops itself and the leaf modules config and _blas."""
    units = _unit_edges()
    allowed = {"linattn_nb.ops", "linattn_nb.config", "linattn_nb._blas"}
    assert units["linattn_nb.ops"] <= allowed, sorted(units["linattn_nb.ops"] - allowed)


def test_the_cuda_front_end_reaches_the_gpu_through_the_launcher_only():
    """Of the CUDA modules under ops/, ``_cuda_dispatch`` imports the launcher (``ops/_cuda_launch.py``) alone:
    the kernels, their launch plans and views, and the workspace pool stay behind it."""
    edges, _ = _edges_and_private_names()
    cuda = {m for m in edges["linattn_nb._cuda_dispatch"] if m.startswith("linattn_nb.ops.") and "cuda" in m}
    assert cuda == {"linattn_nb.ops._cuda_launch"}, sorted(cuda)
