"""The chunked DPLR form in float32 (float32 products, float64 state between chunks) against the float64
reference: chunk boundaries, resets and decays past float32's cut inside a chunk, sub-steps, a named
rule, a state past float32's range, and float32 against float64."""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb as la

B, D, M = 2, 6, 5


def _log(x):
    with np.errstate(divide="ignore"):
        return np.log(x)


def _rel(o, ref):
    return np.linalg.norm(np.asarray(o, np.float64) - ref) / np.linalg.norm(ref)


def _case(rng, n, r, w, ld):
    q = rng.standard_normal((B, n, D)).astype(np.float32)
    kshape = (B, n, r) if (r and w == r) else (B, n)
    k, v = (rng.standard_normal(kshape + (d,)).astype(np.float32) for d in (D, M))
    ab = (B, n, r, D) if r else (B, n, D)
    return q, k, v, {"a": rng.standard_normal(ab) * 0.3, "b": rng.standard_normal(ab) * 0.3, "log_diag": ld,
                     "beta": rng.uniform(0.2, 1, size=kshape)}


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("case", ["ragged", "reset_inside", "reset_first", "cut32", "substeps", "one_write"])
def test_float32_chunks_equal_the_reference(rng, monkeypatch, case, normalize):
    """N = 21 over chunks of 8: a reset inside a chunk and at a chunk's first token, log-decays of -3 a
    token (the cumulative passes float32's cut of -40 inside a chunk) and -45 (one token past it: the
    scan), r = 3 sub-steps with a write after each and after the last."""
    monkeypatch.setattr(la.config, "DPLR_CHUNK", 8)
    n, r, w = 21, 0, 1
    ld = _log(rng.uniform(0.5, 1, size=(B, n, D)))
    if case == "reset_inside":
        ld[:, 5] = -np.inf
        ld[1, 11, 2] = -np.inf
    elif case == "reset_first":
        ld[:, 8] = -np.inf
    elif case == "cut32":
        ld[:, :, 1] = -3.0
        ld[0, 13] = -45.0
    elif case in ("substeps", "one_write"):
        r, w = 3, (3 if case == "substeps" else 1)
        ld = _log(rng.uniform(0.5, 1, size=(B, n)))
        ld[:, 4] = -np.inf
    q, k, v, args = _case(rng, n, r, w, ld)
    S0 = la.LinearState(np.full((B, D, M), 0.3), np.full((B, D), 1.5), 0, "dplr")
    ref, st = la.dplr_attention(q, k, v, method="quadratic", normalize=normalize, initial_state=S0,
                                return_state=True, **args)
    o, st2 = la.dplr_attention(q, k, v, method="chunked", normalize=normalize, initial_state=S0,
                               return_state=True, **args)
    assert o.dtype == np.float32 and np.isfinite(o).all()
    assert _rel(o, ref) < 1e-5
    assert _rel(st2.S, st.S) < 1e-5 and _rel(st2.z, st.z) < 1e-5
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    ref64 = la.dplr_attention(q, k, v, method="quadratic", normalize=normalize, initial_state=S0, **args)
    o64 = la.dplr_attention(q, k, v, method="chunked", normalize=normalize, initial_state=S0, **args)
    assert _rel(o64, ref64) < 1e-12 and _rel(o, ref64) < 1e-5  # float64 chunks: the float64 reference's digits


def test_named_rule_in_float32_with_a_reset(rng, monkeypatch):
    """KDA (its map to the general form in float32): a reset inside a chunk, float32 against the reference."""
    monkeypatch.setattr(la.config, "DPLR_CHUNK", 8)
    n = 19
    q, k, v = (rng.standard_normal((B, n, d)).astype(np.float32) for d in (D, D, M))
    decay = rng.uniform(0.8, 1, size=(B, n, D))
    decay[:, 10] = 0.0
    kw = dict(rule="kda", decay=decay, beta=rng.uniform(0, 1, size=(B, n)), feature_map="l2")
    ref = la.dplr_attention(q, k, v, method="quadratic", **kw)
    o = la.dplr_attention(q, k, v, method="chunked", **kw)
    assert o.dtype == np.float32 and _rel(o, ref) < 1e-5


def test_float32_state_past_float32_range(rng):
    """a = b = ones grows the state 7x a token (past 3.4e38 by token 46); normalised outputs stay O(1):
    float32 chunks must hand such a state to the scan, not overflow."""
    n = 60
    q, k, v = (np.abs(rng.standard_normal((1, n, d))).astype(np.float32) for d in (D, D, M))
    ones = np.ones((1, n, D))
    ref = la.dplr_attention(q, k, v, a=ones, b=ones, method="quadratic", normalize=True)
    o = la.dplr_attention(q, k, v, a=ones, b=ones, method="chunked", normalize=True)
    assert np.isfinite(o).all() and _rel(o, ref) < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [3, 21])
def test_non_finite_a_or_b_is_named(rng, monkeypatch, dtype, n):
    """The chunked forward checks a and b when its kernel reports a non-finite row: a NaN in a whose b is
    zero (no product carries it to the state) and an inf in b are still a ValueError naming the argument."""
    monkeypatch.setattr(la.config, "DPLR_CHUNK", 8)
    q, k, v = (rng.standard_normal((B, n, d)).astype(dtype) for d in (D, D, M))
    a, b = rng.standard_normal((B, n, D)), np.zeros((B, n, D))
    a[1, n - 2, 3] = np.nan
    for method in ("auto", "chunked"):
        with pytest.raises(ValueError, match="a contains non-finite"):
            la.dplr_attention(q, k, v, a=a, b=b, method=method, check_finite=False)
    a[1, n - 2, 3] = 0.0
    b[0, 1, 2] = np.inf
    with pytest.raises(ValueError, match="b contains non-finite"):
        la.dplr_attention(q, k, v, a=a, b=b, method="chunked")


@pytest.mark.parametrize("bad", [0.5, np.nan])
@pytest.mark.parametrize("n", [3, 21])
def test_log_diag_out_of_range_is_named(rng, monkeypatch, bad, n):
    """The chunked forward leaves log_diag's range to the kernel: a value > 0 or NaN is still a ValueError."""
    monkeypatch.setattr(la.config, "DPLR_CHUNK", 8)
    q, k, v = (rng.standard_normal((B, n, d)).astype(np.float32) for d in (D, D, M))
    ld = _log(rng.uniform(0.5, 1, size=(B, n, D)))
    ld[1, n - 1, 2] = bad
    for method in ("auto", "chunked"):
        with pytest.raises(ValueError, match="log_diag must be <= 0"):
            la.dplr_attention(q, k, v, a=np.zeros((B, n, D)), b=np.zeros((B, n, D)), log_diag=ld, method=method,
                              check_finite=False)


def _keyed_args(rng, name, b, n, f):
    """A keyed rule's arguments with resets (a zero decay) at token 0, inside the chunk and at a chunk's
    first token (chunks of 8)."""
    from linattn_nb.rules import get_dplr_rule

    spec = get_dplr_rule(name)
    args = spec.sample(rng, b, n, f, 2)
    if "decay" in args:
        args["decay"] = args["decay"].copy()
        for t in (0, 5, 8):
            if t < n:
                args["decay"][:, t] = 0.0
    return spec, args


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, b", [(1, 1), (21, 1), (21, 2)])
@pytest.mark.parametrize("name", ["kda", "delta_product", "gated_delta_product"])
def test_keyed_rules_equal_the_reference(rng, monkeypatch, name, n, b, dtype):
    """A rule with a keyed form runs the chunked kernel on its keys and per-token scalars (never a, b, kw):
    N = 1, N = 21 over chunks of 8 with resets at the first token, inside a chunk and at a chunk's first
    token, B = 1 and 2, float32 and float64, against the float64 reference."""
    import linattn_nb.ops.dplr.chunked as CH

    monkeypatch.setattr(la.config, "DPLR_CHUNK", 8)
    spec, args = _keyed_args(rng, name, b, n, D)
    shape = (b, n, 2) if spec.substeps else (b, n)
    q = rng.standard_normal((b, n, D)).astype(dtype)
    k, v = (rng.standard_normal(shape + (d,)).astype(dtype) for d in (D, M))
    seen = []
    real = CH.dplr_chunked
    monkeypatch.setattr(CH, "dplr_chunked", lambda *a: seen.append(len(a)) or real(*a))
    S0 = la.LinearState(np.full((b, D, M), 0.3), np.full((b, D), 0.5), 0, name)
    kw = dict(rule=name, feature_map="l2", initial_state=S0, return_state=True, **args)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    ref, st = la.dplr_attention(q64, k64, v64, method="quadratic", **kw)
    o, st2 = la.dplr_attention(q, k, v, method="chunked", **kw)
    assert seen == [12]  # the keyed call: cb and cw after the general arguments
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert o.dtype == dtype and _rel(o, ref) < tol
    assert _rel(st2.S, st.S) < tol and _rel(st2.z, st.z) < tol
    o2 = la.dplr_attention(q, k, v, method="auto", **kw)[0]  # N = 1 and 21 below the crossover: the scan
    assert _rel(o2, ref) < tol


@pytest.mark.parametrize("name", ["kda", "delta_product", "gated_delta_product"])
def test_keyed_form_is_the_built_form(rng, name):
    """A rule's keyed form declares the same a, b, kw and writes as its build (a = D k, b = cb k, kw = cw k)."""
    spec, args = _keyed_args(rng, name, 2, 9, D)
    r = 2 if spec.substeps else 0
    fk = rng.standard_normal((2, 9, r, D) if r else (2, 9, D))
    v = rng.standard_normal((2, 9, r, M) if r else (2, 9, M))
    checked = spec.check(args, (2,), 9, D, r)
    g = spec.build(fk, v, checked)
    kf = spec.keyed(fk, v, checked)
    K = fk if r else fk[:, :, None]
    with np.errstate(divide="ignore"):
        dg = np.exp(kf.ld)[:, :, None, :] if kf.ld.shape[2] else np.ones((2, 9, 1, 1))
    a = K.copy()
    a[:, :, :1] *= dg
    np.testing.assert_array_equal(g.ld, kf.ld)
    np.testing.assert_allclose(g.a, a, rtol=1e-15, atol=0)
    np.testing.assert_allclose(g.b, kf.cb[..., None] * K, rtol=1e-15, atol=0)
    np.testing.assert_allclose(g.kw, kf.cw[..., None] * K, rtol=1e-15, atol=0)
    np.testing.assert_array_equal(g.vw, kf.vw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [8, 16, 24, 17])
def test_state_after_whole_chunks_and_a_continuation(rng, monkeypatch, n, dtype):
    """The state after an odd and an even number of whole chunks (and a last partial one) is the
    reference's, and a second call from it continues the sequence: a chunk writes its new state to a
    second buffer, which the kernel copies back when the state ends there."""
    monkeypatch.setattr(la.config, "DPLR_CHUNK", 8)
    ld = _log(rng.uniform(0.5, 1, size=(1, 2 * n, D)))
    q, k, v, args = _case(rng, 2 * n, 0, 1, ld)
    q, k, v = (x[:1].astype(dtype) for x in (q, k, v))
    args = {key: x[:1] for key, x in args.items()}
    S0 = la.LinearState(np.full((1, D, M), 0.3), np.full((1, D), 1.5), 0, "dplr")
    ref, st = la.dplr_attention(q, k, v, method="quadratic", initial_state=S0, return_state=True, **args)
    first = {key: x[:, :n] for key, x in args.items()}
    second = {key: x[:, n:] for key, x in args.items()}
    o1, s1 = la.dplr_attention(q[:, :n], k[:, :n], v[:, :n], method="chunked", initial_state=S0, return_state=True,
                               **first)
    ref1, st1 = la.dplr_attention(q[:, :n], k[:, :n], v[:, :n], method="quadratic", initial_state=S0,
                                  return_state=True, **first)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert _rel(s1.S, st1.S) < tol and _rel(s1.z, st1.z) < tol and _rel(o1, ref1) < tol
    o2, s2 = la.dplr_attention(q[:, n:], k[:, n:], v[:, n:], method="chunked", initial_state=s1, return_state=True,
                               **second)
    assert _rel(o2, ref[:, n:]) < tol
    assert _rel(s2.S, st.S) < tol and _rel(s2.z, st.z) < tol


@pytest.mark.parametrize("code", [4, 5])  # l2, silu_l2 (linattn_nb.ops._codes)
@pytest.mark.parametrize("src", [np.float32, np.float64])
def test_row_features_edge_rows(rng, code, src):
    """The chunked path's float32 row map against the float64 NumPy form, row by row: ordinary rows,
    a zero row, rows with NaN and inf, float64 rows whose squares overflow or underflow (the scaled
    form), one tiny entry beside ordinary ones, and rows of SiLU values below float32's exp."""
    from linattn_nb.ops.dplr.chunked import row_features

    x = rng.standard_normal((12, 7)) * 3
    x[1] = 0.0
    x[2, 3] = np.nan
    x[3, 0] = np.inf
    x[4, 5] = -np.inf
    x[5] *= 1e200 if src == np.float64 else 1e30
    x[6] *= 1e-200 if src == np.float64 else 1e-40
    x[7, :] = [1e-30, 1, 2, 3, 4, 5, 6]
    x[8] = -100.0 - rng.uniform(0, 5, 7)  # SiLU values ~ 1e-42: zero in float32's exp
    x = x.astype(src)
    with np.errstate(all="ignore"):
        s = np.asarray(x, np.float64)
        if code == 5:
            s = s / (1.0 + np.exp(-s))
        mx = np.abs(s).max(axis=1, keepdims=True)
        y = s / np.where(mx > 0, mx, 1.0)  # scaled first: no overflow or underflow in the norm
        ref = y / np.where(mx > 0, np.linalg.norm(y, axis=1, keepdims=True), 1.0)
    ref[~np.isfinite(s).all(axis=1)] = np.nan  # a row with NaN or inf is NaN throughout
    out = np.full(x.shape, -7.0, np.float32)
    row_features(x.reshape(12, 1, 7), out, code)
    np.testing.assert_allclose(out, ref.astype(np.float32), rtol=2e-6, atol=1e-37, equal_nan=True)
    assert np.array_equal(np.isnan(out), np.isnan(ref))


def test_work_arrays_reused_across_calls_and_threads(rng, monkeypatch):
    """The chunked path's feature work arrays: a second call (same shape, other inputs) leaves the first
    call's outputs and state as they were, calls from two threads at once each get their own, and a
    limit of 0 bytes (fresh arrays every call) gives the same values."""
    import threading

    from linattn_nb import dplr as dp

    n = 40
    cases = []
    for _ in range(4):
        q, k, v = (rng.standard_normal((B, n, d)).astype(np.float32) for d in (D, D, M))
        kw = dict(rule="kda", log_decay=_log(rng.uniform(0.6, 1, size=(B, n, D))),
                  beta=rng.uniform(0, 1, size=(B, n)), feature_map="l2", method="chunked", return_state=True)
        cases.append((q, k, v, kw))
    monkeypatch.setattr(la.config, "DPLR_WORK_BYTES", 0)
    want = [la.dplr_attention(q, k, v, **kw) for q, k, v, kw in cases]
    monkeypatch.setattr(la.config, "DPLR_WORK_BYTES", 64 << 20)
    got = [la.dplr_attention(q, k, v, **kw) for q, k, v, kw in cases]  # each call reuses the last one's arrays
    for (o, st), (o2, st2) in zip(got, want):
        np.testing.assert_array_equal(o, o2)
        np.testing.assert_array_equal(st.S, st2.S)
    assert dp._WORK.pool["key"].shape == (B, n, D)
    results = [None] * 4

    def work(i):
        for _ in range(5):
            results[i] = la.dplr_attention(*cases[i][:3], **cases[i][3])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (o, st), (o2, _) in zip(results, want):
        np.testing.assert_array_equal(o, o2)
