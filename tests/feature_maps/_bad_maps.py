"""Feature maps that return wrongly shaped features, shared by the tests of every path that applies a map."""
from __future__ import annotations

import numpy as np

from linattn_nb import feature_maps as fm

#: The ways :class:`BadShapeMap` gets its output wrong.
BAD_SHAPES = ["drop_row", "extra_row", "drop_batch", "features"]


class BadShapeMap(fm.FeatureMap):
    """ReLU features with one thing wrong: ``how`` in :data:`BAD_SHAPES`."""

    is_positive = True

    def __init__(self, how):
        self.how = how
        self.name = f"bad-{how}"

    def transform(self, x):
        f = np.maximum(x, 0.0)
        if self.how == "drop_row":
            return f[..., :-1, :]
        if self.how == "extra_row":
            return np.concatenate([f, f[..., -1:, :]], axis=-2)
        if self.how == "drop_batch":
            return f[1:] if f.ndim >= 3 else f[None]
        return np.concatenate([f, f], axis=-1)  # "features": 2D columns, output_dim says D
