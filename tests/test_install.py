"""Installation and the kernel cache folder (linattn_nb/_cache.py).

The slow test replays the README's two commands in the order that used to
break the install: a regular ``pip install`` of the package, one kernel run
(Numba writes its cache), then an editable install imported from outside the
repository.  Numba used to write the cache into site-packages/linattn_nb, pip
left those files behind, and the leftover folder became an empty namespace
package that hid the editable install.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Oldest setuptools that builds this pyproject.toml (``license = "BSD-3-Clause"``
# is PEP 639 syntax, accepted from setuptools 77).
SETUPTOOLS_MIN = (77,)

PROBE = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import linattn_nb
    x = np.random.default_rng(0).normal(size=(1, 2, 8, 4))
    out = linattn_nb.linear_attention(x, x, x, causal=True, method="scan")
    assert out.shape == x.shape and np.isfinite(out).all()
    print(json.dumps({"file": linattn_nb.__file__, "version": linattn_nb.__version__,
                      "cache_dir": getattr(linattn_nb.config, "CACHE_DIR", None)}))
""")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "NUMBA_CACHE_DIR", "LINATTN_CACHE_DIR", "LINATTN_NO_CACHE",
                        "LINATTN_CACHE_PRUNE_DAYS", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", **extra)
    return env


def _run(cmd, *, cwd, env, timeout=300):
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def running_site_dirs() -> list[str]:
    """The site-packages folders of the environment running the tests (a venv, conda or a base interpreter)."""
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    # what this interpreter really imports from: also covers environments whose
    # layout site.getsitepackages() does not describe
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return [d for i, d in enumerate(dirs) if os.path.isdir(d) and d not in dirs[:i]]


def make_nested_venv(venv: Path) -> Path:
    """A fresh venv at ``venv`` that sees the running environment's packages; its python.

    ``--system-site-packages`` is not enough: inside a venv (or a conda env), the
    nested venv would see the *base* interpreter's site-packages, not those of
    the environment running the tests.  Instead the nested venv gets a ``.pth``
    file listing the running environment's site-packages folders as plain paths
    (appended to ``sys.path`` after the nested venv's own folder, so what is
    installed into the nested venv wins; the ``.pth`` files in those folders,
    such as an editable install's finder, are not run).
    """
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, f"cannot create a virtual environment: {made.stderr.strip()[-1000:]}"
    py = venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    own = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, timeout=60, env=_clean_env())
    assert own.returncode == 0, own.stderr
    purelib = Path(own.stdout.strip())
    purelib.mkdir(parents=True, exist_ok=True)
    (purelib / "_linattn_test_parent_env.pth").write_text("\n".join(running_site_dirs()) + "\n")
    return py


def test_nested_venv_sees_the_running_environment(tmp_path):
    """The nested venv imports numba from wherever this interpreter does (venv, conda or base)."""
    py = make_nested_venv(tmp_path / "venv")
    res = subprocess.run([py, "-c", "import sys, numba; print(sys.prefix); print(numba.__file__)"],
                         capture_output=True, text=True, timeout=120, env=_clean_env(), cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    prefix, numba_file = res.stdout.split()
    import numba
    assert Path(prefix) == tmp_path / "venv"
    assert Path(numba_file).resolve() == Path(numba.__file__).resolve()


@pytest.mark.slow
def test_install_then_editable_from_outside(tmp_path):
    """pip install . ; run a kernel ; pip install -e . ; import from elsewhere: works, site-packages unwritten."""
    t0 = time.monotonic()
    venv = tmp_path / "venv"
    py = make_nested_venv(venv)
    xdg = tmp_path / "xdg"
    env = _clean_env(XDG_CACHE_HOME=str(xdg))
    work = tmp_path / "elsewhere"
    work.mkdir()

    # numba, numpy, pip, setuptools, ... come from the environment running the tests (the
    # nested venv's .pth file); the package is built here, without downloads, unless
    # setuptools is too old.
    version = _run([py, "-c", "import importlib.metadata as m; print(m.version('setuptools'))"],
                   cwd=work, env=env).stdout.strip()
    if tuple(int(p) for p in version.split(".")[:1]) < SETUPTOOLS_MIN:
        _run([py, "-m", "pip", "install", "-q", f"setuptools>={SETUPTOOLS_MIN[0]}"], cwd=work, env=env)

    # A copy of the repository's package sources, so that the builds leave
    # nothing (build/, *.egg-info) in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    shutil.copytree(ROOT / "linattn_nb", src / "linattn_nb", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    pip = [py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]

    # 1. regular install, one kernel run: the cache goes to the user cache folder
    _run(pip + [src], cwd=work, env=env)
    site_pkg = Path(_run([py, "-c", "import linattn_nb, os; print(os.path.dirname(linattn_nb.__file__))"],
                         cwd=work, env=env).stdout.strip())
    assert site_pkg.is_relative_to(venv), site_pkg
    before = _files(site_pkg)
    info = json.loads(_run([py, "-c", PROBE], cwd=work, env=env).stdout.strip().splitlines()[-1])
    new = sorted(f for f in _files(site_pkg) - before if not f.endswith(".pyc"))
    assert not new, f"running a kernel wrote into the installed package: {new}"
    assert not [f for f in _files(site_pkg) if f.endswith((".nbi", ".nbc"))]
    cache_dir = Path(info["cache_dir"])
    assert cache_dir.parent == xdg / "linattn_nb" and cache_dir.name.startswith(f"{info['version']}-")
    assert any(p.suffix == ".nbi" for p in cache_dir.rglob("*")), "no kernel was cached"

    # 2. editable install over it, imported from outside the repository
    _run(pip + ["-e", src], cwd=work, env=env)
    assert not site_pkg.exists(), f"pip left {sorted(_files(site_pkg))} in {site_pkg}"
    info2 = json.loads(_run([py, "-c", PROBE], cwd=work, env=env).stdout.strip().splitlines()[-1])
    assert Path(info2["file"]) == src / "linattn_nb" / "__init__.py"
    assert info2["cache_dir"] == info["cache_dir"]  # same sources, same folder
    assert not [f for f in _files(src / "linattn_nb") if f.endswith((".nbi", ".nbc"))]
    assert time.monotonic() - t0 < 600


# --------------------------------------------------------------------------
# The cache folder: hash, choice, pruning
# --------------------------------------------------------------------------
def _folder_in_subprocess(tmp_path, **env):
    code = ("import json, warnings, linattn_nb\n"
            "from linattn_nb import _cache, config\n"
            "print(json.dumps([*_cache.cache_folder(), config.CACHE, config.CACHE_DIR]))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=_clean_env(XDG_CACHE_HOME=str(tmp_path / "xdg"), **env))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_cache_folder_choice(tmp_path):
    from linattn_nb import __version__
    from linattn_nb._cache import source_hash

    key = f"{__version__}-{source_hash()}"
    (folder, origin, cache, cfg), _ = _folder_in_subprocess(tmp_path)
    assert (folder, origin, cache) == (str(tmp_path / "xdg" / "linattn_nb" / key), "default", True)
    assert cfg == folder and (Path(folder) / ".last_used").is_file()
    (folder, origin, _, _), _ = _folder_in_subprocess(tmp_path, LINATTN_CACHE_DIR=str(tmp_path / "mine"))
    assert (folder, origin) == (str(tmp_path / "mine" / key), "LINATTN_CACHE_DIR")
    # NUMBA_CACHE_DIR alone: Numba's own rule, unchanged
    (folder, origin, _, _), _ = _folder_in_subprocess(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "nb"))
    assert (folder, origin) == (str(tmp_path / "nb"), "NUMBA_CACHE_DIR")
    # both: the package's own setting wins for its kernels
    (folder, origin, _, _), _ = _folder_in_subprocess(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "nb"),
                                                      LINATTN_CACHE_DIR=str(tmp_path / "mine"))
    assert (folder, origin) == (str(tmp_path / "mine" / key), "LINATTN_CACHE_DIR")
    (folder, origin, cache, cfg), _ = _folder_in_subprocess(tmp_path, LINATTN_NO_CACHE="1")
    assert (folder, cache, cfg) == (None, False, None) and "LINATTN_NO_CACHE" in origin
    # an impossible folder: caching off with a warning, never the package folder
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    (folder, origin, cache, cfg), err = _folder_in_subprocess(tmp_path, LINATTN_CACHE_DIR=str(blocker / "c"))
    assert (folder, cache, cfg) == (None, False, None) and "caching is off" in err


def test_kernels_cache_only_into_the_folder(tmp_path):
    """A kernel run writes its cache under the chosen folder; other code keeps Numba's own locators."""
    code = textwrap.dedent("""
        import numpy as np, linattn_nb
        from numba import njit
        from numba.core.caching import CacheImpl
        from linattn_nb.ops.causal.cpu import causal_scan_kernel
        x = np.random.default_rng(0).normal(size=(1, 2, 8, 4))
        linattn_nb.linear_attention(x, x, x, causal=True, method="scan")
        print(causal_scan_kernel._cache._cache_path)

        @njit(cache=True)
        def other(a):
            return a + 1

        print(other._cache._cache_path)
    """)
    mod = tmp_path / "probe.py"
    mod.write_text(code)
    env = _clean_env(LINATTN_CACHE_DIR=str(tmp_path / "mine"), PYTHONPATH=str(ROOT))  # this checkout
    res = subprocess.run([sys.executable, str(mod)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr
    ours, other = res.stdout.split()
    assert Path(ours).is_relative_to(tmp_path / "mine")
    assert any(p.suffix == ".nbi" for p in (tmp_path / "mine").rglob("*"))
    assert Path(other) == tmp_path / "__pycache__"  # Numba's in-tree locator, as without linattn_nb


def test_cuda_kernels_use_the_folder(tmp_path):
    """numba-cuda's caching is redirected as soon as it is imported (CUDA kernels decorated after)."""
    pytest.importorskip("numba_cuda")
    code = textwrap.dedent("""
        import linattn_nb
        from numba import cuda
        import numba.cuda.core.caching as caching
        print(getattr(caching.CacheImpl._locator_classes[0], "_linattn", False))
    """)
    env = _clean_env(LINATTN_CACHE_DIR=str(tmp_path / "mine"))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=env)
    if res.returncode != 0 and "caching" in res.stderr and "No module" in res.stderr:
        pytest.skip("this numba-cuda has no numba.cuda.core.caching (it uses numba.core.caching)")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"


def test_source_hash(tmp_path):
    from linattn_nb._cache import source_hash

    pkg = tmp_path / "pkg"
    (pkg / "sub" / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "sub" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"junk")
    h = source_hash(str(pkg))
    assert len(h) == 16 and int(h, 16) >= 0
    (pkg / "sub" / "__pycache__" / "k.nbi").write_bytes(b"more junk")
    (pkg / "notes.txt").write_text("not a source")
    assert source_hash(str(pkg)) == h  # only .py files count
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    assert source_hash(str(pkg)) != h
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    assert source_hash(str(pkg)) == h
    (pkg / "sub" / "b.py").rename(pkg / "sub" / "c.py")
    assert source_hash(str(pkg)) != h  # names count too


def test_prune(tmp_path):
    from linattn_nb._cache import MARKER, prune

    old = time.time() - 30 * 86400
    names = ["0.1.0-0123456789abcdef", "0.0.9-fedcba9876543210", "0.1.0-aaaaaaaaaaaaaaaa", "keepme", "0.1.0-short",
             "mydata-0123456789abcdef", "0.0.8-bbbbbbbbbbbbbbbb"]
    for n in names:
        (tmp_path / n).mkdir()
        if n not in ("mydata-0123456789abcdef", "0.0.8-bbbbbbbbbbbbbbbb"):  # a user's folders have no marker
            (tmp_path / n / MARKER).touch()
            os.utime(tmp_path / n / MARKER, (old, old))
        os.utime(tmp_path / n, (old, old))
    (tmp_path / "mydata-0123456789abcdef" / "results.csv").write_text("1\n")
    os.utime(tmp_path / "0.1.0-aaaaaaaaaaaaaaaa" / MARKER)  # used just now
    removed = prune(str(tmp_path), keep="0.1.0-0123456789abcdef", max_age_days=14)
    assert [Path(p).name for p in removed] == ["0.0.9-fedcba9876543210"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(set(names) - {"0.0.9-fedcba9876543210"})
    assert prune(str(tmp_path), keep=None, max_age_days=-1) == []
    prune(str(tmp_path), keep="0.1.0-0123456789abcdef", max_age_days=0)
    # folders without the marker, or not named <version>-<hash>, are never ours to remove
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.0.8-bbbbbbbbbbbbbbbb", "0.1.0-0123456789abcdef",
                                                          "0.1.0-short", "keepme", "mydata-0123456789abcdef"]


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def _across_major(installed: dict, planned: dict) -> dict:
    """Packages of ``installed`` that ``planned`` gives another major version: name -> (installed, planned)."""
    return {n: (installed[n], v) for n, v in planned.items()
            if n in installed and n != "linattn-nb" and _major(installed[n]) != _major(v)}


def test_extras_one_after_another_replace_nothing_across_a_major_version(tmp_path):
    """The main command's extra (``report``), then ``[torch]``, then ``[cuda]`` and ``[torch]`` again, in one fresh venv.

    No install replaces a package an earlier extra installed with another major
    version (``cuda`` followed by ``torch`` used to swap the CUDA 12 toolkit for
    CUDA 13).  ``[torch]`` is resolved by pip (``--dry-run --report``) inside the
    venv the earlier installs filled, which reads what it would replace without
    downloading torch's wheels.  The main command's install pulls no CUDA
    toolkit and no dask.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    py = venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    env = _clean_env()

    def norm(name):
        return name.lower().replace("_", "-")

    def installed():
        listed = _run([py, "-m", "pip", "list", "--format", "json"], cwd=tmp_path, env=env).stdout
        return {norm(p["name"]): p["version"] for p in json.loads(listed)}

    def torch_plan():
        report = tmp_path / "torch.json"
        _run([py, "-m", "pip", "install", "-q", "--dry-run", "--report", report, f"{ROOT}[torch]"], cwd=tmp_path,
             env=env, timeout=900)
        plan = {norm(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
        assert "torch" in plan, sorted(plan)
        return plan

    bare = installed()  # pip and setuptools come with the venv, not from an extra
    _run([py, "-m", "pip", "install", "-q", f"{ROOT}[report]"], cwd=tmp_path, env=env, timeout=900)
    first = {n: v for n, v in installed().items() if n not in bare}
    for name in ("numba", "numpy", "scipy", "matplotlib", "linattn-nb"):
        assert name in first, f"{name} missing after the main command's install: {sorted(first)}"
    cuda = sorted(n for n in first if n.startswith(("nvidia-", "cuda-", "numba-cuda")))
    assert not cuda, f"the main command's install pulled CUDA packages: {cuda}"
    assert "dask" not in first and "distributed" not in first
    changed = _across_major(first, torch_plan())
    assert not changed, f"[torch] after the main command would replace (installed, planned): {changed}"

    _run([py, "-m", "pip", "install", "-q", f"{ROOT}[cuda]"], cwd=tmp_path, env=env, timeout=900)
    second = {n: v for n, v in installed().items() if n not in bare}
    changed = _across_major(first, second)
    assert not changed, f"[cuda] after the main command replaced (before, after): {changed}"
    changed = _across_major(second, torch_plan())
    assert not changed, f"[torch] after [cuda] would replace (installed, planned): {changed}"
