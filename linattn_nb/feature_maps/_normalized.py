"""The L2-normalised maps of DeltaNet, applied inline by the Numba kernels: ``l2`` and ``silu_l2``.

``l2`` divides each row by its norm (a zero row maps to zero); ``silu_l2`` applies SiLU first.
"""
from __future__ import annotations

import numpy as np

from ..ops._codes import KERNEL_CODE_L2, KERNEL_CODE_SILU_L2
from ._base import FeatureMap, vjp_inputs


class L2FeatureMap(FeatureMap):
    """L2 normalisation: ``phi(x) = x / ||x||`` per row, exactly (a zero row maps to zero).

    DeltaNet's keys and queries (Yang et al. 2024): with unit keys and ``beta`` in [0, 2] the delta
    rule's state stays bounded.  No epsilon; the norm is taken in float64, with the row scaled by a
    power of two (exact) so that no square overflows or underflows: every finite non-zero row maps to
    its unit direction, however large or small.  Signed features: the normaliser can be <= 0.
    Applied inside the kernels (``kernel_code``).
    """

    name = "l2"
    kernel_code = KERNEL_CODE_L2
    is_positive = False

    def _pre(self, x):
        return np.asarray(x, dtype=np.float64)

    @staticmethod
    def _scaled(y):
        """``(y', e)``: the rows of ``y`` scaled by powers of two, ``y' = y 2^-e`` (exact), so that each row's
        largest magnitude is in [0.5, 1) and its squares neither overflow nor underflow; ``e = 0`` for zero
        and non-finite rows.  ``y' / |y'|`` is ``y / |y|``."""
        mx = np.max(np.abs(y), axis=-1, keepdims=True, initial=0.0)
        e = np.where(np.isfinite(mx), np.frexp(mx)[1], 0)
        return np.ldexp(y, -e), e

    def transform(self, x):
        y, _ = self._scaled(self._pre(x))
        nrm = np.linalg.norm(y, axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            # a zero row has zero features; a NaN row stays NaN, as in the compiled kernels
            out = np.where(nrm == 0, 0.0, y / np.where(nrm == 0, 1.0, nrm))
        return out.astype(x.dtype, copy=False)

    def _dpre(self, y):
        """Derivative of :meth:`_pre`, elementwise (float64)."""
        return np.ones_like(y)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``d(s/|s|) = (g - f (f . g)) / |s|`` with ``f = s/|s|``; a zero row has
        zero features and gets a zero gradient.
        """
        x, g, out_dtype = vjp_inputs(self, x, grad_features, role)
        s, e = self._scaled(self._pre(x))  # |s| of the unscaled row is |s'| 2^e
        nrm = np.linalg.norm(s, axis=-1, keepdims=True)
        safe = np.where(nrm == 0, 1.0, nrm)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            f = s / safe
            ds = np.where(nrm == 0, 0.0,
                          np.ldexp((g - f * np.einsum("...i,...i->...", f, g)[..., None]) / safe, -e))
        dx = ds * self._dpre(np.asarray(x, dtype=np.float64))
        return dx.astype(out_dtype, copy=False), None


class SiluL2FeatureMap(L2FeatureMap):
    """SiLU, then L2 normalisation per row: ``phi(x) = s / ||s||``, ``s = x * sigmoid(x)`` (DeltaNet).

    As :class:`L2FeatureMap`, after the elementwise SiLU; applied inside the kernels.
    """

    name = "silu_l2"
    kernel_code = KERNEL_CODE_SILU_L2

    def _pre(self, x):
        y = np.asarray(x, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            s = y / (1.0 + np.exp(-y))  # exp overflow -> inf -> y / inf = -0 for very negative y
        return np.where(y == -np.inf, -0.0, s)  # the limit at -inf (-inf / inf is NaN), as the kernels give

    def _dpre(self, y):
        # silu'(y) = sigmoid(y) (1 + y (1 - sigmoid(y))); 1 - sigmoid(y) = sigmoid(-y), kept exact for large y
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + np.exp(-y))
            sig_neg = 1.0 / (1.0 + np.exp(y))
        with np.errstate(invalid="ignore"):  # y = +-inf: the limits 1 and 0; NaN propagates
            return np.where(np.isinf(y), (y > 0).astype(np.float64), sig * (1.0 + y * sig_neg))
