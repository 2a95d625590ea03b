"""Where Numba's on-disk cache of linattn_nb's kernels lives.

Where and why: ``docs/design-cpu.md``, "The kernel cache".
"""
from __future__ import annotations

import hashlib
import importlib.abc
import os
import re
import shutil
import sys
import time
import warnings

from . import config

#: The package folder (absolute, with a trailing separator): files under it are ours.
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")

#: Name of the file whose modification time records the last use of a cache folder.
MARKER = ".last_used"

#: ``<version>-<hash>``: a version starts with a digit (``0.1.0``, ``1.2.dev3``).
_KEYED_NAME = re.compile(r"^[0-9][^\s/\\]*-[0-9a-f]{16}$")

#: The cache folder of linattn_nb's kernels in this process (None before
#: :func:`install` or when caching is off) and where it came from.
_folder: str | None = None
_origin: str = "not installed"


def source_hash(package_dir: str = _PACKAGE_DIR) -> str:
    """Hash (the first 16 hex digits of a SHA-1) of the sorted relative paths and contents of every ``.py``
    file under ``package_dir`` (default: this installed copy; ``__pycache__`` and hidden folders skipped)."""
    root = os.path.abspath(package_dir)
    files = []
    for top, dirs, names in os.walk(root, onerror=_raise):
        dirs[:] = [d for d in dirs if d != "__pycache__" and not d.startswith(".")]
        files += [os.path.relpath(os.path.join(top, n), root).replace(os.sep, "/")
                  for n in names if n.endswith(".py")]
    digest = hashlib.sha1()
    for rel in sorted(files):
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def _raise(exc: OSError):
    raise exc


def user_cache_root() -> str:
    """The per-user root of linattn_nb's caches (before the ``<version>-<hash>`` folder): the platform's
    user cache folder (docs/guide/configuration.md)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or os.path.join(os.path.expanduser("~"), "AppData", "Local")
        return os.path.join(base, "linattn_nb", "Cache")
    if sys.platform == "darwin":
        return os.path.join(os.path.expanduser("~/Library/Caches"), "linattn_nb")
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "linattn_nb")


def cache_folder() -> tuple[str | None, str]:
    """``(folder, origin)``: the cache folder of linattn_nb's kernels in this process (None when caching is
    off) and where it came from (``"LINATTN_CACHE_DIR"``, ``"NUMBA_CACHE_DIR"``, ``"default"``, or why off)."""
    return _folder, _origin


def prune(root: str, keep: str | None, max_age_days: float) -> list[str]:
    """Remove the ``<version>-<hash>`` folders under ``root`` but ``keep`` whose last-use marker is
    ``max_age_days`` old (0: all of them; negative: none); returns them.

    Only folders with the marker this module writes are ours: ``LINATTN_CACHE_DIR`` may name a folder shared
    with other programs, whose folders of a similar name (``mydata-0123456789abcdef``) are never touched."""
    if max_age_days < 0:
        return []
    removed = []
    cutoff = time.time() - max_age_days * 86400.0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if entry.name == keep or not _KEYED_NAME.match(entry.name) or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            used = os.stat(os.path.join(entry.path, MARKER)).st_mtime
        except OSError:  # no marker: not a folder of ours
            continue
        if used <= cutoff:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _prepare(folder: str) -> None:
    """Create ``folder`` and record its use; raises OSError when it cannot be written."""
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, MARKER)
    open(marker, "a").close()
    os.utime(marker)


def _locator_class(caching):
    """A Numba cache locator (for the ``caching`` module given) that serves linattn_nb's files only."""
    base = getattr(caching, "UserProvidedCacheLocator", None) or getattr(caching, "_UserProvidedCacheLocator", None)
    if base is None:
        return None

    class LinattnCacheLocator(base):
        """Caches a function of linattn_nb's sources into ``linattn_nb._cache._folder``."""

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(_folder, self.get_suitable_cache_subpath(py_file))

        def get_cache_path(self):
            return self._cache_path

        @classmethod
        def from_function(cls, py_func, py_file):
            if _folder is None or not os.path.abspath(py_file).startswith(_PACKAGE_DIR):
                return None
            # skip the base's test of numba.config.CACHE_DIR: the source-file
            # mixin checks that the file exists and the folder is writable
            return super(base, cls).from_function(py_func, py_file)

    LinattnCacheLocator._linattn = True
    return LinattnCacheLocator


def _add_locator(caching) -> bool:
    """Put the linattn_nb locator first in ``caching.CacheImpl._locator_classes``; False if impossible."""
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)
    if not isinstance(classes, list):
        return False
    if any(getattr(c, "_linattn", False) for c in classes):
        return True
    cls = _locator_class(caching)
    if cls is None:
        return False
    classes.insert(0, cls)
    return True


_CUDA_CACHING = "numba.cuda.core.caching"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Adds the locator to numba-cuda's caching module right after that module is imported.

    Importing ``numba.cuda`` at import of linattn_nb would cost about 0.3 s, so
    the CUDA side is set up when the CUDA kernels first import it.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _CUDA_CACHING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenAddLocator(spec.loader)
        return spec


class _ThenAddLocator(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _add_locator(module)

    def __getattr__(self, name):  # get_source, get_filename, ... of the real loader
        return getattr(self._inner, name)


def _hook_cuda() -> None:
    module = sys.modules.get(_CUDA_CACHING)
    if module is not None:
        _add_locator(module)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def install(version: str) -> str | None:
    """Choose the cache folder of linattn_nb's kernels (``version``-<source hash>) and make Numba use it,
    before any kernel module is imported.  Sets ``config.CACHE_DIR`` (``config.CACHE = False`` when no
    folder can be written); returns the folder, or None when caching is off or the sources are not files.
    """
    global _folder, _origin
    if not config.CACHE:
        _folder, _origin = None, "off (LINATTN_NO_CACHE)"
        config.CACHE_DIR = None
        return None
    from numba.core import caching
    from numba.core import config as nbconfig

    root = os.environ.get("LINATTN_CACHE_DIR", "")
    if not root and nbconfig.CACHE_DIR:
        _folder, _origin = str(nbconfig.CACHE_DIR), "NUMBA_CACHE_DIR"
        config.CACHE_DIR = _folder
        return _folder
    origin = "LINATTN_CACHE_DIR" if root else "default"
    root = os.path.abspath(os.path.expanduser(root)) if root else user_cache_root()
    try:
        name = f"{version}-{source_hash()}"
    except OSError:  # sources not in plain files (zip import, frozen application)
        _folder, _origin = None, "Numba's default locators (the package sources are not plain files)"
        return None
    folder = os.path.join(root, name)
    try:
        _prepare(folder)
    except OSError as exc:
        warnings.warn(f"linattn_nb: cannot write the kernel cache folder {folder} ({exc}); caching is off, "
                      "kernels compile in every process (set LINATTN_CACHE_DIR to a writable folder)",
                      RuntimeWarning, stacklevel=2)
        return _off("off (cache folder not writable)")
    _folder, _origin = folder, origin
    if not _add_locator(caching):
        return _off("off (this Numba version has no cache locator list)")
    _hook_cuda()
    prune(root, keep=name, max_age_days=config.CACHE_PRUNE_DAYS)
    config.CACHE_DIR = folder
    return folder


def _off(why: str) -> None:
    global _folder, _origin
    _folder, _origin = None, why
    config.CACHE = False
    config.CACHE_DIR = None
    return None
