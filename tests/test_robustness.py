"""Hostile inputs to the front end: nothing crashes, every argument is checked, nothing is lost.

Each case raises a clear error naming the argument before any kernel runs, or
gives the right answer.  Calls that used to corrupt the heap or segfault run
in a subprocess, so a crash fails the test instead of ending the run.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import linattn_nb as la
from linattn_nb import feature_maps as fm

METHODS = [(True, "scan"), (True, "chunked"), (True, "quadratic"), (False, "aggregate"), (False, "quadratic")]


class _Bad(fm.FeatureMap):
    """A map whose transform returns a wrongly shaped array (mode picks how)."""

    name = "bad"
    is_positive = True

    def __init__(self, mode="extra_row"):
        self.mode = mode

    def output_dim(self, d):
        return {"zero_dim": 0, "negative_dim": -3}.get(self.mode, d)

    def transform(self, x):
        y = np.maximum(x, 0.0) + 1.0
        if self.mode == "extra_row":
            return np.concatenate([y, y[..., :1, :]], axis=-2)
        if self.mode == "short_row":
            return y[..., :-1, :]
        if self.mode == "dropped_batch":
            return y[:-1]
        if self.mode == "extra_batch":
            return np.concatenate([y, y[:1]], axis=0)
        if self.mode == "wrong_features":
            return np.concatenate([y, y[..., :1]], axis=-1)
        return y


BAD_MODES = ["extra_row", "short_row", "dropped_batch", "extra_batch", "wrong_features", "zero_dim",
             "negative_dim"]


def _qkv(rng, b=2, n=37, d=5, m=3, dtype=np.float64):
    return (rng.standard_normal((b, n, d)).astype(dtype), rng.standard_normal((b, n, d)).astype(dtype),
            rng.standard_normal((b, n, m)).astype(dtype))


@pytest.mark.parametrize("mode", BAD_MODES)
@pytest.mark.parametrize("causal,method", METHODS)
def test_a_map_of_the_wrong_shape_raises_naming_the_map(rng, mode, causal, method):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="feature map 'bad'"):
        la.linear_attention(q, k, v, feature_map=_Bad(mode), causal=causal, method=method)


@pytest.mark.parametrize("mode", ["extra_row", "short_row", "dropped_batch"])
def test_a_map_of_the_wrong_shape_raises_on_the_cuda_host_path(rng, mode):
    pytest.importorskip("numba.cuda")
    q, k, v = _qkv(rng, n=9)
    with pytest.raises(ValueError, match="feature map 'bad'"):
        la.linear_attention(q, k, v, feature_map=_Bad(mode), causal=True, device="cuda")


def test_wrong_shapes_never_crash_the_process():
    """The cases that used to abort (heap corruption in the scan, a segfault in the
    chunked kernel): in a subprocess, each must end in a clean ValueError."""
    code = textwrap.dedent(
        f"""
        import numpy as np, linattn_nb as la
        import sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_robustness import _Bad, BAD_MODES
        rng = np.random.default_rng(0)
        q, k = rng.standard_normal((2, 2, 300, 6))
        v = rng.standard_normal((2, 300, 4))
        for mode in BAD_MODES:
            for method in ("scan", "chunked"):
                try:
                    la.linear_attention(q, k, v, feature_map=_Bad(mode), causal=True, method=method)
                except ValueError as exc:
                    assert "feature map 'bad'" in str(exc), exc
                else:
                    raise SystemExit(f"no error for {{mode}} {{method}}")
        print("clean")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "clean"


def test_an_unknown_kernel_code_raises(rng):
    class Odd(fm.EluFeatureMap):
        kernel_code = 7

    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="kernel_code 7"):
        la.linear_attention(q, k, v, feature_map=Odd(), causal=True)


def test_registering_an_instance_is_refused():
    with pytest.raises(TypeError, match="class or a factory"):
        fm.register("elu_instance", fm.EluFeatureMap())
    assert "elu_instance" not in fm.available()


@pytest.mark.parametrize("causal", ["False", "True", 2.5, 1, 0, [1], np.array([True]), np.array(True), None])
def test_causal_must_be_a_bool(rng, causal):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="causal"):
        la.linear_attention(q, k, v, causal=causal)
    with pytest.raises(TypeError, match="causal"):
        la.softmax_attention(q, k, v, causal=causal)


def test_numpy_bools_are_bools(rng):
    q, k, v = _qkv(rng)
    np.testing.assert_array_equal(la.linear_attention(q, k, v, causal=np.True_),
                                  la.linear_attention(q, k, v, causal=True))


@pytest.mark.parametrize("position,exc", [(None, TypeError), ("3", TypeError), (float("nan"), ValueError),
                                          (2.5, ValueError), (-1, ValueError), (float("inf"), ValueError),
                                          (True, TypeError)])
def test_initial_state_position_is_checked(rng, position, exc):
    q, k, v = _qkv(rng)
    _, st = la.linear_attention(q, k, v, causal=True, return_state=True)
    with pytest.raises(exc, match=r"initial_state\.position"):
        la.linear_attention(q, k, v, causal=True, initial_state=(st.S, st.z, position))


def test_an_integral_float_position_is_accepted(rng):
    q, k, v = _qkv(rng)
    _, st = la.linear_attention(q, k, v, causal=True, return_state=True)
    a = la.linear_attention(q, k, v, causal=True, initial_state=(st.S, st.z, 37.0))
    b = la.linear_attention(q, k, v, causal=True, initial_state=st)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("causal,method", METHODS)
@pytest.mark.parametrize("shift", [1, -1])
def test_out_overlapping_an_input_gives_the_right_answer(rng, causal, method, shift):
    """out=buf[1:] with q=buf[:-1] (and the other way round): the result is as without overlap."""
    n, d = 40, 6
    buf = rng.standard_normal((n + 1, d))
    q = buf[:-1] if shift == 1 else buf[1:]
    k = rng.standard_normal((n, d))
    v = rng.standard_normal((n, d))
    ref = la.linear_attention(q.copy(), k, v, causal=causal, method=method)
    out = buf[1:] if shift == 1 else buf[:-1]
    la.linear_attention(q, k, v, causal=causal, method=method, out=out)
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-13)


def test_out_overlapping_the_values(rng):
    n, d = 33, 4
    q, k = rng.standard_normal((2, n, d))
    v = rng.standard_normal((n, d))
    ref = la.linear_attention(q, k, v.copy(), causal=True)
    la.linear_attention(q, k, v, causal=True, out=v)
    np.testing.assert_allclose(v, ref, rtol=1e-13, atol=1e-13)


def test_array_subclasses_and_byte_orders(rng):
    """A big-endian float64 array is float64 (it was refused as '>f8'); np.matrix inputs read as plain
    arrays (a matrix grad_out was told it had the wrong shape, under the name g); masked arrays are refused
    by name, since their mask cannot be honoured; a matrix or masked out= raises TypeError, not a Numba
    typing error after a compile; a KV cache answers zero queries with an empty array, even when empty."""
    x = rng.standard_normal((5, 4))
    ref = la.linear_attention(x, x, x)
    np.testing.assert_array_equal(la.linear_attention(x.astype(">f8"), x, x), ref)
    ref_dq = la.linear_attention_vjp(x, x, x, x, causal=True).dq
    np.testing.assert_allclose(la.linear_attention_vjp(x, x, x, np.matrix(x), causal=True).dq, ref_dq)
    with pytest.raises(TypeError, match="q is a masked array"):
        la.linear_attention(np.ma.masked_array(x, mask=x > 1), x, x)
    for out in (np.matrix(np.zeros((5, 4))), np.ma.zeros((5, 4))):
        with pytest.raises(TypeError, match="out must be a numpy.ndarray"):
            la.linear_attention(x, x, x, out=out)
    with pytest.raises(TypeError, match="byte order"):
        la.linear_attention(x, x, x, out=np.zeros((5, 4), ">f8"))
    assert la.KVCache(4, 4).query(np.zeros((0, 4))).shape == (0, 4)
