"""Outside the rule modules and the kernel layer, code asks the rule registry and never compares a rule's name.

A new rule then costs its own module (``linattn_nb/rules/<name>.py``) and a
registry line: nothing in the front ends, the state, the analyses, the studies
or the torch adapter branches on which rule it is.  Flagged, by reading the
syntax tree of every module outside ``linattn_nb/rules/``, ``linattn_nb/ops/``
(the kernels switch on the rule's integer code, tabled in their per-rule
hooks) and ``config.py`` (tuning tables keyed by rule):

* a comparison (``==``, ``!=``, ``in``, ``not in``) with a rule's name, or with
  a tuple/list/set holding one;
* a dict literal with a rule's name as a key (a table by rule);
* the kernels' rule codes (``RULE_*``) and the kernel rule table.

A line that uses a rule's name for something else says so with the comment
``# not a rule`` (e.g. the torch layer's own ``decay="gate"`` option).
"""
import ast
from pathlib import Path

from linattn_nb import rules

ROOT = Path(__file__).resolve().parents[2] / "linattn_nb"
NAMES = set(rules.rule_names())
SKIP_DIRS = {"rules", "ops"}
SKIP_FILES = {"config.py"}


def _is_name(node) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_name(e) for e in node.elts)
    return False


def offenders():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP_DIRS or str(rel) in SKIP_FILES:
            continue
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            bad = None
            if isinstance(node, ast.Compare) and (_is_name(node.left) or any(_is_name(c) for c in node.comparators)):
                bad = "compares a rule name"
            elif isinstance(node, ast.Dict) and any(k is not None and _is_name(k) for k in node.keys):
                bad = "a table keyed by rule name"
            elif isinstance(node, ast.Name) and node.id.startswith("RULE_"):
                bad = "uses a kernel rule code"
            elif isinstance(node, ast.alias) and (node.name.startswith("RULE_") or node.name == "RULES"):
                bad = "imports the kernels' rule table"
            if bad is None:
                continue
            line = getattr(node, "lineno", None)
            if line is not None and "# not a rule" in lines[line - 1]:
                continue
            found.append(f"linattn_nb/{rel}:{line}: {bad}: {lines[line - 1].strip() if line else ''}")
    return found


def test_no_module_outside_the_rules_and_kernels_branches_on_a_rule_name():
    found = offenders()
    assert not found, "ask linattn_nb.rules instead:\n" + "\n".join(found)
