"""The base class :class:`FeatureMap` and the helpers the built-in maps share (input, role and count
checks, the cast back to the input dtype, pieces of the vector-Jacobian products); adding a map:
docs/guide/feature_maps.md.
"""
from __future__ import annotations

import math

import numpy as np


def _layout_free(method):
    """``method(self, x, ...)`` called with ``x`` C-contiguous (a copy only for other layouts).

    NumPy's products round differently for other layouts (other BLAS kernels); with this, a map's
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

    Subclasses set :attr:`name`, implement :meth:`transform` and, when ``D_phi != D``, :meth:`output_dim`;
    gradients need :meth:`vjp` (and :meth:`parameters`).  Adding a map: docs/guide/feature_maps.md.

    Attributes
    ----------
    name : str
        Registry name.
    kernel_code : int or None
        For elementwise maps the Numba kernels apply inline; ``None`` for maps applied in NumPy.
    is_positive : bool
        Every feature is >= 0 for every input (the normaliser ``phi(q) . z`` is non-negative).
    position_dependent : bool
        The features depend on the token position (cosFormer); :meth:`apply` gets the positions.
    strictly_positive : bool
        Every feature is > 0 in exact arithmetic (no weight is exactly 0; :func:`fit` needs no floor).
    needs_normalizer : bool
        The features carry per-row factors that cancel only in the normaliser:
        ``linear_attention(..., normalize=False)`` refuses such maps.
    """

    name: str = ""
    kernel_code: int | None = None
    is_positive: bool = False
    strictly_positive: bool = False
    #: The registered map this one equals at its default parameters (t2r at ``W = I``, ``b = 0``
    #: is relu): the studies leave it out of their default map lists.
    same_as: str | None = None
    position_dependent: bool = False
    #: ``phi(q) . phi(k)`` estimates the softmax kernel ``exp(scale q . k)`` (such maps take
    #: ``scale``, default ``1/sqrt(D)``).
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
        return self.transform(check_input(self.name, x))

    def apply(self, x: np.ndarray, *, role: str, causal: bool = False, offset: int = 0,
              total_length: int | None = None) -> np.ndarray:
        """Features as the attention dispatcher asks for them.

        ``role``: ``"query"`` or ``"key"``; ``offset``: the position of ``x``'s first token in the
        whole sequence; ``total_length``: its length when known.  The default returns ``self(x)``;
        maps whose features depend on the role or the position override it.

        Raises
        ------
        ValueError
            If ``role`` is not ``"query"`` or ``"key"``.
        """
        check_role(self.name, role)
        return self(x)

    def parameters(self) -> dict:
        """The map's trainable parameters: a dict ``name -> ndarray`` (empty by default).

        The arrays are the map's own: updating one in place (``p -= lr * g``) updates the map.
        """
        return {}

    def vjp(self, x, grad_features, *, role: str, causal: bool = False, offset: int = 0,
            total_length: int | None = None):
        """Vector-Jacobian product of :meth:`apply`: gradients through ``phi``.

        Differentiates exactly what :meth:`apply` computes, in float64 (docs/guide/feature_maps.md).
        A subclass that changes a built-in map's function must override ``vjp`` too (or ``_df``, for an
        :class:`ElementwiseFeatureMap`).

        Parameters
        ----------
        x : array_like, shape (..., N, D)
            The inputs given to :meth:`apply`.
        grad_features : array_like, shape (..., N, D_phi)
            ``dL/d phi(x)``, ``D_phi = output_dim(D)``.
        role : {"query", "key"}
        causal : bool, default False
        offset : int, default 0
        total_length : int, optional
            As for :meth:`apply`.

        Returns
        -------
        dx : ndarray, shape of ``x``
            ``dL/dx``; float64 for float64 ``x``, else the result dtype of ``x`` and
            ``grad_features`` (at least float32).
        dparams : dict or None
            ``None`` without trainable parameters, else ``name -> dL/dparameter`` (float64, the
            names and shapes of :meth:`parameters`).

        Raises
        ------
        NotImplementedError
            In this base class (a user map defines ``vjp``).
        ValueError
            If ``grad_features`` does not have the shape of the features, a bad ``role``, and
            whatever :meth:`apply` raises for these inputs.

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
        raise NotImplementedError(no_vjp_message(self))

    def apply_with_vjp(self, x, *, role: str, causal: bool = False, offset: int = 0,
                       total_length: int | None = None):
        """:meth:`apply` and its vector-Jacobian product in one call: ``(features, pullback)``.

        ``pullback(grad_features)`` returns what :meth:`vjp` returns (hedgehog and t2r reuse the
        forward's projections).

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

        ``x``, ``y`` of shape ``(..., D)`` (broadcast) give ``(...,)``: ``phi(x) . phi(y)``; random maps
        give the expectation over the draw.
        """
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        return np.sum(self(x) * self(y), axis=-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


for _name in ("__call__", "apply", "vjp", "apply_with_vjp"):
    setattr(FeatureMap, _name, _layout_free(FeatureMap.__dict__[_name]))
del _name


# ---------------------------------------------------------------------------
# Helpers shared by the maps (imported by the other modules of this package)
# ---------------------------------------------------------------------------
_ROLES = ("query", "key")


def check_input(name: str, x) -> np.ndarray:
    """The checks of :meth:`FeatureMap.__call__`, for :meth:`FeatureMap.apply` overrides.

    ``x`` must be a float16, float32 or float64 array (not masked) with at least 1 dimension and a last
    (feature) dimension ``D >= 1``, as :func:`linattn_nb.linear_attention` requires; ``N = 0`` rows (or an
    empty batch) are fine.
    """
    if isinstance(x, np.ma.MaskedArray):  # its mask would be dropped, as linear_attention refuses it
        raise TypeError(f"feature map {name!r}: input is a masked array, whose mask a feature map cannot honour; "
                        "pass x.filled(...) or x.data explicitly")
    x = np.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"feature map {name!r}: input must have at least 1 dimension, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating) or x.dtype.itemsize > 8:  # long double: refused as everywhere
        raise TypeError(f"feature map {name!r}: input must be floating point (float16, float32 or float64), got "
                        f"dtype {x.dtype}")
    if x.shape[-1] < 1:
        raise ValueError(f"feature map {name!r}: input feature dimensions must be at least 1, got D={x.shape[-1]} "
                         f"(input shape {x.shape})")
    return x


def check_role(name: str, role) -> None:
    if role not in _ROLES:
        raise ValueError(f"feature map {name!r}: role must be 'query' or 'key', got {role!r}")


def no_vjp_message(fmap, what: str = "vjp") -> str:
    return (f"feature map {getattr(fmap, 'name', '')!r} ({type(fmap).__name__}) has no vector-Jacobian product; "
            f"define {what}(...) to take gradients through this map")


def vjp_inputs(fmap, x, grad_features, role, cast=True):
    """Checked ``(x, float64 grad_features, dtype of dx)`` for :meth:`FeatureMap.vjp` (``cast=False``:
    ``grad_features`` as given)."""
    check_role(fmap.name, role)
    x = check_input(fmap.name, x)
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


def max_shift_vjp(u, feats, g):
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


def outer_sum(du, xs):
    """``sum over rows of du[r]^T xs[r]``: ``(..., m)`` and ``(..., d)`` -> ``(m, d)``."""
    m, d = du.shape[-1], xs.shape[-1]
    return du.reshape(-1, m).T @ xs.reshape(-1, d)


def check_scale(scale):
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a positive number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not (scale > 0.0) or math.isinf(scale):
        raise ValueError(f"scale must be a finite positive number or None, got {scale}")
    return scale


def check_count(what: str, value, *, allow_none: bool = True):
    if value is None and allow_none:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{what} must be an integer >= 1{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


class FeatureOverflow(ValueError):
    """Features of finite inputs overflow the inputs' dtype (``dtype``: that dtype).

    A ValueError for a direct call of a map.  The attention front ends (:func:`linattn_nb.linear_attention`,
    :func:`linattn_nb.linear_attention_vjp`, the torch adapter) catch it below float64 and run the call
    again in float64, as they do when the float32 sums overflow: the normalised outputs stay representable.
    """

    def __init__(self, message: str, dtype):
        super().__init__(message)
        self.dtype = np.dtype(dtype)


def cast_features(fmap, feats: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Cast float64 features to the input dtype; :class:`FeatureOverflow` if finite inputs overflow it.

    ``fmap``: the map (or its name).  Where the map's own parameters hold NaN or inf (an in-place update
    ``p -= lr * g`` that diverged), non-finite features of finite inputs are a ValueError naming the parameter,
    not an overflow: smaller inputs would not help."""
    name = fmap if isinstance(fmap, str) else fmap.name
    with np.errstate(over="ignore"):
        out = feats.astype(x.dtype, copy=False)
    bad = ~np.isfinite(out)
    if bad.any():
        finite_rows = np.isfinite(x).all(axis=-1)
        if (bad & finite_rows[..., None]).any():
            for pname, arr in ({} if isinstance(fmap, str) else fmap.parameters()).items():
                if not np.isfinite(arr).all():
                    raise ValueError(f"feature map {name!r}: its parameter {pname} holds NaN or inf (an update "
                                     "that diverged?), so its features of finite inputs are not finite")
            raise FeatureOverflow(
                f"feature map {name!r}: features of finite inputs overflow {x.dtype} "
                f"(input shape {x.shape}); "
                + ("use smaller inputs" if x.dtype == np.float64 else "use float64 inputs or smaller inputs"),
                x.dtype
            )
    return out


def features_or_float64(fmap, make, work, check_finite, names=("q", "k"), before_float64=None):
    """``(features, dtype)``: ``make(work)``, a tuple of feature arrays (None where there is none), or
    ``make(float64)`` where those of finite inputs overflow ``work`` -- features that are not finite
    (``check_finite``: the caller scanned the inputs, so that is an overflow) or the map's own
    :class:`FeatureOverflow` -- as :func:`linattn_nb.linear_attention` recomputes such a call in float64.

    ``make(float64)`` is tried even when ``work`` is float64 (a caller may compute a float32 input's map in
    float32 and cast: its retry reads the input in float64).  ``before_float64()`` runs first when ``work``
    is narrower (a caller that cannot take float64 features raises there), given the names of the inputs whose
    features were not finite (none where the map raised :class:`FeatureOverflow`).  With ``check_finite``, float64
    features that are still not finite raise ValueError naming the map and the input (``names``, in the
    order of ``make``'s arrays)."""
    wide = np.dtype(np.float64)

    def not_finite(feats):
        return [n for n, x in zip(names, feats) if x is not None and not np.isfinite(x).all()]

    def refuse(bad):
        raise ValueError(f"feature map {fmap.name!r} returns non-finite features for the finite {bad[0]}, even in "
                         f"float64: {bad[0]} is too large for this map")

    overflowed = []
    try:
        with np.errstate(over="ignore"):  # an overflow is found below
            feats = make(work)
    except FeatureOverflow as e:
        if e.dtype == wide:
            raise
    else:
        overflowed = not_finite(feats) if check_finite else []
        if not overflowed:
            return feats, work
    if before_float64 is not None and np.dtype(work) != wide:
        before_float64(overflowed)
    with np.errstate(over="ignore"):
        feats = make(wide)
    bad = not_finite(feats) if check_finite else []
    if bad:
        refuse(bad)
    return feats, wide


def real_array(name: str, what: str, value) -> np.ndarray:
    """``value`` as a float64 array (a copy); complex and non-numeric data raise TypeError."""
    a = np.asarray(value)
    if a.dtype.kind not in "biuf":
        raise TypeError(f"{name}: {what} must be an array of real numbers, got dtype {a.dtype}")
    return np.array(a, dtype=np.float64)
