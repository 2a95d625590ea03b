"""The linear-attention state: :class:`LinearAttentionState`.

Inputs through the front end, kernels the decode-step launchers of the method table
(docs/launchers.md), files the format of :mod:`linattn_nb.state.fileformat`.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _cuda_dispatch as CD
from .. import _frontend as FE
from .. import _validate as V
from .. import feature_maps as fm
from .._frontend import LinearState
from .._overlap import call_reads, out_overlaps
from ..device import check_device_arg, is_device_array, on_device, resolve_device
from ..feature_maps._base import features_or_float64
from ..ops._codes import LOG_RESET, norm_mode
from ..ops._finite import NonFiniteResult
from ..ops._vec import work_dtype
from ..ops.registry import get_method
from ..ops.step import cpu as _step_cpu
from ..ops.step.cpu import RESULT_NOT_FINITE
from ..rules import get_rule, rule_for, rule_names
from . import fileformat
from ._checks import (F32, F64, STATE_DTYPES, check_batch_shape, check_dim, check_shapes, check_state_dtype,
                      host_tokens, raise_nonfinite, call_forms)
from .fileformat import StateFileError
from .._defaults import DEFAULT_EPS

__all__ = ["LinearAttentionState", "StateFileError"]

#: The rule of a call without decay/log_decay/beta (the additive rule): the one whose step
#: launcher a state looks up while its rule is not fixed yet (``rule=None``, no token absorbed).
RULE = rule_for(factor=None, beta=False).name


def check_rule_name(rule, name="rule"):
    """``rule`` as a registered rule name (:func:`linattn_nb.rules.rule_names`), or None (not fixed yet)."""
    if rule is None or (isinstance(rule, str) and rule in rule_names()):
        return rule
    error = ValueError if isinstance(rule, str) else TypeError
    raise error(f"{name} must be None or one of {', '.join(map(repr, rule_names()))}, "
                f"got {rule!r} ({type(rule).__name__})")


#: Compiled entry points of :func:`linattn_nb.ops.step.cpu.fill_token_inputs` by input dtype
#: (called without Numba's dispatch on the rule fast path).
_FILL = {}


def _fill_entry(dtype):
    from numba import types

    sig = (types.Array(types.float64 if dtype == F64 else types.float32, 1, "C"), types.Array(types.float64, 1, "C"),
           types.int64, types.float64)
    _FILL[dtype] = ep = _step_cpu.fill_token_inputs.compile(sig)
    return ep


class _Inputs:
    """Validated, flattened inputs of one call."""

    __slots__ = ("arrays", "T", "dtype", "work", "device_inputs", "rule", "inputs")


class LinearAttentionState:
    r"""The decoding object: recurrent state of causal linear attention, updated token by token.

    Absorbs tokens in place (:meth:`prefill`, :meth:`step`), answers queries (:meth:`query`), is
    saved and loaded, on the CPU or a GPU; :meth:`from_linear_state` and :meth:`to_linear_state`
    convert from and to :class:`linattn_nb.LinearState` (docs/guide/decoding.md).

    Parameters
    ----------
    key_dim : int
        D, the last dimension of queries and keys.
    value_dim : int
        M, the last dimension of values.
    batch_shape : tuple of int, default ()
        Leading dimensions of every input, e.g. ``(batch, heads)``.
    feature_map : str, FeatureMap or None, default "elu"
        As in :func:`linattn_nb.linear_attention`; ``None`` when queries and
        keys already are features.
    dtype : {numpy.float64, numpy.float32}
        Precision of the state and of the kernels' accumulation (float64 reproduces
        :func:`linattn_nb.linear_attention` to round-off).
    device : {"auto", "cpu", "cuda"}
        Where the state lives; ``"auto"``: where the first inputs live, then fixed.
    eps : float or None, default 1e-8
        Floor of the normaliser, as in :func:`linattn_nb.linear_attention`.
    rule : {None, "additive", "decay", "gate", "delta", "gated_delta"}, default None
        The update rule (:mod:`linattn_nb.rules`); ``None``: the first call that absorbs a token
        fixes it.  A later call with another rule raises ValueError (docs/guide/decoding.md, "Rules").
    normalize : bool or None, default None
        As in :func:`linattn_nb.linear_attention` (None: the rule's convention); False makes
        :meth:`step` and :meth:`query` return ``phi(q)^T S`` undivided.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import LinearAttentionState, linear_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 4, 10, 8))          # (heads=4, T=10, D=8)
    >>> v = rng.normal(size=(4, 10, 6))
    >>> st = LinearAttentionState(8, 6, batch_shape=(4,))
    >>> st.prefill(k[:, :7], v[:, :7])                  # a prompt of 7 tokens
    >>> out = st.step(q[:, 7:], k[:, 7:], v[:, 7:])     # then 3 more
    >>> ref = linear_attention(q, k, v, causal=True)
    >>> bool(np.allclose(out, ref[:, 7:])), st.position
    (True, 10)

    With a decay per head (RetNet's gamma) the state forgets:

    >>> gamma = np.array([0.9, 0.95, 0.99, 1.0])
    >>> st = LinearAttentionState(8, 6, batch_shape=(4,))
    >>> st.prefill(k[:, :7], v[:, :7], decay=gamma)
    >>> out = st.step(q[:, 7:], k[:, 7:], v[:, 7:], decay=gamma)
    >>> ref = linear_attention(q, k, v, causal=True, decay=gamma, method="quadratic")
    >>> bool(np.allclose(out, ref[:, 7:])), st.rule
    (True, 'decay')

    The delta rule (unit keys: the ``"l2"`` map) with a write strength per token:

    >>> beta = rng.uniform(0.0, 1.0, size=(4, 10))
    >>> st = LinearAttentionState(8, 6, batch_shape=(4,), feature_map="l2")
    >>> st.prefill(k[:, :7], v[:, :7], beta=beta[:, :7])
    >>> out = st.step(q[:, 7:], k[:, 7:], v[:, 7:], beta=beta[:, 7:])
    >>> ref = linear_attention(q, k, v, causal=True, feature_map="l2", beta=beta, method="quadratic")
    >>> bool(np.allclose(out, ref[:, 7:])), st.rule, st.normalize
    (True, 'delta', False)
    """

    def __init__(self, key_dim, value_dim, *, batch_shape=(), feature_map="elu", dtype=np.float64,
                 device="auto", eps=DEFAULT_EPS, rule=None, normalize=None):
        d = check_dim("key_dim", key_dim)
        m = check_dim("value_dim", value_dim)
        bs = check_batch_shape(batch_shape)
        fmap = fm.resolve(feature_map)
        dt = check_state_dtype(dtype)
        eps = V.check_eps(eps)
        check_device_arg(device)
        rule = check_rule_name(rule)
        f = FE.feature_dim(fmap, d)
        # normalize's type, and maps that need the normaliser with the rule's convention (the front end's check)
        FE.rule_normalize(fmap, rule or RULE, normalize)
        self._init_fields(d, m, f, bs, fmap, dt, eps, rule, normalize)
        self._position = 0
        dev = None if device == "auto" else resolve_device(device)
        self._attach(dev or "cpu")
        self._device = dev

    def _init_fields(self, d, m, f, bs, fmap, dt, eps, rule=None, normalize=None):
        self._d, self._m, self._f = d, m, f
        self._bs = bs
        self._nb = len(bs)
        self._B = int(np.prod(bs, dtype=np.int64))
        self._fmap = fmap
        self._code = None if fmap.kernel_code is None else int(fmap.kernel_code)
        self._dtype = dt
        self._eps = eps
        self._eps_f = -math.inf if eps is None else float(eps)  # the kernels' "no floor"
        self._c_code = np.int64(self._code if self._code is not None else 0)
        self._vtail = (m,)
        self._q1 = bs + (1, d)
        self._v1 = bs + (1, m)
        self._qk3 = (self._B, 1, d)
        self._o1 = (self._B, 1, m)
        self._rule = rule
        self._normalize_arg = normalize
        self._norm = V.check_normalize(normalize, get_rule(rule or RULE).normalize)

    def _attach(self, dev):
        """Look the step launcher for ``dev`` up in the method table and allocate a zero state there
        (once per device decision, never per token)."""
        rule = self._rule or RULE
        launch = get_method("step", causal=True, device=dev, rule=rule).forward
        S, z, scratch = launch.zeros(self._B, self._f, self._m, self._dtype)
        self._launch, self._S, self._z, self._scratch = launch, S, z, scratch
        self._launch_rule = rule
        self._kern1 = None if launch.kernel is None else launch.kernel(self._B, 1, self._m, self._f)
        self._entry = {}
        self._set_fast()

    def _set_fast(self):
        """Set up the fast paths: ``_fast`` (a rule without inputs, normalised: the kernel's compiled
        entry point) and ``_rfast`` (host, elementwise map, a rule with inputs but no per-feature
        factor: one token's factor and ``beta`` filled into preallocated (B, 1) arrays by
        :func:`~linattn_nb.ops.step.cpu.fill_token_inputs`; anything else takes the validating path)."""
        rule = get_rule(self._launch_rule)  # the state's rule, or the additive one while not fixed
        self._fast = self._code is not None and self._kern1 is not None and not rule.has_inputs and self._norm
        if self._fast:
            (self._feat,) = self._scratch
        self._rfast = (self._code is not None and self._launch.device == "cpu" and rule.has_inputs
                       and rule.factor != "feature")
        if self._rfast:
            B, M, F = self._B, self._m, self._f
            self._rbeta, self._rforgets, self._rdelta = rule.beta, rule.forgets, rule.reads_state
            pick = _step_cpu.pick_delta_kernel if rule.reads_state else _step_cpu.pick_rule_kernel
            self._rkern = pick(B, 1, M, F)
            self._lg1 = np.zeros((B, 1, 1 if rule.forgets else 0))
            self._beta1 = np.zeros((B, 1))
            self._rnorm = np.int64(norm_mode(self._eps, self._norm))
            self._rentry = {}
            (self._rfeat,) = self._scratch

    def _fill_token(self, x, out, kind):
        """One token's factor or write strength into ``out`` (flat, B float64): True when ``x`` is a
        Python number or a float array of the batch shape (or 0-d) with valid values."""
        if isinstance(x, (float, int)) and not isinstance(x, bool):
            a = float(x)
            if kind == _step_cpu.FILL_BETA:
                if not 0.0 <= a <= 2.0:
                    return False
            elif kind == _step_cpu.FILL_DECAY:
                if not 0.0 <= a <= 1.0:
                    return False
                a = math.log(a) if a > 0.0 else -math.inf
            elif not a <= 0.0:
                return False
            out.fill(-math.inf if kind != _step_cpu.FILL_BETA and a <= LOG_RESET else a)
            return True
        if (type(x) is np.ndarray and (x.shape == self._bs or x.ndim == 0)
                and (x.dtype is F64 or x.dtype is F32)):
            fill = _FILL.get(x.dtype)
            if fill is None:
                fill = _fill_entry(x.dtype)
            # the entry point is compiled for a C-contiguous vector and reads it without looking at
            # strides: a strided, reversed or broadcast view is copied first (a view of B values)
            flat = x.reshape(-1)
            if not flat.flags.c_contiguous:
                flat = np.ascontiguousarray(flat)
            return fill(flat, out, kind, LOG_RESET)
        return False

    def _rule_token(self, decay, log_decay, beta):
        """Fill ``_lg1``/``_beta1`` for a one-token step of the fixed rule; False: take the validating path
        (also for arguments of another rule: a factor and ``beta`` exactly where the rule takes them)."""
        if ((beta is not None) != self._rbeta
                or ((decay is not None) + (log_decay is not None)) != self._rforgets):
            return False
        if beta is not None and not self._fill_token(beta, self._beta1.reshape(-1), _step_cpu.FILL_BETA):
            return False
        if not self._rforgets:
            return True
        if decay is not None:
            return self._fill_token(decay, self._lg1.reshape(-1), _step_cpu.FILL_DECAY)
        return self._fill_token(log_decay, self._lg1.reshape(-1), _step_cpu.FILL_LOG_DECAY)

    def _rule_step_fast(self, q, k, v, check_finite):
        """The rule fast path's step (the inputs filled); returns the output, or None when the shapes
        or dtypes are not those of the fast path."""
        dt = q.dtype
        if not (k.dtype is dt and v.dtype is dt and (dt is F32 or dt is F64) and q.shape == self._q1
                and k.shape == self._q1 and v.shape == self._v1 and q.flags.carray
                and k.flags.carray and v.flags.carray):  # carray: C-contiguous, aligned and writeable (step's)
            return None
        res = out = np.empty(self._o1, dt)
        if self._nb != 1:
            q, k, v = q.reshape(self._qk3), k.reshape(self._qk3), v.reshape(self._o1)
            res = out.reshape(self._v1)
        ep = self._rentry.get(dt)
        args = (q, k, v, self._S, self._z, out, self._rfeat, self._c_code, self._eps_f, bool(check_finite),
                self._lg1)
        args += (self._beta1, self._rnorm, True) if self._rdelta else (self._rnorm,)
        if ep is None:
            from numba import typeof

            ep = self._rentry[dt] = self._rkern.compile(tuple(typeof(a) for a in args))
        bad = ep(*args)
        if bad == RESULT_NOT_FINITE:
            self._result_error(1, dt)
        if bad:
            raise_nonfinite(("q", "k", "v")[bad - 1])
        self._position += 1
        if self._device is None:
            self._device = "cpu"
        return res

    # -- the update rule -----------------------------------------------------------
    def _check_rule(self, rule, name):
        """Refuse a call of another rule than the state's (before anything changes)."""
        if self._rule is not None and rule != self._rule:
            raise ValueError(
                f"this LinearAttentionState runs the {self._rule!r} update rule, but {name} asks for the "
                f"{rule!r} rule; a state continues only its own rule ({get_rule(self._rule).hint}, or build "
                "another state)"
            )

    def _set_rule(self, rule):
        """Fix the rule (the first call that absorbs a token), or unfix it (None: that call's inputs
        were refused by the kernel, nothing changed); the rule's launcher is looked up once."""
        self._rule = rule
        self._norm = V.check_normalize(self._normalize_arg, get_rule(rule or RULE).normalize)
        if (rule or RULE) != self._launch_rule:
            self._reattach(self._launch.device)
        else:
            self._set_fast()

    def _reattach(self, dev):
        """Look the launcher up again (another device or rule) and move the state's values to its buffers."""
        S, z = self._launch.view(self._S, self._z)
        self._attach(dev)
        self._launch.put(self._S, self._z, S, z)

    # -- device ---------------------------------------------------------------
    def _set_device(self, dev):
        """Fix the device; move the (host) state to the GPU for "cuda"."""
        if dev != self._launch.device:
            self._reattach(dev)
        self._device = dev

    def _place(self, device):
        """The device of a state built on the host from arrays (:meth:`from_linear_state`, :meth:`load`)."""
        if device != "cpu":
            self._device = None
            if device == "cuda":
                self._set_device(resolve_device("cuda"))

    def _resolve(self, arrays, names):
        """The device these inputs run on (the state's, or for "auto" the data's); refuses inputs on two
        devices or on the other side.  Does not fix an undecided device: :meth:`_prepare` does that."""
        gpu = [n for n, a in zip(names, arrays) if on_device(a)]
        if self._device == "cpu" and gpu:
            raise ValueError(f"this state lives on the host (device='cpu') but {', '.join(gpu)} live on "
                             "the GPU; copy them to the host first (or build the state with device='cuda')")
        if gpu and len(gpu) != len(arrays):
            host = [n for n in names if n not in gpu]
            raise ValueError(f"inputs live on different devices: {', '.join(gpu)} on the GPU, "
                             f"{', '.join(host)} on the host; move them to one device first")
        if self._device is None:
            return resolve_device("cuda") if gpu else "cpu"
        return self._device

    # -- properties -------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self._d

    @property
    def value_dim(self) -> int:
        return self._m

    @property
    def feature_dim(self) -> int:
        """D_phi = feature_map.output_dim(key_dim)."""
        return self._f

    @property
    def batch_shape(self) -> tuple:
        return self._bs

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def feature_map(self):
        return self._fmap

    @property
    def eps(self):
        return self._eps

    @property
    def device(self) -> str:
        """"cpu", "cuda", or "auto" while no input has decided it."""
        return self._device or "auto"

    @property
    def position(self) -> int:
        """Tokens absorbed so far: the position of the next token (the offset of position-dependent maps)."""
        return self._position

    @property
    def rule(self):
        """The update rule ("additive", "decay", "gate", "delta", "gated_delta"), or None until the first
        tokens fix it."""
        return self._rule

    @property
    def normalize(self) -> bool:
        """Whether :meth:`step` and :meth:`query` divide by the normaliser."""
        return self._norm

    @property
    def nbytes(self) -> int:
        """Bytes held by S and z (scratch excluded): independent of the context length."""
        item = self._dtype.itemsize
        return self._B * self._f * (self._m + 1) * item

    @property
    def S(self):
        """``sum_j phi(k_j) v_j^T``, shape ``(*batch_shape, D_phi, M)``: a read-only view on the host; on the GPU
        the current buffer, which a checked update replaces (read it again after a call)."""
        S = self._launch.view(self._S, self._z)[0].reshape(self._bs + (self._f, self._m))
        if isinstance(S, np.ndarray):
            S.flags.writeable = False
        return S

    @property
    def z(self):
        """``sum_j phi(k_j)``, shape ``(*batch_shape, D_phi)``."""
        z = self._launch.view(self._S, self._z)[1].reshape(self._bs + (self._f,))
        if isinstance(z, np.ndarray):
            z.flags.writeable = False
        return z

    def _host_arrays(self):
        """Canonical host copies: S (*bs, F, M), z (*bs, F)."""
        S, z = self._launch.view(self._S, self._z)
        if on_device(S):
            S, z = CD.to_host("S", S), CD.to_host("z", z)
        else:
            S, z = np.ascontiguousarray(S), z.copy()
        return S.reshape(self._bs + (self._f, self._m)), z.reshape(self._bs + (self._f,))

    def __repr__(self) -> str:
        return (f"LinearAttentionState(key_dim={self._d}, value_dim={self._m}, batch_shape={self._bs}, "
                f"feature_map={self._fmap!r}, dtype={self._dtype.name}, device={self.device!r}, "
                f"rule={self._rule!r}, position={self._position}, nbytes={self.nbytes})")

    # -- input handling ----------------------------------------------------------
    def _prepare(self, pairs, check_finite, decay=None, log_decay=None, beta=None, step=None):
        """Validate and flatten inputs; return an _Inputs (host or device arrays of (B, T, *)).

        ``step`` True or False: the rule arguments of a step or a prefill (:func:`._checks.call_forms`),
        parsed by the front end and checked against the state's rule before the device is fixed.
        """
        names = [n for n, _, _ in pairs]
        dev = self._resolve([x for _, x, _ in pairs], names)
        res = self._prepare_on(dev, pairs, check_finite, (decay, log_decay, beta, step))
        if step is not None:
            given = [n for n, x in (("beta", beta), ("decay", decay), ("log_decay", log_decay)) if x is not None]
            what = ("a step" if step else "a prefill") + " without decay/log_decay/beta"
            self._check_rule(res.rule, " with ".join(given) if given else what)
        if self._device is None:
            self._set_device(dev)
        return res

    def _absorb_rule(self, inp):
        """After a valid call: its tokens fix the rule of an unfixed state.  Returns whether it did
        (so that a call the kernel refuses can undo it: ``_set_rule(None)``)."""
        if self._rule is None and inp.T:
            self._set_rule(inp.rule)
            return True
        return False

    def _prepare_on(self, dev, pairs, check_finite, arguments):
        res = _Inputs()
        decay, log_decay, beta, step = arguments
        if dev == "cuda" and any(on_device(x) for _, x, _ in pairs):  # all of them (:meth:`_resolve`)
            arrs = [(n, CD.wrap(n, x), last) for n, x, last in pairs]
            T = check_shapes(self._bs, arrs)
            dts = {np.dtype(a.dtype) for _, a, _ in arrs}
            if len(dts) != 1 or next(iter(dts)) not in STATE_DTYPES + (np.dtype(np.float16),):
                raise TypeError(
                    "GPU inputs must share one dtype, float16, float32 or float64 (no conversion on the "
                    f"device), got {', '.join(f'{n}: {a.dtype}' for n, a, _ in arrs)}"
                )
            out = []
            for n, a, last in arrs:
                if not a.is_c_contiguous():
                    raise ValueError(f"{n} must be C-contiguous on the GPU")
                out.append(a.reshape((self._B, T, last)))
            res.arrays, res.T = out, T
            res.dtype = res.work = next(iter(dts))
            forms = call_forms(decay, log_decay, beta, self._bs, T, self._f, step=bool(step))
            res.rule, res.inputs, _ = FE.rule_arguments(self._fmap, forms["decay"], forms["log_decay"],
                                                        self._normalize_arg, self._bs, T, self._f,
                                                        causal=True, beta=forms["beta"])
            res.device_inputs = True
            if self._code is None:
                raise ValueError(
                    f"feature map {self._fmap.name!r} has no inline (elementwise) form for the GPU "
                    "kernels; pass host arrays, or compute the features and use feature_map=None"
                )
            return res
        arrs, T, dtype = host_tokens(self._bs, pairs)  # checked against the state's dimensions
        work = work_dtype(dtype)
        given = {n: a for n, a, _ in arrs}
        # the request as linear_attention's (NumPy-side features: the raw inputs are scanned here)
        c = FE.host_call(given.get("q"), given.get("k"), given.get("v"), fmap=self._fmap, eps=self._eps,
                         causal=True, normalize=self._normalize_arg, check_qkv=check_finite and self._code is None,
                         **call_forms(decay, log_decay, beta, self._bs, T, self._f, step=bool(step)))
        res.rule, res.inputs = c.rule, c.inputs
        flat, work = self._host_features(c, work, T, check_finite)
        res.arrays, res.T, res.dtype, res.work = flat, T, dtype, work
        res.device_inputs = False
        return res

    def _host_features(self, c, work, T, check_finite):
        """``(arrays, work)``: the flattened kernel inputs of host call ``c`` in ``work``, or in float64 where a
        NumPy-side map's features of finite q or k overflow ``work``
        (:func:`~linattn_nb.feature_maps._base.features_or_float64`).  Runs before the kernel, so that the state
        never absorbs overflowed features; the outputs come back in the inputs' dtype (:meth:`_finish`).  A
        float32 state, which could not sum such features, refuses the call."""
        inline = self._code is not None

        def make(w):
            return FE.host_features(self._fmap, inline, c.q, c.k, c.v, w, causal=True, position=self._position, n=T)

        def refuse_float32_state(bad):
            """``bad``: which features overflowed (none named: the map's own FeatureOverflow); the state sums
            the keys' only."""
            if self._dtype == F64:
                return
            hint = "use a float64 state (LinearAttentionState(..., dtype=np.float64)) or smaller inputs"
            if "k" in bad or not bad:
                raise ValueError(f"feature map {self._fmap.name!r} overflows {work} on these finite inputs "
                                 f"({'the keys k' if bad else 'q or k'}), and so would the {self._dtype} state "
                                 f"that sums the keys' features: {hint}")
            raise ValueError(f"feature map {self._fmap.name!r} overflows {work} on the finite queries q (their "
                             f"features: the state sums only the keys', but a {self._dtype} state refuses a call "
                             f"whose features overflow {work}): {hint}")

        if inline:  # the kernel maps q and k itself
            feats = make(work)
        else:  # q and k were scanned with check_finite (host_call)
            feats, work = features_or_float64(self._fmap, make, work, check_finite,
                                              before_float64=refuse_float32_state)
        return [x for x in feats if x is not None], work

    def _finish(self, out, inp, check_finite=False):
        """Reshape (B, T, M) to the batch shape; cast to the inputs' dtype (float16, or float32 inputs whose
        features were computed in float64); host copy for host inputs.  ``check_finite``: an output that the
        cast overflows raises :class:`~linattn_nb.NonFiniteResult` (after the tokens were absorbed)."""
        if self._device == "cuda" and not inp.device_inputs:
            out = out.copy_to_host()
        out = out.reshape(self._bs + (inp.T, self._m))
        if inp.device_inputs or out.dtype == inp.dtype:
            return out
        with np.errstate(over="ignore"):
            res = out.astype(inp.dtype)
        if check_finite and not np.isfinite(res).all() and np.isfinite(out).all():
            raise NonFiniteResult(f"the outputs of these finite inputs overflow {inp.dtype} (they are finite in "
                                  f"{out.dtype}): pass {out.dtype} inputs to read them; {self._absorbed(inp.T)}")
        return res

    def _absorbed(self, T):
        """The part of an error message after a call whose tokens the state absorbed."""
        return f"the state absorbed the {T} token(s) (position {self._position})"

    def _state_error(self, T):
        """:class:`~linattn_nb.NonFiniteResult` for a host state that holds inf or NaN after absorbing
        T tokens, else None."""
        S, z = self._launch.view(self._S, self._z)
        if not isinstance(S, np.ndarray) or (np.isfinite(S).all() and np.isfinite(z).all()):
            return None
        return NonFiniteResult(f"the {self._dtype} state overflowed on these finite inputs: {self._absorbed(T)} and "
                               "now holds inf or NaN; reset() it or load a saved copy, and use a float64 state or "
                               "smaller inputs")

    def _unchanged_error(self, what):
        """:class:`~linattn_nb.NonFiniteResult` of a GPU call whose kernel found a result of finite inputs that is
        not finite (``what``: the outputs' dtype and the state's): its state buffers were not swapped."""
        return NonFiniteResult(f"an output or a new state element of these finite inputs is not finite in {what}: "
                               "it overflows the dtype (pass float64 inputs, or use a float64 state), or a "
                               "normaliser is 0 with eps=None; the state is unchanged")

    def _result_error(self, T, out_dtype):
        """After a step kernel's :data:`~linattn_nb.ops.step.cpu.RESULT_NOT_FINITE`: the tokens were absorbed
        (the position follows); raise :class:`~linattn_nb.NonFiniteResult` saying whether the
        state overflowed."""
        self._position += T
        if self._device is None:
            self._device = "cpu"
        err = self._state_error(T)
        if err is not None:
            raise err
        raise NonFiniteResult(f"the outputs of these finite inputs are not finite in {out_dtype}: they overflow it "
                              f"or the {self._dtype} state's sums ({self._wider_hint('inputs')}), or a normaliser is "
                              f"0 with eps=None; {self._absorbed(T)}")

    def _wider_hint(self, what):
        """How to read outputs that overflowed: a float64 state where this one is narrower, else float64 inputs."""
        if np.dtype(self._dtype) != np.float64:
            return "use a float64 state, dtype=np.float64, to read them"
        return f"pass float64 {what} to read them"

    def _on_state_device(self, inp):
        """The flattened inputs where the state lives (host inputs copied to a GPU state)."""
        if self._device == "cuda" and not inp.device_inputs:
            return [CD.to_device(a) for a in inp.arrays]
        return inp.arrays

    def _new_out(self, T, dtype):
        shape = (self._B, T, self._m)
        if self._device == "cuda":
            return CD.device_out(None, shape, dtype)
        return np.empty(shape, dtype=dtype)

    def _kernel_out(self, given, inp, reads=()):
        """Where the kernel writes: the caller's ``out`` itself (device inputs to a GPU state: checked
        and viewed as (B, T, M), no allocation), else a new array (copied into ``given`` by
        :meth:`_deliver`)."""
        shape = self._bs + (inp.T, self._m)
        if given is not None and not inp.device_inputs:
            if is_device_array(given) or (self._device == "cuda" and on_device(given)):
                # as linear_attention(..., device="cuda") says it (host inputs run on a GPU state, but their
                # outputs come back to the host)
                raise ValueError("inputs live on different devices: out on the GPU, q, k, v on the host; move them "
                                 "to one device first")
            # as every entry point: not an array or a wrong dtype a TypeError, a wrong shape a ValueError
            V.check_out(given, shape, inp.dtype)
        if isinstance(given, np.ndarray) and not given.flags.writeable:
            # refused before the kernel advances the state (a retry would absorb the tokens twice)
            raise ValueError("out is read-only")
        if given is None or not inp.device_inputs:
            return self._new_out(inp.T, inp.work)
        if not on_device(given):
            what = "a NumPy array" if isinstance(given, np.ndarray) else f"a {type(given).__name__}"
            raise ValueError(f"inputs live on different devices: q, k, v on the GPU, out on the host ({what}); "
                             f"pass a GPU array of shape {shape} and dtype {inp.work}, or no out")
        dout = CD.device_out(given, shape, inp.work)
        if out_overlaps(given, reads + (self._S, self._z)):
            return self._new_out(inp.T, inp.work)  # written into ``given`` once the kernel has read everything
        if not dout.is_c_contiguous():
            raise ValueError("out must be C-contiguous on the GPU")
        return dout.reshape((self._B, inp.T, self._m))

    def _deliver(self, res, given, inp):
        """The call's result: ``res``, or the caller's ``out`` (filled with it unless the kernel wrote
        there directly)."""
        if given is None:
            return res
        if inp.device_inputs:
            if res is not given and not out_overlaps(res, (given,)):
                CD.copy_device(CD.wrap("out", res), CD.wrap("out", given))  # the kernel wrote a scratch result
            return given
        given[...] = res
        return given

    # -- the API ------------------------------------------------------------------------
    def step(self, q, k, v, *, decay=None, log_decay=None, beta=None, check_finite=True, out=None):
        """Absorb T new tokens and return their outputs, exactly as the causal kernel would.

        Token t first updates the state, then reads it (its output includes itself).

        Parameters
        ----------
        q, k : array_like, shape ``(*batch_shape, T, key_dim)``
        v : array_like, shape ``(*batch_shape, T, value_dim)``
            float16/32/64 (mixed dtypes promote to the widest), host or GPU arrays (GPU arrays:
            one dtype, C-contiguous; the outputs have the inputs' dtype).  T >= 0.
        decay, log_decay : float or array_like, optional
            The tokens' factors in [0, 1] (0 resets the state exactly), or their logs <= 0 (-inf
            resets); at most one.  A scalar or an array broadcastable to the batch shape (one per
            sequence: the ``"decay"`` rule) or ``(*batch_shape, D_phi)`` (the ``"gate"`` rule)
            apply to every token; ``(*batch_shape, T, 1)`` or ``(*batch_shape, T, D_phi)`` give
            each token its own.  ``(*batch_shape, D_phi)`` with T = D_phi > 1 is refused as ambiguous
            (``prefill`` and ``linear_attention`` read ``(*batch_shape, N)`` as one factor per token).
            Neither: the additive rule.
        beta : float or array_like, optional
            The delta rule's write strengths in [0, 2]: a scalar or an array broadcastable to the
            batch shape (every token), or ``(*batch_shape, T)`` or ``(*batch_shape, T, 1)`` (one
            per token).  With a decay that is not per feature: the gated delta rule.
        check_finite : bool, default True
            Raise ValueError, leaving the state untouched, when an input holds NaN or inf (checked
            inside the kernel; on the GPU the flag is read back after the launch, so False lets
            a GPU step return without waiting), and
            :class:`~linattn_nb.NonFiniteResult` when finite inputs give a non-finite
            output or state (below).
        out : array, optional
            Where to write the outputs, shape ``(*batch_shape, T, value_dim)``, returned in place
            of a new array: for GPU inputs a C-contiguous device array of the inputs' dtype (the
            kernel writes it directly), for host inputs a NumPy array of the promoted dtype.

        Returns
        -------
        ndarray, shape ``(*batch_shape, T, value_dim)``
            In the promoted input dtype (a device array for GPU inputs).
            ``phi(q)^T S`` undivided when the state has ``normalize=False``.

        Raises
        ------
        ValueError
            Shapes that do not match the state, non-finite inputs, inputs on another device than
            the state; ``decay``/``log_decay``/``beta`` out of range, of no form above, or of
            another rule than the state's; features of finite inputs that overflow a float32 state
            (nothing changed).
        TypeError
            Non-floating inputs; ``check_finite`` not True or False (a string such as ``"False"``, None, 0).
        NonFiniteResult
            With ``check_finite``: an output of finite inputs that is not finite (it overflows the
            outputs' dtype, or a normaliser is 0 with ``eps=None``), or a state that overflowed its
            dtype.  On the CPU the tokens were absorbed (the position follows them) and the message
            says whether the state now holds inf or NaN; a GPU state is unchanged
            (docs/guide/decoding.md, "Overflow").

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState
        >>> st = LinearAttentionState(4, 3, dtype=np.float32)
        >>> x = np.ones((1, 4), dtype=np.float32)
        >>> st.step(x, x, np.ones((1, 3), dtype=np.float32)).tolist()
        [[1.0, 1.0, 1.0]]
        """
        if check_finite is not True:  # one identity test on the decode loop's path
            check_finite = V.check_bool("check_finite", check_finite)
        # Fast path (the additive decode loop): host NumPy arrays of one native dtype, C-contiguous,
        # an elementwise map, a host state.  A few tuple compares, one allocation, one call.
        if (self._fast and out is None and decay is None and log_decay is None and beta is None
                and type(q) is np.ndarray
                and type(k) is np.ndarray and type(v) is np.ndarray):
            dt = q.dtype
            shp = q.shape
            if (k.dtype is dt and v.dtype is dt and (dt is F32 or dt is F64) and k.shape == shp
                    and q.flags.carray and k.flags.carray and v.flags.carray):
                # carray: C-contiguous, aligned and writeable as one flag, at the cost of c_contiguous.  A
                # read-only token is another Numba type (every kernel compiled once more): it takes the
                # general path, which hands the kernels a writeable view of it (_arrays.kernel_view).
                if shp == self._q1 and v.shape == self._v1:
                    T = 1
                    res = out = np.empty(self._o1, dt)
                    if self._nb != 1:
                        q, k, v = q.reshape(self._qk3), k.reshape(self._qk3), v.reshape(self._o1)
                        res = out.reshape(self._v1)
                    ep = self._entry.get(dt)
                    if ep is None:
                        ep = self._entry_point(dt, (q, k, v, out))
                    bad = ep(q, k, v, self._S, self._z, out, self._feat, self._c_code,
                             self._eps_f, check_finite)
                elif (len(shp) == self._nb + 2 and shp[-1] == self._d and shp[:-2] == self._bs
                        and v.shape == shp[:-1] + self._vtail):
                    T = shp[-2]
                    B = self._B
                    res = np.empty(shp[:-1] + self._vtail, dtype=dt)
                    out = res.reshape(B, T, self._m)
                    kern = self._launch.kernel(B, T, self._m, self._f)
                    bad = kern(q.reshape(B, T, self._d), k.reshape(B, T, self._d), v.reshape(B, T, self._m),
                               self._S, self._z, out, self._feat, self._c_code, self._eps_f,
                               check_finite)
                else:
                    T = -1
                if T >= 0:
                    if bad == RESULT_NOT_FINITE:
                        if T and self._rule is None:
                            self._rule = RULE
                        self._result_error(T, dt)
                    if bad:
                        raise_nonfinite(("q", "k", "v")[bad - 1])
                    self._position += T
                    if self._device is None:
                        self._device = "cpu"
                    if T and self._rule is None:
                        self._rule = RULE  # the launcher already is the additive one
                    return res
        # Fast path of a fixed decay/delta rule: one token, host arrays, one factor per sequence.
        if (self._rfast and out is None and type(q) is np.ndarray and type(k) is np.ndarray
                and type(v) is np.ndarray
                and q.shape == self._q1 and self._rule_token(decay, log_decay, beta)):
            res = self._rule_step_fast(q, k, v, check_finite)
            if res is not None:
                return res
        unfixed = self._device is None
        inp = self._prepare([("q", q, self._d), ("k", k, self._d), ("v", v, self._m)], check_finite, decay,
                            log_decay, beta, step=True)
        given = out
        try:
            out = self._kernel_out(given, inp, call_reads(q, k, v, decay, log_decay, beta))
        except (TypeError, ValueError):
            if unfixed:  # a refused out leaves the state as it was: its device open too (the next call fixes it)
                self._device = None
            raise
        fixed = self._absorb_rule(inp)
        qf, kf, vf = self._on_state_device(inp)
        if inp.T == 0:  # nothing to absorb (the rule may still be open: no launcher to run)
            return self._deliver(self._finish(out, inp), given, inp)
        # check_finite: the kernels check the inputs (for NumPy-side maps their features, finite here:
        # _host_features), the outputs and, on a GPU, the new state, whose buffers are then not swapped
        check = bool(check_finite)
        bad = self._launch(qf, kf, vf, self._S, self._z, out, self._scratch, code=self._c_code, eps=self._eps,
                           check=check, inputs=inp.inputs, normalize=self._norm)
        if bad == RESULT_NOT_FINITE and self._device != "cuda":  # the CPU kernels updated the state in place
            self._result_error(inp.T, inp.work)
        if bad:
            if fixed:
                self._set_rule(None)
            if unfixed:  # nothing absorbed: the device stays open too, as for a refused out
                self._device = None
            if bad == RESULT_NOT_FINITE:  # the GPU state's buffers were not swapped
                raise self._unchanged_error(f"{inp.work} (state {self._dtype})")
            raise_nonfinite(("q", "k", "v")[bad - 1])
        self._position += inp.T
        return self._deliver(self._finish(out, inp, check_finite), given, inp)

    def _entry_point(self, dt, arrays):
        """The compiled single-token kernel for input dtype ``dt``, called without Numba's dispatch;
        the fast path's checks fix every argument type."""
        from numba import typeof

        q, k, v, out = arrays
        sig = tuple(typeof(a) for a in (q, k, v, self._S, self._z, out, self._feat,
                                        self._c_code, self._eps_f, True))
        ep = self._kern1.compile(sig)  # loads from the on-disk cache, or compiles once
        self._entry[dt] = ep
        return ep

    def query(self, q, *, check_finite=True):
        """Read the state for T queries without changing it.

        Position-dependent maps number the queries from :attr:`position` on, like the next tokens.

        Parameters
        ----------
        q : array_like, shape ``(*batch_shape, T, key_dim)``
        check_finite : bool, default True
            Raise ValueError on NaN or inf in ``q``, and
            :class:`~linattn_nb.NonFiniteResult` when a host result of finite queries is
            not finite (the state is unchanged either way).

        Returns
        -------
        ndarray, shape ``(*batch_shape, T, value_dim)``
            ``phi(q)^T S / max(phi(q)^T z, eps)`` in the input dtype
            (``phi(q)^T S`` with ``normalize=False``).  No decay applies: the
            queries read the state as the last absorbed token left it.

        Raises
        ------
        TypeError
            ``check_finite`` not True or False.
        NonFiniteResult
            An output that overflows the queries' dtype (pass float64 queries to read it), a
            normaliser of 0 with ``eps=None``, or a state that holds inf or NaN.

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState
        >>> st = LinearAttentionState(2, 2)
        >>> st.prefill(np.zeros((1, 2)), np.array([[1.0, 2.0]]))
        >>> st.query(np.zeros((1, 2))).tolist(), st.position
        ([[1.0, 2.0]], 1)
        """
        check_finite = V.check_bool("check_finite", check_finite)
        inp = self._prepare([("q", q, self._d)], check_finite)
        (qf,) = self._on_state_device(inp)
        out = self._new_out(inp.T, inp.work)
        check = bool(check_finite and self._code is not None)
        bad = self._launch.query(qf, self._S, self._z, out, self._scratch, code=self._c_code, eps=self._eps,
                                 check=check, normalize=self._norm)
        if bad == RESULT_NOT_FINITE:  # a GPU query's own check
            raise self._unchanged_error(f"{inp.work} (state {self._dtype})")
        if bad:
            raise_nonfinite("q")
        res = self._finish(out, inp, check_finite)
        if check_finite and isinstance(res, np.ndarray) and not np.isfinite(res).all():
            raise NonFiniteResult(f"the outputs of these finite queries are not finite in {res.dtype}: they overflow "
                                  f"it or the {self._dtype} state's sums ({self._wider_hint('queries')}), or a "
                                  "normaliser is 0 with eps=None, or the state holds inf or NaN; the state is "
                                  "unchanged")
        return res

    def prefill(self, k, v, *, decay=None, log_decay=None, beta=None, check_finite=True):
        """Absorb a prompt: afterwards the state equals the causal kernels' final state.

        Parameters
        ----------
        k : array_like, shape ``(*batch_shape, T, key_dim)``
        v : array_like, shape ``(*batch_shape, T, value_dim)``
        decay, log_decay, beta : float or array_like, optional
            The forms of :func:`linattn_nb.linear_attention` with N = T (per head, per token, or
            per feature for a decay).  None of them: the additive rule.
        check_finite : bool, default True
            Raise ValueError (state untouched) on NaN or inf, and
            :class:`~linattn_nb.NonFiniteResult` (the tokens absorbed) when a host state
            overflows its dtype on finite inputs.

        Raises
        ------
        ValueError
            As :meth:`step`.
        TypeError
            As :meth:`step`.
        NonFiniteResult
            As :meth:`step`: a state that overflowed.

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState, linear_attention
        >>> rng = np.random.default_rng(1)
        >>> k, v = rng.normal(size=(2, 50, 4))
        >>> st = LinearAttentionState(4, 4)
        >>> st.prefill(k, v)
        >>> _, ref = linear_attention(k, k, v, causal=True, return_state=True)
        >>> bool(np.allclose(st.S, ref.S)), bool(np.allclose(st.z, ref.z)), st.position
        (True, True, 50)
        """
        check_finite = V.check_bool("check_finite", check_finite)
        unfixed = self._device is None
        inp = self._prepare([("k", k, self._d), ("v", v, self._m)], check_finite, decay, log_decay, beta,
                            step=False)
        fixed = self._absorb_rule(inp)
        if inp.T == 0:
            return
        kf, vf = self._on_state_device(inp)
        check = bool(check_finite)  # as step's (a NumPy-side map's features are finite here)
        bad = self._launch.prefill(kf, vf, self._S, self._z, self._scratch, code=self._c_code, check=check,
                                   inputs=inp.inputs)
        if bad:
            if fixed:
                self._set_rule(None)
            if unfixed:  # nothing absorbed: the device stays open too
                self._device = None
            if bad == RESULT_NOT_FINITE:  # the GPU state's buffers were not swapped
                raise self._unchanged_error(f"the state's {self._dtype}")
            raise_nonfinite(("k", "v")[bad - 1])
        self._position += inp.T
        err = self._state_error(inp.T) if check_finite else None
        if err is not None:
            raise err

    def reset(self) -> None:
        """Back to the zero state at position 0 (device, buffers and the rule kept)."""
        self._launch.put(self._S, self._z, None, None)  # zeroed where the state lives (no host copy to a GPU)
        self._position = 0

    def copy(self) -> "LinearAttentionState":
        """An independent copy (same device)."""
        new = object.__new__(type(self))
        new._init_fields(self._d, self._m, self._f, self._bs, self._fmap, self._dtype, self._eps, self._rule,
                         self._normalize_arg)
        new._position = self._position
        new._device = self._device
        new._attach(self._launch.device)
        S, z = self._launch.view(self._S, self._z)
        new._launch.put(new._S, new._z, S, z)
        return new

    def __copy__(self) -> "LinearAttentionState":
        # a shallow copy would share the buffers the step kernels write in place
        return self.copy()

    def __reduce__(self):
        # the launcher is a closure, which pickle cannot write: the state travels as its host arrays and
        # fields, as save() writes them, and is rebuilt on the same kind of device (needs a GPU for "cuda")
        S, z = self._host_arrays()
        return (_rebuild_state, (type(self), self._d, self._m, self._bs, self._fmap, self._dtype, self._eps,
                                 self._rule, self._normalize_arg, S, z, self._position, self._device or "auto"))

    def to_linear_state(self) -> LinearState:
        """The state as a float64 host :class:`~linattn_nb.LinearState` (for ``initial_state=``).

        Its ``rule`` is the state's (``"additive"`` while no token has fixed it).
        """
        S, z = self._host_arrays()
        return LinearState(np.asarray(S, dtype=np.float64), np.asarray(z, dtype=np.float64), self._position,
                           self._rule or RULE)

    @classmethod
    def from_linear_state(cls, state, key_dim, *, feature_map="elu", dtype=np.float64, device="auto",
                          eps=DEFAULT_EPS, rule=None, normalize=None) -> "LinearAttentionState":
        """Build a state from ``linear_attention(..., return_state=True)``'s result.

        The batch shape and value dimension come from ``state.S``; the feature
        map must be the one that produced it (its ``output_dim(key_dim)`` must
        equal ``S.shape[-2]``).

        Parameters
        ----------
        state : LinearState or tuple (S, z[, position])
            ``position`` (default 0) must be a non-negative integer.  The
            rule a :class:`~linattn_nb.LinearState` records is the new
            state's; a plain tuple records none.
        key_dim : int
        feature_map, dtype, device, eps, normalize
            As for the constructor.
        rule : str, optional
            The rule, for a tuple (None: the first tokens fix it); for a
            LinearState it must be the one it records.

        Raises
        ------
        TypeError
            ``state`` is not a state, or its position is not an integer
            (None, a string).
        ValueError
            Shapes that do not fit the feature map, non-finite values (values
            beyond the range of a float32 ``dtype`` among them), a negative,
            NaN or non-integral position.
        """
        check_device_arg(device)
        S, z, position = FE.parse_state(state, "state")
        rule = check_rule_name(rule)
        recorded = check_rule_name(getattr(state, "rule", None), "state.rule")
        if recorded is not None and rule is not None and rule != recorded:
            raise ValueError(f"state records the {recorded!r} update rule but rule={rule!r} was given; a state "
                             "continues only the rule that made it")
        rule = recorded or rule
        S, z = FE.host_array("state.S", S), FE.host_array("state.z", z)
        if S.ndim < 2:
            raise ValueError(f"state.S must have shape (..., D_phi, M), got {S.shape}")
        new = cls(key_dim, S.shape[-1], batch_shape=S.shape[:-2], feature_map=feature_map, dtype=dtype,
                  device="cpu", eps=eps, rule=rule, normalize=normalize)
        new._load_arrays(S, z, position, "state")
        new._place(device)
        return new

    def _load_arrays(self, S, z, position, what):
        want_S = self._bs + (self._f, self._m)
        want_z = self._bs + (self._f,)
        if tuple(S.shape) != want_S or tuple(z.shape) != want_z:
            raise ValueError(f"{what}: S must have shape {want_S} and z {want_z} (feature map "
                             f"{self._fmap.name!r}, D_phi={self._f}), got {tuple(S.shape)} and {tuple(z.shape)}")
        V.check_float_dtype(f"{what}.S", S.dtype)
        V.check_float_dtype(f"{what}.z", z.dtype)
        for name, x in (("S", S), ("z", z)):  # a state that holds inf or NaN decodes nothing: no switch to skip it
            V.check_finite(f"{what}.{name}", x, "a state is loaded only when every value is finite")
        cast = []
        for name, x in (("S", S), ("z", z)):  # finite float64 values beyond a float32 state's range: no inf stored
            with np.errstate(over="ignore"):
                c = np.asarray(x, dtype=self._dtype)
            if np.dtype(x.dtype).itemsize > self._dtype.itemsize and not np.isfinite(c).all():
                big = float(np.max(np.abs(x)))
                raise ValueError(f"{what}.{name} has {int(c.size - np.isfinite(c).sum())} finite value(s) beyond the "
                                 f"range of the {self._dtype} state (largest magnitude {big:.3g}): it does not fit "
                                 "the chosen dtype, and a state is loaded only when every value is finite in it; use "
                                 "a float64 state (dtype=np.float64)")
            cast.append(c)
        position = FE.check_position(position, f"{what}.position")
        self._launch.put(self._S, self._z, cast[0].reshape((self._B, self._f, self._m)),
                         cast[1].reshape((self._B, self._f)))
        self._position = position

    # -- files ---------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the state to ``path`` (.npz, the format of :mod:`linattn_nb.state.fileformat`).

        Atomic; S and z bit for bit (docs/frontend.md, "State files").  A map that cannot be rebuilt
        from the registry needs ``feature_map=`` to load.

        Examples
        --------
        >>> import os, tempfile
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState
        >>> st = LinearAttentionState(4, 2, batch_shape=(3,), dtype=np.float32)
        >>> st.prefill(np.ones((3, 5, 4)), np.ones((3, 5, 2)))
        >>> path = os.path.join(tempfile.mkdtemp(), "state.npz")
        >>> st.save(path)
        >>> back = LinearAttentionState.load(path)
        >>> back.position, back.dtype, bool(np.array_equal(back.S, st.S))
        (5, dtype('float32'), True)
        """
        S, z = self._host_arrays()
        fileformat.write(path, S=S, z=z, position=self._position, key_dim=self._d, value_dim=self._m,
                         batch_shape=self._bs, eps=self._eps, feature_map=self._fmap, rule=self._rule,
                         normalize=self._normalize_arg)

    @classmethod
    def load(cls, path, *, feature_map=None, device="auto", key_dim=None, value_dim=None, batch_shape=None,
             dtype=None, rule=None) -> "LinearAttentionState":
        """Read a state written by :meth:`save`.

        Parameters
        ----------
        path : str or os.PathLike
        feature_map : str or FeatureMap, optional
            Use this map instead of rebuilding the saved one; it must give the
            saved features on the probe input.
        device : {"auto", "cpu", "cuda"}
        key_dim, value_dim, batch_shape, dtype, rule : optional
            When given, the file must match them (a file whose rule was not
            fixed yet takes ``rule``).

        Returns
        -------
        LinearAttentionState
            With the file's rule and ``normalize`` (format version 1 files: additive).

        Raises
        ------
        StateFileError (a ValueError)
            Not a readable state file (corrupted, truncated, another format version, missing or
            inconsistent entries, non-finite values), a feature map that cannot be rebuilt, or a
            file that does not match the expectations (another update rule included).
        FileNotFoundError
            No file at ``path``.
        """
        check_device_arg(device)
        sf = fileformat.read(path, feature_map=feature_map, key_dim=key_dim, value_dim=value_dim,
                             batch_shape=batch_shape, dtype=dtype, rule=check_rule_name(rule))
        if sf.rule and sf.rule not in rule_names():
            raise fileformat.StateFileError(f"{path}: the state runs the {sf.rule!r} rule of the diagonal-plus-low-rank "
                                            "family: load it with DPLRState.load")
        try:
            new = cls(sf.key_dim, sf.value_dim, batch_shape=sf.batch_shape, feature_map=sf.feature_map,
                      dtype=sf.S.dtype, device="cpu", eps=sf.eps, rule=sf.rule or rule, normalize=sf.normalize)
        except ValueError as exc:  # entries each valid, not together (favor+ with normalize off, ...)
            raise fileformat.StateFileError(f"{path}: inconsistent entries: {exc}") from exc
        new._launch.put(new._S, new._z, sf.S.reshape((new._B, new._f, new._m)), sf.z.reshape((new._B, new._f)))
        new._position = sf.position
        new._place(device)
        return new


def _rebuild_state(cls, d, m, bs, fmap, dtype, eps, rule, normalize, S, z, position, device):
    """A pickled :class:`LinearAttentionState` (its ``__reduce__``)."""
    new = cls(d, m, batch_shape=bs, feature_map=fmap, dtype=dtype, device="cpu", eps=eps, rule=rule,
              normalize=normalize)
    S = np.asarray(S).reshape((new._B, new._f, new._m))
    new._launch.put(new._S, new._z, S, np.asarray(z).reshape((new._B, new._f)))
    new._position = position
    new._place(device)
    return new

