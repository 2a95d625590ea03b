"""LinearAttention on the DPLR rules RWKV-7, DeltaProduct and gated DeltaProduct: each layer equals its call
written out (projections, the rule's layer forms, :func:`linattn_nb.torch.dplr_attention`), gradients reach
every parameter, gradcheck passes, and the layer's options are checked."""
import dataclasses

import pytest

torch = pytest.importorskip("torch")

from linattn_nb import rules  # noqa: E402
import linattn_nb.torch as lt  # noqa: E402

nnf = torch.nn.functional
B, N, H, D = 2, 5, 2, 3


def _heads(t, *d):
    return t.reshape(B, N, H, *d).transpose(1, 2)


def _arguments(rule, p, x, n_h):
    """The rule's arguments as the layer's forms make them, written out."""
    if rule == "rwkv7":
        return dict(log_decay=_heads(nnf.logsigmoid(p["log_decay"](x)) / 16, D),
                    kappa=nnf.normalize(_heads(p["kappa"](x), D), dim=-1), iclr=_heads(torch.sigmoid(p["iclr"](x)), D))
    args = dict(beta=_heads(torch.sigmoid(p["beta"](x)), n_h))
    if rule == "gated_delta_product":
        args["log_decay"] = -nnf.softplus(p["log_decay"](x)).transpose(1, 2)  # (B, H, N)
    return args


@pytest.mark.parametrize("rule,n_h,widths", [
    ("rwkv7", None, {"log_decay": H * D, "kappa": H * D, "iclr": H * D}),
    ("delta_product", 2, {"beta": H * 2}),
    ("gated_delta_product", 3, {"log_decay": H, "beta": H * 3})])
def test_layer_equals_the_call_written_out(rule, n_h, widths):
    torch.manual_seed(1)
    extra = {} if n_h is None or n_h == 2 else dict(n_h=n_h)  # 2: the default
    layer = lt.LinearAttention(H * D, H, rule=rule, feature_map="l2", method="scan", dtype=torch.float64, **extra)
    assert layer.n_h == n_h and {k: p.out_features for k, p in layer.dplr_proj.items()} == widths
    assert ("n_h=" in repr(layer)) == (n_h is not None)
    x = torch.randn(B, N, H * D, dtype=torch.float64)
    y, st = layer(x, return_state=True)
    step = () if n_h is None else (n_h,)
    q = _heads(layer.q_proj(x), D)
    k, v = _heads(layer.k_proj(x), *step, D), _heads(layer.v_proj(x), *step, D)
    o = lt.dplr_attention(q, k, v, rule=rule, feature_map="l2", method="quadratic",
                          **_arguments(rule, layer.dplr_proj, x, n_h))
    torch.testing.assert_close(y, layer.out_proj(o.transpose(1, 2).reshape(B, N, H * D)), rtol=1e-12, atol=1e-12)
    # two segments through the state give the whole
    y1, st1 = layer(x[:, :2], return_state=True)
    y2, st2 = layer(x[:, 2:], initial_state=st1, return_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st2.S, st.S, rtol=1e-12, atol=1e-12)
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.parameters())


@pytest.mark.parametrize("rule", ["rwkv7", "delta_product", "gated_delta_product"])
def test_layer_gradcheck(rule):
    torch.manual_seed(2)
    small = lt.LinearAttention(4, 1, head_dim=2, rule=rule, feature_map="l2", method="scan", dtype=torch.float64)
    assert torch.autograd.gradcheck(small, (torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True),))


def test_layer_conv_and_gate_start():
    """The convolution takes the n_h keys and values; the per-token gate starts at exp(-softplus(b)) = 0.95."""
    torch.manual_seed(3)
    layer = lt.LinearAttention(6, 2, rule="gated_delta_product", n_h=1, conv_size=2, feature_map="l2",
                               method="scan", dtype=torch.float64)
    assert layer.conv.in_channels == 2 * (3 + 3 + 3)
    assert torch.allclose(torch.exp(-nnf.softplus(layer.dplr_proj["log_decay"].bias)), torch.tensor(0.95).double())
    assert layer(torch.randn(2, 4, 6, dtype=torch.float64)).shape == (2, 4, 6)


def test_layer_option_errors(monkeypatch):
    with pytest.raises(ValueError, match="n_h applies only to rules with sub-steps"):
        lt.LinearAttention(8, 2, rule="kda", n_h=2)
    with pytest.raises(ValueError, match="n_h applies only"):
        lt.LinearAttention(8, 2, rule="delta", n_h=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_h must be a positive int"):
            lt.LinearAttention(8, 2, rule="delta_product", n_h=bad)
    with pytest.raises(ValueError, match="pass decay=None"):
        lt.LinearAttention(8, 2, rule="rwkv7", decay="gate")
    odd = dataclasses.replace(rules.get_dplr_rule("delta_product"), name="odd_form", layer={"beta": "per_moon"})
    monkeypatch.setitem(rules.DPLR_RULES, "odd_form", odd)
    with pytest.raises(ValueError, match=r"layer forms the layer does not know: \{'beta': 'per_moon'\}"):
        lt.LinearAttention(8, 2, rule="odd_form")
