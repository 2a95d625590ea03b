"""Feature maps phi for kernel-based linear attention, and their registry.

A feature map turns queries and keys ``(..., N, D)`` into features ``(..., N, D_phi)`` so that
``phi(q) @ phi(k).T`` replaces the softmax kernel ``exp(q . k)``.

Built-in maps are looked up by name::

    >>> from linattn_nb import feature_maps
    >>> feature_maps.available()  # doctest: +NORMALIZE_WHITESPACE
    ['cosformer', 'dpfp', 'elu', 'favor+', 'hedgehog', 'identity', 'l2', 'relu', 'rff',
     'silu_l2', 'squared_relu', 't2r', 'taylor2']
    >>> phi = feature_maps.get("elu")
    >>> phi.output_dim(64)
    64
    >>> feature_maps.get("favor+", dim=64, num_features=256, orthogonal=True, seed=0).output_dim(64)
    256

Guide: docs/guide/feature_maps.md; formulas and papers: docs/theory.md.
"""
from ..ops._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_NONE, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2,
                          KERNEL_CODE_SQUARED_RELU)
from ._base import FeatureMap, FeatureOverflow
from ._elementwise import (ElementwiseFeatureMap, EluFeatureMap, IdentityFeatureMap, ReluFeatureMap,
                           SquaredReluFeatureMap)
from ._learned import HedgehogFeatureMap, T2RFeatureMap
from ._normalized import L2FeatureMap, SiluL2FeatureMap
from ._polynomial import DpfpFeatureMap, Taylor2FeatureMap
from ._positional import CosformerFeatureMap
from ._random import FavorPlusFeatureMap, RandomFeatureMap, RandomFourierFeatureMap, draw_projection
from ._registry import KERNEL_CODES, Factory, available, factory, get, inline_maps, register, resolve
from ._registry import REGISTRY as _REGISTRY  # noqa: F401  (the registry itself: tests save and restore it)

#: Names of random maps whose by-name use has warned in this process (see
#: :func:`resolve`, which reads this attribute at every call).
_WARNED_BY_NAME: set = set()

__all__ = [
    "fit",
    "FitResult",
    "FitHistory",
    "FeatureMap",
    "FeatureOverflow",
    "ElementwiseFeatureMap",
    "EluFeatureMap",
    "ReluFeatureMap",
    "SquaredReluFeatureMap",
    "IdentityFeatureMap",
    "DpfpFeatureMap",
    "RandomFeatureMap",
    "FavorPlusFeatureMap",
    "RandomFourierFeatureMap",
    "Taylor2FeatureMap",
    "CosformerFeatureMap",
    "HedgehogFeatureMap",
    "T2RFeatureMap",
    "draw_projection",
    "register",
    "get",
    "available",
    "resolve",
    "inline_maps",
    "factory",
    "KERNEL_CODE_NONE",
    "KERNEL_CODE_ELU",
    "KERNEL_CODE_RELU",
    "KERNEL_CODE_SQUARED_RELU",
    "KERNEL_CODE_L2",
    "KERNEL_CODE_SILU_L2",
]

# ``fit``, ``FitResult`` and ``FitHistory`` (defined in linattn_nb.fitting, which
# builds on this package and on the front end) are attached here by
# linattn_nb's __init__: this package never imports upward.
