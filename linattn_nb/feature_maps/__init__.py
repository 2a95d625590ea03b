"""Feature maps phi for kernel-based linear attention, and their registry.

A feature map turns queries and keys of shape ``(..., N, D)`` into features of
shape ``(..., N, D_phi)`` so that ``phi(q) @ phi(k).T`` replaces the softmax
kernel ``exp(q . k)``.  Linear attention then aggregates ``S = sum phi(k) v^T``
and ``z = sum phi(k)`` and never forms the ``N x N`` matrix.

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

============  =========================================  ==================  ==============================
name          kernel ``phi(q) . phi(k)``                 ``D_phi``           source
============  =========================================  ==================  ==============================
elu           ``(elu(q)+1) . (elu(k)+1)``                ``d``               Katharopoulos et al. 2020
relu          ``relu(q) . relu(k)``                      ``d``
squared_relu  ``relu(q)^2 . relu(k)^2``                  ``d``
identity      ``q . k`` (signed)                         ``d``
l2            ``q/|q| . k/|k|`` (signed)                 ``d``               DeltaNet (Yang et al. 2024)
silu_l2       as l2, after SiLU                          ``d``               DeltaNet (Yang et al. 2024)
dpfp          DPFP(nu) products of rectified coords      ``2 d nu``          Schlag et al. 2021, §5.4
favor+        estimates ``exp(scale q.k)``, positive     ``m`` / ``2m``      Choromanski et al. 2021
rff           estimates ``exp(scale q.k)`` (signed)      ``2m``              Performer Lemma 2; RFA
taylor2       ``1 + t + t^2/2``, ``t = scale q.k``       ``1+d+d(d+1)/2``    Arora et al. 2024 (Based)
cosformer     ``relu.relu * cos(pi/2 (i-j)/M)``          ``2d``              Qin et al. 2022
hedgehog      ``[e^(Wq+b), e^-(Wq+b)] . [...]``          ``2 d_out``         Zhang et al. 2024
t2r           ``relu(Wq+b) . relu(Wk+b)``                ``d_out``           Kasai et al. 2021
============  =========================================  ==================  ==============================

One temperature convention: every map that estimates the softmax kernel
(``estimates_softmax``) estimates ``exp(scale q . k)`` with the default
``scale = 1/sqrt(D)`` of :func:`linattn_nb.softmax_attention`, so attention-
level comparisons need no extra scaling.  Random maps take ``dim``,
``num_features``, ``orthogonal``, ``seed`` and have ``redraw()``.

Users register their own maps (a :class:`FeatureMap` subclass, or any callable
returning one)::

    >>> import numpy as np
    >>> class Softplus(feature_maps.FeatureMap):
    ...     '''softplus features: phi(x) = log(1 + exp(x)), kernel phi(q).phi(k).'''
    ...     name = "softplus"
    ...     def transform(self, x):
    ...         return np.logaddexp(0.0, x).astype(x.dtype, copy=False)
    >>> feature_maps.register("softplus", Softplus, overwrite=True)
    >>> feature_maps.get("softplus")(np.zeros((2, 3))).round(3).tolist()
    [[0.693, 0.693, 0.693], [0.693, 0.693, 0.693]]

Every built-in map has :meth:`FeatureMap.vjp`, the vector-Jacobian product
of the features that attention uses (``dL/dx`` from ``dL/dphi``), and
:meth:`FeatureMap.parameters`, its trainable parameters (hedgehog's and t2r's
``W`` and ``b``; favor+'s projection with ``learn_projection=True``) whose
gradients ``vjp`` returns too.  Maps with trained parameters save and load with
them (the state file stores a map's constructor parameters).

Elementwise maps whose output dimension equals the input dimension can also
carry a ``kernel_code`` so that the Numba kernels apply them on the fly, block
by block, without a full-size copy of ``phi(q)`` and ``phi(k)``.  Any other map
is applied in NumPy by the dispatcher before the kernel runs.
"""
# The package, by kind of map (every name is re-exported here; the documented
# path of each is ``linattn_nb.feature_maps.<name>``):
#
#   _base.py         FeatureMap (with _layout_free), helpers shared by the maps
#   _elementwise.py  elu, relu, squared_relu, identity
#   _polynomial.py   dpfp, taylor2
#   _random.py       draw_projection, RandomFeatureMap, favor+, rff
#   _positional.py   cosformer
#   _learned.py      _AffineFeatureMap, hedgehog, t2r
#   _normalized.py   l2, silu_l2
#   _registry.py     register, get, resolve, available, factory, inline_maps,
#                    KERNEL_CODES, the registration of the built-in maps

# The module names below were attributes of the single-file module this
# package replaces; they stay, so that its public namespace is unchanged.
import math  # noqa: F401
import os  # noqa: F401
import sys  # noqa: F401
import warnings  # noqa: F401
from typing import Callable, Dict, Union  # noqa: F401

import numpy as np  # noqa: F401

from ..ops._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_NONE, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2,
                          KERNEL_CODE_SQUARED_RELU)
from ._base import FeatureMap
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
