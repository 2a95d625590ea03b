"""CPU backward launchers of the causal sequence methods ``scan`` and ``chunked``.

Design: ``docs/design-cpu.md``, "Backward launchers".
"""
from __future__ import annotations

import numpy as np

from ... import config
from ..._blas import single_threaded_blas
from .._chunks import check_chunk_arrays
from .._codes import KERNEL_CODE_NONE, RULE_ADDITIVE, RULE_DECAY, RULE_DELTA, RULE_GATE, RULE_GATED_DELTA
from .._rules import check_rule, log_factors
from .._twins import pick
from . import Grads
from ._outgrad import times_factor

_WORK = (np.dtype(np.float32), np.dtype(np.float64))


def _alloc(shape, dtype):
    """Output buffers (np.empty: every element is written; tests swap in NaN-filled ones)."""
    return np.empty(shape, dtype)


def _check(qf, kf, v1, H0, g1, dHN):
    """Validate the contract's arrays; return them C-contiguous (no copy when they already are)."""
    if not isinstance(qf, np.ndarray) or qf.ndim != 3:
        raise ValueError(f"qf must be a (B, N, F) array, got {getattr(qf, 'shape', type(qf).__name__)}")
    wt = qf.dtype
    if wt not in _WORK:
        raise ValueError(f"qf must be float32 or float64 (the working dtype), got {wt}")
    B, N, F = qf.shape
    for name, x, shape in (("kf", kf, (B, N, F)), ("v1", v1, (B, N) + tuple(np.shape(v1)[2:3])),
                           ("g1", g1, (B, N) + tuple(np.shape(v1)[2:3]))):
        if not isinstance(x, np.ndarray) or x.ndim != 3 or x.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {getattr(x, 'shape', type(x).__name__)}")
        if x.dtype != wt:
            raise ValueError(f"{name} must have the working dtype {wt} (that of qf), got {x.dtype}")
    M1 = v1.shape[2]
    if M1 < 1:
        raise ValueError("v1 must have at least one column (the normaliser's ones)")
    for name, x in (("H0", H0), ("dHN", dHN)):
        if x is None and name == "dHN":
            continue
        if not isinstance(x, np.ndarray) or x.shape != (B, F, M1) or x.dtype != np.float64:
            desc = f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}"
            raise ValueError(f"{name} must be a float64 array of shape {(B, F, M1)}, got {desc}")
    c = np.ascontiguousarray
    return c(qf), c(kf), c(v1), c(H0), c(g1), (None if dHN is None else c(dHN))


def _outputs(rule, B, N, F, M1, wt):
    dq = _alloc((B, N, F), wt)
    dk = _alloc((B, N, F), wt)
    dv = _alloc((B, N, M1), wt)
    dH0 = _alloc((B, F, M1), np.float64)
    Gd = F if rule == RULE_GATE else (1 if rule in (RULE_DECAY, RULE_GATED_DELTA) else 0)
    dfac = _alloc((B, N, Gd), np.float64)
    delta = rule in (RULE_DELTA, RULE_GATED_DELTA)
    dbeta = _alloc((B, N if delta else 0), np.float64)
    return dq, dk, dv, dH0, dfac, dbeta


def _result(rule, dq, dk, dv, dH0, dfac, dbeta):
    if rule == RULE_GATE:
        fac = dfac
    elif rule in (RULE_DECAY, RULE_GATED_DELTA):
        fac = dfac[:, :, 0]
    else:
        fac = None
    return Grads(dq, dk, dv, dH0, fac, dbeta if rule in (RULE_DELTA, RULE_GATED_DELTA) else None)


def _empty_call(rule, qf, v1, H0, dHN):
    """N == 0: no token, dH0 = dHN (or 0)."""
    B, N, F = qf.shape
    M1 = v1.shape[2]
    wt = qf.dtype
    dq, dk, dv, _, dfac, dbeta = _outputs(rule, B, 0, F, M1, wt)
    dH0 = np.zeros((B, F, M1)) if dHN is None else np.array(dHN, dtype=np.float64)
    return _result(rule, dq, dk, dv, dH0, dfac, dbeta)


def backward_scan(qf, kf, v1, H0, g1, dHN=None, *, inputs=None, rule=RULE_ADDITIVE, checkpoint=None):
    """Gradients of causal linear attention by the checkpointed token recurrence (every rule).

    Parameters
    ----------
    qf, kf, v1, H0, g1, dHN, inputs
        As the backward launcher contract (``docs/launchers.md``).
    rule : int
        Update-rule code (:mod:`linattn_nb.ops._codes`).
    checkpoint : int, optional
        Tokens between stored states; default :func:`linattn_nb.config.cpu_backward_checkpoint`.

    Returns
    -------
    Grads
        ``dq, dk``, ``dv`` in the working dtype; ``dH0``, ``dfactor`` and ``dbeta`` (or None) float64.
    """
    rule = check_rule(rule, inputs)
    qf, kf, v1, H0, g1, dHN = _check(qf, kf, v1, H0, g1, dHN)
    B, N, F = qf.shape
    M1 = v1.shape[2]
    if N == 0 or B == 0:
        return _empty_call(rule, qf, v1, H0, dHN)
    lg = log_factors(rule, inputs, B, N, F)
    L = int(checkpoint if checkpoint is not None else config.cpu_backward_checkpoint(N, F, M1, qf.dtype.itemsize))
    if L < 1:
        raise ValueError(f"checkpoint must be >= 1, got {L}")
    L = min(L, N)
    return _run_scan(rule, qf, kf, v1, H0, g1, dHN, lg, L)


def _run_scan(rule, qf, kf, v1, H0, g1, dHN, lg, L):
    from ._cpu_scan import scan_backward_kernel, scan_backward_kernel_serial

    B, N, F = qf.shape
    M1 = v1.shape[2]
    outs = _outputs(rule, B, N, F, M1, qf.dtype)
    ck = np.empty((B, -(-N // L), F, M1))
    kernel = pick(scan_backward_kernel_serial, scan_backward_kernel, items=B, work=B * N * F * M1,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    kernel(qf, kf, v1, H0, g1, H0 if dHN is None else dHN, dHN is not None, rule, lg, np.int64(L), ck, *outs)
    return _result(rule, *outs)


def backward_chunked(qf, kf, v1, H0, g1, dHN=None, *, inputs=None, rule=RULE_ADDITIVE, chunk=None, saved=None):
    """Gradients of causal linear attention in GEMM-shaped chunks (every rule).

    As :func:`backward_scan`, ``chunk`` (the chunk size; default from :mod:`linattn_nb.config`)
    replacing ``checkpoint``.  The delta rules run the adjoint of the WY/UT chunk form
    (``docs/design-cpu.md``, "Chunked backward"); the decay rule the kernel that keeps a few chunks' states
    (:func:`decay_anchors`), or with ``saved`` (or NaN log-decays) that form without the transform.  ``saved`` (the decay and delta rules: :func:`takes_saved`):
    ``(C, ck, Ys, KKs)`` as a forward :func:`~linattn_nb.ops.causal.chunked.causal_chunked` with ``chunk=C``
    saved them on these features (:func:`save_arrays`); the first pass, which would compute them again, is
    skipped.
    """
    rule = check_rule(rule, inputs)
    qf, kf, v1, H0, g1, dHN = _check(qf, kf, v1, H0, g1, dHN)
    B, N, F = qf.shape
    M1 = v1.shape[2]
    if N == 0 or B == 0:
        return _empty_call(rule, qf, v1, H0, dHN)
    lg = log_factors(rule, inputs, B, N, F)
    delta = rule in (RULE_DELTA, RULE_GATED_DELTA)
    if saved is not None:
        if not takes_saved(rule):
            raise ValueError("saved: only the decay and delta rules' backward takes the forward's saved chunk values")
        return _run_chunked_delta(rule, qf, kf, v1, H0, g1, dHN, lg, int(saved[0]), saved[1:])
    if chunk is None:
        chunk = (config.cpu_backward_delta_chunk(N, F, M1, qf.dtype) if delta else
                 config.cpu_backward_chunk(N, F, M1, qf.dtype))
    C = int(chunk)
    if C < 1:
        raise ValueError(f"chunk must be >= 1, got {C}")
    C = min(C, N)
    if rule == RULE_DECAY:
        anchors = decay_anchors(lg, C)
        if anchors is not None:
            g, _, _, flags = _no_norm(qf.dtype)
            bs = config.cpu_backward_norm_block(C, F, M1, qf.dtype)
            return _run_decay_carry(qf, kf, v1, H0, g, g1, dHN, lg, C, bs, None, flags, _no_maps(qf.dtype), None,
                                    anchors)
    if delta or rule == RULE_DECAY:  # the decay rule (a NaN log-decay, or no anchors): without the WY/UT transform
        return _run_chunked_delta(rule, qf, kf, v1, H0, g1, dHN, lg, C)
    from ._cpu_chunked import chunked_backward_kernel, chunked_backward_kernel_serial

    outs = _outputs(rule, B, N, F, M1, qf.dtype)
    dq, dk, dv, dH0, dfac, _ = outs
    ck = np.empty((B, -(-N // C) if rule != RULE_ADDITIVE else 0, F, M1), qf.dtype)
    kernel = pick(chunked_backward_kernel_serial, chunked_backward_kernel, items=B, work=B * N * F * M1,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    with single_threaded_blas(kernel is chunked_backward_kernel):
        kernel(qf, kf, v1, H0, g1, H0 if dHN is None else dHN, dHN is not None, rule, lg, np.int64(C), ck,
               dq, dk, dv, dH0, dfac, np.empty(0, qf.dtype), *_no_norm(qf.dtype), *_no_maps(qf.dtype), False)
    return _result(rule, *outs)


def _no_norm(wt):
    """The kernels' normalised-mode arguments ``(g, eps, floor, flags)`` for a call that gives ``g1``."""
    return np.empty((1, 0, 0), wt), 0.0, False, np.zeros((1, 2), np.bool_)


def _no_maps(wt):
    """The kernels' map arguments ``(xq, xk, code)`` for a call whose ``dq``, ``dk`` are those of the features."""
    return np.empty((1, 0, 0), wt), np.empty((1, 0, 0), wt), np.int64(0)


def _map_args(maps, B, N, F, wt):
    """``maps`` of :func:`backward_chunked_normalized` as the kernels' ``(xq, xk, code)``, checked."""
    if maps is None:
        return _no_maps(wt)
    from ._maps import ELEMENTWISE_CODES

    if not isinstance(maps, tuple) or len(maps) != 3:
        raise ValueError("maps must be a tuple (xq, xk, code)")
    xq, xk, code = maps
    codes = ELEMENTWISE_CODES + (KERNEL_CODE_NONE,)
    if int(code) not in codes:
        raise ValueError(f"maps: code must be one of the elementwise map codes {codes}, got {code}")
    for name, x in (("xq", xq), ("xk", xk)):
        if not isinstance(x, np.ndarray) or x.shape != (B, N, F) or x.dtype != wt:
            desc = f"{getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}"
            raise ValueError(f"maps: {name} must be a {wt} array of shape {(B, N, F)}, got {desc}")
    return np.ascontiguousarray(xq), np.ascontiguousarray(xk), np.int64(code)


def _run_chunked_gate_norm(qf, kf, v1, H0, g, g1, dHN, lg, C, eps, maps, log_grad, empty=None):
    """The gate rule's normalised outputs through :func:`backward_chunked`'s kernel, its first pass writing
    ``g1`` (see :func:`backward_chunked_normalized`; ``empty`` as there).  Returns ``(Grads, g_finite,
    results_finite)``."""
    from ._cpu_chunked import chunked_backward_kernel, chunked_backward_kernel_serial

    B, N, F = qf.shape
    M1 = v1.shape[2]
    outs = _outputs(RULE_GATE, B, N, F, M1, qf.dtype)
    dq, dk, dv, dH0, dfac, _ = outs
    ck = _empty(empty)("ck", (B, -(-N // C), F, M1), qf.dtype)
    flags = np.zeros((B, 2), np.bool_)
    kernel = pick(chunked_backward_kernel_serial, chunked_backward_kernel, items=B, work=B * N * F * M1,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    with single_threaded_blas(kernel is chunked_backward_kernel):
        kernel(qf, kf, v1, H0, g1, H0 if dHN is None else dHN, dHN is not None, RULE_GATE, lg, np.int64(C), ck,
               dq, dk, dv, dH0, dfac, np.empty(0, qf.dtype), g, float(eps if eps is not None else 0.0),
               eps is not None, flags, *maps, bool(log_grad))
    return _result(RULE_GATE, *outs), not flags[:, 0].any(), not flags[:, 1].any()


def takes_saved(rule) -> bool:
    """Whether :func:`backward_chunked` of rule code ``rule`` takes a forward's saved chunk values: the decay
    and delta rules, whose kernel starts with a pass that computes them (the additive rule's kernel sums its
    states in the pass that also needs them; the gate rule's keeps checkpoints of its own)."""
    return int(rule) in (RULE_DECAY, RULE_DELTA, RULE_GATED_DELTA)


def keeps_values(rule) -> bool:
    """Whether the saved chunk values of rule code ``rule`` include residuals and ``K K^T`` (the delta rules)."""
    return int(rule) in (RULE_DELTA, RULE_GATED_DELTA)


def fuses_normalized(rule) -> bool:
    """Whether rule code ``rule`` has :func:`backward_chunked_normalized` (the additive, decay and gate
    rules)."""
    return int(rule) in (RULE_ADDITIVE, RULE_DECAY, RULE_GATE)


def norm_row_blocks(rule) -> bool:
    """Whether :func:`backward_chunked_normalized` of rule code ``rule`` runs its chunks in row blocks, i.e. takes
    both ``chunk`` and ``block`` (the additive and decay rules; the gate rule's takes the chunk only)."""
    return int(rule) in (RULE_ADDITIVE, RULE_DECAY)


def _fresh(name, shape, dtype):
    return np.empty(shape, dtype)


def _empty(empty):
    """``empty(name, shape, dtype)`` of a caller that keeps its own work arrays, else fresh ones."""
    return _fresh if empty is None else empty


def save_arrays(rule, B, N, F, M1, dtype, chunk=None, empty=None):
    """``(C, ck, Ys, KKs)``: empty arrays for a forward of rule code ``rule`` (:func:`takes_saved`) to save its
    chunk values into (``save=`` of :func:`~linattn_nb.ops.causal.chunked.causal_chunked`, ``saved=`` of
    :func:`backward_chunked`), at the backward's chunk size (``chunk`` or the config's): the chunk-start
    states, and for the delta rules each chunk's residuals and ``K K^T`` (the decay rule: ``Ys``, ``KKs``
    with no rows); ``empty(name, shape, dtype)`` makes them (default ``np.empty``)."""
    if not takes_saved(rule):
        raise ValueError(f"rule: code {rule} has no saved chunk values (takes_saved)")
    delta = keeps_values(rule)
    C = int(chunk if chunk is not None else (config.cpu_backward_delta_chunk(N, F, M1, dtype) if delta
                                             else config.cpu_backward_chunk(N, F, M1, dtype)))
    C = max(1, min(C, max(int(N), 1)))
    P = -(-int(N) // C)
    Cw = C if delta else 0
    wt = np.dtype(dtype)
    empty = _empty(empty)
    return C, empty("ck", (B, P, F, M1), wt), empty("Ys", (B, P, Cw, M1), wt), empty("KKs", (B, P, Cw, Cw), wt)


def _run_chunked_delta(rule, qf, kf, v1, H0, g1, dHN, lg, C, have=None, norm=None, maps=None, empty=None):
    """``norm``: ``(g, eps, flags)`` for the decay rule's normalised outputs (``g1`` then receives
    ``dL/d[num | den]``; see :func:`backward_chunked_normalized`); ``maps`` the kernels' ``(xq, xk, code)``
    (:func:`_map_args`, normalised outputs only); ``empty`` makes the chunk values' arrays where ``have`` is
    None (as :func:`save_arrays`'s)."""
    from ._cpu_chunked_delta import delta_backward_kernel, delta_backward_kernel_serial

    B, N, F = qf.shape
    M1 = v1.shape[2]
    if norm is None:
        norm = (np.empty((1, 0, 0), qf.dtype), None, np.zeros((1, 2), np.bool_))
    g, eps, flags = norm
    outs = _outputs(rule, B, N, F, M1, qf.dtype)
    P = -(-N // C)
    wt = qf.dtype
    Cw = C if keeps_values(rule) else 0  # the decay rule keeps no residuals or K K^T
    if have is None:
        make = _empty(empty)
        ck, Ys, KKs = make("ck", (B, P, F, M1), wt), make("Ys", (B, P, Cw, M1), wt), make("KKs", (B, P, Cw, Cw), wt)
    else:
        ck, Ys, KKs = have
        check_chunk_arrays("saved", (("ck", ck, (B, P, F, M1)), ("Ys", Ys, (B, P, Cw, M1)),
                                     ("KKs", KKs, (B, P, Cw, Cw))), wt, C)
    kernel = pick(delta_backward_kernel_serial, delta_backward_kernel, items=B, work=B * N * F * M1,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    with single_threaded_blas(kernel is delta_backward_kernel):
        kernel(qf, kf, v1, H0, g1, H0 if dHN is None else dHN, dHN is not None, rule, lg, np.int64(C), ck,
               Ys, KKs, have is not None, *outs, np.empty(0, wt), g, float(eps if eps is not None else 0.0),
               eps is not None, flags, *(maps if maps is not None else _no_maps(wt)))
    return _result(rule, *outs)


def decay_anchors(lg, C):
    """The chunks whose start state the decay rule's normalised backward keeps
    (:mod:`linattn_nb.ops.grad._cpu_chunked_decay`), for log-decays ``lg`` (B, N, 1) in chunks of ``C``:
    ``(slot, count)``, ``slot`` (B, ceil(N / C)) int64 the chunk's place in the kept states or -1, ``count``
    the most any sequence keeps.  Kept: every :data:`linattn_nb.config.BACKWARD_DECAY_ANCHOR`-th chunk from
    the first, and every chunk whose product of decays is below
    :data:`linattn_nb.config.BACKWARD_DECAY_CARRY_MIN` (a reset included).  None where that kernel does not
    run: ``BACKWARD_DECAY_ANCHOR`` 0, or a NaN log-decay (the kernel that keeps every chunk's state takes
    it)."""
    K = int(config.BACKWARD_DECAY_ANCHOR)
    B, N = lg.shape[:2]
    if K < 1 or np.isnan(lg).any():
        return None
    P = -(-N // C)
    keep = np.zeros((B, P), bool)
    keep[:, ::K] = True
    if N:
        sums = np.add.reduceat(lg[:, :, 0], np.arange(0, N, C), axis=1)
        floor = max(float(config.BACKWARD_DECAY_CARRY_MIN), np.finfo(np.float64).tiny)  # a reset: always kept
        keep |= ~(sums >= np.log(floor))
    slot = np.cumsum(keep, axis=1, dtype=np.int64) - 1
    slot[~keep] = -1
    return slot, int(keep.sum(axis=1).max(initial=0))


def _norm_chunk(chunk, N, F, M1, wt):
    """The chunk size of the fused normalised kernels (``chunk`` or the config's), checked, at most ``N``."""
    C = int(chunk if chunk is not None else config.cpu_backward_norm_chunk(N, F, M1, wt))
    if C < 1:
        raise ValueError(f"chunk must be >= 1, got {C}")
    return min(C, N)


def _norm_block(block, C, F, M1, wt):
    """The row block of their intra-chunk products (``block`` or the config's), checked, at most ``C``."""
    bs = int(block if block is not None else config.cpu_backward_norm_block(C, F, M1, wt))
    if bs < 1:
        raise ValueError(f"block must be >= 1, got {bs}")
    return min(bs, C)


def _run_decay_carry(qf, kf, v1, H0, g, g1, dHN, lg, C, bs, eps, flags, maps, empty, anchors):
    """The decay rule's normalised backward that keeps the states of the chunks :func:`decay_anchors` names
    (``anchors`` its result; other arguments as :func:`backward_chunked_normalized`'s, checked; ``maps`` from
    :func:`_map_args`)."""
    from ._cpu_chunked_decay import decay_backward_kernel, decay_backward_kernel_serial

    B, N, F = qf.shape
    M1 = v1.shape[2]
    wt = qf.dtype
    slot, count = anchors
    kept = _empty(empty)("anchors", (B, count, F, M1), wt)
    dq, dk, dv, dH0, dfac, dbeta = _outputs(RULE_DECAY, B, N, F, M1, wt)
    kernel = pick(decay_backward_kernel_serial, decay_backward_kernel, items=B, work=B * N * F * M1,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    with single_threaded_blas(kernel is decay_backward_kernel):
        kernel(qf, kf, v1, g, H0, H0 if dHN is None else dHN, dHN is not None, lg, np.int64(C), np.int64(bs),
               kept, slot, float(eps) if eps is not None else 0.0, eps is not None, g1, dq, dk, dv, dH0, dfac,
               flags, *maps, np.empty(0, wt))
    return _result(RULE_DECAY, dq, dk, dv, dH0, dfac, dbeta)


def backward_chunked_normalized(qf, kf, v1, H0, g, dHN=None, *, eps=None, chunk=None, block=None, g1=None,
                                rule=RULE_ADDITIVE, inputs=None, maps=None, log_grad=False, empty=None):
    """Gradients of normalised causal attention (the additive, decay and gate rules) from ``g = dL/dout``, no
    forward run.

    Where :func:`backward_chunked` takes ``g1 = dL/d[num | den]``, which needs the forward's outputs
    and normalisers, this kernel computes each row's normaliser ``den = A 1 + φ(q) z`` and
    ``g . num = Σ A ⊙ (G Vᵀ) + Σ φ(Q) ⊙ (G Sᵀ)`` from products its own first pass needs anyway
    (``docs/design-cpu.md``, "Chunked backward of normalised outputs").

    Parameters
    ----------
    qf, kf, v1, H0, dHN
        As the backward launcher contract (``docs/launchers.md``).
    g : ndarray
        (B, N, M) gradient of the normalised outputs, in the working dtype.
    eps : float, optional
        The normaliser's floor (``den' = den`` where ``den > eps``, else ``eps`` with no gradient to
        ``den``); None: no floor.
    chunk, block : int, optional
        Chunk size and the row block of its intra-chunk products (default from :mod:`linattn_nb.config`,
        the same for the additive and decay rules; the gate rule: its chunk of :func:`backward_chunked`, no
        row blocks; the decay rule's kernel that keeps every state: that chunk too).
    g1 : ndarray, optional
        (B, N, M + 1) array of the working dtype that receives ``dL/d[num | den]`` (default a new one).
    rule, inputs
        :data:`~linattn_nb.ops._codes.RULE_ADDITIVE`, ``RULE_DECAY`` or ``RULE_GATE`` (their ``inputs`` as
        :func:`backward_chunked`'s); the decay rule runs the kernel that keeps a few chunks' states
        (:func:`decay_anchors`; NaN log-decays: the one that keeps every chunk's state and writes ``g1`` in
        its reverse pass).
    maps : tuple, optional
        ``(xq, xk, code)``: the inputs (B, N, F) of the working dtype of an elementwise feature map ``code``
        (:data:`linattn_nb.ops.grad._maps.ELEMENTWISE_CODES`) whose outputs are ``qf``, ``kf``; read only
        for a map not in :data:`~linattn_nb.ops.grad._maps.FROM_FEATURES` (others: any such arrays).  The kernel
        then passes each chunk's complete rows of ``dq`` and ``dk`` through the map's VJP (the per-element
        product of :func:`linattn_nb.ops.grad._maps.vjp`, the same results) and the returned ``dq``, ``dk``
        are the gradients of ``xq``, ``xk``; ``results_finite`` then also says whether every stored
        ``dq``, ``dk`` and ``dv[..., :M]`` element is finite.  No pass over them of their own.  Code
        ``KERNEL_CODE_NONE`` (0): features given as they are, whose gradients pass through (the check alone).
    log_grad : bool, optional
        The decay and gate rules: the returned factor gradient is that of the log-factors,
        ``d/d log a = a dL/da`` (0 at a reset), instead of the factors'.  The gate rule's kernel multiplies
        each chunk's rows once complete, while its factors are at hand (the same values as
        :func:`~linattn_nb.ops.grad._outgrad.times_factor` on the result, without its pass over it).
    empty : callable, optional
        The decay and gate rules: ``empty(name, shape, dtype)`` makes the kernel's array of chunk-start
        states (``name`` "ck", never returned; as :func:`save_arrays`'s), e.g. from a caller's per-thread work
        arrays, whose pages are then not new on every call (default: a fresh array).

    Returns
    -------
    (Grads, g_finite, results_finite)
        The rule's :class:`~linattn_nb.ops.grad.Grads`; whether every element of ``g`` is
        finite (False for a NaN or inf, and possibly where a sum of large finite elements overflows:
        check ``g`` itself before reporting it); whether every normaliser, ``g . num`` and the final
        state is, in the working dtype (False: the working dtype overflowed, or an input was not
        finite).
    """
    if not fuses_normalized(rule):
        raise ValueError(f"rule: the fused normalised backward takes the additive, decay and gate rules, got code "
                         f"{rule}")
    rule = check_rule(rule, inputs)
    qf, kf, v1, H0, _, dHN = _check(qf, kf, v1, H0, v1, dHN)
    B, N, F = qf.shape
    M1 = v1.shape[2]
    wt = qf.dtype
    if not isinstance(g, np.ndarray) or g.shape != (B, N, M1 - 1):
        raise ValueError(f"g must have shape {(B, N, M1 - 1)}, got {getattr(g, 'shape', type(g).__name__)}")
    if g.dtype != wt:
        raise ValueError(f"g must have the working dtype {wt} (that of qf), got {g.dtype}")
    g = np.ascontiguousarray(g)
    if g1 is None:
        g1 = np.empty((B, N, M1), wt)
    elif g1.shape != (B, N, M1) or g1.dtype != wt or not g1.flags.c_contiguous:
        raise ValueError(f"g1 must be a C-contiguous {wt} array of shape {(B, N, M1)}")
    margs = _map_args(maps, B, N, F, wt)
    if N == 0 or B == 0:
        return _empty_call(rule, qf, v1, H0, dHN), True, True
    floor = eps is not None
    if rule == RULE_GATE:
        lg = log_factors(rule, inputs, B, N, F)
        C = int(chunk if chunk is not None else config.cpu_backward_chunk(N, F, M1, wt))
        if C < 1:
            raise ValueError(f"chunk must be >= 1, got {C}")
        return _run_chunked_gate_norm(qf, kf, v1, H0, g, g1, dHN, lg, min(C, N), eps, margs, log_grad, empty)
    if rule == RULE_DECAY:
        lg = log_factors(rule, inputs, B, N, F)
        # the kernel that carries the pairs: the additive kernel's chunk and row block (its intra-chunk
        # products are the same); the one that keeps every state: backward_chunked's chunk
        C = _norm_chunk(chunk, N, F, M1, wt)
        bs = _norm_block(block, C, F, M1, wt)
        flags = np.zeros((B, 2), np.bool_)
        anchors = decay_anchors(lg, C)
        if anchors is not None:
            grads = _run_decay_carry(qf, kf, v1, H0, g, g1, dHN, lg, C, bs, eps, flags, margs, empty, anchors)
        else:
            C = min(int(chunk if chunk is not None else config.cpu_backward_chunk(N, F, M1, wt)), N)
            grads = _run_chunked_delta(rule, qf, kf, v1, H0, g1, dHN, lg, C, norm=(g, eps, flags), maps=margs,
                                       empty=empty)
        if log_grad:  # one factor a token: a pass of its own costs little
            times_factor(grads.dfactor, lg[:, :, 0])
        return grads, not flags[:, 0].any(), not flags[:, 1].any()
    C = _norm_chunk(chunk, N, F, M1, wt)
    bs = _norm_block(block, C, F, M1, wt)
    from ._cpu_chunked_norm import normalized_backward_kernel, normalized_backward_kernel_serial

    dq, dk, dv, dH0, dfac, dbeta = _outputs(RULE_ADDITIVE, B, N, F, M1, wt)
    flags = np.zeros((B, 2), np.bool_)
    kernel = pick(normalized_backward_kernel_serial, normalized_backward_kernel, items=B, work=B * N * F * M1,
                  limit="CPU_CHUNKED_SERIAL_MAX_WORK")
    with single_threaded_blas(kernel is normalized_backward_kernel):
        kernel(qf, kf, v1, g, H0, H0 if dHN is None else dHN, dHN is not None, float(eps) if floor else 0.0,
               floor, np.int64(C), np.int64(bs), g1, dq, dk, dv, dH0, flags, *margs, np.empty(0, wt))
    grads = _result(RULE_ADDITIVE, dq, dk, dv, dH0, dfac, dbeta)
    return grads, not flags[:, 0].any(), not flags[:, 1].any()
