"""The random feature maps (FAVOR+, random Fourier features) and the draw of their projection.

Formulas and papers: docs/theory.md; the FAVOR+ shifts: docs/guide/feature_maps.md.
"""
from __future__ import annotations

import math

import numpy as np

from .._seeds import generator
from ._base import (FeatureMap, cast_features, check_count, check_input, check_role, check_scale,
                    max_shift_vjp, outer_sum, real_array, vjp_inputs)


def draw_projection(rng: np.random.Generator, num_features: int, dim: int, *,
                    orthogonal: bool, row_norm: str = "chi") -> np.ndarray:
    """Draw the random projection ``W`` (``num_features x dim``) of a random feature map.

    Parameters
    ----------
    rng : numpy.random.Generator
    num_features, dim : int
        ``m`` rows of dimension ``d``.
    orthogonal : bool
        True: rows orthogonal within each block of ``d`` rows (Haar ``Q`` factors, Performer §3);
        False: i.i.d. ``N(0, I_d)`` rows.
    row_norm : {"chi", "fixed"}
        ``"chi"``: norms of ``N(0, I_d)`` vectors (the estimators unbiased); ``"fixed"``: ``sqrt(d)``.

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
    m = check_count("num_features", num_features, allow_none=False)
    d = check_count("dim", dim, allow_none=False)
    if row_norm not in ("chi", "fixed"):
        raise ValueError(f"row_norm must be 'chi' or 'fixed', got {row_norm!r}")
    if not isinstance(orthogonal, (bool, np.bool_)):
        raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
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


class RandomFeatureMap(FeatureMap):
    """Base of the maps built on a random projection ``W`` (``m x d``).

    ``phi(q) . phi(k)`` estimates a kernel of ``scale q . k``.  A map given *by name* is drawn anew at
    every call: build one with a ``seed`` and pass the object (docs/guide/feature_maps.md).

    Parameters
    ----------
    dim : int, optional
        Input dimension ``d``; when omitted, ``W`` is drawn at the first call (then fixed).
    num_features : int, optional
        Rows ``m`` of ``W``; default ``max(1, int(d ln d))`` (Performer's).
    orthogonal : bool
        Block-orthogonal rows instead of i.i.d. Gaussian ones (:func:`draw_projection`).
    row_norm : {"chi", "fixed"}, default "chi"
        Row norms of ``W`` (:func:`draw_projection`).
    seed : int, numpy.random.Generator or None
        Seed of the map's own generator (the same ``W`` and :meth:`redraw` sequence).
    scale : float, optional
        Temperature; default ``1/sqrt(d)``.

    Attributes
    ----------
    W : ndarray (m, d) or None
        The current projection (None until drawn).
    num_features : int or None
        The effective ``m`` (None while neither it nor ``d`` is known).
    """

    default_orthogonal = True

    def __init__(self, dim=None, num_features=None, *, orthogonal=None, row_norm="chi", seed=None,
                 scale=None):
        self.dim = check_count("dim", dim)
        self._num_features = check_count("num_features", num_features)
        if orthogonal is None:
            orthogonal = self.default_orthogonal
        if not isinstance(orthogonal, (bool, np.bool_)):
            raise TypeError(f"orthogonal must be a bool, got {type(orthogonal).__name__}")
        self.orthogonal = bool(orthogonal)
        if row_norm not in ("chi", "fixed"):
            raise ValueError(f"row_norm must be 'chi' or 'fixed', got {row_norm!r}")
        self.row_norm = row_norm
        self.scale = check_scale(scale)
        self.seed = seed
        self._rng = generator(seed)
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
            self._rng = generator(seed)
            self.seed = seed
        if self.dim is not None:
            self._draw(self.dim)

    def materialize(self, d=None):
        """Draw the projection ``W`` now (for inputs of dimension ``d``) if not drawn yet; returns the map.

        Raises
        ------
        ValueError
            If ``W`` is not drawn and ``d`` is missing, or ``d`` differs from the drawn dimension.

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
        self.weights(check_count("d", d))
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

    def _vjp_project(self, x, grad_features, role):
        """The start of a vjp: ``(W, g, out_dtype, root, xs, u)`` with ``root = sqrt(scale)`` (``W`` drawn
        first if needed, as :meth:`apply` would)."""
        check_role(self.name, role)
        self.weights(check_input(self.name, x).shape[-1])
        x, g, out_dtype = vjp_inputs(self, x, grad_features, role)
        xs, u = self._project(x)
        return self.W, g, out_dtype, math.sqrt(self.effective_scale(x.shape[-1])), xs, u

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(dim={self.dim}, num_features={self.num_features}, "
                f"orthogonal={self.orthogonal}, row_norm={self.row_norm!r}, seed={self.seed!r}, "
                f"scale={self.scale})")


class FavorPlusFeatureMap(RandomFeatureMap):
    r"""FAVOR+ positive random features (Choromanski et al., ICLR 2021, Lemma 1, §2.3-3).

    With ``x' = sqrt(scale) x`` and rows ``w_i`` of ``W``:

    * ``kind="positive"``: ``phi(x) = exp(W x' - |x'|^2/2) / sqrt(m)``, output ``m``;
    * ``kind="hyperbolic"``: ``phi(x) = exp([W x', -W x'] - |x'|^2/2) / sqrt(2m)``, output ``2m``.

    ``E[phi(x) . phi(y)] = exp(scale x . y)``; every feature is positive.  :meth:`apply` shifts the
    logits by amounts that cancel in the normaliser (docs/guide/feature_maps.md) but not in an ``eps``
    floor: with inputs of large norm (q, k ~ 3 N(0, I) at d = 16) the default floor of
    :func:`linattn_nb.linear_attention` changes the outputs; pass ``eps=None`` (docs/guide/attention.md).

    Parameters
    ----------
    dim, num_features, orthogonal, row_norm, seed, scale
        See :class:`RandomFeatureMap`; ``orthogonal`` defaults to True
        (the "O" of FAVOR+).
    kind : {"positive", "hyperbolic"}, default "positive"
    learn_projection : bool, default False
        Train ``W``: :meth:`parameters` returns ``{"projection": W}`` (once drawn) and :meth:`vjp`
        its gradient; state files store the current ``W``.
    projection : array_like, shape (m, d), optional
        Use this ``W`` instead of a draw (it fixes ``dim`` and ``num_features``; ``seed`` then only
        seeds :meth:`redraw`).  Without either, a state file stores the seed.

    Attributes
    ----------
    projection : ndarray (m, d) or None
        :attr:`W` when given or learned (and drawn), else None: what a state file stores.

    Raises
    ------
    ValueError
        If ``projection`` is not a non-empty, finite 2-D array, or disagrees with ``dim`` or
        ``num_features``.

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

    #: the queries' per-row shift and the keys' constant shift cancel only in the normaliser
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
        if not self.key_headroom >= 0.0:  # negative: the shift would zero every key feature; NaN: no shift
            raise ValueError(f"config.FAVOR_KEY_HEADROOM must be a number >= 0, got {config.FAVOR_KEY_HEADROOM!r}")
        if projection is None:
            self._keep_projection = False
            super().__init__(dim, num_features, orthogonal=orthogonal, row_norm=row_norm, seed=seed, scale=scale)
            return
        w = real_array(self.name, "projection", projection)
        if w.ndim != 2 or w.size == 0:
            raise ValueError(f"{self.name}: projection must be a non-empty 2-D array (num_features, dim), "
                             f"got shape {w.shape}")
        if not np.isfinite(w).all():
            raise ValueError(f"{self.name}: projection must be finite")
        for what, given, have in (("dim", dim, w.shape[1]), ("num_features", num_features, w.shape[0])):
            if check_count(what, given) not in (None, have):
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
        with np.errstate(over="ignore"):  # overflow is reported by cast_features
            feats = np.exp(u - half_sq[..., None]) / math.sqrt(u.shape[-1])
        return cast_features(self, feats, x)

    def apply(self, x, *, role, causal=False, offset=0, total_length=None):
        check_role(self.name, role)
        x = check_input(self.name, x)
        u, half_sq = self._logits(x)
        if role == "query":
            u = u - np.max(u, axis=-1, keepdims=True)
        else:
            u = u - (half_sq[..., None] + self.key_shift)
        return cast_features(self, np.exp(u) / math.sqrt(u.shape[-1]), x)

    def parameters(self) -> dict:
        """``{"projection": W}`` with ``learn_projection=True`` once ``W`` is drawn, else ``{}``."""
        if self.learn_projection and self.W is not None:
            return {"projection": self.W}
        return {}

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        """Vector-Jacobian product of :meth:`apply` (see :meth:`FeatureMap.vjp`).

        ``dparams``: ``{"projection": dL/dW}`` with ``learn_projection=True`` (for keys including the
        shift's dependence on ``W``), else None.
        """
        w, g, out_dtype, root, xs, u = self._vjp_project(x, grad_features, role)
        m = u.shape[-1]
        if self.kind == "hyperbolic":
            u = np.concatenate([u, -u], axis=-1)
        norm = math.sqrt(u.shape[-1])
        shift = 0.0
        if role == "query":
            feats = np.exp(u - np.max(u, axis=-1, keepdims=True)) / norm
            du = max_shift_vjp(u, feats, g)
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
        dw = outer_sum(du, xs)
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

    * ``target="softmax"`` (Performer): ``phi(x) = exp(|x'|^2/2) / sqrt(m) [sin u, cos u]``,
      ``E[phi(x) . phi(y)] = exp(scale x . y)``;
    * ``target="gaussian"`` (RFA, Peng et al. 2021): ``phi(x) = [sin u, cos u] / sqrt(m)``,
      estimating ``exp(-scale |x - y|^2 / 2)``.

    Features are signed (the normaliser can be zero or negative).  In attention queries drop their
    factor ``exp(|q'|^2/2)``; keys keep it and raise ValueError where it would overflow.

    Parameters
    ----------
    dim, num_features, orthogonal, row_norm, seed, scale
        See :class:`RandomFeatureMap`; ``orthogonal`` defaults to False (as in RFA).
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
            with np.errstate(over="ignore"):  # overflow is reported by cast_features
                feats = feats * np.exp(0.5 * np.einsum("...i,...i->...", xs, xs))[..., None]
        return cast_features(self, feats, x)

    def apply(self, x, *, role, causal=False, offset=0, total_length=None):
        check_role(self.name, role)
        x = check_input(self.name, x)
        if role == "key":
            return self.transform(x)
        return cast_features(self, self._trig(x)[1], x)

    def vjp(self, x, grad_features, *, role, causal=False, offset=0, total_length=None):
        w, g, out_dtype, root, xs, u = self._vjp_project(x, grad_features, role)
        m = u.shape[-1]
        sin, cos = np.sin(u), np.cos(u)
        gs, gc = g[..., :m], g[..., m:]
        if role == "key" and self.target == "softmax":
            # phi = exp(|x'|^2/2) [sin u, cos u] / sqrt(m)
            with np.errstate(over="ignore"):
                e = np.exp(0.5 * np.einsum("...i,...i->...", xs, xs))[..., None]
                feats = np.concatenate([sin, cos], axis=-1) * (e / math.sqrt(m))
            cast_features(self, feats, check_input(self.name, x))  # raises where apply raises (overflow)
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
