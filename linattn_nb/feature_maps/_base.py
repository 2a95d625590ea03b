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
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Callable, Dict, Union

import numpy as np

from ..ops._codes import (KERNEL_CODE_ELU, KERNEL_CODE_L2, KERNEL_CODE_NONE, KERNEL_CODE_RELU, KERNEL_CODE_SILU_L2,
                          KERNEL_CODE_SQUARED_RELU)

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

# KERNEL_CODE_*: the codes understood by the Numba kernels, defined once in
# linattn_nb.ops._codes (applied by linattn_nb.ops._common.phi on the CPU).
# 0 means "the inputs already are features": the kernel uses them as they are.
KERNEL_CODES = (KERNEL_CODE_NONE, KERNEL_CODE_ELU, KERNEL_CODE_RELU, KERNEL_CODE_SQUARED_RELU, KERNEL_CODE_L2,
                KERNEL_CODE_SILU_L2)


def _layout_free(method):
    """``method(self, x, ...)`` called with ``x`` C-contiguous (a copy only for other layouts).

    NumPy's products round differently for a Fortran-ordered or strided ``x``
    than for a C-contiguous one (other BLAS kernels); with this, a map's
    features of a view equal, bit for bit, those of a contiguous copy.
    """
    import functools

    @functools.wraps(method)
    def wrapped(self, x, *args, **kwargs):
        if isinstance(x, np.ndarray) and not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        return method(self, x, *args, **kwargs)

    wrapped._layout_free = True
    return wrapped


class FeatureMap:
    """Base class of all feature maps.

    Subclasses set :attr:`name`, implement :meth:`transform` (features of an
    ``(..., N, D)`` array) and, when the output dimension differs from the
    input dimension, :meth:`output_dim`.  The class docstring states the kernel
    the map stands for and where it comes from.  To take gradients through
    the map, define :meth:`vjp` (and :meth:`parameters` when it has trainable
    parameters); every built-in map has both.

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
    strictly_positive : bool
        True when every feature is > 0 for every input (in exact
        arithmetic), so that no linear attention weight is exactly 0;
        :func:`fit` needs no floor in its cross-entropy and KL losses then.
    needs_normalizer : bool
        True when the features carry per-row factors (stabilising shifts
        inside ``exp``) that cancel only between numerator and normaliser:
        ``linear_attention(..., normalize=False)`` refuses such maps.
    """

    name: str = ""
    kernel_code: int | None = None
    is_positive: bool = False
    strictly_positive: bool = False
    #: The registered map whose features this map gives at its default
    #: parameters (t2r at ``W = I``, ``b = 0`` is relu): the studies leave it
    #: out of their default map lists.  None for most maps.
    same_as: str | None = None
    position_dependent: bool = False
    #: True when ``phi(q) . phi(k)`` estimates or approximates the softmax
    #: kernel ``exp(scale q . k)`` (such maps take ``scale``, default
    #: ``1/sqrt(D)``, the temperature of :func:`linattn_nb.softmax_attention`).
    estimates_softmax: bool = False
    needs_normalizer: bool = False

    def __init_subclass__(cls, **kwargs):
        # every map, built-in or a user's subclass, reads x by its layout (see _layout_free)
        super().__init_subclass__(**kwargs)
        for name in ("__call__", "transform", "apply", "vjp", "apply_with_vjp"):
            fn = cls.__dict__.get(name)
            if callable(fn) and not getattr(fn, "_layout_free", False):
                setattr(cls, name, _layout_free(fn))

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

        Raises
        ------
        ValueError
            If ``role`` is not ``"query"`` or ``"key"``.
        """
        _check_role(self.name, role)
        return self(x)

    def parameters(self) -> dict:
        """The map's trainable parameters: a dict ``name -> ndarray`` (empty by default).

        The arrays are the map's own (not copies): updating one in place
        (``p -= lr * g``) updates the map.  :meth:`vjp` returns the gradients
        under the same names.
        """
        return {}

    def vjp(self, x, grad_features, *, role: str, causal: bool = False, offset: int = 0,
            total_length: int | None = None):
        """Vector-Jacobian product of :meth:`apply`: gradients through ``phi``.

        Differentiates exactly the function
        ``self.apply(x, role=role, causal=causal, offset=offset, total_length=total_length)``
        computes, role-dependent stabilising shifts included (a per-row
        maximum passes its gradient to the one entry that attains it, the
        first on ties).  At kinks (ReLU at 0) the derivative on the zero side
        is used.  The product is computed in float64.  ``dx`` of a token
        depends on that token's ``x`` and ``grad_features`` only.  A subclass
        of a built-in map that changes the function must override ``vjp``
        too (or ``_df``, for an :class:`ElementwiseFeatureMap`).

        Parameters
        ----------
        x : array_like, shape (..., N, D)
            The inputs given to :meth:`apply`.
        grad_features : array_like, shape (..., N, D_phi)
            ``dL/d phi(x)``, the gradient of a loss with respect to the features,
            ``D_phi = output_dim(D)``.
        role : {"query", "key"}
        causal : bool, default False
        offset : int, default 0
        total_length : int, optional
            As for :meth:`apply`.

        Returns
        -------
        dx : ndarray, shape of ``x``
            ``dL/dx``; float64 when ``x`` is float64, else the result dtype of
            ``x`` and ``grad_features`` (at least float32).
        dparams : dict or None
            ``None`` for maps without trainable parameters, else
            ``name -> dL/dparameter`` (float64, the shapes of
            :meth:`parameters`; see the map's docstring for its names).

        Raises
        ------
        NotImplementedError
            In this base class: a user map defines ``vjp`` to take gradients
            through it.
        ValueError
            If ``grad_features`` does not have the shape of the features, or
            ``role`` is not ``"query"`` or ``"key"`` (and whatever
            :meth:`apply` raises for these inputs).

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import feature_maps
        >>> phi = feature_maps.get("elu")
        >>> x = np.array([[-1.0, 2.0]])
        >>> dx, dparams = phi.vjp(x, np.ones((1, 2)), role="key")
        >>> dx.round(4).tolist(), dparams
        ([[0.3679, 1.0]], None)
        """
        raise NotImplementedError(_no_vjp_message(self))

    def apply_with_vjp(self, x, *, role: str, causal: bool = False, offset: int = 0,
                       total_length: int | None = None):
        """:meth:`apply` and its vector-Jacobian product in one call: ``(features, pullback)``.

        ``pullback(grad_features)`` returns what
        ``self.vjp(x, grad_features, role=role, ...)`` returns.  The default
        calls :meth:`apply` now and :meth:`vjp` in the pullback; maps whose
        backward pass needs the forward's intermediates (the affine maps
        hedgehog and t2r: the projections and their exponentials) keep them
        instead of computing them twice.  A training loop that calls
        :meth:`apply`, then :meth:`vjp` at the same ``x`` (the fitting loop
        of :func:`linattn_nb.fitting.fit`) saves that work with this method.

        Parameters
        ----------
        x, role, causal, offset, total_length
            As for :meth:`apply`.

        Returns
        -------
        features : ndarray
            ``self.apply(x, ...)``.
        pullback : callable
            ``grad_features -> (dx, dparams)``, see :meth:`vjp`.

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import feature_maps
        >>> phi = feature_maps.get("hedgehog")
        >>> x = np.array([[0.5, -1.0]])
        >>> feats, pullback = phi.apply_with_vjp(x, role="key")
        >>> dx, dparams = pullback(np.ones_like(feats))
        >>> bool(np.allclose(dx, phi.vjp(x, np.ones_like(feats), role="key")[0]))
        True
        """
        feats = self.apply(x, role=role, causal=causal, offset=offset, total_length=total_length)

        def pullback(grad_features):
            return self.vjp(x, grad_features, role=role, causal=causal, offset=offset,
                            total_length=total_length)

        return feats, pullback

    def kernel(self, x, y) -> np.ndarray:
        """The kernel ``k(x, y)`` these features compute, for pairs of rows.

        ``x`` and ``y`` of shape ``(..., D)`` (broadcast) give ``(...,)``.  For
        deterministic maps this is ``phi(x) . phi(y)``; random maps override it
        with the expectation over the draw (the kernel they estimate).
        """
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        return np.sum(self(x) * self(y), axis=-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


for _name in ("__call__", "apply", "vjp", "apply_with_vjp"):
    setattr(FeatureMap, _name, _layout_free(FeatureMap.__dict__[_name]))
del _name


class ElementwiseFeatureMap(FeatureMap):
    """A map applied to each coordinate independently (``D_phi = D``).

    Subclasses define ``_f`` (the function) and, for gradients, ``_df`` (its
    derivative, on float64 arrays); :meth:`vjp` is then ``g * _df(x)``.
    """

    def _f(self, x: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _df(self, x: np.ndarray) -> np.ndarray:
        """Derivative of ``_f`` elementwise (float64 in, float64 out)."""
        raise NotImplementedError(_no_vjp_message(self, "_df"))

    def transform(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(self._f(x), dtype=x.dtype)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        if type(self)._df is ElementwiseFeatureMap._df:
            raise NotImplementedError(_no_vjp_message(self, "_df"))
        x, _, out_dtype = _vjp_inputs(self, x, grad_features, role, cast=False)
        # elementwise: one product per entry, exact enough in the result dtype (no float64 copies of
        # (..., N, D) arrays: they would double the memory of a long sequence's backward)
        dx = np.asarray(self._df(np.asarray(x, dtype=out_dtype)), dtype=out_dtype)
        dx *= np.asarray(grad_features, dtype=out_dtype)
        return dx, None


class EluFeatureMap(ElementwiseFeatureMap):
    """ELU+1: ``phi(x) = elu(x) + 1`` (x + 1 for x >= 0, exp(x) otherwise).

    Kernel: ``phi(q) . phi(k)``, a positive similarity used as a stand-in for
    ``exp(q . k)`` (Katharopoulos et al. 2020, "Transformers are RNNs", Eq. 7).
    Overflow-safe: ``exp`` only ever sees non-positive numbers.
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

    Kernel ``q . k`` (unnormalised "linear" attention).  Features are signed,
    so the normaliser ``phi(q) . z`` can be zero or negative: see the ``eps``
    parameter of :func:`linattn_nb.linear_attention`.
    """

    name = "identity"
    kernel_code = KERNEL_CODE_NONE
    is_positive = False

    def _f(self, x):
        return x

    def _df(self, x):
        return np.ones_like(x)


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

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
        d = x.shape[-1]
        if self.nu >= 2 * d:
            raise ValueError(f"dpfp: nu={self.nu} must be smaller than 2*D={2 * d}")
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


# ---------------------------------------------------------------------------
# Helpers shared by the maps below
# ---------------------------------------------------------------------------
_ROLES = ("query", "key")


def _check_input(name: str, x) -> np.ndarray:
    """The checks of :meth:`FeatureMap.__call__`, for :meth:`FeatureMap.apply` overrides."""
    x = np.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"feature map {name!r}: input must have at least 1 dimension, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"feature map {name!r}: input must be floating point, got dtype {x.dtype}")
    return x


def _check_role(name: str, role) -> None:
    if role not in _ROLES:
        raise ValueError(f"feature map {name!r}: role must be 'query' or 'key', got {role!r}")


def _no_vjp_message(fmap, what: str = "vjp") -> str:
    return (f"feature map {getattr(fmap, 'name', '')!r} ({type(fmap).__name__}) has no vector-Jacobian product; "
            f"define {what}(...) to take gradients through this map")


def _vjp_inputs(fmap, x, grad_features, role, cast=True):
    """Checked ``(x, float64 grad_features, dtype of dx)`` for :meth:`FeatureMap.vjp` (``cast=False``:
    ``grad_features`` as given)."""
    _check_role(fmap.name, role)
    x = _check_input(fmap.name, x)
    g = np.asarray(grad_features)
    if g.dtype == np.bool_ or not (np.issubdtype(g.dtype, np.floating) or np.issubdtype(g.dtype, np.integer)):
        raise TypeError(f"feature map {fmap.name!r}: grad_features must be real numbers, got dtype {g.dtype}")
    want = x.shape[:-1] + (int(fmap.output_dim(x.shape[-1])),)
    if g.shape != want:
        raise ValueError(
            f"feature map {fmap.name!r}: grad_features must have the shape of the features, {want} "
            f"(x has shape {x.shape}), got {g.shape}"
        )
    out_dtype = np.result_type(x.dtype, g.dtype, np.float32)
    return x, (np.asarray(g, dtype=np.float64) if cast else g), out_dtype


def _max_shift_vjp(u, feats, g):
    """Gradient w.r.t. ``u`` of ``feats = c exp(u - max(u, axis=-1))`` (``c`` a constant) for ``g`` (float64).

    ``d/du_l exp(u_k - u_a) = f_k (delta_kl - delta_la)``, ``a`` the argmax
    (the first on ties): the maximum sends ``-sum_k g_k f_k`` to entry ``a``.
    """
    gf = g * feats
    du = gf.copy()
    if du.shape[-1] and du.size:
        a = np.argmax(u, axis=-1)[..., None]
        np.put_along_axis(du, a, np.take_along_axis(du, a, axis=-1) - gf.sum(axis=-1, keepdims=True), axis=-1)
    return du


def _outer_sum(du, xs):
    """``sum over rows of du[r]^T xs[r]``: ``(..., m)`` and ``(..., d)`` -> ``(m, d)``."""
    m, d = du.shape[-1], xs.shape[-1]
    return du.reshape(-1, m).T @ xs.reshape(-1, d)


def _check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a positive number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale > 0.0) or math.isinf(scale):
        raise ValueError(f"scale must be a finite positive number or None, got {scale}")
    return scale


def _check_count(what: str, value, *, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


def _cast_features(name: str, feats: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Cast float64 features to the input dtype; raise if finite inputs overflow it."""
    with np.errstate(over="ignore"):
        out = feats.astype(x.dtype, copy=False)
    bad = ~np.isfinite(out)
    if bad.any():
        finite_rows = np.isfinite(x).all(axis=-1)
        if (bad & finite_rows[..., None]).any():
            raise ValueError(
                f"feature map {name!r}: features of finite inputs overflow {x.dtype} "
                f"(input shape {x.shape}); use float64 inputs or smaller inputs"
            )
    return out


def draw_projection(rng: np.random.Generator, num_features: int, dim: int, *,
                    orthogonal: bool, row_norm: str = "chi") -> np.ndarray:
    """Draw the random projection ``W`` (``num_features x dim``) of a random feature map.

    Parameters
    ----------
    rng : numpy.random.Generator
    num_features, dim : int
        ``m`` rows of dimension ``d``.
    orthogonal : bool
        True: rows orthogonal within each block of ``d`` rows, each block the
        ``Q`` factor of the QR decomposition of a ``d x d`` Gaussian matrix
        with the signs fixed by ``diag(R)`` (so that ``Q`` is Haar-distributed
        and every row direction uniform on the sphere); blocks are independent
        and stacked for ``m > d`` (Performer §3, Choromanski et al. 2021;
        Yu et al. 2016).  False: i.i.d. ``N(0, I_d)`` rows.
    row_norm : {"chi", "fixed"}
        ``"chi"``: row norms distributed as the norm of a ``N(0, I_d)``
        vector, so that every row is marginally ``N(0, I_d)`` and the
        estimators stay unbiased; ``"fixed"``: every row has norm ``sqrt(d)``.

    Returns
    -------
    ndarray, shape (num_features, dim), float64

    Examples
    --------
    >>> import numpy as np
    >>> W = draw_projection(np.random.default_rng(0), 3, 4, orthogonal=True, row_norm="fixed")
    >>> bool(np.allclose(W @ W.T, 4 * np.eye(3)))
    True
    """
    m = _check_count("num_features", num_features, allow_none=False)
    d = _check_count("dim", dim, allow_none=False)
    if row_norm not in ("chi", "fixed"):
        raise ValueError(f"row_norm must be 'chi' or 'fixed', got {row_norm!r}")
    if orthogonal:
        blocks = []
        left = m
        while left > 0:
            qm, r = np.linalg.qr(rng.standard_normal((d, d)))
            signs = np.where(np.diag(r) < 0, -1.0, 1.0)
            blocks.append((qm * signs).T[: min(d, left)])
            left -= d
        w = np.concatenate(blocks, axis=0)
        if row_norm == "chi":
            norms = np.linalg.norm(rng.standard_normal((m, d)), axis=1)
        else:
            norms = np.full(m, math.sqrt(d))
        return np.ascontiguousarray(w * norms[:, None])
    w = rng.standard_normal((m, d))
    if row_norm == "fixed":
        w *= math.sqrt(d) / np.linalg.norm(w, axis=1, keepdims=True)
    return w


# ---------------------------------------------------------------------------
# Random feature maps
# ---------------------------------------------------------------------------
class RandomFeatureMap(FeatureMap):
    """Base of the maps built on a random projection ``W`` (``m x d``).

    Inputs are first scaled by ``sqrt(scale)`` (default ``scale = 1/sqrt(d)``,
    the temperature of :func:`linattn_nb.softmax_attention`), so that
    ``phi(q) . phi(k)`` estimates a kernel of ``scale q . k``.

    Parameters
    ----------
    dim : int, optional
        Input dimension ``d``.  When omitted, ``W`` is drawn at the first call
        from the input's last axis (then fixed: later inputs must match).
    num_features : int, optional
        Number ``m`` of random projections (rows of ``W``).  Default
        ``max(1, int(d ln d))``, Performer's default (fixed once ``d`` is
        known: given as ``dim``, or at the first call).
    orthogonal : bool
        Orthogonal (block-QR) rows instead of i.i.d. Gaussian rows
        (see :func:`draw_projection`).
    row_norm : {"chi", "fixed"}, default "chi"
        Row norms of ``W`` (see :func:`draw_projection`).
    seed : int, numpy.random.Generator or None
        Seed of the map's own generator: a given seed gives the same ``W``
        and the same sequence of :meth:`redraw` results.
    scale : float, optional
        Temperature; default ``1/sqrt(d)``.

    Attributes
    ----------
    W : ndarray (m, d) or None
        The current projection (None until drawn).
    num_features : int or None
        The effective ``m``: the number given, else the default for ``d``
        once ``d`` is known; None only for a map built without ``dim`` or
        ``num_features`` that was never called.

    Notes
    -----
    A random map given to a function *by name* (``feature_map="favor+"``)
    is built anew, unseeded, at every call, so every call draws another
    ``W``; the first such call in a process warns (once per map name).
    Build the map once with a ``seed`` and pass the object instead.
    """

    default_orthogonal = True

    def __init__(self, dim=None, num_features=None, *, orthogonal=None, row_norm="chi", seed=None,
                 scale=None):
        self.dim = _check_count("dim", dim)
        self._num_features = _check_count("num_features", num_features)
        if orthogonal is None:
            orthogonal = self.default_orthogonal
        if not isinstance(orthogonal, (bool, np.bool_)):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = bool(orthogonal)
        if row_norm not in ("chi", "fixed"):
            raise ValueError(f"row_norm must be 'chi' or 'fixed', got {row_norm!r}")
        self.row_norm = row_norm
        self.scale = _check_scale(scale)
        self.seed = seed
        self._rng = np.random.default_rng(seed)
        self.W = None
        if self.dim is not None:
            self._draw(self.dim)

    @property
    def num_features(self):
        """The effective number ``m`` of random projections (None before ``d`` is known, see the class)."""
        if self._num_features is not None:
            return self._num_features
        if self.W is not None:
            return int(self.W.shape[0])
        return self.num_projections(self.dim) if self.dim is not None else None

    # -- projection ----------------------------------------------------------
    def num_projections(self, d: int) -> int:
        """``m`` for input dimension ``d``."""
        if self._num_features is not None:
            return self._num_features
        return max(1, int(d * math.log(d))) if d > 1 else 1

    def effective_scale(self, d: int) -> float:
        """The temperature used for inputs of dimension ``d``."""
        return self.scale if self.scale is not None else 1.0 / math.sqrt(d)

    def _draw(self, d: int) -> None:
        self.W = draw_projection(self._rng, self.num_projections(d), d, orthogonal=self.orthogonal,
                                 row_norm=self.row_norm)
        self.dim = d

    def redraw(self, seed=None) -> None:
        """Draw a new projection ``W`` (from the map's generator, or from ``seed``).

        Before ``W`` was ever drawn (``dim`` unknown) the next call draws it.
        """
        if seed is not None:
            self.seed = seed
            self._rng = np.random.default_rng(seed)
        if self.dim is not None:
            self._draw(self.dim)

    def materialize(self, d=None):
        """Draw the projection ``W`` now (for inputs of dimension ``d``) if it was not drawn yet.

        The features do not change: a map built without ``dim`` draws ``W``
        at its first call anyway; this draws it up front, so that
        :meth:`parameters` (``learn_projection=True``) and the state file
        have it.  Returns the map.

        Raises
        ------
        ValueError
            If ``W`` is not drawn and ``d`` is missing, or ``d`` differs from
            the dimension ``W`` was drawn for.

        Examples
        --------
        >>> from linattn_nb import feature_maps
        >>> fmap = feature_maps.get("favor+", num_features=6, seed=0, learn_projection=True)
        >>> fmap.materialize(4).parameters()["projection"].shape
        (6, 4)
        """
        if d is None:
            if self.W is None:
                raise ValueError(f"feature map {self.name!r}: materialize needs d (the input dimension): "
                                 f"its projection is not drawn yet")
            return self
        self.weights(_check_count("d", d))
        return self

    def weights(self, d: int) -> np.ndarray:
        """The projection for inputs of dimension ``d`` (drawn now if needed)."""
        if self.W is None:
            self._draw(int(d))
        elif d != self.dim:
            raise ValueError(
                f"feature map {self.name!r} was drawn for dim={self.dim}, got inputs of dimension {d}"
            )
        return self.W

    def _project(self, x: np.ndarray):
        """Scaled inputs ``xs`` (float64) and projections ``u = xs W^T``."""
        d = x.shape[-1]
        w = self.weights(d)
        xs = np.asarray(x, dtype=np.float64) * math.sqrt(self.effective_scale(d))
        return xs, xs @ w.T

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dim={self.dim}, num_features={self.num_features}, "
                f"orthogonal={self.orthogonal}, row_norm={self.row_norm!r}, seed={self.seed!r}, "
                f"scale={self.scale})")


class FavorPlusFeatureMap(RandomFeatureMap):
    r"""FAVOR+ positive random features (Choromanski et al., ICLR 2021, Lemma 1, §2.3-3).

    With ``x' = sqrt(scale) x`` and rows ``w_i`` of ``W``:

    * ``kind="positive"``: ``phi(x) = exp(W x' - |x'|^2/2) / sqrt(m)``, output ``m``;
    * ``kind="hyperbolic"``: ``phi(x) = exp([W x', -W x'] - |x'|^2/2) / sqrt(2m)``, output ``2m``.

    ``E[phi(x) . phi(y)] = exp(scale x . y)``, the softmax kernel at the
    temperature of :func:`linattn_nb.softmax_attention`; every feature is
    positive, so normalisers are positive (no sign cancellation, unlike
    :class:`RandomFourierFeatureMap`).  Mean squared error: Lemma 2 (i.i.d.)
    and Theorem 2 (orthogonal), see :mod:`linattn_nb.analysis.theory`.

    Calling the map (``phi(x)``, :meth:`transform`) returns the estimator's
    features exactly as above.  Attention goes through :meth:`apply`, which
    stabilises them with shifts inside ``exp`` that cancel between numerator
    and normaliser:

    * queries (``role="query"``): each token's own maximum logit is
      subtracted, so query features lie in ``(0, 1]``.  A per-query factor
      cancels in ``phi(q)^T S / phi(q)^T z`` row by row, causal or not.
    * keys (``role="key"``): one constant ``c = max(0, max_i |w_i|^2/2 - H)``
      (``H`` = ``config.FAVOR_KEY_HEADROOM``, 40) is subtracted for every key.
      Since ``w.x' - |x'|^2/2 = |w|^2/2 - |x' - w|^2/2 <= |w|^2/2``, key
      features are at most ``exp(H)``: nothing can overflow, for any input.
      ``c`` depends on ``W`` only, never on the data, so it is the same scalar
      for every key a query sees, it uses no future token in causal
      attention (a max over the sequence would: performer-pytorch issue #82),
      and it is the same in every segment of a sequence processed with
      ``initial_state``.  The price of a data-independent shift is that keys
      far from every ``w_i`` underflow: a key's features vanish when
      ``|x' - w_i|^2/2`` exceeds about 100 (float32) or 740 (float64) for all
      ``i``; the features then are 0 and the key gets zero weight.

    A map is drawn once and kept until :meth:`redraw`; pass the same map
    object (not the name, which builds a new unseeded map per call and warns
    once per process) to every call that must share ``W``, e.g. segments
    linked by ``initial_state``.

    Parameters
    ----------
    dim, num_features, orthogonal, row_norm, seed, scale
        See :class:`RandomFeatureMap`; ``orthogonal`` defaults to True
        (the "O" of FAVOR+).
    kind : {"positive", "hyperbolic"}, default "positive"
    learn_projection : bool, default False
        Treat the projection as a trainable parameter: :meth:`parameters`
        returns ``{"projection": W}`` (the ``(m, d)`` array :attr:`W` itself,
        unscaled: the features use ``W`` and ``x' = sqrt(scale) x``) and
        :meth:`vjp` returns its gradient under the same name.  Before ``W``
        is drawn (no ``dim`` given and never called) there is nothing to
        return: give ``dim`` to have the parameter from the start.
        :meth:`redraw` replaces a trained ``W`` by a fresh draw.  A state file
        (:meth:`linattn_nb.LinearAttentionState.save`) stores the current
        ``W`` of such a map as ``projection``, so a trained projection loads
        back as it was.
    projection : array_like, shape (m, d), optional
        Use this projection as ``W`` instead of drawing one (a trained one,
        say): it fixes ``dim = d`` and ``num_features = m`` (given ones must
        agree), and ``seed`` then only seeds :meth:`redraw`.  A map built
        with ``projection`` stores its current ``W`` in state files like a
        map with ``learn_projection=True``; without either, a state file
        stores the seed and the map is drawn again from it on loading.

    Attributes
    ----------
    projection : ndarray (m, d) or None
        What a state file stores: :attr:`W` itself when the map was built
        with ``projection`` or has ``learn_projection=True`` (and ``W`` is
        drawn), else None.

    Raises
    ------
    ValueError
        If ``projection`` is not a non-empty, finite 2-D array, or disagrees
        with ``dim`` or ``num_features``.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import feature_maps
    >>> phi = feature_maps.get("favor+", dim=8, num_features=4096, seed=0, scale=1.0)
    >>> x, y = np.full(8, 0.1), np.full(8, -0.05)
    >>> est = float(phi(x) @ phi(y)); exact = float(np.exp(x @ y))
    >>> abs(est - exact) < 0.02
    True
    """

    #: the queries' per-row shift and the keys' constant shift cancel only in
    #: the normaliser
    needs_normalizer = True

    name = "favor+"
    is_positive = True
    strictly_positive = True
    estimates_softmax = True
    default_orthogonal = True

    def __init__(self, dim=None, num_features=None, *, kind="positive", orthogonal=True, row_norm="chi",
                 seed=None, scale=None, learn_projection=False, projection=None):
        if kind not in ("positive", "hyperbolic"):
            raise ValueError(f"kind must be 'positive' or 'hyperbolic', got {kind!r}")
        if not isinstance(learn_projection, (bool, np.bool_)):
            raise TypeError(f"learn_projection must be a bool, got {type(learn_projection).__name__}")
        self.kind = kind
        self.learn_projection = bool(learn_projection)
        from .. import config

        self.key_headroom = float(config.FAVOR_KEY_HEADROOM)
        if projection is None:
            self._keep_projection = False
            super().__init__(dim, num_features, orthogonal=orthogonal, row_norm=row_norm, seed=seed, scale=scale)
            return
        w = _real_array(self.name, "projection", projection)
        if w.ndim != 2 or w.size == 0:
            raise ValueError(f"{self.name}: projection must be a non-empty 2-D array (num_features, dim), "
                             f"got shape {w.shape}")
        if not np.isfinite(w).all():
            raise ValueError(f"{self.name}: projection must be finite")
        for what, given, have in (("dim", dim, w.shape[1]), ("num_features", num_features, w.shape[0])):
            if _check_count(what, given) not in (None, have):
                raise ValueError(f"{self.name}: {what}={given} disagrees with projection of shape {w.shape} "
                                 "(num_features, dim)")
        # no draw: W is the given projection (the generator only serves redraw())
        super().__init__(None, w.shape[0], orthogonal=orthogonal, row_norm=row_norm, seed=seed, scale=scale)
        self.W, self.dim = w, int(w.shape[1])
        self._keep_projection = True

    @property
    def projection(self):
        """:attr:`W` when the map was built with ``projection`` or learns it (once drawn), else None."""
        if self.W is not None and (self._keep_projection or self.learn_projection):
            return self.W
        return None

    def output_dim(self, d: int) -> int:
        m = self.num_projections(int(d))
        return 2 * m if self.kind == "hyperbolic" else m

    @property
    def key_shift(self) -> float:
        """The constant subtracted from every key logit (0 before ``W`` is drawn)."""
        if self.W is None:
            return 0.0
        bound = 0.5 * float(np.max(np.einsum("ij,ij->i", self.W, self.W)))
        return max(0.0, bound - self.key_headroom)

    def _logits(self, x):
        xs, u = self._project(x)
        if self.kind == "hyperbolic":
            u = np.concatenate([u, -u], axis=-1)
        half_sq = 0.5 * np.einsum("...i,...i->...", xs, xs)
        return u, half_sq

    def transform(self, x):
        u, half_sq = self._logits(x)
        with np.errstate(over="ignore"):  # overflow is reported by _cast_features
            feats = np.exp(u - half_sq[..., None]) / math.sqrt(u.shape[-1])
        return _cast_features(self.name, feats, x)

    def apply(self, x, *, role, causal=False, offset=0, total_length=None):
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        u, half_sq = self._logits(x)
        if role == "query":
            u = u - np.max(u, axis=-1, keepdims=True)
        else:
            u = u - (half_sq[..., None] + self.key_shift)
        return _cast_features(self.name, np.exp(u) / math.sqrt(u.shape[-1]), x)

    def parameters(self) -> dict:
        """``{"projection": W}`` with ``learn_projection=True`` once ``W`` is drawn, else ``{}``."""
        if self.learn_projection and self.W is not None:
            return {"projection": self.W}
        return {}

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``dparams`` is ``{"projection": dL/dW}`` (shape ``(m, d)``) with
        ``learn_projection=True``, else None.  For keys the gradient includes
        the key shift's dependence on ``W`` (through the row of largest norm)
        when the shift is active.
        """
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        d = x.shape[-1]
        w = self.weights(d)  # draws W now if needed, as apply would; checks the dimension first
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
        root = math.sqrt(self.effective_scale(d))
        xs = np.asarray(x, dtype=np.float64) * root
        u = xs @ w.T
        m = u.shape[-1]
        if self.kind == "hyperbolic":
            u = np.concatenate([u, -u], axis=-1)
        norm = math.sqrt(u.shape[-1])
        shift = 0.0
        if role == "query":
            feats = np.exp(u - np.max(u, axis=-1, keepdims=True)) / norm
            du = _max_shift_vjp(u, feats, g)
            d_half_sq = None
        else:
            shift = self.key_shift
            feats = np.exp(u - (0.5 * np.einsum("...i,...i->...", xs, xs)[..., None] + shift)) / norm
            du = g * feats
            d_half_sq = -du.sum(axis=-1)
        if self.kind == "hyperbolic":
            du = du[..., :m] - du[..., m:]
        dxs = du @ w
        if d_half_sq is not None:
            dxs += d_half_sq[..., None] * xs
        dx = (dxs * root).astype(out_dtype, copy=False)
        if not self.learn_projection:
            return dx, None
        dw = _outer_sum(du, xs)
        if shift > 0.0:
            # shift = |w_a|^2/2 - H, a the row of largest norm: d shift / d w_a = w_a
            a = int(np.argmax(np.einsum("ij,ij->i", w, w)))
            dw[a] += float(d_half_sq.sum()) * w[a]
        return dx, {"projection": dw}

    def kernel(self, x, y):
        """``exp(scale x . y)``, the kernel the features estimate."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        return np.exp(self.effective_scale(x.shape[-1]) * np.sum(x * y, axis=-1))

    def __repr__(self) -> str:
        learn = ", learn_projection=True" if self.learn_projection else ""
        return super().__repr__()[:-1] + f", kind={self.kind!r}{learn})"


class RandomFourierFeatureMap(RandomFeatureMap):
    r"""Trigonometric random Fourier features (Rahimi & Recht 2007; Performer Lemma 2; RFA).

    With ``x' = sqrt(scale) x`` and ``u = W x'`` (``m`` projections, output ``2m``):

    * ``target="softmax"`` (Performer's trigonometric estimator):
      ``phi(x) = exp(|x'|^2/2) / sqrt(m) [sin u, cos u]``, so that
      ``E[phi(x) . phi(y)] = exp(scale x . y)``;
    * ``target="gaussian"`` (Random Feature Attention, Peng et al. 2021):
      ``phi(x) = [sin u, cos u] / sqrt(m)``, estimating
      ``exp(-scale |x - y|^2 / 2)``.

    Features are signed: the normaliser ``phi(q) . z`` can be zero or
    negative (see the ``eps`` parameter of :func:`linattn_nb.linear_attention`
    and ``nonpositive_normalizer_rate`` of
    :func:`linattn_nb.analysis.approximation_error`).

    In attention (:meth:`apply`) queries drop the factor ``exp(|q'|^2/2)``
    (positive, per query: it cancels row by row, causal or not, and keeps
    the normaliser's sign).  Keys keep ``exp(|k'|^2/2)``: it is unbounded, so
    no data-independent shift can bound it; keys with ``|k'|^2/2`` above
    ~88 (float32) raise ValueError instead of overflowing silently.

    Parameters
    ----------
    dim, num_features, orthogonal, row_norm, seed, scale
        See :class:`RandomFeatureMap`; ``orthogonal`` defaults to False
        (i.i.d. frequencies, as in RFA).
    target : {"softmax", "gaussian"}, default "softmax"
    """

    name = "rff"
    is_positive = False
    default_orthogonal = False

    def __init__(self, dim=None, num_features=None, *, target="softmax", orthogonal=False, row_norm="chi",
                 seed=None, scale=None):
        if target not in ("softmax", "gaussian"):
            raise ValueError(f"target must be 'softmax' or 'gaussian', got {target!r}")
        self.target = target
        self.estimates_softmax = target == "softmax"
        super().__init__(dim, num_features, orthogonal=orthogonal, row_norm=row_norm, seed=seed, scale=scale)

    def output_dim(self, d: int) -> int:
        return 2 * self.num_projections(int(d))

    def _trig(self, x):
        xs, u = self._project(x)
        m = u.shape[-1]
        return xs, np.concatenate([np.sin(u), np.cos(u)], axis=-1) / math.sqrt(m)

    def transform(self, x):
        xs, feats = self._trig(x)
        if self.target == "softmax":
            with np.errstate(over="ignore"):  # overflow is reported by _cast_features
                feats = feats * np.exp(0.5 * np.einsum("...i,...i->...", xs, xs))[..., None]
        return _cast_features(self.name, feats, x)

    def apply(self, x, *, role, causal=False, offset=0, total_length=None):
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        if role == "key":
            return self.transform(x)
        return _cast_features(self.name, self._trig(x)[1], x)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        d = x.shape[-1]
        w = self.weights(d)
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
        root = math.sqrt(self.effective_scale(d))
        xs = np.asarray(x, dtype=np.float64) * root
        u = xs @ w.T
        m = u.shape[-1]
        sin, cos = np.sin(u), np.cos(u)
        gs, gc = g[..., :m], g[..., m:]
        if role == "key" and self.target == "softmax":
            # phi = exp(|x'|^2/2) [sin u, cos u] / sqrt(m)
            with np.errstate(over="ignore"):
                e = np.exp(0.5 * np.einsum("...i,...i->...", xs, xs))[..., None]
                feats = np.concatenate([sin, cos], axis=-1) * (e / math.sqrt(m))
            _cast_features(self.name, feats, x)  # raises where apply raises (features overflow the dtype)
            du = (gs * cos - gc * sin) * (e / math.sqrt(m))
            dxs = du @ w + np.einsum("...i,...i->...", g, feats)[..., None] * xs
        else:
            du = (gs * cos - gc * sin) / math.sqrt(m)
            dxs = du @ w
        return (dxs * root).astype(out_dtype, copy=False), None

    def kernel(self, x, y):
        """``exp(scale x . y)`` (softmax target) or ``exp(-scale |x - y|^2 / 2)`` (gaussian)."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        s = self.effective_scale(x.shape[-1])
        if self.target == "softmax":
            return np.exp(s * np.sum(x * y, axis=-1))
        return np.exp(-0.5 * s * np.sum((x - y) ** 2, axis=-1))

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", target={self.target!r})"


# ---------------------------------------------------------------------------
# Deterministic maps
# ---------------------------------------------------------------------------
class Taylor2FeatureMap(FeatureMap):
    r"""Second-order Taylor features of ``exp(scale q . k)`` (Based; Arora et al. 2024, Eq. 4).

    With ``x' = sqrt(scale) x`` (default ``scale = 1/sqrt(d)``)::

        phi(x) = [1, x', (x'_i^2 / sqrt(2))_i, (x'_i x'_j)_{i<j}]

    in the symmetric form of output dimension ``1 + d + d(d+1)/2`` (153 at
    d = 16), so that exactly

    .. math:: \phi(q)\cdot\phi(k) = 1 + t + t^2/2,\quad t = \text{scale}\; q\cdot k,

    the second-order Taylor polynomial of ``exp(t)``.  The kernel is at least
    1/2 for every pair (``1 + t + t^2/2 = (1 + (1 + t)^2)/2``), so normalisers
    are positive even though single features are signed.

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
        self.scale = _check_scale(scale)

    def effective_scale(self, d: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(d)

    def output_dim(self, d: int) -> int:
        d = int(d)
        return 1 + d + d * (d + 1) // 2

    def transform(self, x):
        d = x.shape[-1]
        xs = np.asarray(x, dtype=np.float64) * math.sqrt(self.effective_scale(d))
        i, j = np.triu_indices(d)
        w = np.where(i == j, 1.0 / math.sqrt(2.0), 1.0)
        quad = xs[..., i] * xs[..., j] * w
        ones = np.ones(xs.shape[:-1] + (1,))
        return np.concatenate([ones, xs, quad], axis=-1).astype(x.dtype, copy=False)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
        d = x.shape[-1]
        root = math.sqrt(self.effective_scale(d))
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


class CosformerFeatureMap(FeatureMap):
    r"""cosFormer: ReLU features with cos/sin position reweighting (Qin et al., ICLR 2022, §3.3).

    The kernel between a query at position ``i`` and a key at position ``j``
    is ``relu(q) . relu(k) * cos(pi/2 * (i - j) / M)``.  Because
    ``cos(a - b) = cos a cos b + sin a sin b`` it factorises into

    .. math:: \phi(x_i) = [\,\mathrm{relu}(x_i)\cos\theta_i,\ \mathrm{relu}(x_i)\sin\theta_i\,],
       \quad \theta_i = \frac{\pi}{2}\frac{i}{M},

    output dimension ``2d``, so attention stays linear.  Positions run over
    ``0..M-1``; with ``|i - j| < M`` the weight is positive and every feature
    is non-negative.

    How positions enter attention (``position_dependent = True``): the
    dispatcher passes ``offset`` (position of the first token of ``x``; the
    ``position`` of an ``initial_state``) and ``total_length``.  Token ``t`` of
    ``x`` sits at position ``offset + t``, for queries and keys alike.

    * Non-causal: every query ``i`` sums over all keys ``j`` with weight
      ``cos(pi/2 (i - j)/M)``; ``M`` defaults to the sequence length
      (``total_length``, else ``N``), the paper's choice.
    * Causal: the same kernel restricted to ``j <= i``, computed by the
      recurrence over ``phi(k_j) v_j^T`` with the position-weighted features;
      the features of a token depend on its own position only, so the state
      carries no future information.
    * Segment-wise processing (``offset > 0``) needs the same ``M`` in every
      segment: give ``max_length``; without it, ``offset > 0`` raises
      ValueError.  A position ``>= M`` raises ValueError too (the weight would
      turn negative).

    Parameters
    ----------
    max_length : int, optional
        ``M``; at least the length of the whole sequence.

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
        self.max_length = _check_count("max_length", max_length)

    def output_dim(self, d: int) -> int:
        return 2 * int(d)

    def _length(self, offset: int, n: int, total_length) -> int:
        offset = int(offset)
        if offset < 0:
            raise ValueError(f"cosformer: offset must be >= 0, got {offset}")
        big_m = self.max_length
        if big_m is None:
            if offset > 0:
                raise ValueError(
                    f"cosformer: offset={offset} (segment-wise processing) needs a fixed max_length, "
                    "the same in every segment; build the map with "
                    "feature_maps.get('cosformer', max_length=...)"
                )
            big_m = int(total_length) if total_length is not None else n
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
        _check_role(self.name, role)
        return self._features(_check_input(self.name, x), offset, total_length)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
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


class _AffineFeatureMap(FeatureMap):
    """Base of the maps built on a trainable affine projection ``u = W x + b`` (hedgehog, t2r).

    Holds and checks ``W`` (``d_out x d``, default the identity) and ``b``
    (``d_out``, default 0), and provides :meth:`parameters`,
    :meth:`materialize` and the chain rule from ``dL/du`` to ``x``, ``W``
    and ``b``.  A default (``None``) is not stored: the map then skips the
    product (or the sum), with the same result as the explicit default.
    Subclasses build their features from :meth:`_affine`.

    Parameters
    ----------
    W : array_like, shape (d_out, d), optional
    b : array_like, shape (d_out,), optional
    """

    def __init__(self, W=None, b=None):
        if W is not None:
            W = _real_array(self.name, "W", W)
            if W.ndim != 2 or W.size == 0:
                raise ValueError(f"{self.name}: W must be a non-empty 2-D array (d_out, d), got shape {W.shape}")
            if not np.isfinite(W).all():
                raise ValueError(f"{self.name}: W must be finite")
        if b is not None:
            b = _real_array(self.name, "b", b)
            if b.ndim != 1 or b.size == 0 or (W is not None and b.shape[0] != W.shape[0]):
                want = f"({W.shape[0]},)" if W is not None else "(d,)"
                raise ValueError(f"{self.name}: b must have shape {want}, got {b.shape}")
            if not np.isfinite(b).all():
                raise ValueError(f"{self.name}: b must be finite")
        self.W = W
        self.b = b

    def _d_out(self, d: int) -> int:
        """``d_out``, the number of projections, for input dimension ``d``."""
        return self.W.shape[0] if self.W is not None else int(d)

    def _affine(self, x):
        """``u = x W^T + b`` in float64, ``(..., d)`` -> ``(..., d_out)``; checks ``W`` and ``b`` against ``x``."""
        d = x.shape[-1]
        u = np.asarray(x, dtype=np.float64)
        if self.W is not None:
            if self.W.shape[1] != d:
                raise ValueError(f"{self.name}: W has shape {self.W.shape}, inputs have dimension {d}")
            u = u @ self.W.T
        if self.b is not None:
            if self.b.shape[0] != u.shape[-1]:
                raise ValueError(f"{self.name}: b has shape {self.b.shape}, projections have dimension {u.shape[-1]}")
            u = u + self.b
        return u

    def _fuses(self, cls) -> bool:
        """True when ``apply``, ``vjp`` and ``transform`` are ``cls``'s own: a subclass that changes the
        function (and overrides ``vjp`` to match) gets :meth:`FeatureMap.apply_with_vjp`'s default,
        which calls its overrides."""
        t = type(self)
        return all(getattr(t, m) is getattr(cls, m) for m in ("__call__", "apply", "vjp", "transform", "_affine"))

    def _chain(self, x, du, out_dtype):
        """``(dx, {"W": dL/dW, "b": dL/db})`` from ``du = dL/du`` (float64, ``(..., d_out)``) at inputs ``x``."""
        dx = du @ self.W if self.W is not None else du
        dw = _outer_sum(du, np.asarray(x, dtype=np.float64))
        db = du.reshape(-1, du.shape[-1]).sum(axis=0)
        return dx.astype(out_dtype, copy=False), {"W": dw, "b": db}

    def parameters(self) -> dict:
        """The stored parameters: ``{"W": W, "b": b}``, leaving out those not given (defaults)."""
        return {k: v for k, v in (("W", self.W), ("b", self.b)) if v is not None}

    def materialize(self, d=None):
        """Store the defaults explicitly (``W = I_d``, ``b = 0``) so that :meth:`parameters` has both.

        The features do not change.  ``d`` (the input dimension) is needed
        only when neither ``W`` nor ``b`` is set; when given it must agree
        with them.  Returns the map.

        Raises
        ------
        ValueError
            If ``d`` is needed and missing, or disagrees with the shape of
            ``W`` or ``b``.

        Examples
        --------
        >>> from linattn_nb import feature_maps
        >>> sorted(feature_maps.get("hedgehog").materialize(4).parameters())
        ['W', 'b']
        """
        if self.W is None:
            if self.b is not None:
                if d is not None and int(d) != self.b.shape[0]:
                    raise ValueError(f"{self.name}: d={d} but b has shape {self.b.shape}")
                d = self.b.shape[0]
            d = _check_count("d", d, allow_none=False)
            self.W = np.eye(d)
        elif d is not None and int(d) != self.W.shape[1]:
            raise ValueError(f"{self.name}: d={d} but W has shape {self.W.shape}")
        if self.b is None:
            self.b = np.zeros(self.W.shape[0])
        return self

    def __repr__(self) -> str:
        shape = None if self.W is None else self.W.shape
        return f"{type(self).__name__}(W shape={shape}, b={'set' if self.b is not None else None})"


def _real_array(name: str, what: str, value) -> np.ndarray:
    """``value`` as a float64 array (a copy); complex and non-numeric data raise TypeError."""
    a = np.asarray(value)
    if a.dtype.kind not in "biuf":
        raise TypeError(f"{name}: {what} must be an array of real numbers, got dtype {a.dtype}")
    return np.array(a, dtype=np.float64)


class HedgehogFeatureMap(_AffineFeatureMap):
    r"""Hedgehog features ``phi(x) = [exp(W x + b), exp(-W x - b)]`` (Zhang et al., ICLR 2024, §4.1).

    ``W`` (``d_out x d``) and ``b`` (``d_out``) are supplied by the user (in the
    paper they are trained so that the linear weights match softmax weights);
    the defaults, ``W = I`` and ``b = 0``, give
    ``phi(q) . phi(k) = sum_i 2 cosh(q_i + k_i)``.  Output dimension
    ``2 d_out``; every feature is positive.  Not an estimator of the softmax
    kernel (no ``scale``): how close it gets is what
    :func:`linattn_nb.analysis.approximation_error` measures.

    In attention (:meth:`apply`) query features are divided by their own
    largest value (a per-query factor: it cancels row by row, causal or not).
    Key features have no data-independent bound; keys whose features overflow
    the dtype raise ValueError.

    Gradients: :meth:`vjp` always returns ``{"W": dL/dW, "b": dL/db}``
    (shapes ``(d_out, d)`` and ``(d_out,)``), the gradients with respect to
    the parameters the map uses, defaults included (``W = I``, ``b = 0``).
    :meth:`parameters` returns the stored arrays only (``W`` and ``b`` when
    given); call :meth:`materialize` to store the defaults explicitly before
    training them.

    Parameters
    ----------
    W : array_like, shape (d_out, d), optional
    b : array_like, shape (d_out,), optional
    """

    #: the per-row max subtracted inside the softmax cancels only in the normaliser
    needs_normalizer = True

    name = "hedgehog"
    is_positive = True
    strictly_positive = True

    def output_dim(self, d: int) -> int:
        return 2 * self._d_out(d)

    def _logits(self, x):
        u = self._affine(x)
        return np.concatenate([u, -u], axis=-1)

    def transform(self, x):
        with np.errstate(over="ignore"):  # overflow is reported by _cast_features
            feats = np.exp(self._logits(x))
        return _cast_features(self.name, feats, x)

    def apply(self, x, *, role, causal=False, offset=0, total_length=None):
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        if role == "key":
            return self.transform(x)
        u = self._logits(x)
        return _cast_features(self.name, np.exp(u - np.max(u, axis=-1, keepdims=True)), x)

    def _forward(self, x, role):
        """``(logits, float64 features)`` of :meth:`apply` (the key's unshifted, the query's max-shifted)."""
        logits = self._logits(x)  # checks W and b against the input dimension
        if role == "key":
            with np.errstate(over="ignore"):
                return logits, np.exp(logits)
        return logits, np.exp(logits - np.max(logits, axis=-1, keepdims=True))

    def _pull(self, x, logits, feats, grad_features, role):
        """``(dx, dparams)`` from the forward's ``logits`` and float64 ``feats``."""
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
        m = logits.shape[-1] // 2
        dl = g * feats if role == "key" else _max_shift_vjp(logits, feats, g)
        return self._chain(x, dl[..., :m] - dl[..., m:], out_dtype)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``dparams`` is always ``{"W": (d_out, d), "b": (d_out,)}``, the
        defaults' gradients when ``W`` or ``b`` was not given.
        """
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        logits, feats = self._forward(x, role)
        if role == "key":
            _cast_features(self.name, feats, x)  # raises where apply raises (features overflow the dtype)
        return self._pull(x, logits, feats, grad_features, role)

    def apply_with_vjp(self, x, *, role, causal=False, offset=0, total_length=None):
        """:meth:`apply` and a pullback that reuses its logits and exponentials (see
        :meth:`FeatureMap.apply_with_vjp`)."""
        if not self._fuses(HedgehogFeatureMap) or type(self)._logits is not HedgehogFeatureMap._logits:
            return super().apply_with_vjp(x, role=role, causal=causal, offset=offset, total_length=total_length)
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        logits, feats = self._forward(x, role)
        out = _cast_features(self.name, feats, x)
        return out, lambda grad_features: self._pull(x, logits, feats, grad_features, role)


class T2RFeatureMap(_AffineFeatureMap):
    r"""T2R features ``phi(x) = relu(W x + b)`` (Kasai et al. 2021).

    Kasai et al., "Finetuning Pretrained Transformers into RNNs", EMNLP 2021:
    T2R ("Transformer to RNN") swaps a pretrained transformer's softmax for
    linear attention with this learned map and finetunes ``W`` (``d_out x d``)
    and ``b`` (``d_out``) with the rest of the model.  The defaults,
    ``W = I`` and ``b = 0``, give the ``"relu"`` map.  Output dimension
    ``d_out``.  Features are non-negative but can be exactly zero: a query
    and a key whose projections have disjoint supports get weight 0, and a
    query whose features are all 0 has a zero normaliser, which the ``eps``
    floor of :func:`linattn_nb.linear_attention` handles
    (``strictly_positive`` is False).  NaN propagates.  The same features
    for queries and keys, with no stabilising shift (``needs_normalizer``
    is False); applied in NumPy before the kernels run.

    Gradients: :meth:`vjp` always returns ``{"W": dL/dW, "b": dL/db}``
    (shapes ``(d_out, d)`` and ``(d_out,)``), defaults included; at the kink
    (``W x + b = 0``) the derivative of the zero side, 0, is used.
    :meth:`parameters` returns the stored arrays only (``W`` and ``b`` when
    given); call :meth:`materialize` to store the defaults explicitly before
    training them.

    Parameters
    ----------
    W : array_like, shape (d_out, d), optional
        Default: the identity (``d_out = d``).
    b : array_like, shape (d_out,), optional
        Default: 0.

    Raises
    ------
    ValueError
        If ``W`` is not a non-empty, finite 2-D array, or ``b`` is not a
        finite 1-D array of length ``d_out``.
    TypeError
        If ``W`` or ``b`` holds anything but real numbers.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import feature_maps
    >>> phi = feature_maps.get("t2r", W=[[1.0, -1.0], [0.5, 0.5], [0.0, 2.0]], b=[0.0, -1.0, 0.5])
    >>> phi.output_dim(2)
    3
    >>> x = np.array([[2.0, 1.0], [-1.0, 1.0]])
    >>> phi(x).tolist()
    [[1.0, 0.5, 2.5], [0.0, 0.0, 2.5]]
    >>> dx, dparams = phi.vjp(x, np.ones((2, 3)), role="key")
    >>> dparams["W"].shape, dparams["b"].tolist()
    ((3, 2), [1.0, 1.0, 2.0])
    >>> bool(np.array_equal(feature_maps.get("t2r")(x), np.maximum(x, 0)))
    True
    """

    name = "t2r"
    same_as = "relu"
    kernel_code = None
    is_positive = True
    strictly_positive = False
    needs_normalizer = False

    def output_dim(self, d: int) -> int:
        return self._d_out(d)

    def transform(self, x):
        return _cast_features(self.name, np.maximum(self._affine(x), 0.0), x)  # np.maximum keeps NaN

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``dparams`` is always ``{"W": (d_out, d), "b": (d_out,)}``, the
        defaults' gradients when ``W`` or ``b`` was not given.
        """
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        u = self._affine(x)  # checks W and b against the input dimension
        _cast_features(self.name, np.maximum(u, 0.0), x)  # raises where apply raises (features overflow the dtype)
        return self._pull(x, u, grad_features, role)

    def _pull(self, x, u, grad_features, role):
        """``(dx, dparams)`` from the forward's projections ``u`` (float64)."""
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
        return self._chain(x, g * np.heaviside(u, 0.0), out_dtype)  # 0 at the kink; NaN propagates

    def apply_with_vjp(self, x, *, role, causal=False, offset=0, total_length=None):
        """:meth:`apply` and a pullback that reuses its projections (see
        :meth:`FeatureMap.apply_with_vjp`)."""
        if not self._fuses(T2RFeatureMap):
            return super().apply_with_vjp(x, role=role, causal=causal, offset=offset, total_length=total_length)
        _check_role(self.name, role)
        x = _check_input(self.name, x)
        u = self._affine(x)
        out = _cast_features(self.name, np.maximum(u, 0.0), x)
        return out, lambda grad_features: self._pull(x, u, grad_features, role)


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
    if isinstance(factory, FeatureMap):
        raise TypeError(
            f"register({name!r}, ...) needs a FeatureMap class or a factory that builds one, got an instance "
            f"of {type(factory).__name__}; register the class (register({name!r}, {type(factory).__name__})) "
            "or pass the instance itself as feature_map="
        )
    if not callable(factory):
        raise TypeError(f"factory for {name!r} must be callable, got {type(factory).__name__}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"feature map {name!r} is already registered; pass overwrite=True to replace it")
    _REGISTRY[name] = factory


def available() -> list[str]:
    """Names of the registered feature maps, sorted."""
    return sorted(_REGISTRY)


def factory(name: str) -> Factory:
    """The class or factory registered under ``name``.

    Raises
    ------
    KeyError
        If no map of that name is registered (the message lists those that are).
    """
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise KeyError(f"unknown feature map {name!r}; available: {', '.join(available())}") from None


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
        return _check_kernel_code(feature_map)
    if isinstance(feature_map, str):
        try:
            fmap = _check_kernel_code(get(feature_map))
        except KeyError as exc:
            raise ValueError(f"feature_map: {exc.args[0]}") from None
        if isinstance(fmap, RandomFeatureMap) and feature_map not in _WARNED_BY_NAME:
            _WARNED_BY_NAME.add(feature_map)
            warnings.warn(
                f"feature_map={feature_map!r} given by name builds a new, unseeded map at every call: "
                "each call draws another random projection W (results differ from call to call, and "
                "calls linked by initial_state do not share W). Build the map once, e.g. "
                f"feature_maps.get({feature_map!r}, dim=D, num_features=m, seed=0), and pass it instead. "
                "(Shown once per process for each map name.)",
                UserWarning, stacklevel=_outside_stacklevel(),
            )
        return fmap
    raise TypeError(
        "feature_map must be a registered name, a FeatureMap instance or None, "
        f"got {type(feature_map).__name__}"
    )


#: Names of random maps whose by-name use has warned in this process (see :func:`resolve`).
_WARNED_BY_NAME: set = set()
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _outside_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside this package (for a warning raised deep inside it)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    return level


def _check_kernel_code(fmap: FeatureMap) -> FeatureMap:
    code = fmap.kernel_code
    if code is not None and (isinstance(code, bool) or not isinstance(code, (int, np.integer))
                             or int(code) not in KERNEL_CODES):
        raise ValueError(
            f"feature map {fmap.name!r} has kernel_code {code!r}; the kernels know "
            f"{', '.join(map(str, KERNEL_CODES))} (identity, ELU+1, ReLU, squared ReLU, L2, SiLU then L2) or None "
            "(the map is applied in NumPy)"
        )
    return fmap


def inline_maps() -> list[str]:
    """Names of the registered maps with an inline kernel form (``kernel_code`` not None)."""
    names = []
    for nm in available():
        try:
            if get(nm).kernel_code is not None:
                names.append(nm)
        except Exception:  # maps that need parameters
            continue
    return names


class L2FeatureMap(FeatureMap):
    """L2 normalisation: ``phi(x) = x / ||x||`` per row, exactly (a zero row maps to zero).

    DeltaNet's keys and queries (Yang et al. 2024): with unit keys and write
    strengths ``beta`` in [0, 2], ``I - beta k k^T`` is a contraction and the
    delta rule's state stays bounded (``../shared/REFERENCES.md``, "Delta
    rule").  There is no epsilon inside the norm; the norm is taken in
    float64, so rows of float32 or float16 inputs whose squares overflow are
    normalised correctly.  Signed features: the normaliser ``phi(q) . z``
    can be <= 0 (see ``eps`` of :func:`linattn_nb.linear_attention`).
    Applied inside the kernels (``kernel_code``).
    """

    name = "l2"
    kernel_code = KERNEL_CODE_L2
    is_positive = False

    def _pre(self, x):
        return np.asarray(x, dtype=np.float64)

    def transform(self, x):
        y = self._pre(x)
        nrm = np.linalg.norm(y, axis=-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = np.where(nrm > 0, y / np.where(nrm > 0, nrm, 1.0), 0.0)
        return out.astype(x.dtype, copy=False)

    def _dpre(self, y):
        """Derivative of :meth:`_pre`, elementwise (float64)."""
        return np.ones_like(y)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``d(s/|s|) = (g - f (f . g)) / |s|`` with ``f = s/|s|``; a zero row has
        zero features and gets a zero gradient.
        """
        x, g, out_dtype = _vjp_inputs(self, x, grad_features, role)
        s = self._pre(x)
        nrm = np.linalg.norm(s, axis=-1, keepdims=True)
        safe = np.where(nrm > 0, nrm, 1.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            f = s / safe
            ds = np.where(nrm > 0, (g - f * np.einsum("...i,...i->...", f, g)[..., None]) / safe, 0.0)
        dx = ds * self._dpre(np.asarray(x, dtype=np.float64))
        return dx.astype(out_dtype, copy=False), None


class SiluL2FeatureMap(L2FeatureMap):
    """SiLU, then L2 normalisation per row: ``phi(x) = s / ||s||``, ``s = x * sigmoid(x)`` (DeltaNet).

    As :class:`L2FeatureMap` (exact, a zero row maps to zero), after the
    elementwise SiLU of Yang et al. 2024's DeltaNet keys and queries.
    Applied inside the kernels (``kernel_code``).
    """

    name = "silu_l2"
    kernel_code = KERNEL_CODE_SILU_L2

    def _pre(self, x):
        y = np.asarray(x, dtype=np.float64)
        with np.errstate(over="ignore"):
            return y / (1.0 + np.exp(-y))  # exp overflow -> inf -> y / inf = -0 for very negative y

    def _dpre(self, y):
        # silu'(y) = sigmoid(y) (1 + y (1 - sigmoid(y))); 1 - sigmoid(y) = sigmoid(-y), kept exact for large y
        with np.errstate(over="ignore"):
            sig = 1.0 / (1.0 + np.exp(-y))
            sig_neg = 1.0 / (1.0 + np.exp(y))
        with np.errstate(invalid="ignore"):  # y = +-inf: the limits 1 and 0; NaN propagates
            return np.where(np.isinf(y), (y > 0).astype(np.float64), sig * (1.0 + y * sig_neg))


register("elu", EluFeatureMap)
register("relu", ReluFeatureMap)
register("squared_relu", SquaredReluFeatureMap)
register("identity", IdentityFeatureMap)
register("dpfp", DpfpFeatureMap)
register("favor+", FavorPlusFeatureMap)
register("rff", RandomFourierFeatureMap)
register("taylor2", Taylor2FeatureMap)
register("cosformer", CosformerFeatureMap)
register("hedgehog", HedgehogFeatureMap)
register("t2r", T2RFeatureMap)
register("l2", L2FeatureMap)
register("silu_l2", SiluL2FeatureMap)

# the name bound by ``from __future__ import annotations`` is not part of the API
del annotations

# ``fit``, ``FitResult`` and ``FitHistory`` (defined in linattn_nb.fitting, which
# builds on this module and on the front end) are attached here by the
# package's __init__: this module never imports upward.
