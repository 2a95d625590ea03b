"""The linattn command line and import-time behaviour."""
from __future__ import annotations

import subprocess
import sys

import pytest

from linattn_nb import cli


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for key in ("numba", "numpy", "scipy", "threading", "threads", "cuda", "cache dir"):
        assert key in out


def test_demo_small(capsys):
    assert cli.main(["demo", "--batch", "1", "--heads", "2", "--length", "33", "--dim", "8"]) == 0
    out = capsys.readouterr().out
    assert "scan" in out and "softmax_attention" in out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_bad_argument():
    with pytest.raises(SystemExit):
        cli.main(["demo", "--length", "0"])


def test_nothing_compiles_at_import():
    """Importing the package compiles no kernel (Numba compiles lazily)."""
    code = (
        "import linattn_nb, numba\n"
        "from linattn_nb.ops.causal.cpu import causal_scan_kernel\n"
        "from linattn_nb.ops.noncausal.cpu import noncausal_kernel\n"
        "from linattn_nb.ops.softmax.cpu import softmax_kernel\n"
        "assert not causal_scan_kernel.signatures and not noncausal_kernel.signatures\n"
        "assert not softmax_kernel.signatures\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"
