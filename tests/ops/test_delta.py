"""The delta and gated delta rules on the CPU: ``scan`` and ``chunked`` against the reference.

Rules (``linattn_nb/ops/_codes.py``): on ``H = [S | z]``,
``H_t = a_t (I - beta_t k k^T) H_{t-1} + beta_t k [v_t 1]`` (``a_t = 1``:
the delta rule; ``a_t = exp(log_decay)``, ``-inf`` a reset: the gated delta
rule).  The reference is the closed form in float64
(``causal_linear_quadratic``, itself checked against the recurrence in
``test_delta_reference.py``).  Every launcher call gets a NaN-filled ``out``
and an initial state, and must leave no NaN anywhere.  Also here: the row
feature maps ``l2`` and ``silu_l2`` applied inline by the CPU kernels (scan,
chunked, non-causal) against their NumPy forms, and two facts of the rule
(exact retrieval with orthonormal keys, a bounded state with unit keys).
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

import linattn_nb
from linattn_nb.feature_maps import get as get_map
from linattn_nb.ops._codes import KERNEL_CODE_L2, KERNEL_CODE_SILU_L2, RULE_ADDITIVE, RULE_DELTA, RULE_GATED_DELTA
from linattn_nb.ops.causal.chunked import causal_chunked
from linattn_nb.ops.causal.cpu import causal_scan
from linattn_nb.ops.causal.naive import causal_linear_quadratic
from linattn_nb.ops.noncausal.cpu import noncausal_aggregate

from _rule_checks import check_result

THREADS = numba.get_num_threads()
C = 8  # chunk size of the launcher-level tests
RULES = {"delta": RULE_DELTA, "gated_delta": RULE_GATED_DELTA}
METHODS = {"scan": causal_scan, "chunked": causal_chunked}
TOL = {np.float64: 1e-12, np.float32: 1e-5, np.float16: 4e-3}


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _problem(rng, B, N, F, M, dtype, rule, resets=(), positive=False):
    """Unit-norm features (rounded to ``dtype``), values, an initial state and the rule's inputs."""
    lo = 0.1 if positive else -1.0
    q = _unit(rng.uniform(lo, 1.0, (B, N, F))).astype(dtype)
    k = _unit(rng.uniform(lo, 1.0, (B, N, F))).astype(dtype)
    v = rng.standard_normal((B, N, M)).astype(dtype)
    S0 = rng.standard_normal((B, F, M))
    z0 = rng.uniform(0.5, 2.0, (B, F))
    inputs = {"beta": rng.uniform(0.0, 2.0, (B, N))}
    if rule == "gated_delta":
        ld = rng.uniform(-0.5, 0.0, (B, N))
        for b, t in resets:
            if b < B and t < N:
                ld[b, t] = -np.inf
        inputs["log_decay"] = ld
    return q, k, v, S0, z0, inputs


def _launch(method, rule, q, k, v, S0, z0, inputs, *, code=0, eps=1e-8, normalize=False, **kw):
    """A launcher called directly: NaN-filled ``out``, state in and out."""
    B, N, F = q.shape
    M = v.shape[2]
    H = np.zeros((B, F, M + 1))
    H[..., :M] = S0
    H[..., M] = z0
    out = np.full((B, N, M), np.nan, dtype=v.dtype)
    METHODS[method](q, k, v, H, out, code=code, eps=eps, inputs=inputs, rule=RULES[rule], normalize=normalize,
                    **({"chunk": C} if method == "chunked" else {}), **kw)
    return out, H


def _reference(rule, q, k, v, S0, z0, inputs, *, eps=1e-8, normalize=False):
    return causal_linear_quadratic(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), eps=eps,
                                   S0=S0, z0=z0, rule=RULES[rule], inputs=inputs, normalize=normalize)


def _check(out, H, ref, dtype, what=""):
    """:func:`_rule_checks.check_result` at this file's tolerance for ``dtype``."""
    check_result(out, H, ref, dtype, TOL[dtype], what)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("N", [0, 1, C - 1, C, C + 1, 37])
def test_edge_lengths(rng, rule, method, N):
    """N = 0, 1, a chunk +- 1, odd; D != M; B above the thread count; a reset in gated_delta."""
    B, F, M = THREADS + 1, 6, 5
    prob = _problem(rng, B, N, F, M, np.float64, rule, resets=((0, N // 2),))
    out, H = _launch(method, rule, *prob)
    _check(out, H, _reference(rule, *prob), np.float64, f"{rule} {method} N={N}")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("B", [1, THREADS + 1])
def test_batch_below_and_above_threads(rng, rule, B):
    """Chunked (batch-parallel only for these rules, ``seq_parallel=True`` included) equals the scan."""
    prob = _problem(rng, B, 67, 5, 7, np.float64, rule)
    ref = _reference(rule, *prob)
    for seq_parallel in (None, True):
        out, H = _launch("chunked", rule, *prob, seq_parallel=seq_parallel)
        _check(out, H, ref, np.float64, f"{rule} chunked B={B} seq_parallel={seq_parallel}")
    out, H = _launch("scan", rule, *prob)
    _check(out, H, ref, np.float64, f"{rule} scan B={B}")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes(rng, rule, method, dtype):
    prob = _problem(rng, 2, 29, 8, 6, dtype, rule, resets=((1, 13),))
    out, H = _launch(method, rule, *prob)
    _check(out, H, _reference(rule, *prob), dtype, f"{rule} {method} {np.dtype(dtype).name}")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("normalize", [False, True])
def test_normalize(rng, rule, method, normalize):
    """Divided by the state of the value 1 (positive unit features keep it away from 0), or not."""
    prob = _problem(rng, 2, 33, 6, 4, np.float64, rule, positive=True)
    out, H = _launch(method, rule, *prob, normalize=normalize)
    _check(out, H, _reference(rule, *prob, normalize=normalize), np.float64, f"{rule} {method} {normalize}")


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("t", [C + 3, 2 * C, 2 * C - 1, 0])
def test_gated_reset(rng, method, t):
    """A reset (log_decay -inf) mid-chunk, at a chunk boundary, at a chunk's end, at token 0: exact, no NaN."""
    prob = _problem(rng, 2, 4 * C + 3, 6, 5, np.float64, "gated_delta", resets=((0, t), (1, t)))
    out, H = _launch(method, "gated_delta", *prob)
    ref = _reference("gated_delta", *prob)
    _check(out, H, ref, np.float64, f"reset at {t}")
    # after the reset nothing of the initial state or the earlier tokens remains
    q, k, v, S0, z0, inputs = prob
    cut = {key: x[:, t:] for key, x in inputs.items()}
    cut["log_decay"] = cut["log_decay"].copy()
    cut["log_decay"][:, 0] = -np.inf
    o2, H2 = _launch(method, "gated_delta", q[:, t:], k[:, t:], v[:, t:], 0 * S0, 0 * z0, cut)
    np.testing.assert_allclose(o2, out[:, t:], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(H2, H, rtol=1e-12, atol=1e-12)


def test_beta_zero_keeps_the_state_and_one_replaces(rng):
    """beta = 0 writes nothing; beta = 1 with a unit key replaces the value read for that key."""
    q, k, v, S0, z0, _ = _problem(rng, 1, 9, 4, 3, np.float64, "delta")
    for method in METHODS:
        out, H = _launch(method, "delta", q, k, v, S0, z0, {"beta": np.zeros((1, 9))})
        np.testing.assert_allclose(H[0, :, :3], S0[0], rtol=0, atol=0)
        out, H = _launch(method, "delta", q, k, v, S0, z0, {"beta": np.ones((1, 9))})
        np.testing.assert_allclose(k[0, -1] @ H[0, :, :3], v[0, -1], atol=1e-13)


# ---------------------------------------------------------------------------
# the row feature maps l2 and silu_l2, inline
# ---------------------------------------------------------------------------
def _raw_rows(rng, B, N, F, dtype):
    """Raw rows with a zero row, a row of huge magnitude (float32 squares overflow) and a very negative row."""
    x = rng.standard_normal((B, N, F))
    x[0, 1] = 0.0
    x[0, 2] *= 3e37 if dtype != np.float16 else 3e4
    x[-1, N - 1] = -rng.uniform(95.0, 100.0, F)  # SiLU below float32's exp range: all values tiny
    x[-1, 0] *= 1e-30 if dtype != np.float16 else 1e-3
    return x.astype(dtype)


@pytest.mark.parametrize("fmap", ["l2", "silu_l2"])
@pytest.mark.parametrize("kernel", ["scan", "chunked", "noncausal"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_l2_maps_inline(rng, fmap, kernel, dtype):
    """The kernels' inline row maps equal the NumPy maps (norm in float64), zero and huge rows included."""
    B, N, F, M = 2, 11, 7, 5
    q = _raw_rows(rng, B, N, F, dtype)
    k = _raw_rows(rng, B, N, F, dtype)[:, ::-1].copy()
    v = rng.standard_normal((B, N, M)).astype(dtype)
    m = get_map(fmap)
    qf, kf = (m.transform(x.astype(np.float64)) for x in (q, k))
    assert np.isfinite(qf).all() and np.abs(qf[0, 1]).max() == 0.0
    assert np.allclose(np.linalg.norm(qf[0, 2]), 1.0) and np.allclose(np.linalg.norm(qf[-1, N - 1]), 1.0)
    code = KERNEL_CODE_L2 if fmap == "l2" else KERNEL_CODE_SILU_L2
    S0 = rng.standard_normal((B, F, M))
    z0 = np.zeros((B, F))
    H = np.zeros((B, F, M + 1))
    H[..., :M] = S0
    out = np.full((B, N, M), np.nan, dtype=dtype)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    if kernel == "noncausal":
        noncausal_aggregate(q, k, v, H, out, code=code, eps=None, normalize=False)
        S = S0 + np.einsum("bnf,bnm->bfm", kf, v.astype(np.float64))
        ref = np.einsum("bnf,bfm->bnm", qf, S)
        np.testing.assert_allclose(H[..., :M], S, rtol=0, atol=tol * np.abs(S).max())
    else:
        beta = rng.uniform(0.0, 2.0, (B, N))
        ref, S, _ = causal_linear_quadratic(qf, kf, v.astype(np.float64), eps=None, S0=S0, z0=z0, rule=RULE_DELTA,
                                            inputs={"beta": beta}, normalize=False)
        kw = {"chunk": 4} if kernel == "chunked" else {}
        METHODS[kernel](q, k, v, H, out, code=code, eps=None, inputs={"beta": beta}, rule=RULE_DELTA,
                        normalize=False, **kw)
        np.testing.assert_allclose(H[..., :M], S, rtol=0, atol=tol * np.abs(S).max())
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=0, atol=tol * np.abs(ref).max())


def test_l2_maps_inline_float16(rng):
    """float16 inputs: read as bits, normalised in float64, used in float32."""
    B, N, F, M = 1, 9, 6, 4
    q, k = (_raw_rows(rng, B, N, F, np.float16) for _ in range(2))
    v = rng.standard_normal((B, N, M)).astype(np.float16)
    for fmap, code in (("l2", KERNEL_CODE_L2), ("silu_l2", KERNEL_CODE_SILU_L2)):
        m = get_map(fmap)
        qf, kf = (m.transform(x.astype(np.float64)) for x in (q, k))
        beta = np.full((B, N), 0.5)
        ref, _, _ = causal_linear_quadratic(qf, kf, v, eps=None, rule=RULE_DELTA, inputs={"beta": beta},
                                            normalize=False)
        for method in METHODS:
            H = np.zeros((B, F, M + 1))
            out = np.full((B, N, M), np.nan, dtype=np.float16)
            METHODS[method](q, k, v, H, out, code=code, eps=None, inputs={"beta": beta}, rule=RULE_DELTA,
                            normalize=False)
            np.testing.assert_allclose(out.astype(np.float64), ref, rtol=0, atol=4e-3 * np.abs(ref).max())


# ---------------------------------------------------------------------------
# facts of the rule, through the public API
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("n", [1, 5, 16])
def test_orthonormal_keys_retrieve_exactly(rng, method, n):
    """beta = 1 and orthonormal keys store n <= D_phi pairs exactly: querying key i returns value i."""
    D, M = 16, 3
    Qm, _ = np.linalg.qr(rng.standard_normal((D, D)))
    keys = Qm[:n]  # orthonormal rows
    vals = rng.standard_normal((n, M))
    # n writes, then n reads (a zero key writes nothing: l2 maps it to zero)
    k = np.vstack([keys, np.zeros((n, D))])[None]
    v = np.vstack([vals, np.zeros((n, M))])[None]
    q = np.vstack([rng.standard_normal((n, D)), keys])[None]
    out = linattn_nb.linear_attention(q, k, v, causal=True, beta=1.0, feature_map="l2", method=method)
    assert np.abs(out[0, n:] - vals).max() <= 1e-12
    # a second write to the same key replaces the value (an additive state would sum them)
    k2 = np.vstack([keys[:1], keys[:1], keys[:1]])[None]
    v2 = np.vstack([vals[:1], 2 * vals[:1], np.zeros((1, M))])[None]
    o2 = linattn_nb.linear_attention(k2, k2, v2, causal=True, beta=np.array([[1.0, 1.0, 0.0]]), feature_map="l2",
                                     method=method)
    assert np.abs(o2[0, 2] - 2 * vals[0]).max() <= 1e-12


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_unit_keys_keep_the_state_bounded(rng, method):
    """beta in [0, 2] and unit keys: the state stays bounded over a long random sequence (the additive one grows)."""
    N, D, M = 8192, 8, 4
    q, k = (rng.standard_normal((1, N, D)) for _ in range(2))
    v = rng.standard_normal((1, N, M))
    beta = rng.uniform(0.0, 2.0, (1, N))
    beta[0, ::7] = 2.0  # the edge of the range, often
    out, st = linattn_nb.linear_attention(q, k, v, causal=True, beta=beta, feature_map="l2", method=method,
                                          return_state=True)
    S = np.asarray(st.S)
    assert np.isfinite(out).all() and np.isfinite(S).all()
    # each direction of S is a running mix of values with weights |1 - beta| <= 1
    assert np.abs(S).max() <= 10.0, np.abs(S).max()
    assert np.abs(out).max() <= 10.0 * np.sqrt(D)
    add = linattn_nb.linear_attention(q, k, v, causal=True, feature_map="l2", method=method, normalize=False)
    assert np.abs(add[0, -N // 8:]).max() > np.abs(out[0, -N // 8:]).max()


@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("gated", [False, True])
def test_public_api(rng, method, gated):
    """linear_attention(..., beta=, [log_decay=], feature_map="silu_l2") against the reference on NumPy features."""
    Bb, Hh, N, D, M = 2, 3, 21, 8, 5
    q, k = (rng.standard_normal((Bb, Hh, N, D)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((Bb, Hh, N, M)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (Bb, Hh, N))
    kw = {"beta": beta}
    inputs = {"beta": beta.reshape(-1, N)}
    if gated:
        ld = rng.uniform(-0.3, 0.0, (Bb, Hh, N))
        ld[0, 1, 10] = -np.inf
        kw["log_decay"] = ld
        inputs["log_decay"] = ld.reshape(-1, N)
    out = linattn_nb.linear_attention(q, k, v, causal=True, feature_map="silu_l2", method=method, **kw)
    m = get_map("silu_l2")
    qf, kf = (m.transform(x.astype(np.float64)).reshape(-1, N, D) for x in (q, k))
    ref, _, _ = causal_linear_quadratic(qf, kf, v.reshape(-1, N, M), eps=None,
                                        rule=RULE_GATED_DELTA if gated else RULE_DELTA, inputs=inputs,
                                        normalize=False)
    assert out.shape == v.shape and out.dtype == np.float32
    np.testing.assert_allclose(out.reshape(-1, N, M), ref, rtol=0, atol=2e-6 * np.abs(ref).max())


def test_additive_rule_unchanged_with_l2_code(rng):
    """The row maps also serve the additive rule's kernels (scan and chunked agree with NumPy features)."""
    B, N, F, M = 2, 13, 5, 3
    q, k = (rng.standard_normal((B, N, F)) for _ in range(2))
    v = rng.standard_normal((B, N, M))
    m = get_map("l2")
    ref, _, _ = causal_linear_quadratic(m.transform(q), m.transform(k), v, eps=None, normalize=False)
    for fn in (causal_scan, causal_chunked):
        H = np.zeros((B, F, M + 1))
        out = np.full((B, N, M), np.nan)
        fn(q, k, v, H, out, code=KERNEL_CODE_L2, eps=None, normalize=False, rule=RULE_ADDITIVE)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)
