"""Tests that catch the bugs planted by tools/mutate.py which the rest of the suite let pass.

Each test checks a result against an independent reference written out here
with NumPy (the formula from its paper, weights formed explicitly), never
against a value copied from the code under test.
"""
from __future__ import annotations

import numpy as np
import pytest

from linattn_nb.analysis import approximation_error
from linattn_nb.analysis.theory import orthogonal_mse_bound

from _state_files import rewrite_state_file


def _elu1(x):
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _explicit_statistics(q, k, v, causal):
    """Softmax weights P, ELU+1 linear weights W and the row statistics, from explicit N x N matrices."""
    B, N, D = q.shape
    rows = []
    o_sm = np.empty_like(v)
    o_lin = np.empty_like(v)
    for b in range(B):
        s = (q[b] @ k[b].T) / np.sqrt(D)
        a = _elu1(q[b]) @ _elu1(k[b]).T
        if causal:
            mask = np.tril(np.ones((N, N), dtype=bool))
            s = np.where(mask, s, -np.inf)
            a = np.where(mask, a, 0.0)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        w = a / a.sum(axis=1, keepdims=True)
        o_sm[b] = p @ v[b]
        o_lin[b] = w @ v[b]
        for i in range(N):
            n_i = i + 1 if causal else N
            pi, wi = p[i, :n_i], w[i, :n_i]
            mi = 0.5 * (pi + wi)
            rows.append({
                "tv": 0.5 * np.abs(pi - wi).sum(),
                "kl": np.sum(pi * np.log(pi / wi)),
                "hp": -np.sum(pi * np.log(pi)),
                "js": 0.5 * np.sum(pi * np.log(pi / mi)) + 0.5 * np.sum(wi * np.log(wi / mi)),
            })
    return o_sm, o_lin, rows


@pytest.mark.parametrize("causal", [False, True])
def test_approximation_error_summaries_against_explicit_weights(causal):
    # Catches: tv_mean computed as a max, output_rel_error over ||O_lin|| (mutations
    # error_tv_mean_max, error_rel_denominator): the fast path and the naive one share
    # the summary, so the reference here is written out from the weights.
    rng = np.random.default_rng(7)
    B, N, D, M = 2, 9, 4, 3
    q, k = rng.standard_normal((2, B, N, D))
    v = rng.standard_normal((B, N, M))
    err = approximation_error(q, k, v, "elu", causal=causal)
    o_sm, o_lin, rows = _explicit_statistics(q, k, v, causal)
    tv = np.array([r["tv"] for r in rows])
    kl = np.array([r["kl"] for r in rows])
    rel = np.linalg.norm(o_lin - o_sm) / np.linalg.norm(o_sm)
    assert np.linalg.norm(o_lin) != pytest.approx(np.linalg.norm(o_sm), rel=1e-3)  # the denominators differ
    assert tv.max() > 1.1 * tv.mean()  # mean and max differ
    assert err.n_rows == B * N
    assert err.output_rel_error == pytest.approx(rel, rel=1e-12)
    assert err.tv_mean == pytest.approx(tv.mean(), rel=1e-12)
    assert err.tv_max == pytest.approx(tv.max(), rel=1e-12)
    assert err.kl_mean == pytest.approx(kl.mean(), rel=1e-10)
    assert err.kl_max == pytest.approx(kl.max(), rel=1e-10)
    assert err.entropy_softmax == pytest.approx(np.mean([r["hp"] for r in rows]), rel=1e-12)
    assert err.js_mean == pytest.approx(np.mean([r["js"] for r in rows]), rel=1e-10)


def test_orthogonal_mse_bound_is_theorem_2_written_out():
    # Catches: the coefficient 2(m - 1) / (m (d + 2)) with d in place of d + 2
    # (mutation theory_thm2_coefficient).  Choromanski et al. (ICLR 2021):
    # Lemma 1, MSE_pos = SM^2 exp(|x + y|^2) (1 - exp(-|x + y|^2)) / m, and
    # Theorem 2, MSE_ort <= MSE_pos - 2 (m - 1) / (m (d + 2)) (SM - exp(-(|x|^2 + |y|^2) / 2))^2.
    rng = np.random.default_rng(3)
    for d, m in [(4, 2), (6, 6), (16, 5)]:
        x, y = 0.4 * rng.standard_normal((2, 5, d))
        sm = np.exp(np.einsum("ij,ij->i", x, y))
        u2 = np.einsum("ij,ij->i", x + y, x + y)
        mse_pos = sm ** 2 * np.exp(u2) * (1.0 - np.exp(-u2)) / m
        gap = sm - np.exp(-0.5 * (np.einsum("ij,ij->i", x, x) + np.einsum("ij,ij->i", y, y)))
        want = mse_pos - 2.0 * (m - 1) / (m * (d + 2)) * gap ** 2
        np.testing.assert_allclose(orthogonal_mse_bound(x, y, m), want, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------
# the state file format
# ---------------------------------------------------------------------------
def _state_file(tmp_path, **kw):
    from linattn_nb import LinearAttentionState

    st = LinearAttentionState(3, 2, batch_shape=(2,), **kw)
    st.prefill(np.ones((2, 4, 3)), np.ones((2, 4, 2)))
    path = tmp_path / "state.npz"
    st.save(path)
    return st, path


def test_state_file_one_version_ahead_is_refused(tmp_path):
    # Catches: the newer-version check off by one (mutation file_newer_version_accepted):
    # the next format version, not only a far-off one, must be refused.
    from linattn_nb import LinearAttentionState
    from linattn_nb.state.fileformat import FORMAT_VERSION, StateFileError

    _, good = _state_file(tmp_path)
    for version in (FORMAT_VERSION + 1, FORMAT_VERSION + 2):
        bad = tmp_path / f"v{version}.npz"
        rewrite_state_file(good, bad, version=np.array(version, dtype=np.int64))
        with pytest.raises(StateFileError, match=f"format version {version} was written by a newer"):
            LinearAttentionState.load(bad)
    ok = tmp_path / "same.npz"
    rewrite_state_file(good, ok, version=np.array(FORMAT_VERSION, dtype=np.int64))
    assert LinearAttentionState.load(ok).position == 4


@pytest.mark.parametrize("entry", ["rule", "normalize"])
def test_state_file_version_2_entries_are_required(tmp_path, entry):
    # Catches: a version-2 file without its version-2 entries read as a version-1 file
    # (mutation file_version_keys).
    from linattn_nb import LinearAttentionState
    from linattn_nb.state.fileformat import StateFileError

    _, good = _state_file(tmp_path)
    bad = tmp_path / "bad.npz"
    rewrite_state_file(good, bad, **{entry: None})
    with pytest.raises(StateFileError, match=rf"missing entries \['{entry}'\]"):
        LinearAttentionState.load(bad)
    # a version-1 file has neither entry and is read as additive
    v1 = tmp_path / "v1.npz"
    rewrite_state_file(good, v1, version=np.array(1, dtype=np.int64), rule=None, normalize=None)
    assert LinearAttentionState.load(v1).position == 4


def test_state_file_unknown_rule_is_refused(tmp_path):
    # Catches: the rule entry not checked against the known rules (mutation file_rule_unchecked).
    from linattn_nb import LinearAttentionState
    from linattn_nb.state.fileformat import StateFileError

    _, good = _state_file(tmp_path)
    bad = tmp_path / "bad.npz"
    rewrite_state_file(good, bad, rule=np.array("no_such_rule"))
    with pytest.raises(StateFileError, match="entry 'rule' must be a registered rule, one of"):
        LinearAttentionState.load(bad)


@pytest.mark.parametrize("normalize", [True, False])
def test_state_file_keeps_normalize(tmp_path, normalize):
    # Catches: save() dropping the normalize setting (mutation file_normalize_dropped).
    from linattn_nb import LinearAttentionState

    st, path = _state_file(tmp_path, normalize=normalize)
    with np.load(path, allow_pickle=False) as npz:
        assert int(npz["normalize"]) == int(normalize)
    back = LinearAttentionState.load(path)
    assert back.normalize is normalize
    q = np.linspace(-1.0, 1.0, 2 * 3).reshape(2, 1, 3)
    np.testing.assert_array_equal(back.query(q), st.query(q))


# ---------------------------------------------------------------------------
# the normaliser floor of every CPU kernel
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
def test_eps_floor_every_cpu_method(causal):
    # Catches: a kernel that skips the floor or floors with the wrong sign (mutations
    # scan_floor_dropped, chunked_floor_dropped, noncausal_floor_sign).  Signed features
    # (the identity map) give normalisers on both sides of the floor; the reference
    # is the explicit weight matrix, out_t = num_t / max(den_t, eps).
    from linattn_nb import linear_attention
    from linattn_nb.ops.registry import available_methods

    rng = np.random.default_rng(11)
    N, D, M, eps = 13, 3, 2, 0.5
    q, k = rng.standard_normal((2, N, D))
    v = rng.standard_normal((N, M))
    a = q @ k.T
    if causal:
        a = np.tril(a)
    den = a.sum(axis=1)
    assert (den < eps).sum() >= 3 and (den > eps).sum() >= 3  # the floor bites on some rows only
    want = (a @ v) / np.maximum(den, eps)[:, None]
    for method in available_methods(causal=causal, device="cpu"):
        out = linear_attention(q, k, v, feature_map="identity", causal=causal, eps=eps, method=method)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14, err_msg=method)


# ---------------------------------------------------------------------------
# the device-side finiteness count
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["first", "last"])
def test_device_nonfinite_count_reaches_every_element(where):
    # Catches: the grid-stride count stopping one element short (mutation cuda_pool_count_last):
    # a NaN in the first or the last element of each input must be counted.
    cuda = pytest.importorskip("numba.cuda")
    import linattn_nb as la

    rng = np.random.default_rng(5)
    B, N, F, M = 2, 5, 3, 2
    for name in ("q", "k", "v"):
        arrays = {"q": rng.standard_normal((B, N, F)), "k": rng.standard_normal((B, N, F)),
                  "v": rng.standard_normal((B, N, M))}
        idx = (0, 0, 0) if where == "first" else (B - 1, N - 1, arrays[name].shape[-1] - 1)
        arrays[name][idx] = np.nan
        dev = {n: cuda.to_device(x.astype(np.float32)) for n, x in arrays.items()}
        with pytest.raises(ValueError, match=rf"{name} contains 1 non-finite"):
            la.linear_attention(dev["q"], dev["k"], dev["v"], device="cuda")
    # q, k, v are counted inside the sequence kernel; the pool's grid-stride count checks a device
    # initial state: a NaN in its first or last entry of S, and of z, must be counted too
    q, k, v = (cuda.to_device(rng.standard_normal((B, N, d)).astype(np.float32)) for d in (F, F, M))
    for name, shape in (("S", (B, F, M)), ("z", (B, F))):
        S0, z0 = rng.standard_normal((B, F, M)), rng.uniform(1.0, 2.0, (B, F))
        x = S0 if name == "S" else z0
        x[(0,) * len(shape) if where == "first" else tuple(s - 1 for s in shape)] = np.nan
        with pytest.raises(ValueError, match=rf"initial_state.{name} contains 1 non-finite"):
            la.linear_attention(q, k, v, device="cuda", initial_state=(cuda.to_device(S0), cuda.to_device(z0)))


# ---------------------------------------------------------------------------
# the returned state of every non-causal CPU method
# ---------------------------------------------------------------------------
def test_noncausal_state_every_cpu_method_from_an_initial_state():
    # Catches: the non-causal reference (method "quadratic") returning phi(K)^T V without
    # the initial state (mutation naive_noncausal_state_overwritten).  Reference:
    # S = S0 + phi(K)^T V, z = z0 + sum_j phi(k_j), out = phi(Q) S / (phi(Q) z).
    from linattn_nb import linear_attention
    from linattn_nb.ops.registry import available_methods

    rng = np.random.default_rng(21)
    B, N, D, M = 2, 6, 3, 4
    q, k = rng.standard_normal((2, B, N, D))
    v = rng.standard_normal((B, N, M))
    S0 = rng.standard_normal((B, D, M))
    z0 = rng.uniform(1.0, 2.0, (B, D))
    fq, fk = _elu1(q), _elu1(k)
    S = S0 + np.einsum("bnf,bnm->bfm", fk, v)
    z = z0 + fk.sum(axis=1)
    want = np.einsum("bnf,bfm->bnm", fq, S) / np.einsum("bnf,bf->bn", fq, z)[..., None]
    for method in available_methods(causal=False, device="cpu"):
        out, st = linear_attention(q, k, v, causal=False, method=method, initial_state=(S0, z0),
                                   return_state=True)
        np.testing.assert_allclose(out, want, rtol=1e-12, err_msg=method)
        np.testing.assert_allclose(st.S, S, rtol=1e-12, atol=1e-14, err_msg=method)
        np.testing.assert_allclose(st.z, z, rtol=1e-12, err_msg=method)


# ---------------------------------------------------------------------------
# fitting losses, capacity read-out, CUDA host logic
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_fitting_kl_and_cross_entropy_against_explicit_rows(causal):
    # Catches: the KL loss adding the softmax entropy instead of subtracting it
    # (mutation fit_kl_entropy_sign).  Reference: mean over rows of
    # -sum_j p_ij log w_ij (cross entropy) and sum_j p_ij log(p_ij / w_ij) (KL).
    from linattn_nb import feature_maps as fm
    from linattn_nb.fitting import objective

    rng = np.random.default_rng(8)
    B, N, D, scale = 2, 7, 4, 0.4
    q, k = rng.standard_normal((2, B, N, D))
    phi = fm.get("hedgehog", W=0.5 * rng.standard_normal((3, D)), b=0.1 * rng.standard_normal(3))
    fq = phi.apply(q, role="query", causal=causal)
    fk = phi.apply(k, role="key", causal=causal)
    ce_rows, kl_rows = [], []
    for b in range(B):
        s = scale * (q[b] @ k[b].T)
        a = fq[b] @ fk[b].T  # positive features: every weight > 0
        for i in range(N):
            n_i = i + 1 if causal else N
            p = np.exp(s[i, :n_i] - s[i, :n_i].max())
            p /= p.sum()
            w = a[i, :n_i] / a[i, :n_i].sum()
            ce_rows.append(-np.sum(p * np.log(w)))
            kl_rows.append(np.sum(p * np.log(p / w)))
    ce, _ = objective(phi, q, k, causal=causal, scale=scale, loss="cross_entropy", floor=0.0)
    kl, _ = objective(phi, q, k, causal=causal, scale=scale, loss="kl", floor=0.0)
    assert ce == pytest.approx(np.mean(ce_rows), rel=1e-10)
    assert kl == pytest.approx(np.mean(kl_rows), rel=1e-9)


def test_nearest_accuracy_is_the_nearest_row_by_distance():
    # Catches: the nearest-neighbour read-out with the wrong sign of |v_j|^2 (mutation
    # capacity_nearest_sign).  Reference: argmin_j |vhat_i - v_j| computed directly.
    from linattn_nb.analysis.capacity import _nearest_accuracy

    rng = np.random.default_rng(2)
    v = rng.standard_normal((12, 3)) * rng.uniform(0.2, 4.0, (12, 1))  # rows of very different norms
    vhat = v + 0.8 * rng.standard_normal(v.shape)
    dist = np.linalg.norm(vhat[:, None, :] - v[None, :, :], axis=-1)
    want = np.mean(np.argmin(dist, axis=1) == np.arange(12))
    assert 0.0 < want < 1.0
    assert _nearest_accuracy(vhat, v) == want
    assert _nearest_accuracy(v, v) == 1.0


def test_cuda_auto_counts_a_partial_column_block(monkeypatch):
    # Catches: the auto choice counting batch x floor(M / MB) blocks instead of the
    # ceil(M / MB) the scan launches (mutation cuda_auto_blocks_floor).
    pytest.importorskip("numba.cuda")
    from linattn_nb import _cuda_dispatch as D
    from linattn_nb import config
    from linattn_nb.ops.cuda import plan as KP

    f, m, dtype = 4, 3, np.float32
    monkeypatch.setattr(config, "CUDA_VALUE_COLS", 2)
    MB = KP.seq_config(f, m, np.dtype(KP.acc_name(dtype)).itemsize, 0)[3]
    assert MB == 2  # M = 3: a full and a partial column block per sequence
    monkeypatch.setattr(config, "CUDA_AUTO_SCAN_BLOCKS_PER_SM", 1)
    monkeypatch.setattr(D, "multiprocessor_count", lambda: 4)
    # 2 sequences x 2 blocks = 4 blocks >= 1 per SM x 4 SMs: the scan; 1 x 2 = 2 < 4: not
    assert D.select_auto_cuda(rule="additive", causal=True, batch=2, n=4096, f=f, m=m, dtype=dtype) == "scan"
    assert D.select_auto_cuda(rule="additive", causal=True, batch=1, n=4096, f=f, m=m, dtype=dtype) != "scan"


def test_decay_state_one_token_steps_count_positions():
    # Catches: the one-token fast path of a decay state not advancing the position
    # (mutation state_rule_step_position).
    from linattn_nb import LinearAttentionState

    rng = np.random.default_rng(6)
    q, k = rng.standard_normal((2, 2, 5, 3))
    v = rng.standard_normal((2, 5, 2))
    for rule in (None, "decay"):  # rule="decay" fixed at construction: the one-token fast path from token 0
        st = LinearAttentionState(3, 2, batch_shape=(2,), rule=rule)
        for t in range(5):
            # C-contiguous one-token arrays (the fast path's inputs) and a slice of the sequence
            one = [np.ascontiguousarray(x[:, t:t + 1]) for x in (q, k, v)] if t % 2 == 0 else \
                [x[:, t:t + 1] for x in (q, k, v)]
            st.step(*one, decay=0.9)
            assert st.position == t + 1
        assert st.rule == "decay"


@pytest.mark.parametrize("which", ["S", "z"])
def test_cuda_initial_state_nonfinite_is_named(which):
    # Catches: the finiteness check of the initial state reading the wrong column of H
    # (mutation cuda_pack_state_z_column): a NaN in z (or in S's last column) must be
    # reported as that entry.
    cuda = pytest.importorskip("numba.cuda")
    import linattn_nb as la

    rng = np.random.default_rng(4)
    B, N, F, M = 2, 3, 3, 2
    q, k = (rng.standard_normal((B, N, F)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, N, M)).astype(np.float32)
    S0 = rng.standard_normal((B, F, M))
    z0 = rng.uniform(1.0, 2.0, (B, F))
    if which == "S":
        S0[B - 1, F - 1, M - 1] = np.nan
    else:
        z0[B - 1, F - 1] = np.nan
    dev = [cuda.to_device(x) for x in (q, k, v)]
    with pytest.raises(ValueError, match=rf"initial_state\.{which} contains 1 non-finite"):
        la.linear_attention(*dev, causal=True, device="cuda",
                            initial_state=(cuda.to_device(S0), cuda.to_device(z0)))


def test_every_planted_bug_still_applies():
    """Each mutation of tools/mutate.py names a snippet found exactly once in its file and test targets
    that exist: a stale snippet (the code moved or was re-indented) would plant nothing, and its last
    recorded "caught" would go on standing for a check that no longer runs."""
    import importlib.util
    import pathlib
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("_mutate", root / "tools" / "mutate.py")
    mutate = importlib.util.module_from_spec(spec)
    sys.modules["_mutate"] = mutate  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(mutate)
    finally:
        del sys.modules["_mutate"]
    stale = []
    for m in mutate.MUTATIONS:
        count = (root / "linattn_nb" / m.file).read_text().count(m.old)
        if count != 1:
            stale.append(f"{m.name}: snippet found {count} times in {m.file}")
        stale += [f"{m.name}: no test file {t}" for t in m.targets if not (root / t.split("::")[0]).exists()]
    assert not stale, stale
