"""The float32 ``exp`` of the ELU+1 features: options side by side, speed and accuracy.

Run::

    python benchmarks/exp_options.py              # 2**20 arguments, 15 interleaved rounds
    python benchmarks/exp_options.py --rounds 31

ELU+1 computes ``exp(x)`` for every negative feature argument; in the chunked
causal kernel reading q, k, v with the features costs about 68 of 352 ns per
token on the AMD EPYC VM (``chunked_breakdown.py``), most of it this ``exp``
over 128 features.  The candidates, each a Numba ``@njit`` loop over a float32
array (vectorised as the kernel's own loop is, one thread):

* ``kernel (deg 6, Cody-Waite)``: the package's ``_elu1_f32`` -- round
  ``x log2 e`` to ``k`` with the 1.5 * 2^23 trick, ``r = x - k ln2`` in two
  steps (ln2 split in a high part exact in float32 and a low part), a degree-6
  polynomial fitted for relative error, ``2^k`` from the exponent bits;
* ``deg 5``: the same with a degree-5 polynomial (fitted here the same way):
  one FMA fewer;
* ``one-step reduction``: ``r = x - k ln2`` in one FMA (no low part);
* ``exp2 form``: ``t = x log2 e`` and ``2^(t - k)`` by a degree-6 polynomial in
  ``t - k`` (lookup-free; the rounding of ``t`` is the error);
* ``float64 evaluation``: the argument widened, ``exp`` by the package's
  float64 ``_elu1_f64`` (degree 13), rounded back;
* ``np.exp`` (NumPy's, for scale).

Accuracy: every float32 in a dense grid over [-87.3, 0] plus the edge points of
the kernel's tests, against float64 ``exp``: max and mean error in float32
ulp.  The kernel's accuracy tests ask for <= 1.5 ulp and a mean within 0.1 ulp
(``tests/ops/test_causal_chunked.py``).  Speed: ns per element, median of
interleaved rounds, arguments uniform in [-10, 0] (the branch-free loop costs
the same for any argument).  Results: a table and
``benchmarks/results/exp_options.json``.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from _common import machine, positive_int, print_machine, table, write_json
from numba import njit

from linattn_nb.ops import _vec as V

F32 = np.float32
LOG2E = V._LOG2E
MAGIC = V._MAGIC_F32
HI, LO = V._LN2_HI_F32, V._LN2_LO_F32
LN2 = float(np.log(2.0))
LIM = -87.3
FLAGS = V._EXP_FLAGS


def _fit(degree, lo=-LN2 / 2, hi=LN2 / 2, base=np.e):
    """Coefficients (ascending) of a polynomial p with p(r) ~ base**r, relative least squares at Chebyshev nodes."""
    m = 4096
    r = (lo + hi) / 2 + (hi - lo) / 2 * np.cos(np.pi * (np.arange(m) + 0.5) / m)
    y = base ** r
    A = np.vander(r, degree + 1, increasing=True) / y[:, None]
    c, *_ = np.linalg.lstsq(A, np.ones(m), rcond=None)
    return tuple(float(x) for x in c)


C5 = _fit(5)
C6_2 = _fit(6, -0.5, 0.5, base=2.0)


@njit(fastmath=FLAGS)
def _kernel(x, out):
    for i in range(x.shape[0]):
        out[i] = V.elu1(x[i])


@njit(fastmath=FLAGS, inline="always")
def _round(xi):
    """The clamped argument and k = round(x log2 e), as the kernel's exp computes them."""
    xc = xi if xi < F32(0.0) else F32(0.0)
    xc = xc if xc > F32(LIM) else F32(LIM)
    kf = xc * F32(LOG2E) + F32(MAGIC)
    return xc, kf - F32(MAGIC)


@njit(fastmath=FLAGS, inline="always")
def _horner6(c, r):
    p = F32(c[6])
    for j in range(5, -1, -1):
        p = p * r + F32(c[j])
    return p


@njit(fastmath=FLAGS, inline="always")
def _finish(p, kf, xi):
    """p * 2^k from the exponent bits, flushed below the range, ELU+1's x + 1 above 0."""
    p = p * V._bits_f32(kf * F32(8388608.0) + F32(127.0 * 8388608.0))
    p = p if not (xi < F32(LIM)) else F32(0.0)
    return p if xi < F32(0.0) else xi + F32(1.0)


@njit(fastmath=FLAGS)
def _deg5(x, out):
    c = C5
    for i in range(x.shape[0]):
        xi = x[i]
        xc, kf = _round(xi)
        r = xc - kf * F32(HI)
        r = r - kf * F32(LO)
        p = F32(c[5])
        for j in range(4, -1, -1):
            p = p * r + F32(c[j])
        out[i] = _finish(p, kf, xi)


@njit(fastmath=FLAGS)
def _one_step(x, out):
    c = V._EXP_F32_COEFFS
    for i in range(x.shape[0]):
        xi = x[i]
        xc, kf = _round(xi)
        out[i] = _finish(_horner6(c, xc - kf * F32(LN2)), kf, xi)


@njit(fastmath=FLAGS)
def _exp2(x, out):
    c = C6_2
    for i in range(x.shape[0]):
        xi = x[i]
        xc = xi if xi < F32(0.0) else F32(0.0)
        xc = xc if xc > F32(LIM) else F32(LIM)
        t = xc * F32(LOG2E)
        kf = t + F32(MAGIC)
        kf = kf - F32(MAGIC)
        out[i] = _finish(_horner6(c, t - kf), kf, xi)


@njit(fastmath=FLAGS)
def _f64(x, out):
    for i in range(x.shape[0]):
        out[i] = F32(V.elu1(np.float64(x[i])))


def _numpy(x, out):
    np.exp(x, out=out)


OPTIONS = {
    "kernel (deg 6, Cody-Waite)": _kernel,
    "deg 5": _deg5,
    "one-step reduction": _one_step,
    "exp2 form": _exp2,
    "float64 evaluation": _f64,
    "np.exp": _numpy,
}


def _accuracy(fn):
    """(max, mean) error in float32 ulp over a dense grid of [-87.3, 0] and its edge points."""
    grid = np.linspace(LIM, 0.0, 2_000_001, dtype=np.float64).astype(F32)
    edges = np.array([LIM, -LN2 / 2, LN2 / 2 - 1, -1e-7, -1e-30, -0.0], dtype=F32)
    x = np.unique(np.concatenate([grid, edges, -np.abs(np.nextafter(edges, F32(0)))]))
    x = x[(x <= 0) & (x >= F32(LIM))]
    out = np.empty_like(x)
    fn(x, out)
    ref = np.exp(x.astype(np.float64))
    ulp = (out.astype(np.float64) - ref) / np.spacing(ref.astype(F32)).astype(np.float64)
    return float(np.abs(ulp).max()), float(ulp.mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=positive_int, default=1 << 20, help="arguments per call")
    ap.add_argument("--rounds", type=positive_int, default=15)
    args = ap.parse_args(argv)
    import numba

    numba.set_num_threads(1)
    x = np.random.default_rng(0).uniform(-10.0, 0.0, args.n).astype(F32)
    out = np.empty_like(x)
    for fn in OPTIONS.values():
        fn(x, out)  # compile
    times = {name: [] for name in OPTIONS}
    for r in range(args.rounds):
        names = list(OPTIONS) if r % 2 == 0 else list(OPTIONS)[::-1]
        for name in names:
            t = time.perf_counter()
            OPTIONS[name](x, out)
            times[name].append(time.perf_counter() - t)
    info = machine()
    base = float(np.median(times["kernel (deg 6, Cody-Waite)"]))
    rows = []
    for name, fn in OPTIONS.items():
        mx, mean = _accuracy(fn)
        t = float(np.median(times[name]))
        rows.append({"option": name, "ns/element": t / args.n * 1e9, "x kernel": t / base, "max ulp": mx,
                     "mean ulp": mean, "passes": "yes" if mx <= 1.5 and abs(mean) <= 0.1 else "no"})
    print_machine("# ")
    print(f"# float32 exp options, one core, {args.n} arguments, medians of {args.rounds} interleaved rounds "
          f"-- {info['date']}, {info['cpu']}")
    print(table(rows, ["option", "ns/element", "x kernel", "max ulp", "mean ulp", "passes"],
                {"ns/element": "{:.3f}", "x kernel": "{:.2f}", "max ulp": "{:.2f}", "mean ulp": "{:+.3f}"}))
    print("passes: within the chunked kernel's accuracy tests (<= 1.5 ulp of float64 exp, mean within 0.1 ulp)")
    write_json("exp_options", {"machine": info, "n": args.n, "rounds": args.rounds, "rows": rows,
                               "times_s": times})


if __name__ == "__main__":
    main()
