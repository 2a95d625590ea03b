"""The front end's (B, N, M + 1) arrays in one parallel pass each: ``[v | 1]``, ``dL/d[num | den]`` and the
outputs from ``[num | den]``; and the gradient of the log-factors from that of the factors.

For the gradient front end (:func:`linattn_nb._gradfront.prepare` and
:func:`linattn_nb._gradfront.backward`).  Per row, in float64, ``g / den'`` and
``-(g . num) / den'^2`` (0 where the ``eps`` floor is active), or ``[g | 0]`` for
unnormalised outputs, written in the working dtype; NumPy's several passes and float64
temporaries over (B, N, M) arrays were a tenth of an additive-rule VJP.  Each pass also
says whether what it read (``v``, ``g``) is finite, so that the front end's check of
``check_finite=True`` costs no pass of its own over an array that is read anyway.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ... import config
from .._vec import elu1

#: Rows per task of the parallel loops.
_ROWS = 64

#: dtypes of ``g``, ``nd`` and ``v`` the kernels take (others: the caller's NumPy form).
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@njit(parallel=True, fastmath=False, error_model="numpy", cache=config.CACHE)
def _kernel(g, nd, g1, eps, floor, norm):
    R, M = g.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, np.bool_)
    for t in prange(tasks):
        good = True
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            if not norm:
                for i in range(M):
                    x = g[r, i]
                    good &= (x - x) == 0  # inf - inf and NaN - NaN are NaN
                    g1[r, i] = x
                g1[r, M] = 0.0
                continue
            den = np.float64(nd[r, M])
            active = True
            if floor and not den > eps:
                active = False
                den = eps
            inv = 1.0 / den
            dot = 0.0
            for i in range(M):
                x = np.float64(g[r, i])
                good &= (x - x) == 0
                dot += x * np.float64(nd[r, i])
                g1[r, i] = x * inv
            g1[r, M] = -dot * inv * inv if active else 0.0
        ok[t] = good
    return ok.all()


@njit(parallel=True, fastmath=False, cache=config.CACHE)
def _ones_kernel(v, v1):
    R, M = v.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, np.bool_)
    for t in prange(tasks):
        good = True
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            for i in range(M):
                x = v[r, i]
                good &= (x - x) == 0
                v1[r, i] = x
            v1[r, M] = 1.0
        ok[t] = good
    return ok.all()


@njit(parallel=True, fastmath=False, error_model="numpy", cache=config.CACHE)
def _outputs_kernel(nd, out, eps, floor, norm):
    R, M = out.shape
    tasks = (R + _ROWS - 1) // _ROWS
    ok = np.ones(tasks, np.bool_)
    fin = np.ones(tasks, np.bool_)
    for t in prange(tasks):
        good = True
        bad = np.uint8(0)  # a NaN or inf element of nd read (every column, den's too)
        for r in range(t * _ROWS, min(R, (t + 1) * _ROWS)):
            d = np.float64(nd[r, M])
            bad |= np.uint8(not (d - d) == 0)
            den = 1.0
            if norm:
                den = d
                if floor and not den > eps:
                    den = eps
            for i in range(M):
                a = np.float64(nd[r, i])
                bad |= np.uint8(not (a - a) == 0)
                x = a / den
                out[r, i] = x
                y = out[r, i]
                # finite in float64, not in the output's dtype: an overflow of the narrowing cast
                good &= not ((x - x) == 0 and not (y - y) == 0)
        ok[t] = good
        fin[t] = bad == 0
    return ok.all(), fin.all()


def outputs_from(nd, eps, out, normalize=True, nd_finite=False):
    """Write the outputs ``num / den'`` (R, M) into ``out`` from ``nd = [num | den]`` (R, M + 1), each quotient
    in float64 and then cast to ``out``'s dtype, as NumPy's ``(num / den'[:, None]).astype(out.dtype)`` with
    a float64 ``den'`` gives; ``den' = den`` where ``den > eps``, else ``eps`` (``eps`` None: no floor);
    ``normalize`` False: ``num`` itself.  ``nd`` and ``out`` float32 or float64 (see :data:`DTYPES`).  Returns
    False where a quotient finite in float64 overflowed ``out``'s dtype.  One parallel pass with no float64
    temporary: NumPy's division and cast took 18 ms of the 38 ms a forward of the PyTorch adapter took at
    B*H = 16, N = 4096, D = M = 64 (2 cores, Intel Xeon, 2026-12-06).  ``nd_finite``: return
    ``(that, whether every element of nd is finite)``, the check read in the same pass (a pass of its own
    over ``nd`` took 1.6 ms at that shape)."""
    if not out.shape[0]:
        return (True, True) if nd_finite else True
    floor = eps is not None
    ok, fin = _outputs_kernel(nd, out, float(eps) if floor else 0.0, floor, bool(normalize))
    return (bool(ok), bool(fin)) if nd_finite else bool(ok)


def output_gradient(g, nd, eps, out, normalize=True):
    """Write ``dL/d[num | den]`` (R, M + 1) into ``out`` from ``g = dL/dout`` (R, M) and ``nd = [num | den]``
    (R, M + 1); ``eps`` None: no floor; ``normalize`` False: ``[g | 0]`` (``nd`` unread).  ``g`` and ``nd``
    float32 or float64 (see :data:`DTYPES`).  Returns whether every element of ``g`` is finite."""
    if not g.shape[0]:
        return True
    floor = eps is not None
    return bool(_kernel(g, nd, out, float(eps) if floor else 0.0, floor, bool(normalize)))


def values_with_ones(v, out):
    """Write ``[v | 1]`` (R, M + 1) into ``out`` (the working dtype) from ``v`` (R, M), float32 or float64;
    returns whether every element of ``v`` is finite."""
    if not v.shape[0]:
        return True
    return bool(_ones_kernel(v, out))


#: Elements per task of :func:`_times_factor_kernel`.
_ELEMS = 1 << 14


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _times_factor_span(g, lg):
    for i in range(g.shape[0]):
        g[i] = g[i] * elu1(lg[i])  # exp(lg) for lg <= 0, in vector form


@njit(parallel=True, fastmath=config.FASTMATH, cache=config.CACHE)
def _times_factor_kernel(g, lg):
    n = g.shape[0]
    tasks = (n + _ELEMS - 1) // _ELEMS
    for t in prange(tasks):
        lo = t * _ELEMS
        hi = min(n, lo + _ELEMS)
        # a span of its own: written in place in the prange body, the loop lost its vector form (8.0 against
        # 1.25 ms for 4M elements, measured)
        _times_factor_span(g[lo:hi], lg[lo:hi])


def times_factor(g, lg):
    """``g * exp(lg)``, written over ``g``: the gradient of the log-factors ``lg`` (all <= 0, ``-inf`` at a
    reset) from ``g``, that of the factors (``d/d log a = a d/da``).  ``g`` and ``lg`` C-contiguous float64
    of one shape.  One parallel pass: 1.25 ms over a per-feature gate at B*H = 16, N = 4096, F = 64, where
    NumPy's ``g * np.exp(lg)`` took 6.5-7.3 ms (2 cores, AMD EPYC).  ``exp`` is the kernels' own
    (:func:`~linattn_nb.ops._vec.elu1` below 0: within 2 ulp of NumPy's), 0 below about -708.3, where NumPy's
    is subnormal."""
    if g.shape != lg.shape or g.dtype != np.float64 or lg.dtype != np.float64:
        raise ValueError(f"g and lg must be float64 arrays of one shape, got {g.dtype} {g.shape} and "
                         f"{lg.dtype} {lg.shape}")
    if not (g.flags.c_contiguous and lg.flags.c_contiguous and g.flags.writeable):
        raise ValueError("g must be a writeable C-contiguous array and lg a C-contiguous one")
    if g.size:
        _times_factor_kernel(g.reshape(-1), lg.reshape(-1))
    return g
