"""The layer's causal depthwise convolution (``LinearAttention(conv_size=K)``) on CPU tensors: the
package's kernel against ``torch.nn.Conv1d`` (values, input, weight and bias gradients) on edge shapes,
gradcheck, and the fallback to torch's convolution."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import linattn_nb.torch as lt  # noqa: E402
from linattn_nb.ops._shortconv import short_conv, short_conv_vjp  # noqa: E402


def _torch_conv(x, conv):
    return conv(x.transpose(1, 2))[..., :x.shape[1]].transpose(1, 2)


@pytest.mark.parametrize("shape", [(2, 7, 5, 3), (1, 1, 4, 4), (3, 2, 1, 4), (2, 70, 6, 1), (1, 130, 3, 2),
                                   (0, 5, 3, 2), (2, 0, 3, 2)])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_short_conv_equals_conv1d(shape, dtype, tol):
    """(B, N, C, K): N = 1 and N < K (taps before the first token are 0), K = 1, several row tasks
    (N > 64), empty batches; values and every gradient against torch's convolution."""
    B, N, C, K = shape
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(C, C, K, groups=C, padding=K - 1, dtype=dtype)
    x = torch.randn(B, N, C, dtype=dtype, requires_grad=True)
    g = torch.randn(B, N, C, dtype=dtype)
    if N == 0:  # torch's convolution refuses an empty sequence; the kernel gives empty outputs, zero gradients
        y = lt._short_conv(x, conv)
        assert y.shape == (B, 0, C)
        y.backward(g)
        assert not conv.weight.grad.any() and not conv.bias.grad.any()
        return
    ref = _torch_conv(x, conv)
    ref.backward(g)
    rx, rw, rb = x.grad.clone(), conv.weight.grad.clone(), conv.bias.grad.clone()
    x.grad = conv.weight.grad = conv.bias.grad = None
    y = lt._short_conv(x, conv)
    assert y.dtype == dtype and y.shape == (B, N, C)
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    y.backward(g)
    for got, want in ((x.grad, rx), (conv.weight.grad, rw), (conv.bias.grad, rb)):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * max(1, B * N) ** 0.5)


def test_short_conv_gradcheck_and_no_bias():
    torch.manual_seed(1)
    conv = torch.nn.Conv1d(3, 3, 3, groups=3, padding=2, bias=False, dtype=torch.float64)
    x = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: lt._ShortConvFunction.apply(x, w, None), (x, conv.weight))
    torch.testing.assert_close(lt._short_conv(x, conv), _torch_conv(x, conv))


def test_short_conv_float16_falls_back_to_torch():
    conv = torch.nn.Conv1d(2, 2, 2, groups=2, padding=1, dtype=torch.float16)
    x = torch.randn(1, 4, 2).to(torch.float16)
    assert lt._short_conv(x, conv).grad_fn.name() != "_ShortConvFunctionBackward"


def test_short_conv_kernel_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"\(B, N, C\)"):
        short_conv(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="x's shape"):
        short_conv_vjp(np.zeros((1, 2, 3)), np.zeros((3, 2)), np.zeros((1, 3, 3)))
    with pytest.raises(TypeError, match="float32 or float64"):
        short_conv(np.zeros((1, 2, 3), np.int64), np.zeros((3, 2)))


def test_short_conv_refuses_a_second_derivative():
    """The backward runs outside autograd: differentiating it again raises instead of giving zeros."""
    conv = torch.nn.Conv1d(2, 2, 2, groups=2, padding=1, dtype=torch.float64)
    x = torch.randn(1, 3, 2, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(lt._short_conv(x, conv).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|not differentiable|twice"):
        gx.sum().backward()

