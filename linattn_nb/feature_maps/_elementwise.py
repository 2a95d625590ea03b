"""The elementwise maps: ELU+1, ReLU, squared ReLU and the identity (``D_phi = D``).

Each is ``_f`` of one coordinate (``_df`` its derivative), applied inline by the Numba kernels.
"""
from __future__ import annotations

import numpy as np

from ..ops._codes import KERNEL_CODE_ELU, KERNEL_CODE_NONE, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU
from ._base import FeatureMap, no_vjp_message, vjp_inputs


class ElementwiseFeatureMap(FeatureMap):
    """A map applied to each coordinate independently (``D_phi = D``).

    Subclasses define ``_f`` (the function) and, for gradients, ``_df`` (its
    derivative, on float64 arrays); :meth:`vjp` is then ``g * _df(x)``.
    """

    def _f(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _df(self, x: np.ndarray) -> np.ndarray:
        """Derivative of ``_f`` elementwise (float64 in, float64 out)."""
        raise NotImplementedError(no_vjp_message(self, "_df"))

    def transform(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._f(x), dtype=x.dtype)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        if type(self)._df is ElementwiseFeatureMap._df:
            raise NotImplementedError(no_vjp_message(self, "_df"))
        x, _, out_dtype = vjp_inputs(self, x, grad_features, role, cast=False)
        # elementwise: one product per entry, exact enough in the result dtype (no float64 copies of
        # (..., N, D) arrays: they would double the memory of a long sequence's backward)
        dx = np.asarray(self._df(np.asarray(x, dtype=out_dtype)), dtype=out_dtype)
        dx *= np.asarray(grad_features, dtype=out_dtype)
        return dx, None


class EluFeatureMap(ElementwiseFeatureMap):
    """ELU+1: ``phi(x) = elu(x) + 1`` (x + 1 for x >= 0, exp(x) otherwise).

    A positive stand-in for ``exp(q . k)`` (Katharopoulos et al. 2020, Eq. 7); ``exp`` only ever
    sees non-positive numbers.
    """

    name = "elu"
    kernel_code = KERNEL_CODE_ELU
    is_positive = True
    strictly_positive = True

    def _f(self, x):
        # exp(-|x|) equals exp(x) where it is used (x < 0), never overflows, and
        # avoids NumPy's slow exp path on the many exact zeros of minimum(x, 0).
        return np.where(x >= 0, x + 1, np.exp(-np.abs(x)))

    def _df(self, x):
        # 1 for x >= 0 (both branches have slope 1 at 0), exp(x) below; NaN propagates
        return np.where(x >= 0, 1.0, np.exp(-np.abs(x)))  # exp(-|x|): see _f


class ReluFeatureMap(ElementwiseFeatureMap):
    """ReLU: ``phi(x) = max(x, 0)``.

    Non-negative, but disjoint supports give a zero normaliser (the ``eps`` floor of
    :func:`linattn_nb.linear_attention` handles it).  NaN propagates.
    """

    name = "relu"
    kernel_code = KERNEL_CODE_RELU
    is_positive = True

    def _f(self, x):
        return np.maximum(x, 0)

    def _df(self, x):
        return np.heaviside(x, 0.0)  # 0 at the kink; NaN propagates


class SquaredReluFeatureMap(ElementwiseFeatureMap):
    """Squared ReLU: ``phi(x) = max(x, 0)**2``.

    Kernel ``relu(q)^2 . relu(k)^2``, non-negative.
    """

    name = "squared_relu"
    kernel_code = KERNEL_CODE_SQUARED_RELU
    is_positive = True

    def _f(self, x):
        r = np.maximum(x, 0)
        return r * r

    def _df(self, x):
        return 2.0 * np.maximum(x, 0)


class IdentityFeatureMap(ElementwiseFeatureMap):
    """Identity: ``phi(x) = x``.

    Kernel ``q . k``.  Signed features: the normaliser can be zero or negative (see ``eps`` of
    :func:`linattn_nb.linear_attention`).
    """

    name = "identity"
    kernel_code = KERNEL_CODE_NONE
    is_positive = False

    def _f(self, x):
        return x

    def _df(self, x):
        return np.ones_like(x)
