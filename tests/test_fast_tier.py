"""The fast tier's lists in tests/conftest.py name files and test functions that exist.

A renamed or moved test would otherwise leave its entry behind and return to the fast tier unseen
(and an entry with a typo would move nothing).
"""
from __future__ import annotations

import re

from conftest import ROOT, SLOW_FILES, SLOW_TESTS, _NUMPY_ONLY

TESTS = ROOT / "tests"


def test_every_slow_file_exists():
    missing = sorted(f for f in SLOW_FILES | _NUMPY_ONLY if not (TESTS / f).is_file())
    assert missing == []


def test_every_slow_test_is_a_test_function_of_its_file():
    missing = []
    for entry in sorted(SLOW_TESTS):
        rel, name = entry.split("::")
        path = TESTS / rel
        if not path.is_file() or not re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.MULTILINE):
            missing.append(entry)
    assert missing == []
    assert not {entry.split("::")[0] for entry in SLOW_TESTS} & SLOW_FILES  # a whole file is listed once
