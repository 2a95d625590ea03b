"""The decay and gate update rules on the CPU: ``scan`` and ``chunked`` against the naive reference.

Rules (``linattn_nb/ops/_codes.py``): ``H_t = a_t (.) H_{t-1} +
phi(k_t)^T [v_t 1]`` with a scalar factor per token (decay: RetNet's gamma,
Mamba-2/SSD) or one per feature (gate: GLA), from log-factors <= 0 where
``-inf`` resets the state exactly.  The reference is the explicit quadratic
form in float64 (``causal_linear_quadratic``), itself checked here against a
plain per-token loop.  Every launcher call gets a NaN-filled ``out`` and an
initial state, and must leave no NaN anywhere.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

import linattn_nb
import linattn_nb.config as cfg
from linattn_nb.ops._codes import RULE_ADDITIVE, RULE_DECAY, RULE_GATE
from linattn_nb.ops.causal import chunked as ch
from linattn_nb.ops.causal.chunked import causal_chunked
from linattn_nb.ops.causal.cpu import causal_scan
from linattn_nb.ops.causal.naive import causal_linear_quadratic

from _rule_checks import check_result

THREADS = numba.get_num_threads()
C = 8  # chunk size of the launcher-level tests
RULES = {"decay": RULE_DECAY, "gate": RULE_GATE}
METHODS = {"scan": causal_scan, "chunked": causal_chunked}
TOL = {np.float64: 1e-12, np.float32: 3e-6, np.float16: 4e-3}


def _log_factors(rng, rule, B, N, F, resets=(), low=-1.0):
    """Log-factors in [low, 0] (decay (B, N), gate (B, N, F)); -inf at the (b, t) of ``resets``."""
    shape = (B, N) if rule == "decay" else (B, N, F)
    lg = rng.uniform(low, 0.0, shape)
    for b, t in resets:
        if b < B and t < N:
            lg[b, t] = -np.inf
    return {"log_decay" if rule == "decay" else "log_gate": lg}


def _problem(rng, B, N, F, M, dtype, rule, resets=(), low=-1.0):
    """Features (positive, rounded to ``dtype``), values, an initial state and the rule's inputs."""
    q = rng.uniform(0.1, 1.0, (B, N, F)).astype(dtype)
    k = rng.uniform(0.1, 1.0, (B, N, F)).astype(dtype)
    v = rng.standard_normal((B, N, M)).astype(dtype)
    S0 = rng.standard_normal((B, F, M))
    z0 = rng.uniform(0.5, 2.0, (B, F))
    return q, k, v, S0, z0, _log_factors(rng, rule, B, N, F, resets, low)


def _launch(method, rule, q, k, v, S0, z0, inputs, *, eps=1e-8, normalize=True, **kw):
    """A launcher called directly on features (``code=0``): NaN-filled ``out``, state in and out."""
    B, N, F = q.shape
    M = v.shape[2]
    H = np.zeros((B, F, M + 1))
    H[..., :M] = S0
    H[..., M] = z0
    out = np.full((B, N, M), np.nan, dtype=q.dtype)
    METHODS[method](q, k, v, H, out, code=0, eps=eps, inputs=inputs, rule=RULES.get(rule, rule),
                    normalize=normalize, **kw)
    return out, H


def _reference(rule, q, k, v, S0, z0, inputs, *, eps=1e-8, normalize=True):
    return causal_linear_quadratic(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), eps=eps,
                                   S0=S0, z0=z0, rule=RULES.get(rule, rule), inputs=inputs, normalize=normalize)


def _check(out, H, ref, dtype, what=""):
    """:func:`_rule_checks.check_result` at this file's tolerance for ``dtype``."""
    check_result(out, H, ref, dtype, TOL[dtype], what)


def _plain_loop(rule, qf, kf, v, S0, z0, inputs, eps, normalize):
    """The recurrence token by token, float64: the reference of the reference."""
    B, N, F = qf.shape
    M = v.shape[2]
    out = np.empty((B, N, M))
    S, z = S0.copy(), z0.copy()
    for b in range(B):
        for t in range(N):
            lg = inputs["log_decay"][b, t] if rule == "decay" else inputs["log_gate"][b, t]
            a = np.broadcast_to(np.exp(lg), (F,))
            S[b] = a[:, None] * S[b] + np.outer(kf[b, t], v[b, t])
            z[b] = a * z[b] + kf[b, t]
            num = qf[b, t] @ S[b]
            if normalize:
                den = qf[b, t] @ z[b]
                num = num / (den if eps is None else max(den, eps))
            out[b, t] = num
    return out, S, z


# ---------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("normalize", [True, False])
def test_reference_equals_plain_loop(rng, rule, normalize):
    q, k, v, S0, z0, inputs = _problem(rng, 2, 19, 4, 3, np.float64, rule, resets=[(0, 0), (1, 7), (1, 8)])
    got = _reference(rule, q, k, v, S0, z0, inputs, eps=None, normalize=normalize)
    want = _plain_loop(rule, q, k, v, S0, z0, inputs, None, normalize)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------
# every CPU method against the reference
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("N", [0, 1, 7, C - 1, C, C + 1, 4 * C + 3])
def test_edge_lengths(rng, rule, method, N):
    """N = 0, 1, odd, chunk +- 1 and several chunks; D != M; resets inside and at chunk boundaries."""
    kw = {"chunk": C} if method == "chunked" else {}
    q, k, v, S0, z0, inputs = _problem(rng, 3, N, 5, 3, np.float64, rule, resets=[(0, 3), (1, C), (2, C - 1)])
    out, H = _launch(method, rule, q, k, v, S0, z0, inputs, **kw)
    _check(out, H, _reference(rule, q, k, v, S0, z0, inputs), np.float64, f"{rule} {method} N={N}")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes(rng, rule, method, dtype):
    kw = {"chunk": C} if method == "chunked" else {}
    q, k, v, S0, z0, inputs = _problem(rng, 3, 3 * C + 5, 6, 4, dtype, rule, resets=[(1, 11)], low=-0.3)
    out, H = _launch(method, rule, q, k, v, S0, z0, inputs, **kw)
    _check(out, H, _reference(rule, q, k, v, S0, z0, inputs), dtype, f"{rule} {method} {np.dtype(dtype)}")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("B", [1, THREADS + 1])
@pytest.mark.parametrize("seq_parallel", [True, False])
def test_chunked_sequence_splitting(rng, monkeypatch, rule, B, seq_parallel):
    """B below and above the thread count, sequences split into segments or not: the pieces' factors."""
    monkeypatch.setattr(cfg, "CPU_CHUNKED_MIN_SEGMENT_CHUNKS", 1)
    N = 9 * C + 3
    assert ch.plan(B, N, chunk=C, seq_parallel=seq_parallel)[0] == (1 if seq_parallel is False else max(
        2, -(-THREADS // B)))
    resets = [(0, 2 * C + 1), (B - 1, 5 * C)]
    q, k, v, S0, z0, inputs = _problem(rng, B, N, 5, 7, np.float64, rule, resets=resets, low=-0.2)
    out, H = _launch("chunked", rule, q, k, v, S0, z0, inputs, chunk=C, seq_parallel=seq_parallel)
    _check(out, H, _reference(rule, q, k, v, S0, z0, inputs), np.float64, f"{rule} B={B} sp={seq_parallel}")


def test_chunked_many_segments_and_pieces(rng, monkeypatch):
    """Several segments of several pass-1 pieces each: factors combined piece by piece, for both rules."""
    orig = ch.plan
    monkeypatch.setattr(ch, "plan", lambda B, N, chunk, seq_parallel=None: (4, 3))
    try:
        for rule in RULES:
            q, k, v, S0, z0, inputs = _problem(rng, 2, 20 * 4 + 1, 4, 3, np.float64, rule,
                                               resets=[(0, 37)], low=-0.1)
            out, H = _launch("chunked", rule, q, k, v, S0, z0, inputs, chunk=4)
            _check(out, H, _reference(rule, q, k, v, S0, z0, inputs), np.float64, f"{rule} 4x3 pieces")
    finally:
        monkeypatch.setattr(ch, "plan", orig)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("normalize, eps", [(False, 1e-8), (True, None)])
def test_normalize_and_raw_division(rng, rule, method, normalize, eps):
    kw = {"chunk": C} if method == "chunked" else {}
    q, k, v, S0, z0, inputs = _problem(rng, 2, 2 * C + 3, 5, 3, np.float32, rule, resets=[(0, 4)])
    out, H = _launch(method, rule, q, k, v, S0, z0, inputs, eps=eps, normalize=normalize, **kw)
    ref = _reference(rule, q, k, v, S0, z0, inputs, eps=eps, normalize=normalize)
    _check(out, H, ref, np.float32, f"{rule} {method} normalize={normalize} eps={eps}")


# ---------------------------------------------------------------------------
# special factors: 1 (the additive rule), 0 (a reset), strong decay
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
def test_factor_one_is_the_additive_rule(rng, rule, method):
    kw = {"chunk": C} if method == "chunked" else {}
    q, k, v, S0, z0, inputs = _problem(rng, 2, 3 * C + 1, 5, 3, np.float64, rule)
    for x in inputs.values():
        x[...] = 0.0
    out, H = _launch(method, rule, q, k, v, S0, z0, inputs, **kw)
    out_a, H_a = _launch(method, RULE_ADDITIVE, q, k, v, S0, z0, None, **kw)
    np.testing.assert_allclose(out, out_a, rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(H, H_a, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_reset_is_exact(rng, rule, method, dtype):
    """A -inf log-factor (decay 0) at token r: from r on, the result is that of a fresh start at r.

    Resets at the first token, mid-chunk, at the last token of a chunk and at
    the first of the next; the state before carries large values and the
    factors before are strong, so any leak or NaN shows.
    """
    kw = {"chunk": C} if method == "chunked" else {}
    N, F, M = 4 * C, 5, 3
    for r in (0, 3, C - 1, C, 2 * C + 5):
        q, k, v, S0, z0, inputs = _problem(rng, 1, N, F, M, dtype, rule, resets=[(0, r)], low=-30.0)
        S0 = S0 * 1e6
        out, H = _launch(method, rule, q, k, v, S0, z0, inputs, **kw)
        assert np.isfinite(out).all() and np.isfinite(H).all()
        tail = {name: np.ascontiguousarray(x[:, r:]) for name, x in inputs.items()}
        zS, zz = np.zeros_like(S0), np.zeros_like(z0)
        fresh = _reference(rule, q[:, r:], k[:, r:], v[:, r:], zS, zz, tail)
        _check(out[:, r:], H, fresh, dtype, f"{rule} {method} reset at {r}")
        # and the whole sequence against the reference (outputs before r included)
        _check(out, H, _reference(rule, q, k, v, S0, z0, inputs), dtype, f"{rule} {method} reset at {r}")


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strong_decay_no_overflow(rng, rule, method, dtype):
    """log-factor -20 per token (per feature for the gate), chunks of 64: no overflow, no NaN, no inf.

    A product of forward and inverse cumulative factors would need
    exp(20 * 64); every factor here stays in [0, 1].
    """
    kw = {"chunk": 64} if method == "chunked" else {}
    q, k, v, S0, z0, inputs = _problem(rng, 2, 3 * 64 + 7, 6, 4, dtype, rule, resets=[(1, 70)])
    for x in inputs.values():
        x[np.isfinite(x)] = -20.0
    out, H = _launch(method, rule, q, k, v, S0, z0, inputs, **kw)
    _check(out, H, _reference(rule, q, k, v, S0, z0, inputs), dtype, f"{rule} {method} strong")
    # the extreme: just above the reset threshold
    for x in inputs.values():
        x[np.isfinite(x)] = -745.0
    out, H = _launch(method, rule, q, k, v, S0, z0, inputs, **kw)
    _check(out, H, _reference(rule, q, k, v, S0, z0, inputs), dtype, f"{rule} {method} -745")


def test_gate_with_mixed_features(rng):
    """Gate rows that never decay next to rows that reset every token and rows that decay strongly."""
    B, N, F, M = 2, 5 * C + 2, 6, 3
    q, k, v, S0, z0, inputs = _problem(rng, B, N, F, M, np.float64, "gate")
    g = inputs["log_gate"]
    g[..., 0] = 0.0
    g[..., 1] = -np.inf
    g[..., 2] = -20.0
    ref = _reference("gate", q, k, v, S0, z0, inputs)
    for method in METHODS:
        out, H = _launch(method, "gate", q, k, v, S0, z0, inputs, **({"chunk": C} if method == "chunked" else {}))
        _check(out, H, ref, np.float64, f"gate {method}")


def test_wrong_input_shapes_raise(rng):
    q, k, v, S0, z0, inputs = _problem(rng, 2, 9, 4, 3, np.float64, "gate")
    for method in METHODS:
        with pytest.raises(ValueError, match="log_gate"):
            _launch(method, "gate", q, k, v, S0, z0, {"log_gate": inputs["log_gate"][..., :3]})
        with pytest.raises(ValueError, match="log_decay"):
            _launch(method, "decay", q, k, v, S0, z0, {"log_decay": np.zeros((2, 8))})
        with pytest.raises(ValueError, match="inputs"):
            _launch(method, "decay", q, k, v, S0, z0, None)


# ---------------------------------------------------------------------------
# through the public API
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["scan", "chunked"])
@pytest.mark.parametrize("form", ["head", "token", "feature", "log_token"])
def test_public_api(rng, method, form):
    """linear_attention(causal=True, decay=...) with the per-head, per-token and per-feature forms."""
    Bt, Hd, N, D, M = 2, 3, 45, 8, 5
    q = rng.standard_normal((Bt, Hd, N, D))
    k = rng.standard_normal((Bt, Hd, N, D))
    v = rng.standard_normal((Bt, Hd, N, M))
    if form == "head":
        kw = {"decay": rng.uniform(0.8, 1.0, (Bt, Hd))}
    elif form == "token":
        d = rng.uniform(0.5, 1.0, (Bt, Hd, N))
        d[0, 1, 17] = 0.0  # a document boundary
        kw = {"decay": d}
    elif form == "feature":
        kw = {"decay": rng.uniform(0.3, 1.0, (Bt, Hd, N, D))}
    else:
        lg = rng.uniform(-0.5, 0.0, (Bt, Hd, N))
        lg[1, 2, 30] = -np.inf
        kw = {"log_decay": lg}
    ref = linattn_nb.linear_attention(q, k, v, causal=True, method="quadratic", **kw)
    for dtype, tol in ((np.float64, 1e-11), (np.float32, 2e-5)):
        args = [x.astype(dtype) for x in (q, k, v)]
        out = linattn_nb.linear_attention(*args, causal=True, method=method, **kw)
        assert out.dtype == np.dtype(dtype) and np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())
    # segment-wise: two halves through return_state / initial_state equal one call
    half = N // 2

    def cut(x, sl):
        return {key: (val[..., sl] if (np.ndim(val) == 3 and val.shape[-1] == N) else
                      val[..., sl, :] if np.ndim(val) == 4 else val) for key, val in x.items()}

    o1, st = linattn_nb.linear_attention(q[..., :half, :], k[..., :half, :], v[..., :half, :], causal=True,
                                         method=method, return_state=True, **cut(kw, slice(0, half)))
    o2 = linattn_nb.linear_attention(q[..., half:, :], k[..., half:, :], v[..., half:, :], causal=True,
                                     method=method, initial_state=st, **cut(kw, slice(half, N)))
    np.testing.assert_allclose(np.concatenate([o1, o2], axis=-2), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", ["scan", "chunked"])
def test_public_api_normalize_false(rng, method):
    q, k, v = (rng.standard_normal((2, 37, 6)) for _ in range(3))
    d = rng.uniform(0.7, 1.0, (2, 37, 6))
    ref = linattn_nb.linear_attention(q, k, v, causal=True, method="quadratic", decay=d, normalize=False)
    out = linattn_nb.linear_attention(q, k, v, causal=True, method=method, decay=d, normalize=False)
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
