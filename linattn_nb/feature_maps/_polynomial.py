"""The deterministic polynomial maps: DPFP and Taylor-2 (formulas and papers: docs/theory.md)."""
from __future__ import annotations

import math

import numpy as np

from .._arrays import kernel_view
from ._base import FeatureMap, check_scale, vjp_inputs


class DpfpFeatureMap(FeatureMap):
    """DPFP(nu): deterministic parameter-free projection (Schlag, Irie & Schmidhuber 2021, §5.4).

    ``r = relu([x, -x])`` in R^(2d); ``phi_{i,j}(x) = r_i * r_{(i + j) mod 2d}`` for
    ``j = 1..nu``, concatenated: output dimension ``2 d nu``, non-negative and sparse; no softmax
    target, its point is a large ``D_phi`` for capacity (§4.1).

    Parameters
    ----------
    nu : int, default 1
        Number of rolls, ``1 <= nu < 2d``.
    """

    name = "dpfp"
    is_positive = True

    def __init__(self, nu: int = 1):
        if isinstance(nu, bool) or not isinstance(nu, (int, np.integer)) or nu < 1:
            raise ValueError(f"nu must be an integer >= 1, got {nu!r}")
        self.nu = int(nu)

    def output_dim(self, d: int) -> int:
        return 2 * int(d) * self.nu

    def transform(self, x):
        d = x.shape[-1]
        if self.nu >= 2 * d:
            raise ValueError(f"dpfp: nu={self.nu} must be smaller than 2*D={2 * d}")
        if x.dtype in (np.float32, np.float64) and x.size:
            from ._polynomial_kernels import dpfp_rows

            out = np.empty(x.shape[:-1] + (self.output_dim(d),), dtype=x.dtype)
            dpfp_rows(kernel_view(np.ascontiguousarray(x)).reshape(-1, d), self.nu, out.reshape(-1, out.shape[-1]))
            return out
        return self._transform_numpy(x)

    def _transform_numpy(self, x):
        """The NumPy form of :meth:`transform` (the compiled rows' reference; float16 inputs)."""
        r = np.maximum(np.concatenate([x, -x], axis=-1), 0)
        parts = [r * np.roll(r, -j, axis=-1) for j in range(1, self.nu + 1)]
        return np.concatenate(parts, axis=-1).astype(x.dtype, copy=False)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        x, g, out_dtype = vjp_inputs(self, x, grad_features, role, cast=False)
        d = x.shape[-1]
        if self.nu >= 2 * d:
            raise ValueError(f"dpfp: nu={self.nu} must be smaller than 2*D={2 * d}")
        if x.dtype in (np.float32, np.float64) and g.dtype in (np.float32, np.float64) and x.size:
            from ._polynomial_kernels import dpfp_vjp_rows

            out = np.empty(x.shape, dtype=out_dtype)
            dpfp_vjp_rows(np.ascontiguousarray(x).reshape(-1, d), np.ascontiguousarray(g).reshape(-1, g.shape[-1]),
                          self.nu, out.reshape(-1, d))
            return out, None
        return self._vjp_numpy(x, np.asarray(g, dtype=np.float64), out_dtype)

    def _vjp_numpy(self, x, g, out_dtype):
        """The NumPy form of :meth:`vjp` (the compiled rows' reference; float16 and integer inputs)."""
        d = x.shape[-1]
        y = np.asarray(x, dtype=np.float64)
        s = np.concatenate([y, -y], axis=-1)
        r = np.maximum(s, 0.0)
        # phi_j = r * roll(r, -j): r_i feeds phi_j[i] (times r_{i+j}) and phi_j[i-j] (times r_{i-j})
        dr = np.zeros_like(r)
        for j in range(1, self.nu + 1):
            gj = g[..., (j - 1) * 2 * d: j * 2 * d]
            dr += gj * np.roll(r, -j, axis=-1) + np.roll(gj * r, j, axis=-1)
        ds = dr * np.heaviside(s, 0.0)
        return (ds[..., :d] - ds[..., d:]).astype(out_dtype, copy=False), None

    def __repr__(self) -> str:
        return f"DpfpFeatureMap(nu={self.nu})"


class Taylor2FeatureMap(FeatureMap):
    r"""Second-order Taylor features of ``exp(scale q . k)`` (Based; Arora et al. 2024, Eq. 4).

    Output dimension ``1 + d + d(d+1)/2``; exactly ``phi(q) . phi(k) = 1 + t + t^2/2``,
    ``t = scale q . k`` (at least 1/2: normalisers are positive although features are signed).
    The features: docs/theory.md.

    Parameters
    ----------
    scale : float, optional
        Default ``1/sqrt(d)``.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import feature_maps
    >>> phi = feature_maps.get("taylor2", scale=1.0)
    >>> x, y = np.array([0.3, -0.2]), np.array([0.5, 0.4])
    >>> t = x @ y
    >>> bool(np.isclose(phi(x) @ phi(y), 1 + t + t * t / 2))
    True
    """

    name = "taylor2"
    is_positive = False
    estimates_softmax = True

    def __init__(self, scale=None):
        self.scale = check_scale(scale)

    def effective_scale(self, d: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(d)

    def output_dim(self, d: int) -> int:
        d = int(d)
        return 1 + d + d * (d + 1) // 2

    def transform(self, x):
        d = x.shape[-1]
        if x.dtype in (np.float32, np.float64) and x.size:
            from ._polynomial_kernels import taylor2_rows

            out = np.empty(x.shape[:-1] + (self.output_dim(d),), dtype=x.dtype)
            taylor2_rows(kernel_view(np.ascontiguousarray(x)).reshape(-1, d), math.sqrt(self.effective_scale(d)),
                         out.reshape(-1, out.shape[-1]))
            return out
        return self._transform_numpy(x)

    def _transform_numpy(self, x):
        """The NumPy form of :meth:`transform` (the compiled rows' reference; float16 inputs)."""
        d = x.shape[-1]
        xs = np.asarray(x, dtype=np.float64) * math.sqrt(self.effective_scale(d))
        i, j = np.triu_indices(d)
        w = np.where(i == j, 1.0 / math.sqrt(2.0), 1.0)
        quad = xs[..., i] * xs[..., j] * w
        ones = np.ones(xs.shape[:-1] + (1,))
        return np.concatenate([ones, xs, quad], axis=-1).astype(x.dtype, copy=False)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        x, g, out_dtype = vjp_inputs(self, x, grad_features, role, cast=False)
        d = x.shape[-1]
        root = math.sqrt(self.effective_scale(d))
        if x.dtype in (np.float32, np.float64) and g.dtype in (np.float32, np.float64) and x.size:
            from ._polynomial_kernels import taylor2_vjp_rows

            out = np.empty(x.shape, dtype=out_dtype)
            taylor2_vjp_rows(np.ascontiguousarray(x).reshape(-1, d), np.ascontiguousarray(g).reshape(-1, g.shape[-1]),
                             root, out.reshape(-1, d))
            return out, None
        return self._vjp_numpy(x, np.asarray(g, dtype=np.float64), out_dtype, root)

    def _vjp_numpy(self, x, g, out_dtype, root):
        """The NumPy form of :meth:`vjp` (the compiled rows' reference; float16 and integer inputs)."""
        d = x.shape[-1]
        xs = np.asarray(x, dtype=np.float64) * root
        dxs = g[..., 1:1 + d].copy()
        gq = g[..., 1 + d:]
        # quad lists the pairs (a, b >= a) row by row (np.triu_indices): row a is one contiguous run
        start = 0
        for a in range(d):
            run = gq[..., start:start + d - a].copy()
            run[..., 0] *= 1.0 / math.sqrt(2.0)  # x'_a^2 / sqrt(2)
            dxs[..., a] += np.einsum("...k,...k->...", run, xs[..., a:])
            dxs[..., a:] += run * xs[..., a:a + 1]
            start += d - a
        return (dxs * root).astype(out_dtype, copy=False), None

    def kernel(self, x, y):
        """``1 + t + t^2/2`` with ``t = scale x . y`` (closed form)."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        t = self.effective_scale(x.shape[-1]) * np.sum(x * y, axis=-1)
        return 1.0 + t + 0.5 * t * t

    def __repr__(self) -> str:
        return f"Taylor2FeatureMap(scale={self.scale})"
