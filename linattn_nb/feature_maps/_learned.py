"""The maps with a trainable affine projection ``u = W x + b``: Hedgehog and T2R.

:func:`linattn_nb.fitting.fit` trains their parameters (docs/guide/feature_maps.md).
"""
from __future__ import annotations

import numpy as np

from ._base import (FeatureMap, cast_features, check_count, check_input, check_role, max_shift_vjp,
                    outer_sum, real_array, vjp_inputs)


class _AffineFeatureMap(FeatureMap):
    """Base of hedgehog and t2r: holds and checks ``W`` (d_out, d) and ``b`` (d_out,), carries the chain rule.

    A default (``W = I``, ``b = 0``) is not stored: the product or sum is skipped.
    """

    def __init__(self, W=None, b=None):
        if W is not None:
            W = real_array(self.name, "W", W)
            if W.ndim != 2 or W.size == 0:
                raise ValueError(f"{self.name}: W must be a non-empty 2-D array (d_out, d), got shape {W.shape}")
            if not np.isfinite(W).all():
                raise ValueError(f"{self.name}: W must be finite")
        if b is not None:
            b = real_array(self.name, "b", b)
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
        dw = outer_sum(du, np.asarray(x, dtype=np.float64))
        db = du.reshape(-1, du.shape[-1]).sum(axis=0)
        return dx.astype(out_dtype, copy=False), {"W": dw, "b": db}

    def parameters(self) -> dict:
        """The stored parameters: ``{"W": W, "b": b}``, leaving out those not given (defaults)."""
        return {k: v for k, v in (("W", self.W), ("b", self.b)) if v is not None}

    def materialize(self, d=None):
        """Store the defaults explicitly (``W = I_d``, ``b = 0``) so that :meth:`parameters` has both.

        The features do not change; ``d`` (the input dimension) is needed only when neither ``W`` nor
        ``b`` is set.  Returns the map.

        Raises
        ------
        ValueError
            If ``d`` is needed and missing, is not an integer >= 1, or disagrees with the shape of ``W``
            or ``b``.

        Examples
        --------
        >>> from linattn_nb import feature_maps
        >>> sorted(feature_maps.get("hedgehog").materialize(4).parameters())
        ['W', 'b']
        """
        if d is not None:  # checked whether or not it is needed (2.7 is no dimension)
            d = check_count("d", d, allow_none=False)
        if self.W is None:
            if self.b is not None:
                if d is not None and d != self.b.shape[0]:
                    raise ValueError(f"{self.name}: d={d} but b has shape {self.b.shape}")
                d = self.b.shape[0]
            d = check_count("d", d, allow_none=False)
            self.W = np.eye(d)
        elif d is not None and d != self.W.shape[1]:
            raise ValueError(f"{self.name}: d={d} but W has shape {self.W.shape}")
        if self.b is None:
            self.b = np.zeros(self.W.shape[0])
        return self

    def __repr__(self) -> str:
        shape = None if self.W is None else self.W.shape
        return f"{type(self).__name__}(W shape={shape}, b={'set' if self.b is not None else None})"


class HedgehogFeatureMap(_AffineFeatureMap):
    r"""Hedgehog features ``phi(x) = [exp(W x + b), exp(-W x - b)]`` (Zhang et al., ICLR 2024, §4.1).

    ``W`` (``d_out x d``, default ``I``) and ``b`` (``d_out``, default 0) are trained by
    :func:`linattn_nb.feature_maps.fit`.  Output dimension ``2 d_out``; every feature is positive.  In
    attention, keys whose features overflow the dtype raise ValueError (docs/guide/feature_maps.md).

    :meth:`vjp` always returns ``{"W": dL/dW, "b": dL/db}``; :meth:`parameters` only the stored arrays:
    :meth:`materialize` stores the defaults before training.

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
        with np.errstate(over="ignore"):  # overflow is reported by cast_features
            feats = np.exp(self._logits(x))
        return cast_features(self, feats, x)

    def apply(self, x, *, role, causal=False, offset=0, total_length=None):
        check_role(self.name, role)
        x = check_input(self.name, x)
        if role == "key":
            return self.transform(x)
        u = self._logits(x)
        return cast_features(self, np.exp(u - np.max(u, axis=-1, keepdims=True)), x)

    def _forward(self, x, role):
        """``(logits, float64 features)`` of :meth:`apply` (the key's unshifted, the query's max-shifted)."""
        logits = self._logits(x)  # checks W and b against the input dimension
        if role == "key":
            with np.errstate(over="ignore"):
                return logits, np.exp(logits)
        return logits, np.exp(logits - np.max(logits, axis=-1, keepdims=True))

    def _pull(self, x, logits, feats, grad_features, role):
        """``(dx, dparams)`` from the forward's ``logits`` and float64 ``feats``."""
        x, g, out_dtype = vjp_inputs(self, x, grad_features, role)
        m = logits.shape[-1] // 2
        dl = g * feats if role == "key" else max_shift_vjp(logits, feats, g)
        return self._chain(x, dl[..., :m] - dl[..., m:], out_dtype)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``dparams`` is always ``{"W": (d_out, d), "b": (d_out,)}``, the
        defaults' gradients when ``W`` or ``b`` was not given.
        """
        check_role(self.name, role)
        x = check_input(self.name, x)
        logits, feats = self._forward(x, role)
        if role == "key":
            cast_features(self, feats, x)  # raises where apply raises (features overflow the dtype)
        return self._pull(x, logits, feats, grad_features, role)

    def apply_with_vjp(self, x, *, role, causal=False, offset=0, total_length=None):
        """:meth:`apply` and a pullback that reuses its logits and exponentials (see
        :meth:`FeatureMap.apply_with_vjp`)."""
        if not self._fuses(HedgehogFeatureMap) or type(self)._logits is not HedgehogFeatureMap._logits:
            return super().apply_with_vjp(x, role=role, causal=causal, offset=offset, total_length=total_length)
        check_role(self.name, role)
        x = check_input(self.name, x)
        logits, feats = self._forward(x, role)
        out = cast_features(self, feats, x)
        return out, lambda grad_features: self._pull(x, logits, feats, grad_features, role)


class T2RFeatureMap(_AffineFeatureMap):
    r"""T2R features ``phi(x) = relu(W x + b)`` (Kasai et al. 2021).

    ``W`` (``d_out x d``) and ``b`` (``d_out``) are trained (:func:`linattn_nb.feature_maps.fit`); the
    defaults ``W = I``, ``b = 0`` give the ``"relu"`` map.  Output dimension ``d_out``; features are
    non-negative but can be exactly zero (the ``eps`` floor handles a zero normaliser).

    :meth:`vjp` always returns ``{"W": dL/dW, "b": dL/db}`` (derivative 0 at the kink); :meth:`parameters`
    only the stored arrays: :meth:`materialize` stores the defaults before training.

    Parameters
    ----------
    W : array_like, shape (d_out, d), optional
        Default: the identity (``d_out = d``).
    b : array_like, shape (d_out,), optional
        Default: 0.

    Raises
    ------
    ValueError
        If ``W`` is not a non-empty, finite 2-D array, or ``b`` not a finite 1-D array of length ``d_out``.
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
        return cast_features(self, np.maximum(self._affine(x), 0.0), x)  # np.maximum keeps NaN

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``dparams`` is always ``{"W": (d_out, d), "b": (d_out,)}``, the
        defaults' gradients when ``W`` or ``b`` was not given.
        """
        check_role(self.name, role)
        x = check_input(self.name, x)
        u = self._affine(x)  # checks W and b against the input dimension
        cast_features(self, np.maximum(u, 0.0), x)  # raises where apply raises (features overflow the dtype)
        return self._pull(x, u, grad_features, role)

    def _pull(self, x, u, grad_features, role):
        """``(dx, dparams)`` from the forward's projections ``u`` (float64)."""
        x, g, out_dtype = vjp_inputs(self, x, grad_features, role)
        return self._chain(x, g * np.heaviside(u, 0.0), out_dtype)  # 0 at the kink; NaN propagates

    def apply_with_vjp(self, x, *, role, causal=False, offset=0, total_length=None):
        """:meth:`apply` and a pullback that reuses its projections (see
        :meth:`FeatureMap.apply_with_vjp`)."""
        if not self._fuses(T2RFeatureMap):
            return super().apply_with_vjp(x, role=role, causal=causal, offset=offset, total_length=total_length)
        check_role(self.name, role)
        x = check_input(self.name, x)
        u = self._affine(x)
        out = cast_features(self, np.maximum(u, 0.0), x)
        return out, lambda grad_features: self._pull(x, u, grad_features, role)
