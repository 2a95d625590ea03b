"""The position-dependent map: cosFormer (Qin et al. 2022); docs/guide/feature_maps.md."""
from __future__ import annotations

import numpy as np

from .._validate import check_int
from ._base import FeatureMap, check_count, check_input, check_role, vjp_inputs


class CosformerFeatureMap(FeatureMap):
    r"""cosFormer: ReLU features with cos/sin position reweighting (Qin et al., ICLR 2022, §3.3).

    The kernel between positions ``i`` and ``j`` is ``relu(q) . relu(k) * cos(pi/2 * (i - j) / M)``,
    (output ``2d``, non-negative).  ``M`` defaults to the sequence length; segment-wise processing
    (``offset > 0``) needs ``max_length``; a position ``>= M`` raises ValueError.

    Parameters
    ----------
    max_length : int, optional
        ``M``; at least the length of the whole sequence.

    Raises
    ------
    TypeError
        From :meth:`apply` and :meth:`vjp`, if ``offset`` or ``total_length`` is not an integer (a
        Python or NumPy integer; bools, floats and strings are refused).
    ValueError
        From :meth:`apply` and :meth:`vjp`, if ``offset`` or ``total_length`` is negative, or a
        position is ``>= M``.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import feature_maps
    >>> phi = feature_maps.get("cosformer")
    >>> f = phi(np.ones((4, 2)))           # positions 0..3, M = 4
    >>> f.shape
    (4, 4)
    >>> bool(np.isclose(f[0] @ f[2], 2 * np.cos(np.pi / 2 * 2 / 4)))
    True
    """

    name = "cosformer"
    is_positive = True
    position_dependent = True

    def __init__(self, max_length=None):
        self.max_length = check_count("max_length", max_length)

    def output_dim(self, d: int) -> int:
        return 2 * int(d)

    def _length(self, offset: int, n: int, total_length) -> int:
        offset = check_int("cosformer: offset", offset)
        if total_length is not None:
            total_length = check_int("cosformer: total_length", total_length)
        big_m = self.max_length
        if big_m is None:
            if offset > 0:
                raise ValueError(
                    f"cosformer: offset={offset} (segment-wise processing) needs a fixed max_length, "
                    "the same in every segment; build the map with "
                    "feature_maps.get('cosformer', max_length=...)"
                )
            big_m = total_length if total_length is not None else n
        if offset + n > big_m:
            raise ValueError(
                f"cosformer: positions {offset}..{offset + n - 1} exceed max_length M={big_m}; "
                "cos(pi/2 (i - j)/M) needs M >= sequence length"
            )
        return big_m

    def _features(self, x, offset, total_length):
        if x.ndim < 2:
            raise ValueError(f"cosformer: input must have shape (..., N, D), got {x.shape}")
        n = x.shape[-2]
        big_m = self._length(offset, n, total_length)
        theta = (0.5 * np.pi / max(big_m, 1)) * (int(offset) + np.arange(n, dtype=np.float64))
        r = np.maximum(np.asarray(x, dtype=np.float64), 0.0)
        r = np.where(np.isnan(x), np.nan, r)
        feats = np.concatenate([r * np.cos(theta)[:, None], r * np.sin(theta)[:, None]], axis=-1)
        return feats.astype(x.dtype, copy=False)

    def transform(self, x):
        return self._features(x, 0, None)

    def apply(self, x, *, role, causal=False, offset=0, total_length=None):
        check_role(self.name, role)
        return self._features(check_input(self.name, x), offset, total_length)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        x, g, out_dtype = vjp_inputs(self, x, grad_features, role)
        if x.ndim < 2:
            raise ValueError(f"cosformer: input must have shape (..., N, D), got {x.shape}")
        n, d = x.shape[-2], x.shape[-1]
        big_m = self._length(offset, n, total_length)
        theta = (0.5 * np.pi / max(big_m, 1)) * (int(offset) + np.arange(n, dtype=np.float64))
        dr = g[..., :d] * np.cos(theta)[:, None] + g[..., d:] * np.sin(theta)[:, None]
        dx = dr * np.heaviside(np.asarray(x, dtype=np.float64), 0.0)
        return dx.astype(out_dtype, copy=False), None

    def kernel(self, x, y, *, pos_x=0, pos_y=0, max_length=None):
        """``relu(x) . relu(y) cos(pi/2 (pos_x - pos_y) / M)``, ``M = max_length`` (or the map's)."""
        big_m = max_length if max_length is not None else self.max_length
        if big_m is None:
            big_m = max(int(np.max(pos_x)), int(np.max(pos_y))) + 1
        x = np.maximum(np.asarray(x, dtype=np.float64), 0.0)
        y = np.maximum(np.asarray(y, dtype=np.float64), 0.0)
        return np.sum(x * y, axis=-1) * np.cos(0.5 * np.pi * (np.asarray(pos_x) - np.asarray(pos_y)) / big_m)

    def __repr__(self) -> str:
        return f"CosformerFeatureMap(max_length={self.max_length})"
