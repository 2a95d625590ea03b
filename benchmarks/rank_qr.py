"""Streamed QR of rank.py: LAPACK against the hand-written Householder kernel it replaced.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/rank_qr.py [--n 1000000] [--d 16 64 256] [--rounds 3]

The R factor (D x D) of an N x D float64 matrix, streamed in blocks of rows, three ways,
interleaved over ``--rounds`` rounds (one call of each per round, after one warm-up call
that compiles the Numba kernels):

* ``hand``: the hand-written parallel Householder TSQR that ``linattn_nb/analysis/rank.py``
  held up to commit 2b20974 (copied below unchanged, for this comparison only: one
  chunk of rows per Numba thread, 128 rows per block, chunk factors merged at the end);
* ``tpqrt``: ``rank._r_factor``, the library path -- LAPACK ``dtpqrt`` on ``[R; block]``
  (``scipy.linalg.lapack.dtpqrt``, R kept triangular, ~2 L D^2 flops a block);
* ``qr``: ``scipy.linalg.qr(np.vstack([R, block]), mode='r')`` per block (dense QR of
  the stacked matrix, ~2 (D + L) D^2 flops a block), same blocks as ``tpqrt``.

Both LAPACK ways run with BLAS pinned to one thread, as ``rank._stream_r`` runs them
(``linattn_nb._blas.single_threaded_blas``); the hand-written kernel uses every Numba thread.

Prints the CPU model, the BLAS library (``threadpoolctl``: internal_api, architecture,
num_threads), the Numba thread count, then per D the median seconds of each way and the
ratios ``lapack / hand`` (above 1: the hand-written kernel is faster), and checks that
the three R factors agree (|R|^T |R| equal to round-off; rows may differ in sign).
The machine may be shared: compare medians and ratios, not single times.
"""
from __future__ import annotations

import argparse
import math
import platform
import subprocess
import time

import numba
import numpy as np
import scipy.linalg
import threadpoolctl
from numba import njit, prange

from linattn_nb import config
from linattn_nb._blas import single_threaded_blas
from linattn_nb.analysis import rank as rank_mod
from linattn_nb.ops._common import phi


# ---------------------------------------------------------------------------
# The hand-written kernel rank.py used before (commit 2b20974), unchanged but for cache=False
# ---------------------------------------------------------------------------
@njit(fastmath=config.FASTMATH, cache=False)
def _householder_update(R, XT, L):
    """R (F x F upper triangular) <- R factor of [R; X] with X = XT[:, :L].T; XT is overwritten.

    One Householder reflection per column; the reflector of column j lives on
    row j of R and the L rows of X only (R is already triangular), so a
    block costs ~2 L F^2 flops (backward stable, like LAPACK's dgeqrf).  XT holds the block transposed so that the
    inner loops run over contiguous memory (SIMD).
    """
    F = R.shape[0]
    for j in range(F):
        # LAPACK dlarfg-style reflector H = I - tau u u^T, u = [1; x / (a - alpha)],
        # computed on values scaled by their largest magnitude (no over/underflow).
        m = abs(R[j, j])
        for t in range(L):
            m = max(m, abs(XT[j, t]))
        if m == 0.0:
            continue
        s = 0.0
        for t in range(L):
            y = XT[j, t] / m
            s += y * y
        if s == 0.0:  # nothing to eliminate (or below m * 1e-154: negligible)
            continue
        a = R[j, j] / m
        nrm = math.sqrt(a * a + s)
        alpha = -nrm if a > 0 else nrm
        d = a - alpha          # |d| >= nrm > 0
        tau = -d / alpha       # in [1, 2]
        for t in range(L):
            XT[j, t] = (XT[j, t] / m) / d   # u_t, |u_t| <= 1
        R[j, j] = alpha * m
        for c in range(j + 1, F):
            w = R[j, c]
            for t in range(L):
                w += XT[j, t] * XT[c, t]
            w *= tau
            R[j, c] -= w
            for t in range(L):
                XT[c, t] -= w * XT[j, t]


@njit(fastmath=config.FASTMATH, cache=False)
def _qr_append(R, X, block):
    """Stream the rows of X (n x F) into the R factor R (F x F), ``block`` rows at a time."""
    n, F = X.shape
    lb = max(1, min(block, n))
    XT = np.empty((F, lb))
    for s0 in range(0, n, lb):
        L = min(lb, n - s0)
        for t in range(L):
            for j in range(F):
                XT[j, t] = X[s0 + t, j]
        _householder_update(R, XT, L)


@njit(parallel=True, fastmath=config.FASTMATH, cache=False)
def _stream_r_kernel(X, code, z, eps, clip, normalise, nchunks, block):
    """TSQR of the rows ``y_t = phi(X[t], code)`` -- divided by ``max(y_t . z, eps)`` when ``normalise``.

    One chunk of rows per thread, each streamed into its own R factor block
    by block, then the chunk factors are combined.  Returns ``(R, colsum, bad)``:
    the F x F factor, the column sums of the (unnormalised) features (``z``
    for keys) and the number of rows whose normaliser was zero or not finite.
    The features are never stored: memory O(threads F^2 + block F).
    """
    n, F = X.shape
    Rs = np.zeros((nchunks, F, F))
    sums = np.zeros((nchunks, F))
    bad = np.zeros(nchunks, dtype=np.int64)
    for c in prange(nchunks):
        a = c * n // nchunks
        b = (c + 1) * n // nchunks
        lb = max(1, min(block, b - a))
        XT = np.empty((F, lb))
        row = np.empty(F)
        for s0 in range(a, b, lb):
            L = min(lb, b - s0)
            for t in range(L):
                den = 0.0
                for j in range(F):
                    y = phi(X[s0 + t, j], code)
                    row[j] = y
                    sums[c, j] += y
                    den += y * z[j]
                if normalise:
                    if clip and den < eps:
                        den = eps
                    if den == 0.0 or not math.isfinite(den):
                        bad[c] += 1
                    for j in range(F):
                        XT[j, t] = row[j] / den
                else:
                    for j in range(F):
                        XT[j, t] = row[j]
            _householder_update(Rs[c], XT, L)
    R = Rs[0].copy()
    for c in range(1, nchunks):
        _qr_append(R, Rs[c], block)
    colsum = np.zeros(F)
    for c in range(nchunks):
        for j in range(F):
            colsum[j] += sums[c, j]
    return R, colsum, bad.sum()


def hand_r_factor(x, block=128):
    """R factor of x (N x D) by the hand-written parallel TSQR (``rank._r_factor`` before)."""
    n, f = x.shape
    nchunks = max(1, min(numba.get_num_threads(), n // max(4 * f, 1)))
    return _stream_r_kernel(x, 0, np.zeros(f), 0.0, False, False, nchunks, block)[0]


def qr_vstack_r_factor(x, rows=None):
    """R factor of x by ``scipy.linalg.qr(np.vstack([R, block]), mode='r')`` per block of rows."""
    n, f = x.shape
    rows = rank_mod._qr_rows() if rows is None else rows
    r = np.zeros((f, f))
    with single_threaded_blas():  # as the library path
        for s0 in range(0, n, rows):
            r = scipy.linalg.qr(np.vstack([r, x[s0:s0 + rows]]), mode="r", check_finite=False)[0][:f]
    return r


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv=None):
    from _common import positive_int

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=positive_int, default=1_000_000)
    ap.add_argument("--d", type=positive_int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--ways", nargs="+", default=["hand", "tpqrt", "qr"], choices=["hand", "tpqrt", "qr"])
    args = ap.parse_args(argv)

    ways = {"hand": hand_r_factor, "tpqrt": rank_mod._r_factor, "qr": qr_vstack_r_factor}
    ways = {k: ways[k] for k in args.ways}
    warm = np.random.default_rng(1).standard_normal((4096, 8))
    for fn in ways.values():  # compile / load LAPACK
        fn(warm)
    from _common import print_machine

    print_machine()
    print(f"date: {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"CPU: {cpu_model()} ({platform.machine()}), {__import__('os').cpu_count()} logical CPUs")
    for info in threadpoolctl.threadpool_info():
        kind = "BLAS" if info.get("user_api") == "blas" else info.get("user_api")
        print(f"{kind}: {info.get('internal_api')} {info.get('version')}, architecture {info.get('architecture')}, "
              f"num_threads {info.get('num_threads')} ({info.get('filepath')})")
    print(f"numpy {np.__version__}, scipy {scipy.__version__}, numba {numba.__version__} "
          f"({numba.get_num_threads()} threads); rows per LAPACK call {rank_mod._qr_rows()}, "
          f"hand-written block 128; N = {args.n}, float64, {args.rounds} rounds interleaved")
    rng = np.random.default_rng(0)
    head = f"{'D':>5} " + " ".join(f"{k + ' s':>10}" for k in ways)
    ratios = [k for k in ways if k != "hand"] if "hand" in ways else []
    head += "".join(f" {k + '/hand':>11}" for k in ratios)
    rows = []
    for d in args.d:
        x = rng.standard_normal((args.n, d))
        times = {k: [] for k in ways}
        out = {}
        for _ in range(args.rounds):
            for k, fn in ways.items():
                t0 = time.perf_counter()
                out[k] = fn(x)
                times[k].append(time.perf_counter() - t0)
        g = x.T @ x
        for k, r in out.items():
            err = np.abs(r.T @ r - g).max() / np.abs(g).max()
            assert err < 1e-12, (k, d, err)
        med = {k: float(np.median(v)) for k, v in times.items()}
        line = f"{d:>5} " + " ".join(f"{med[k]:>10.3f}" for k in ways)
        line += "".join(f" {med[k] / med['hand']:>11.2f}" for k in ratios)
        rows.append(line)
        print(f"D = {d}: all times (s): " + "; ".join(f"{k} " + ", ".join(f"{t:.3f}" for t in v)
                                                    for k, v in times.items()), flush=True)
        del x
    print()
    print(head)
    for line in rows:
        print(line)


if __name__ == "__main__":
    main()
