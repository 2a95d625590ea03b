"""Reading array arguments: the first step of every public function's checks.

Imports nothing from the package, so that every layer (the rules' argument checks included) can read its
arrays as :func:`linattn_nb.linear_attention` reads them.
"""
from __future__ import annotations

import numpy as np


def as_host_array(name: str, x) -> np.ndarray:
    """``np.asarray`` with a clear error for things that are not arrays.

    Subclasses (``np.matrix``) are read as plain arrays, whose reshapes the kernels rely on; masked arrays
    are refused (their mask would be lost); a float array of the other byte order is read in the native one.
    """
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} is a masked array, whose mask linear attention cannot honour; pass "
                        f"{name}.filled(...) or {name}.data explicitly")
    if isinstance(x, np.ndarray):
        if type(x) is not np.ndarray:
            x = np.asarray(x)
        return kernel_view(_native(x))
    if x is None:
        raise TypeError(f"{name} must be an array, got None")
    try:
        arr = np.asarray(x)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise TypeError(f"{name} could not be converted to an array: {exc}") from exc
    if arr.dtype == object:
        big = [e for e in arr.ravel() if isinstance(e, int) and not isinstance(e, bool)]
        if big and len(big) == arr.size:  # Python ints beyond 64 bits, e.g. decay=2**64: a value, not a type
            bits = max(abs(e).bit_length() for e in big)
            raise ValueError(f"{name} holds an integer of {bits} bits, more than the 64-bit integers of an array "
                             "hold")
        raise TypeError(f"{name} must be a numeric array, got an object array (ragged or non-numeric input?)")
    return kernel_view(_native(arr))


def _native(x: np.ndarray) -> np.ndarray:
    """A floating array of the non-native byte order (``>f8`` on x86, from FITS or network-order files)
    as a native copy; anything else unchanged."""
    if x.dtype.kind == "f" and not x.dtype.isnative:
        return x.astype(x.dtype.newbyteorder("="))
    return x


class _Memory:
    """Holds a read-only array's memory as a writeable ``__array_interface__`` (:func:`kernel_view`)."""

    def __init__(self, x: np.ndarray):
        face = dict(x.__array_interface__)
        face["data"] = (face["data"][0], False)
        self.__array_interface__ = face
        self.owner = x  # keeps the memory alive as long as the view


def kernel_view(x: np.ndarray) -> np.ndarray:
    """A read-only array (``np.broadcast_to``, a memory map opened ``"r"``, ``LinearAttentionState.S``,
    an array from another library) as a writeable view of the same memory, no copy; anything else
    unchanged.

    Numba types a read-only array as another type than a writeable one, so every kernel it reaches
    would compile once more: 27.5 s more for a first causal call, 6.3 s for its gradient (measured:
    docs/frontend.md, "Read-only inputs").  The kernels never write their inputs: every public
    function is called on read-only inputs in ``tests/test_layouts.py``, which checks the values after
    the call and that no result a caller gets is a writeable view of them.  The view stays inside
    the library."""
    if x.flags.writeable:
        return x
    return np.asarray(_Memory(x))
