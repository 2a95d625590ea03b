"""Feature maps phi for kernel-based linear attention, and their registry.

A feature map turns queries and keys of shape ``(..., N, D)`` into features of
shape ``(..., N, D_phi)`` so that ``phi(q) @ phi(k).T`` replaces the softmax
kernel ``exp(q . k)``.  Linear attention then aggregates ``S = sum phi(k) v^T``
and ``z = sum phi(k)`` and never forms the ``N x N`` matrix.

Built-in maps are looked up by name::

    >>> from linattn_nb import feature_maps
    >>> sorted(feature_maps.available())[:3]
    ['elu', 'identity', 'relu']
    >>> phi = feature_maps.get("elu")
    >>> phi.output_dim(64)
    64

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

Elementwise maps whose output dimension equals the input dimension can also
carry a ``kernel_code`` so that the Numba kernels apply them on the fly, block
by block, without a full-size copy of ``phi(q)`` and ``phi(k)``.  Any other map
is applied in NumPy by the dispatcher before the kernel runs.
"""
from __future__ import annotations

from typing import Callable, Dict, Union

import numpy as np

__all__ = [
    "FeatureMap",
    "ElementwiseFeatureMap",
    "EluFeatureMap",
    "ReluFeatureMap",
    "SquaredReluFeatureMap",
    "IdentityFeatureMap",
    "DpfpFeatureMap",
    "register",
    "get",
    "available",
    "resolve",
    "KERNEL_CODE_NONE",
    "KERNEL_CODE_ELU",
    "KERNEL_CODE_RELU",
    "KERNEL_CODE_SQUARED_RELU",
]

# Codes understood by the Numba kernels (see linattn_nb.ops._phi).  0 means
# "the inputs already are features": the kernel uses them as they are.
KERNEL_CODE_NONE = 0
KERNEL_CODE_ELU = 1
KERNEL_CODE_RELU = 2
KERNEL_CODE_SQUARED_RELU = 3


class FeatureMap:
    """Base class of all feature maps.

    Subclasses set :attr:`name`, implement :meth:`transform` (features of an
    ``(..., N, D)`` array) and, when the output dimension differs from the
    input dimension, :meth:`output_dim`.  The class docstring states the kernel
    the map stands for and where it comes from.

    Attributes
    ----------
    name : str
        Registry name.
    kernel_code : int or None
        For elementwise maps the Numba kernels can apply inline; ``None`` for
        maps applied in NumPy before the kernel runs.
    is_positive : bool
        True when every feature is >= 0 for every input, so that the
        normaliser ``phi(q) . z`` is non-negative.
    position_dependent : bool
        True when the features depend on the token position (cosFormer); the
        dispatcher then passes positions through :meth:`apply`.
    """

    name: str = ""
    kernel_code: int | None = None
    is_positive: bool = False
    position_dependent: bool = False

    # -- to implement -------------------------------------------------------
    def transform(self, x: np.ndarray) -> np.ndarray:
        """Features of ``x`` (``(..., N, D)`` -> ``(..., N, output_dim(D))``)."""
        raise NotImplementedError

    def output_dim(self, d: int) -> int:
        """Feature dimension ``D_phi`` for input dimension ``d``."""
        return int(d)

    # -- provided ------------------------------------------------------------
    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim < 1:
            raise ValueError(f"feature map {self.name!r}: input must have at least 1 dimension, got shape {x.shape}")
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"feature map {self.name!r}: input must be floating point, got dtype {x.dtype}")
        return self.transform(x)

    def apply(self, x: np.ndarray, *, role: str, causal: bool, offset: int = 0,
              total_length: int | None = None) -> np.ndarray:
        """Features as the attention dispatcher asks for them.

        ``role`` is ``"query"`` or ``"key"``; ``offset`` is the position of the
        first token of ``x`` in the whole sequence (segment-wise processing);
        ``total_length`` is the length of the whole sequence when known.  The
        default ignores all of these and returns ``self(x)``; maps whose
        features depend on the role (a stabilising shift) or on the position
        (cosFormer) override it.
        """
        return self(x)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ElementwiseFeatureMap(FeatureMap):
    """A map applied to each coordinate independently (``D_phi = D``)."""

    def _f(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def transform(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._f(x), dtype=x.dtype)


class EluFeatureMap(ElementwiseFeatureMap):
    """ELU+1: ``phi(x) = elu(x) + 1`` (x + 1 for x >= 0, exp(x) otherwise).

    Kernel: ``phi(q) . phi(k)``, a positive similarity used as a stand-in for
    ``exp(q . k)`` (Katharopoulos et al. 2020, "Transformers are RNNs", Eq. 7).
    Overflow-safe as in the seed: ``exp`` only ever sees ``min(x, 0)``.
    """

    name = "elu"
    kernel_code = KERNEL_CODE_ELU
    is_positive = True

    def _f(self, x):
        return np.where(x >= 0, x + 1, np.exp(np.minimum(x, 0)))


class ReluFeatureMap(ElementwiseFeatureMap):
    """ReLU: ``phi(x) = max(x, 0)``.

    Kernel ``relu(q) . relu(k)`` (used e.g. by cosFormer before its position
    reweighting).  Non-negative, but a query and a key with disjoint supports
    give a zero normaliser, which the ``eps`` floor of
    :func:`linattn_nb.linear_attention` handles.  NaN propagates.
    """

    name = "relu"
    kernel_code = KERNEL_CODE_RELU
    is_positive = True

    def _f(self, x):
        return np.maximum(x, 0)


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


class IdentityFeatureMap(ElementwiseFeatureMap):
    """Identity: ``phi(x) = x``.

    Kernel ``q . k`` (unnormalised "linear" attention).  Features are signed,
    so the normaliser ``phi(q) . z`` can be zero or negative: see the ``eps``
    parameter of :func:`linattn_nb.linear_attention`.
    """

    name = "identity"
    kernel_code = KERNEL_CODE_NONE
    is_positive = False

    def _f(self, x):
        return x


class DpfpFeatureMap(FeatureMap):
    """DPFP(nu): deterministic parameter-free projection (Schlag, Irie & Schmidhuber 2021, §5.4).

    ``r = relu([x, -x])`` in R^(2d); ``phi_{i,j}(x) = r_i * r_{(i + j) mod 2d}`` for
    ``j = 1..nu``, concatenated over ``j``: output dimension ``2 d nu``.  The
    features are non-negative and, for generic inputs, sparse (each is a
    product of two rectified coordinates).  Kernel: ``phi(q) . phi(k)``, no
    softmax target; its point is a large ``D_phi`` for capacity (§4.1).

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
        r = np.maximum(np.concatenate([x, -x], axis=-1), 0)
        parts = [r * np.roll(r, -j, axis=-1) for j in range(1, self.nu + 1)]
        return np.concatenate(parts, axis=-1).astype(x.dtype, copy=False)

    def __repr__(self) -> str:
        return f"DpfpFeatureMap(nu={self.nu})"


# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------
Factory = Callable[..., FeatureMap]
_REGISTRY: Dict[str, Factory] = {}


def register(name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register a feature map under ``name``.

    Parameters
    ----------
    name : str
        Registry name (case-sensitive, non-empty).
    factory : callable
        A :class:`FeatureMap` subclass or any callable that takes the map's
        parameters as keyword arguments and returns a :class:`FeatureMap`.
    overwrite : bool, default False
        Replace an existing registration of the same name.

    Raises
    ------
    ValueError
        If ``name`` is empty or already registered and ``overwrite`` is False.
    TypeError
        If ``factory`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {type(factory).__name__}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"feature map {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = factory


def available() -> list[str]:
    """Names of the registered feature maps, sorted."""
    return sorted(_REGISTRY)


def get(name: str, **params) -> FeatureMap:
    """Build the registered feature map ``name`` with ``params``.

    Raises
    ------
    KeyError
        If no map of that name is registered (the message lists those that are).
    """
    if isinstance(name, FeatureMap):
        if params:
            raise TypeError("parameters given together with a FeatureMap instance")
        return name
    try:
        factory = _REGISTRY[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown feature map {name!r}; available: {', '.join(available())}") from None
    fmap = factory(**params)
    if not isinstance(fmap, FeatureMap):
        raise TypeError(f"factory of feature map {name!r} returned {type(fmap).__name__}, not a FeatureMap")
    return fmap


def resolve(feature_map: Union[str, FeatureMap, None]) -> FeatureMap:
    """Turn the ``feature_map`` argument of the public functions into a map.

    ``None`` means "q and k already are features" (the identity map).
    """
    if feature_map is None:
        return IdentityFeatureMap()
    if isinstance(feature_map, FeatureMap):
        return feature_map
    if isinstance(feature_map, str):
        try:
            return get(feature_map)
        except KeyError as exc:
            raise ValueError(f"feature_map: {exc.args[0]}") from None
    raise TypeError(
        "feature_map must be a registered name, a FeatureMap instance or None, "
        f"got {type(feature_map).__name__}"
    )


register("elu", EluFeatureMap)
register("relu", ReluFeatureMap)
register("squared_relu", SquaredReluFeatureMap)
register("identity", IdentityFeatureMap)
register("dpfp", DpfpFeatureMap)
