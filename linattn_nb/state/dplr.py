"""The decoding state of a diagonal-plus-low-rank rule, :class:`DPLRState`: the API of
:class:`~linattn_nb.LinearAttentionState` over :func:`linattn_nb.dplr_attention` (docs/dplr.md)."""
from __future__ import annotations

import numpy as np

from .._frontend import LinearState, read_state
from ..feature_maps import resolve as _resolve_map
from . import fileformat
from .linear import LinearAttentionState as _Linear
from .._defaults import DEFAULT_EPS
from .._validate import check_bool, check_eps
from ..ops._finite import NonFiniteResult
from ._checks import shape_text, check_batch_shape

_GENERAL = "dplr"


class DPLRState:
    """Recurrent state ``S`` (batch + (D_phi, M)) and ``z`` of a DPLR rule, for token-by-token decoding.

    Parameters
    ----------
    key_dim, value_dim : int
        ``D`` of queries and keys, ``M`` of values.
    rule : str, optional
        A named DPLR rule (:func:`linattn_nb.rules.dplr_rule_names`); the general form when omitted
        (its ``a``, ``b``, ``log_diag``, ``beta`` passed to every call).
    batch_shape : int or tuple of int, default ()
        Leading dimensions of every input (an int ``n`` is ``(n,)``), as for
        :class:`~linattn_nb.LinearAttentionState`.
    feature_map : str or FeatureMap, default "elu"
    normalize : bool, default False
    eps : float or None

    Examples
    --------
    Decoding token by token gives the outputs of one call over the sequence:

    >>> import numpy as np
    >>> import linattn_nb as la
    >>> from linattn_nb.state.dplr import DPLRState
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((3, 6, 4))
    >>> decay, beta = rng.uniform(0.5, 1, size=(6, 4)), rng.uniform(0, 1, size=6)
    >>> st = DPLRState(4, 4, rule="kda", feature_map="l2")
    >>> st.prefill(k[:3], v[:3], decay=decay[:3], beta=beta[:3])
    >>> outs = [st.step(q[t], k[t], v[t], decay=decay[t], beta=beta[t]) for t in range(3, 6)]
    >>> whole = la.dplr_attention(q, k, v, rule="kda", feature_map="l2", decay=decay, beta=beta)
    >>> bool(np.allclose(np.stack(outs), whole[3:], atol=1e-12)), st.position
    (True, 6)
    """

    def __init__(self, key_dim, value_dim, *, rule=None, batch_shape=(), feature_map="elu", normalize=False,
                 eps=DEFAULT_EPS):
        from ..rules import get_dplr_rule

        for name, x in (("key_dim", key_dim), ("value_dim", value_dim)):
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 1:
                raise ValueError(f"{name} must be a positive integer, got {x!r}")
        bs = check_batch_shape(batch_shape)
        if not isinstance(normalize, (bool, np.bool_)):
            raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
        self._spec = None if rule in (None, _GENERAL) else get_dplr_rule(rule)
        self._d, self._m, self._bs = int(key_dim), int(value_dim), bs
        self._fmap = _resolve_map(feature_map)
        self._f = int(self._fmap.output_dim(self._d))
        self._normalize, self._eps = bool(normalize), check_eps(eps)
        self.reset()

    # -- properties -----------------------------------------------------------------
    @property
    def rule(self) -> str:
        """The rule's name (``"dplr"`` for the general form)."""
        return _GENERAL if self._spec is None else self._spec.name

    # the getters of LinearAttentionState's fields, which this state keeps under the same names
    key_dim = _Linear.key_dim
    value_dim = _Linear.value_dim
    feature_dim = _Linear.feature_dim
    batch_shape = _Linear.batch_shape
    feature_map = _Linear.feature_map
    eps = _Linear.eps
    position = _Linear.position

    @property
    def normalize(self) -> bool:
        return self._normalize

    @property
    def S(self) -> np.ndarray:
        """A copy of the state, batch + (D_phi, M), float64."""
        return self._S.copy()

    @property
    def z(self) -> np.ndarray:
        """A copy of the normaliser, batch + (D_phi,), float64."""
        return self._z.copy()

    def __repr__(self) -> str:
        return (f"DPLRState(rule={self.rule!r}, key_dim={self._d}, value_dim={self._m}, batch_shape={self._bs}, "
                f"feature_map={self._fmap.name!r}, position={self._position})")

    # -- running ----------------------------------------------------------------------
    def _run(self, q, k, v, arguments, check_finite):
        from ..dplr import dplr_attention

        out, st = dplr_attention(q, k, v, rule=None if self._spec is None else self._spec.name,
                                 feature_map=self._fmap, normalize=self._normalize, eps=self._eps,
                                 check_finite=check_finite, initial_state=self.to_linear_state(), return_state=True,
                                 **arguments)
        self._S, self._z, self._position = st.S, st.z, st.position
        return out

    def _one_token(self, x) -> bool:
        return np.ndim(x) == len(self._bs) + 1

    def _check_tokens(self, q, k, v, one: bool) -> None:
        """``q``, ``k``, ``v`` against this state's batch shape, ``key_dim`` and ``value_dim`` (ValueError naming
        the argument, in the shapes the caller passed); :func:`~linattn_nb.dplr_attention` checks the rest (dtypes,
        values, the rule's arguments).  Shapes that NumPy cannot read (ragged lists) are left to it as well."""
        named = [(n, x) for n, x in (("q", q), ("k", k), ("v", v)) if x is not None]  # prefill: no q
        try:
            shapes = {n: tuple(np.shape(x)) for n, x in named}
        except ValueError:
            return
        bs = self._bs
        tok = () if one else ("T",)
        # DeltaProduct's keys and values carry n_h writes a token: batch + (T, n_h, D)
        sub = len(shapes["k"]) == len(bs) + len(tok) + 2 and (self._spec is None or bool(self._spec.substeps))
        what = "one token" if one else "T tokens"
        for name, shp in shapes.items():
            last, label = (self._m, "value_dim") if name == "v" else (self._d, "key_dim")
            want = bs + tok + (("n_h",) if name != "q" and sub else ()) + (last,)
            if len(shp) != len(want) or shp[:len(bs)] != bs or shp[-1] != last:
                raise ValueError(f"{name} must have shape {shape_text(want)} (batch_shape {bs}, {what}, {label} "
                                 f"{last}), got {shp}")
        if not one and len({s[len(bs)] for s in shapes.values()}) > 1:
            raise ValueError(f"{', '.join(shapes)} must have the same number of tokens T (axis {len(bs)}), got "
                             f"shapes {', '.join(str(s) for s in shapes.values())}")

    def step(self, q, k, v, *, check_finite=True, **arguments):
        """Absorb tokens and return their outputs.

        ``q`` of shape batch + (D,) is one token (every argument then without the token axis:
        ``beta`` batch-shaped, a per-feature ``decay`` batch + (D_phi,), DeltaProduct's ``k``
        batch + (n_h, D)); batch + (T, D) is T tokens, with the arguments of
        :func:`linattn_nb.dplr_attention`.  Returns batch + (M,) or batch + (T, M).
        An argument without the batch axes (a scalar ``beta`` of a batched state) is refused
        with :func:`~linattn_nb.dplr_attention`'s ValueError naming it.
        """
        one = self._one_token(q)
        self._check_tokens(q, k, v, one)
        if one:
            ax = len(self._bs)

            def token_axis(x):  # fewer axes than the batch: passed as it is, for dplr_attention to refuse by name
                x = np.asarray(x)
                return np.expand_dims(x, ax) if x.ndim >= ax else x

            out = self._run(*(token_axis(x) for x in (q, k, v)),
                            {n: token_axis(x) for n, x in arguments.items()}, check_finite)
            return out[(slice(None),) * ax + (0,)]
        return self._run(q, k, v, arguments, check_finite)

    def prefill(self, k, v, *, check_finite=True, **arguments) -> None:
        """Absorb a prompt (batch + (T, D) keys; DeltaProduct's batch + (T, n_h, D)) without outputs."""
        k = np.asarray(k)
        self._check_tokens(None, k, v, False)
        q = k[..., 0, :] if (self._spec is not None and self._spec.substeps) or \
            (self._spec is None and k.ndim == len(self._bs) + 3) else k
        self._run(q, k, v, arguments, check_finite)

    def query(self, q, *, check_finite=True):
        """The outputs of queries (batch + (T, D) or batch + (D,)) against the state, which stays as it is.

        Returned in the queries' dtype, as :meth:`step`'s outputs (with ``check_finite``, an output beyond that
        dtype's range raises :class:`~linattn_nb.NonFiniteResult`; pass float64 queries to read it);
        ``check_finite`` must be True or False (TypeError otherwise).
        """
        check_finite = check_bool("check_finite", check_finite)
        q = np.asarray(q)
        one = self._one_token(q)
        if one:
            q = np.expand_dims(q, len(self._bs))
        if not np.issubdtype(q.dtype, np.floating):
            raise TypeError(f"q must be a floating-point array, got dtype {q.dtype}")
        if q.shape[:len(self._bs)] != self._bs or q.shape[-1] != self._d or q.ndim != len(self._bs) + 2:
            raise ValueError(f"q must have shape batch + (T, D) = {self._bs + ('T', self._d)}, got {q.shape}")
        if check_finite and not np.isfinite(q).all():
            raise ValueError("q contains non-finite values (NaN or inf)")
        fq = np.asarray(self._fmap.apply(q, role="query", causal=True, offset=self._position), dtype=np.float64)
        out = read_state(fq, self._S, self._z, self._normalize, self._eps)
        with np.errstate(over="ignore"):
            res = out.astype(q.dtype)
        if check_finite and not np.isfinite(res).all() and np.isfinite(out).all():
            raise NonFiniteResult(f"the outputs of these finite queries overflow {q.dtype} (they are finite in "
                                  "float64): pass float64 queries to read them; the state is unchanged")
        out = res
        return out[(slice(None),) * len(self._bs) + (0,)] if one else out

    def reset(self) -> None:
        """Back to the empty state at position 0."""
        self._S = np.zeros(self._bs + (self._f, self._m))
        self._z = np.zeros(self._bs + (self._f,))
        self._position = 0

    def copy(self) -> "DPLRState":
        new = DPLRState.__new__(DPLRState)
        new.__dict__.update(self.__dict__)
        new._S, new._z = self._S.copy(), self._z.copy()
        return new

    # -- conversion and files -------------------------------------------------------
    def to_linear_state(self):
        """The state as a :class:`~linattn_nb.LinearState` (copies; ``rule`` the rule's name)."""
        return LinearState(self._S.copy(), self._z.copy(), self._position, self.rule)

    def save(self, path) -> None:
        """Write the state to ``path`` (.npz, the format of :mod:`linattn_nb.state.fileformat`, atomically)."""
        fileformat.write(path, S=self._S, z=self._z, position=self._position, key_dim=self._d, value_dim=self._m,
                         batch_shape=self._bs, eps=self._eps, feature_map=self._fmap, rule=self.rule,
                         normalize=self._normalize)

    @classmethod
    def load(cls, path, *, feature_map=None, rule=None) -> "DPLRState":
        """Read a state written by :meth:`save` (``rule``, when given, must be the file's).

        Raises
        ------
        StateFileError (a ValueError)
            Not a readable state file, or one of another rule (a LinearAttentionState's among them).
        """
        from ..rules import dplr_rule_names

        sf = fileformat.read(path, feature_map=feature_map, rule=rule)
        if sf.rule not in (_GENERAL,) + dplr_rule_names():
            raise fileformat.StateFileError(f"{path}: the state runs the {sf.rule!r} update rule, not a DPLR rule: "
                                            "load it with LinearAttentionState.load")
        new = cls(sf.key_dim, sf.value_dim, rule=sf.rule, batch_shape=sf.batch_shape, feature_map=sf.feature_map,
                  normalize=bool(sf.normalize), eps=sf.eps)
        new._S = np.array(sf.S, dtype=np.float64).reshape(new._S.shape)
        new._z = np.array(sf.z, dtype=np.float64).reshape(new._z.shape)
        new._position = int(sf.position)
        return new
