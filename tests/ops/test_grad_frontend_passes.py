"""The gradient front end's fused passes: the gradient of ``[num | den]`` in one parallel pass (over the
forward's ``[num | den]`` when allowed) and the maps' VJP over the launcher's own results."""
import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import _gradfront as GF
from linattn_nb import feature_maps as fm
from linattn_nb.ops.grad import _maps, _outgrad, _rowmaps


def _reference(g, nd, eps):
    """The NumPy formula in float64: ``g / den'``, ``-(g . num) / den'^2`` (0 where the floor is active)."""
    g, nd = g.astype(np.float64), nd.astype(np.float64)
    m = g.shape[-1]
    den = nd[..., m]
    active = np.ones(den.shape, bool) if eps is None else den > eps
    den = np.where(active, den, eps if eps is not None else 1.0)
    out = np.empty(nd.shape)
    out[..., :m] = g / den[..., None]
    out[..., m] = np.where(active, -np.einsum("rm,rm->r", g, nd[..., :m]) / den ** 2, 0.0)
    return out


@pytest.mark.parametrize("rows", [1, 7, 64, 131])
@pytest.mark.parametrize("gdt, ndt", [(np.float32, np.float32), (np.float64, np.float64),
                                      (np.float64, np.float32)])
@pytest.mark.parametrize("eps", [None, 1e-3])
def test_output_gradient_matches_the_float64_formula(rows, gdt, ndt, eps):
    rng = np.random.default_rng(rows)
    m = 5
    g = rng.standard_normal((rows, m)).astype(gdt)
    nd = rng.standard_normal((rows, m + 1)).astype(ndt)
    nd[:, m] = rng.uniform(0.5, 2.0, rows)
    if rows > 1:
        nd[::2, m] = 1e-4  # below the floor: no gradient through the normaliser
    want = _reference(g, nd, eps)
    out = np.full((rows, m + 1), np.nan, ndt)
    _outgrad.output_gradient(g, nd, eps, out)
    tol = 1e-6 if ndt == np.float32 else 1e-14
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * np.abs(want).max())
    if eps is not None and rows > 1:
        assert not out[::2, m].any()
    # written over nd itself (each row read before it is written): the same numbers
    own = nd.copy()
    _outgrad.output_gradient(g, own, eps, own)
    np.testing.assert_array_equal(own, out)


@pytest.mark.parametrize("rows", [1, 7, 64, 131])
@pytest.mark.parametrize("ndt, odt", [(np.float32, np.float32), (np.float64, np.float64),
                                      (np.float64, np.float32)])
@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("normalize", [True, False])
def test_outputs_from_nd_are_numpys_quotients_bit_for_bit(rows, ndt, odt, eps, normalize):
    """``outputs_from``: NumPy's float64 ``num / den'`` cast to the output dtype, the same bits, with NaN, inf,
    a zero and a negative normaliser, normalisers under the floor, and its overflow flag where a quotient
    finite in float64 overflows float32."""
    rng = np.random.default_rng(rows)
    m = 5
    nd = rng.standard_normal((rows, m + 1)).astype(ndt)
    nd[:, m] = rng.uniform(0.5, 2.0, rows)
    if rows > 1:
        nd[::2, m] = 1e-4  # below the floor where there is one
    if rows > 6:
        nd[1, m], nd[3, m] = 0.0, -1.5
        nd[4, 0], nd[5, 1] = np.inf, np.nan
    den = nd[:, m].astype(np.float64)
    if normalize and eps is not None:
        den = np.where(den > eps, den, eps)
    with np.errstate(all="ignore"):
        wide = nd[:, :m] / den[:, None] if normalize else nd[:, :m].astype(np.float64)
        want = wide.astype(odt)
    out = np.full((rows, m), 7.0, odt)
    ok = _outgrad.outputs_from(nd, eps, out, normalize=normalize)
    np.testing.assert_array_equal(out, want)
    assert ok == (not (np.isfinite(wide) & ~np.isfinite(want)).any())
    if ndt == np.float64 and odt == np.float32 and normalize:
        big = nd.copy()
        big[0, 0], big[0, m] = 1e30, 1e-20  # 1e50: finite in float64, not in float32
        assert not _outgrad.outputs_from(big, None, out, normalize=True)
    # nd_finite: the same outputs and flag, and whether every element of nd (the normaliser column too, read
    # or not) is finite
    out2 = np.full((rows, m), 7.0, odt)
    got = _outgrad.outputs_from(nd, eps, out2, normalize=normalize, nd_finite=True)
    assert got == (ok, bool(np.isfinite(nd).all()))
    np.testing.assert_array_equal(out2, want)
    for col in (0, m):
        bad = np.abs(np.nan_to_num(nd, nan=1.0, posinf=1.0, neginf=1.0))  # finite everywhere, then one NaN or inf
        bad[rows - 1, col] = np.inf if col else np.nan
        assert _outgrad.outputs_from(bad, eps, out2, normalize=normalize, nd_finite=True)[1] is False
        bad[rows - 1, col] = 1.0
        assert _outgrad.outputs_from(bad, eps, out2, normalize=normalize, nd_finite=True)[1] is True


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("normalize", [True, False])
def test_front_end_forward_outputs_are_linear_attentions(dtype, normalize):
    """The front end's forward (the PyTorch adapter's) gives the outputs of ``linear_attention`` with the same
    method, in the inputs' dtype, for the fast pass (float32, float64) and NumPy's (float16)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 37, 4)).astype(dtype) for _ in range(3))
    kw = dict(feature_map="elu", causal=True, method="chunked", device="cpu", eps=1e-8, check_finite=True,
              initial_state=None, normalize=normalize)
    out, nd, _ = GF.forward(GF.prepare(q, k, v, **kw))
    want = la.linear_attention(q, k, v, causal=True, method="chunked", normalize=normalize)
    assert out.dtype == dtype and out.shape == want.shape
    tol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol)


def test_front_end_forward_names_an_output_overflow():
    """float32 inputs whose quotients overflow float32 (finite in float64, the float64 recomputation's):
    ValueError naming the result, as before the fused pass."""
    req = GF.prepare(*(np.ones((1, 3, 2), np.float32) for _ in range(3)), feature_map="elu", causal=True,
                     method="chunked", device="cpu", eps=None, check_finite=True, initial_state=None,
                     work=np.float64)
    nd = np.array([[[1e30, 1.0, 1e-20]] * 3])
    with pytest.raises(ValueError, match="the result overflows float32"):
        GF._outputs_of(req, nd)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 5, 3), (3, 70, 4)])
def test_front_end_output_gradient_over_nd_is_the_separate_one(normalize, dtype, shape):
    """``backward(..., overwrite_nd=True)`` (the VJP's single backward) gives the gradients of a backward that
    keeps ``nd`` (the torch adapter's, which may run twice); the kept ``nd`` is unchanged."""
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
    kw = dict(feature_map="elu", causal=True, method="chunked", device="cpu", eps=1e-8, check_finite=True,
              initial_state=None, normalize=normalize)
    req = GF.prepare(q, k, v, **kw)
    _, nd, _ = GF.forward(req, want_out=False)
    kept = nd.copy()
    a = GF.backward(req, nd, g)
    np.testing.assert_array_equal(nd, kept)
    b = GF.backward(req, nd, g, overwrite_nd=True)
    for x, y in zip(a[:3], b[:3]):
        np.testing.assert_array_equal(x, y)
    c = la.linear_attention_vjp(q, k, v, g, causal=True, method="chunked", normalize=normalize)
    for x, y in zip(a[:3], c[:3]):
        if normalize:  # the VJP's fused kernel (no forward run) sums in another order
            tol = 1e-5 if dtype == np.float32 else 1e-12
            np.testing.assert_allclose(y, x, rtol=tol, atol=tol * (1 + np.abs(x).max()))
        else:
            np.testing.assert_array_equal(x, y)
    ref = la.linear_attention_vjp(*(x.astype(np.float64) for x in (q, k, v, g)), causal=True, method="quadratic",
                                  normalize=normalize)
    for x, y in zip(c[:3], ref[:3]):
        tol = 2e-4 if dtype == np.float32 else 1e-10
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol * (1 + np.abs(y).max()))  # dq, dk: 0 at N = 1


@pytest.mark.parametrize("mod, name", [(_maps, "elu"), (_maps, "relu"), (_rowmaps, "l2"), (_rowmaps, "silu_l2")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_map_vjp_over_its_gradient(mod, name, dtype):
    rng = np.random.default_rng(2)
    code = fm.get(name).kernel_code
    x = rng.standard_normal((2, 9, 6)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    want = mod.vjp(x, g, code, dtype)
    own = g.copy()
    got = mod.vjp(x, own, code, dtype, overwrite=True)
    assert np.shares_memory(got, own)
    np.testing.assert_array_equal(got, want)
    # a gradient it may not take (another dtype, not contiguous): a fresh result, the gradient kept
    for other in (g.astype(np.float64 if dtype == np.float32 else np.float32), np.asfortranarray(g)):
        kept = other.copy()
        got = mod.vjp(x, other, code, dtype, overwrite=True)
        assert not np.shares_memory(got, other)
        np.testing.assert_array_equal(other, kept)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("gdt", [np.float32, np.float64])
def test_unnormalised_output_gradient_and_finite_flags(gdt):
    """Unnormalised outputs: ``[g | 0]`` in one pass; each pass says whether what it read is finite (a NaN or
    inf in the first, a middle and the last row of a task, and in the last row of all)."""
    rng = np.random.default_rng(3)
    rows, m = 131, 4
    g = rng.standard_normal((rows, m)).astype(gdt)
    nd = rng.standard_normal((rows, m + 1)).astype(np.float32)
    out = np.full((rows, m + 1), np.nan, np.float32)
    assert _outgrad.output_gradient(g, nd, None, out, normalize=False) is True
    np.testing.assert_array_equal(out[:, :m], g.astype(np.float32))
    assert not out[:, m].any()
    assert _outgrad.output_gradient(g, nd, 1e-3, out) is True
    ones = np.full((rows, m + 1), np.nan, gdt)
    assert _outgrad.values_with_ones(g, ones) is True
    np.testing.assert_array_equal(ones, np.concatenate([g, np.ones((rows, 1), gdt)], axis=1))
    for r, i, bad in ((0, 0, np.nan), (63, 2, np.inf), (64, 3, -np.inf), (rows - 1, m - 1, np.nan)):
        h = g.copy()
        h[r, i] = bad
        assert _outgrad.output_gradient(h, nd, None, out, normalize=False) is False
        assert _outgrad.output_gradient(h, nd, 1e-3, out) is False
        assert _outgrad.values_with_ones(h, ones) is False
    assert _outgrad.output_gradient(g[:0], nd[:0], None, out[:0], normalize=False) is True
    assert _outgrad.values_with_ones(g[:0], ones[:0]) is True


@pytest.mark.parametrize("mod, name", [(_maps, "elu"), (_maps, "squared_relu"), (_rowmaps, "l2"),
                                       (_rowmaps, "silu_l2")])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_map_vjp_finite_flag(mod, name, dtype):
    """``vjp_checked`` gives :func:`vjp`'s values and says whether they are all finite: False for a NaN or inf
    in the gradient, and for float32 results that overflow."""
    rng = np.random.default_rng(4)
    code = fm.get(name).kernel_code
    x = rng.standard_normal((3, 70, 6)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    got, ok = mod.vjp_checked(x, g, code, dtype)
    assert ok is True
    np.testing.assert_array_equal(got, mod.vjp(x, g, code, dtype))
    for idx, bad in (((0, 0, 0), np.nan), ((1, 33, 2), np.inf), ((2, 69, 5), -np.inf)):
        h = g.copy()
        h[idx] = bad
        assert mod.vjp_checked(x, h, code, dtype)[1] is False
    if dtype == np.float32 and name != "elu":  # ELU+1's slope is at most 1
        big = np.full(x.shape, 3e38, dtype)  # g times a slope above 1 (or over a small row norm) overflows
        xs = np.abs(x) + 1.5 if mod is _maps else x * np.float32(1e-30)
        res, ok = mod.vjp_checked(xs, big, code, dtype)
        assert ok is bool(np.isfinite(res).all()) and not ok
    assert mod.vjp_checked(x[:, :0], g[:, :0], code, dtype)[1] is True
    if mod is _maps:  # without the check: the flag-free kernel, the same values
        res, ok = mod.vjp_checked(x, g, code, dtype, check=False)
        assert ok is None
        np.testing.assert_array_equal(res, got)


@pytest.mark.parametrize("name, kw", [("elu", {}), ("silu_l2", {"normalize": False, "beta": 0.5}),
                                      ("elu", {"log_decay": -0.1})])
def test_vjp_work_arrays(name, kw, monkeypatch):
    """``linear_attention_vjp`` takes its own arrays from the thread's work arrays: the gradients are those of
    fresh arrays, bit for bit, in every call (another shape in between, a float64 call, a float32 overflow that
    recomputes in float64), none of them is a work array, and threads and ``GRAD_WORK_BYTES = 0`` work alike."""
    import threading

    from linattn_nb import config

    rng = np.random.default_rng(5)
    shapes = [(3, 70, 6), (2, 33, 6), (3, 70, 6)]
    data = [tuple(rng.standard_normal(s) for _ in range(4)) for s in shapes]
    args = dict(feature_map=name, causal=True, method="chunked", **kw)

    def run(q, k, v, g, dtype=np.float32):
        return la.linear_attention_vjp(*(x.astype(dtype) for x in (q, k, v, g)), **args)

    monkeypatch.setattr(config, "GRAD_WORK_BYTES", 0)
    want = [run(*d) for d in data] + [run(*data[0], dtype=np.float64)]
    GF._WORK.__dict__.pop("pool", None)
    monkeypatch.setattr(config, "GRAD_WORK_BYTES", 64 << 20)
    got = [run(*d) for d in data] + [run(*data[0], dtype=np.float64)]
    pool = list(GF._WORK.pool.values())
    assert pool  # the work arrays were used
    if "log_decay" in kw:  # the decay rule's fused backward: its kept chunk-start states too (every fourth)
        assert "anchors" in GF._WORK.pool
    for a, b in zip(got, want):
        for field in ("dq", "dk", "dv", "d_beta"):
            x, y = getattr(a, field), getattr(b, field)
            if y is not None:
                np.testing.assert_array_equal(x, y, err_msg=field)
                assert not any(np.shares_memory(x, w) for w in pool if isinstance(x, np.ndarray)), field
    # threads: each its own work arrays, the same numbers
    results = [None] * 4

    def work(i):
        results[i] = run(*data[i % 2])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.dq, want[i % 2].dq)
        np.testing.assert_array_equal(r.dv, want[i % 2].dv)
    # a float32 overflow: the float64 recomputation after the float32 call, with the work arrays in use (values
    # up to 3.3e38 overflow the float32 sums of the forward; the gradients, with g scaled by 1e-30, are finite
    # in float32)
    q, k, v, g = (x.astype(np.float32) for x in data[0])
    req = GF.prepare(q, k, v * np.float32(1e38), device="cpu", eps=1e-8, check_finite=True, initial_state=None,
                     **args)
    assert GF.overflowed(req, *GF.forward(req, want_out=False)[1:], want_out=False)
    del req
    big = la.linear_attention_vjp(q, k, v * np.float32(1e38), g * np.float32(1e-30), **args)
    monkeypatch.setattr(config, "GRAD_WORK_BYTES", 0)
    ref = la.linear_attention_vjp(q, k, v * np.float32(1e38), g * np.float32(1e-30), **args)
    for field in ("dq", "dk", "dv"):
        assert np.isfinite(getattr(big, field)).all(), field
        np.testing.assert_array_equal(getattr(big, field), getattr(ref, field), err_msg=field)
    # gradients finite in float64 only (g scaled by 1e10): named, not returned as inf
    with pytest.raises(ValueError, match="the gradient d[qkv] overflows float32"):
        la.linear_attention_vjp(q, k, v * np.float32(1e36), g * np.float32(1e10), **args)


def test_torch_requests_do_not_reuse():
    """The adapter's requests live until their backward: their arrays are never work arrays."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((2, 9, 4)).astype(np.float32) for _ in range(3))
    req = GF.prepare(q, k, v, feature_map="elu", causal=True, method="chunked", device="cpu", eps=1e-6,
                     check_finite=True, initial_state=None)
    assert not req.reuse
    assert GF._buffer("x", (3,), np.float32, False) is not GF._buffer("x", (3,), np.float32, False)
    assert GF._buffer("x", (3,), np.float32, True) is GF._buffer("x", (3,), np.float32, True)


@pytest.mark.parametrize("name, kw", [("elu", {}), ("silu_l2", {"normalize": False, "beta": 0.5}),
                                      ("elu", {"normalize": False})])
def test_fused_checks_name_the_input(name, kw):
    """The checks folded into the passes over ``v`` and ``grad_out`` still name the input (its first bad
    element in the last row of a task, or its last); ``check_finite=False`` lets the values through."""
    rng = np.random.default_rng(7)
    q, k, v, g = (rng.standard_normal((2, 70, 4)).astype(np.float32) for _ in range(4))
    args = dict(feature_map=name, causal=True, method="chunked", **kw)
    for arr, label in ((v, "v"), (g, "grad_out")):
        for idx, bad in (((0, 63, 1), np.nan), ((1, 69, 3), np.inf)):
            x = arr.copy()
            x[idx] = bad
            call = (q, k, x, g) if label == "v" else (q, k, v, x)
            with pytest.raises(ValueError, match=rf"^{label} contains 1 non-finite"):
                la.linear_attention_vjp(*call, **args)
            la.linear_attention_vjp(*call, check_finite=False, **args)


@pytest.mark.parametrize("rule_kw", [{}, {"decay": 0.9}, {"log_decay": np.full((2, 45, 4), -0.1)}])
def test_unnormalised_vjp_runs_no_forward(rule_kw):
    """An unnormalised ``linear_attention_vjp`` of the additive, decay and gate rules reads nothing of the
    forward, so it runs none (the normalised one does); the gradients are those of the quadratic reference."""
    rng = np.random.default_rng(8)
    q, k, v, g = (rng.standard_normal((2, 45, 4)) for _ in range(4))
    kw = dict(feature_map="elu", causal=True, **rule_kw)
    got = la.linear_attention_vjp(q, k, v, g, method="chunked", normalize=False, **kw)
    ref = la.linear_attention_vjp(q, k, v, g, method="quadratic", normalize=False, **kw)
    for field in ("dq", "dk", "dv", "d_decay", "d_log_decay"):
        a, r = getattr(got, field), getattr(ref, field)
        assert (a is None) == (r is None), field
        if r is not None:
            np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-12 * np.max(np.abs(r)), err_msg=field)
    base = dict(method="chunked", device="cpu", check_finite=True, initial_state=None, **kw)
    out, nd, HN = GF.forward(GF.prepare(q, k, v, eps=None, normalize=False, **base), want_out=False)
    assert out is None and HN is None
    assert GF.forward(GF.prepare(q, k, v, eps=1e-6, normalize=True, **base), want_out=False)[2] is not None
    assert GF.forward(GF.prepare(q, k, v, eps=None, normalize=False, **base))[0] is not None


def test_backward_after_forward_without_nd_computes_it_for_a_wider_gradient():
    """``backward_after_forward`` with ``nd`` None (the adapter keeps none for the fused kernel) and a gradient
    wider than the working dtype, which the fused kernel does not take: the forward's ``[num | den]`` is
    computed again and the gradients are those of the backward from the kept one."""
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 29, 4)).astype(np.float32) for _ in range(3))
    g = rng.standard_normal((2, 29, 4))  # float64
    kw = dict(feature_map="elu", causal=True, method="chunked", device="cpu", eps=1e-8, check_finite=True,
              initial_state=None)
    req = GF.prepare(q, k, v, **kw)
    _, nd, _ = GF.forward(req)
    assert GF.fuses_after_forward(req) and not GF._normalized_fused(req, g)
    want = GF.backward(req, nd, g)
    got = GF.backward_after_forward(req, None, g, None, (q, k, v), kw)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))


def test_float32_gate_work_arrays(monkeypatch):
    """A float32 per-feature gate's float64 copy goes into the thread's work arrays (``linear_attention``:
    ``FACTOR_WORK_BYTES``; ``linear_attention_vjp``: ``GRAD_WORK_BYTES``): outputs and gradients are those of
    the same gate passed as float64, bit for bit, in every call (another shape in between, a reset), the
    caller's gate is left as it was, and nothing returned is a work array."""
    from linattn_nb import _frontend as FE
    from linattn_nb import config

    rng = np.random.default_rng(8)
    data = []
    for shape in ((2, 40, 5), (3, 17, 5), (2, 40, 5)):
        q, k, v, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
        lg = np.log(rng.uniform(0.5, 1.0, shape)).astype(np.float32)
        lg[0, 3, 1] = -np.inf  # a reset
        data.append((q, k, v, g, lg))
    kw = dict(feature_map="relu", causal=True, method="chunked")
    for work_bytes in (64 << 20, 0):
        monkeypatch.setattr(config, "FACTOR_WORK_BYTES", work_bytes)
        monkeypatch.setattr(config, "GRAD_WORK_BYTES", work_bytes)
        for q, k, v, g, lg in data:
            kept = lg.copy()
            out = la.linear_attention(q, k, v, log_decay=lg, **kw)
            want = la.linear_attention(q, k, v, log_decay=lg.astype(np.float64), **kw)
            np.testing.assert_array_equal(out, want)
            res = la.linear_attention_vjp(q, k, v, g, log_decay=lg, **kw)
            ref = la.linear_attention_vjp(q, k, v, g, log_decay=lg.astype(np.float64), **kw)
            for field in ("dq", "dk", "dv", "d_log_decay"):
                np.testing.assert_array_equal(getattr(res, field), getattr(ref, field), err_msg=field)
            np.testing.assert_array_equal(lg, kept)
            pools = [w for loc in (FE._WORK, GF._WORK) for w in loc.__dict__.get("pool", {}).values()]
            for x in (out, res.dq, res.dk, res.dv, res.d_log_decay):
                assert not any(np.shares_memory(x, w) for w in pools)
        if work_bytes:  # both front ends took the work arrays
            assert "log_factors" in FE._WORK.pool and "log_factors" in GF._WORK.pool
