"""Launch machinery shared by the CUDA sequence launchers: plan, scan, chunk sums, prefix, outputs.

The causal and non-causal launchers compose these passes; the front end
(:mod:`linattn_nb._cuda_dispatch`) reaches the GPU through this module only
(views, copies, limits, state packing and the pool's re-exported per-call
services).  Design: ``docs/cuda_kernels.md``, "Launch passes".
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import numpy as np
from numba import cuda

from .. import config
from . import _cuda_pool as P
# the pool's per-call services, re-exported for the front end
from ._cuda_pool import count_out_of_range, discard_counts, fill, raise_if_nonfinite, rule_input, workspace, zeros
from .cuda import helpers as HK
from .cuda.plan import (OFF32_LIMIT, SIM, acc_name, helper_grid, owner_fits, seq_config, threads_per_block,
                        tiles_fits)
from .cuda.seq import seq_kernel
from .cuda.views import as_4d, flat_view, is_sim_array, sequence_span, strided_view, vector_bits
from ._codes import RULE_ADDITIVE, RULE_DECAY, RULE_GATED_DELTA, RULES, check_rule_inputs, norm_mode, rule_name
from ._cuda_common import is_delta_rule, rule_factor_rows

_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)
_SMS: dict = {}
#: (F, M, accumulation itemsize, rule) of tile-layout kernels the device refused to launch (too many
#: registers for their threads per block under this toolkit's compiler): planned in row groups from then
#: on (:func:`_run`).
_REFUSED_TILES: set = set()


def multiprocessor_count() -> int:
    """Streaming multiprocessors of the current GPU (1 on the simulator, or without a device)."""
    if SIM:
        return 1
    try:
        dev = cuda.get_current_device()
    except Exception:  # no driver, no device
        return 1
    n = _SMS.get(dev.id)
    if n is None:
        n = _SMS[dev.id] = int(dev.MULTIPROCESSOR_COUNT)
    return n


def seq_layout(segments: int, F: int, M: int, acc_itemsize: int, rule: int = RULE_ADDITIVE, sms=None) -> str:
    """Thread layout ("owner", "rows" or "tiles") of a sequence-kernel launch over ``segments`` segments:
    ``config.CUDA_SEQ_LAYOUT`` as given, or for "auto" by occupancy on ``sms`` multiprocessors (default:
    the current device's) and rule (``docs/cuda_kernels.md``, "Choosing the layout")."""
    setting = str(config.CUDA_SEQ_LAYOUT)
    if setting not in ("auto", "owner", "rows", "tiles"):
        raise ValueError(f"config.CUDA_SEQ_LAYOUT must be 'auto', 'owner', 'rows' or 'tiles', got {setting!r}")
    if setting != "auto":
        return setting
    if is_delta_rule(rule):  # no owner layout; tiles wherever they fit (no per-token sum across threads)
        if not tiles_fits(F, M, acc_itemsize, rule):
            return "rows"
        sms = multiprocessor_count() if sms is None else int(sms)
        return "tiles" if sms > 1 else "rows"
    if not owner_fits(F, M, acc_itemsize, rule):
        return "rows"
    sms = multiprocessor_count() if sms is None else int(sms)
    MB = seq_config(F, M, acc_itemsize, rule)[3]
    blocks = int(segments) * -(-int(M) // MB)
    if sms > 1 and blocks < int(config.CUDA_AUTO_SCAN_BLOCKS_PER_SM) * sms:
        return "tiles" if tiles_fits(F, M, acc_itemsize, rule) else "rows"
    return "owner"


@dataclass(frozen=True)
class SeqPlan:
    """One launch of a sequence launcher: views, sizes, kernel and chunk layout.

    ``q, k, v, out`` are 4-d (B1, B2, N, ·) views; ``B = B1 B2``; ``acc`` the
    accumulation dtype; ``kernel``/``threads``/``col_blocks``/``cfg`` the sequence
    kernel, its threads per block, blocks over value columns and ``(R, C, G, MB, T)``;
    ``chunk``, ``chunks`` tokens per chunk and chunks per sequence (1 for a scan);
    ``lf`` the (B, N, W) log-factors (:func:`rule_factors`); ``flat``/``strides``
    the 1-d views and element strides the kernel receives, ``off32`` whether 32-bit
    offsets suffice, ``vec`` the vector-load bits; ``flags`` the finiteness counters.
    """

    q: object
    k: object
    v: object
    out: object
    B: int
    B2: int
    N: int
    F: int
    M: int
    acc: np.dtype
    kernel: object
    threads: int
    col_blocks: int
    chunk: int
    chunks: int
    rule: int
    lf: object
    flags: object = None
    cfg: tuple = ()
    flat: tuple = ()
    strides: tuple = ()
    off32: bool = True
    vec: int = 0

    @property
    def empty(self) -> bool:
        """No tokens or no batch entries: nothing to launch, the state is unchanged."""
        return self.N == 0 or self.B == 0


_NO_FLAGS: dict = {}


def _no_flags():
    """The (1,) int32 device array passed as ``flags`` without a finiteness check (never written;
    one per device, allocated once)."""
    try:
        key = cuda.get_current_device().id
    except Exception:  # the simulator
        key = None
    arr = _NO_FLAGS.get(key)
    if arr is None:
        arr = _NO_FLAGS[key] = cuda.device_array(1, dtype=np.int32)
    return arr


def raise_nonfinite(p) -> None:
    """After the launches of plan ``p``: read its finiteness counters once (only with a check) and raise
    ValueError naming the first of q, k, v that held NaN or inf.
    """
    if p.flags is None or p.flags.shape[0] < 3:
        return
    P.raise_if_nonfinite()  # one read, with the counts of a packed initial state; zeroes them again


def chunk_length(chunk_size) -> int:
    """Tokens per chunk: ``chunk_size``, or ``config.CUDA_CHUNK_SIZE`` when None."""
    L = int(config.CUDA_CHUNK_SIZE if chunk_size is None else chunk_size)
    if L < 1:
        raise ValueError(f"chunk_size must be >= 1, got {L}")
    return L


def _placeholder(ndim):
    """A float64 device array of shape (1,) * ndim that a kernel receives but never reads."""
    return P.workspace(("launch.placeholder", ndim), (1,) * ndim, _F64)


def rule_factors(rule: int, inputs, B: int, N: int, F: int):
    """The rule's per-token log-factors as a (B, N, W) float64 (or float32) device array, W from
    :func:`linattn_nb.ops._cuda_common.rule_factor_rows` (no factors: a (1, 1, 1) placeholder).  Host
    inputs are copied as float64, device arrays viewed in place (checked by :func:`_checked_input`)."""
    W = rule_factor_rows(rule, F)
    if W == 0:
        return _placeholder(3)
    if is_delta_rule(rule):
        return _delta_inputs(rule, inputs, B, N)
    name = RULES[rule_name(rule)][1][0]
    x = inputs[name]
    want, dims = ((B, N), "(B, N)") if rule == RULE_DECAY else ((B, N, F), "(B, N, F)")
    x = _checked_input(name, x, want, dims)
    if isinstance(x, np.ndarray):
        return cuda.to_device(np.ascontiguousarray(x, dtype=_F64).reshape(B, N, W))
    strides = tuple(int(s) for s in x.strides)
    if len(strides) == 2:
        strides = strides + (np.dtype(x.dtype).itemsize,)
    return strided_view(x, (B, N, W), strides)


def _checked_input(name, x, want, dims):
    """The per-token input ``x`` checked for shape ``want``: a NumPy array as it is, else a device array
    (ValueError for another shape, a dtype other than float32 or float64, or negative strides)."""
    shape = tuple(int(s) for s in x.shape)
    if shape != want:
        raise ValueError(f"inputs[{name!r}] must have shape {dims} = {want}, got {shape}")
    if isinstance(x, np.ndarray):
        return x
    if not (is_sim_array(x) or type(x).__module__.startswith("numba.cuda")):
        x = cuda.as_cuda_array(x)
    if np.dtype(x.dtype) not in (_F32, _F64):
        raise ValueError(f"inputs[{name!r}] must be float32 or float64, got {np.dtype(x.dtype)}")
    if any(int(s) < 0 for s in x.strides):
        raise ValueError(f"inputs[{name!r}]: negative strides are not supported; make a contiguous copy first")
    return x


def _delta_inputs(rule, inputs, B, N):
    """The delta rules' (B, N, 2) float64 device array: column 0 the log-decay (0 for the delta rule),
    column 1 ``beta``; device inputs go into a pooled workspace valid until the thread's next call.
    """
    names = (("log_decay", 0), ("beta", 1)) if rule == RULE_GATED_DELTA else (("beta", 1),)
    xs = [(_checked_input(name, inputs[name], (B, N), "(B, N)"), w) for name, w in names]
    if all(isinstance(x, np.ndarray) for x, _ in xs):
        packed = np.zeros((B, N, 2), dtype=_F64)
        for x, w in xs:
            packed[:, :, w] = x
        return cuda.to_device(packed)
    dst = P.zeros((B, N, 2), _F64, tag="rule.delta_inputs")  # pooled, zeroed on the device
    for x, w in xs:
        if isinstance(x, np.ndarray):
            x = cuda.to_device(np.ascontiguousarray(x, dtype=_F64))
        if x.size:
            HK.pack_column_kernel[helper_grid(x.size)](x, dst, w)
    return dst


def plan(q, k, v, H, out, *, rule=RULE_ADDITIVE, inputs=None, chunk=None, check_finite=False) -> SeqPlan:
    """Check the launcher arguments and lay out the launch (a scan for ``chunk`` None).  ValueError for
    a bad rule or inputs, leading dimensions that cannot be viewed as 4-d, an ``H`` of the wrong shape or
    layout, an unsupported feature dimension; TypeError for an ``H`` that is not float64."""
    rule = check_rule_inputs(rule, inputs)
    views = []
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        x4 = as_4d(x)
        if x4 is None:
            raise ValueError(f"{name}: the leading dimensions of shape {tuple(x.shape)} cannot be merged "
                             "into one batch axis without a copy")
        views.append(x4)
    q4, k4, v4, o4 = views
    B1, B2, N, F = (int(s) for s in q4.shape)
    M = int(v4.shape[3])
    B = B1 * B2
    if np.dtype(H.dtype) != _F64:
        raise TypeError(f"H must be float64, got {np.dtype(H.dtype)}")
    if tuple(int(s) for s in H.shape) != (B, F, M + 1):
        raise ValueError(f"H must have shape (B, F, M + 1) = {(B, F, M + 1)}, got {tuple(H.shape)}")
    if not H.is_c_contiguous():
        raise ValueError("H must be C-contiguous")
    acc = np.dtype(acc_name(q.dtype, k.dtype, v.dtype))
    if chunk is None:
        L, nc = max(N, 1), 1
    else:
        L = chunk_length(chunk)
        nc = max(-(-N // L), 1)
    layout = seq_layout(B * nc, F, M, acc.itemsize, rule)
    if layout == "tiles" and (F, M, acc.itemsize, int(rule)) in _REFUSED_TILES:
        layout = "rows"
    cfg = seq_config(F, M, acc.itemsize, rule, layout)
    R, C, G, MB, T = cfg
    lf = rule_factors(rule, inputs, B, N, F)
    flat = [flat_view(x) for x in views]
    # 32-bit offsets within a sequence when every sequence spans fewer than 2^31 elements (the
    # batch entry's first element is addressed in 64 bits, once per block)
    off32 = bool(config.CUDA_OFFSETS_32) and all(
        sequence_span(x.shape, es) < OFF32_LIMIT for x, (_, es) in zip(views, flat))
    strides = tuple(es for _, es in flat)
    # four elements per vector load where the layout and alignment allow it
    vec = vector_bits(q4, k4, v4, strides, F, M, MB) if config.CUDA_VECTOR_LOADS else 0
    return SeqPlan(q4, k4, v4, o4, B, B2, N, F, M, acc,
                   seq_kernel(R, C, G, MB, T, acc.name, rule, None, off32, vec),
                   threads_per_block(R, C, G, MB, rule), -(-M // MB), L, nc, rule, lf,
                   P.counters() if check_finite and B * N > 0 else _no_flags(), tuple(int(x) for x in cfg),
                   tuple(f for f, _ in flat), strides, off32, vec)


def _run(p: SeqPlan, Hin, Hout, seg_len, nseg_per_b, state_div, code, eps, normalize=True, *,
         read_state, update, write_out, write_state, count=True):
    """One launch of the sequence kernel over ``B * nseg_per_b`` segments x column blocks.

    ``count``: this launch counts the non-finite inputs it stages into
    ``p.flags`` (every input must be counted by exactly one launch).
    """
    args = (*p.flat, *p.strides, p.F, p.M, Hin, Hout, p.lf, p.N, seg_len, nseg_per_b, state_div, p.B2, int(code),
            float(0.0 if eps is None else eps), norm_mode(eps, normalize), read_state, update, write_out,
            write_state, p.flags if count else _no_flags())
    try:
        _launch(p, code, p.B * nseg_per_b, args)
    except Exception as exc:
        fallback = _rows_instead(p, exc)
        if fallback is None:
            raise
        _launch(fallback, code, p.B * nseg_per_b, args)


def _launch(p: SeqPlan, code, segments: int, args) -> None:
    """Launch the sequence kernel of plan ``p`` (specialised on map ``code`` where configured) over
    ``segments`` x its column blocks."""
    kernel = (seq_kernel(*p.cfg, p.acc.name, p.rule, int(code), p.off32, p.vec) if config.CUDA_SPECIALIZE_MAPS
              else p.kernel)
    kernel[(segments, p.col_blocks), p.threads](*args)


def _rows_instead(p: SeqPlan, exc: Exception):
    """The row-group plan to relaunch with when the device refused ``p``'s tile-layout kernel for lack of
    registers (remembered, with one RuntimeWarning), else None: the error is raised as it is.
    """
    if p.cfg[2] != 0 or "OUT_OF_RESOURCES" not in str(exc):
        return None
    key = (p.F, p.M, p.acc.itemsize, int(p.rule))
    first = key not in _REFUSED_TILES
    _REFUSED_TILES.add(key)
    cfg = seq_config(p.F, p.M, p.acc.itemsize, p.rule, "rows")
    MB = cfg[3]
    refused = (f"the GPU refused the tile-layout kernel (rule {rule_name(p.rule)!r}, D_phi={p.F}, M={p.M}, "
               f"{p.acc.name}): too many registers for its {p.threads} threads per block")
    if -(-p.M // MB) != p.col_blocks:
        raise RuntimeError(f"{refused}; later calls use row groups "
                           "(or set linattn_nb.config.CUDA_SEQ_LAYOUT = 'rows')") from exc
    vec = vector_bits(p.q, p.k, p.v, p.strides, p.F, p.M, MB) if config.CUDA_VECTOR_LOADS else 0
    if first:
        warnings.warn(f"{refused} under this toolkit; running it in row groups instead, here and in later "
                      "calls", RuntimeWarning, stacklevel=4)
    return replace(p, kernel=seq_kernel(*cfg, p.acc.name, p.rule, None, p.off32, vec),
                   threads=threads_per_block(*cfg[:4], p.rule), cfg=tuple(int(x) for x in cfg), vec=vec)


def cast_copy(src, dst):
    """dst[...] = src[...] for (n, F, M + 1) device states (any float dtypes); returns dst."""
    HK.cast_copy_kernel[helper_grid(src.size)](src, dst)
    return dst


def _acc_state(p: SeqPlan, n: int, tag: str):
    """A pooled (n, F, M + 1) workspace in the accumulation dtype (:mod:`linattn_nb.ops._cuda_pool`)."""
    return P.workspace(("launch." + tag), (n, p.F, p.M + 1), p.acc)


def scan(p: SeqPlan, H, *, code, eps, normalize=True) -> None:
    """Every sequence from its state ``H[b]`` (updated to the final state), outputs written; float64
    accumulation with one column block runs in place on ``H``, otherwise through a cast copy.
    """
    if p.empty:
        return
    split = p.col_blocks > 1
    if p.acc == _F64 and not split:
        Hin = Hout = H
    else:
        Hin = cast_copy(H, _acc_state(p, p.B, "state_in"))
        Hout = H if p.acc == _F64 else (_acc_state(p, p.B, "state_out") if split else Hin)
    _run(p, Hin, Hout, p.N, 1, 1, code, eps, normalize, read_state=True, update=True, write_out=True,
         write_state=True)
    if Hout is not H:
        cast_copy(Hout, H)


def chunk_sums(p: SeqPlan, *, code, eps, count=False):
    """(B * chunks, F, M + 1) accumulation-dtype array: every chunk's state from zero.  ``count``:
    count the non-finite k, v (the non-causal launcher; the causal one counts them in the outputs pass).
    """
    Hc = _acc_state(p, p.B * p.chunks, "chunk_states")
    _run(p, Hc, Hc, p.chunk, p.chunks, 1, code, eps, read_state=False, update=True, write_out=False,
         write_state=True, count=count)
    return Hc


def chunk_prefix(p: SeqPlan, Hc, H, *, exclusive: bool):
    """Combine the chunk sums ``Hc`` with the initial state ``H`` (float64, per rule); ``H`` becomes the
    final state.  ``exclusive``: returns ``Hc`` replaced by the state before each chunk; otherwise the
    final state in the accumulation dtype (``H`` itself for float64).
    """
    tot = None if exclusive or p.acc == _F64 else _acc_state(p, p.B, "state_total")
    W = rule_factor_rows(p.rule, p.F)
    if W:
        Af = P.workspace("launch.chunk_factors", (p.B * p.chunks, W), _F64)
        HK.chunk_factors_kernel[helper_grid(Af.size)](p.lf, p.chunk, p.chunks, Af)
    else:
        Af = _placeholder(2)
    HK.chunk_scan_states_kernel[helper_grid(p.B * p.F * (p.M + 1))](
        Hc, H, Hc if tot is None else tot, Af, p.chunks, exclusive, tot is not None, p.rule)
    if exclusive:
        return Hc
    return H if tot is None else tot


def chunk_outputs(p: SeqPlan, Hs, *, code, eps, causal: bool, normalize=True) -> None:
    """Every chunk's outputs: from its exclusive prefix ``Hs[b * chunks + c]`` (``causal``), else from the
    final state ``Hs[b]``.
    """
    if causal:
        _run(p, Hs, Hs, p.chunk, p.chunks, 1, code, eps, normalize, read_state=True, update=True,
             write_out=True, write_state=False)
    else:
        _run(p, Hs, Hs, p.chunk, p.chunks, p.chunks, code, eps, normalize, read_state=True, update=False,
             write_out=True, write_state=False)


# ---------------------------------------------------------------------------
# (S, z) <-> H
# ---------------------------------------------------------------------------
def pack_state(S, z, H=None, *, check_finite=False):
    """The launcher state ``H`` = ``[S | z]`` of device arrays ``S`` (B, F, M) and ``z`` (B, F), into ``H``
    when given (C-contiguous float64 (B, F, M + 1)), else a new one; ``check_finite`` counts the NaN/inf
    entries of S and z.  ValueError when the shapes do not match."""
    if len(S.shape) != 3 or tuple(z.shape) != tuple(S.shape[:2]):
        raise ValueError(f"S must be (B, F, M) and z (B, F), got {tuple(S.shape)} and {tuple(z.shape)}")
    B, F, M = (int(s) for s in S.shape)
    if H is None:
        H = cuda.device_array((B, F, M + 1), dtype=_F64)
    elif tuple(H.shape) != (B, F, M + 1):
        raise ValueError(f"H must be (B, F, M + 1) = {(B, F, M + 1)} for S {(B, F, M)}, got {tuple(H.shape)}")
    if H.size:
        HK.state_copy_kernel[helper_grid(H.size)](S, z, H, True)
    if check_finite and B > 0:
        P.count_nonfinite("initial_state.S", view4(H[:, :, :M]))
        P.count_nonfinite("initial_state.z", view4(H[:, :, M]))
    return H


def unpack_state(H, S=None, z=None):
    """Split ``H`` (B, F, M + 1) into ``S`` (B, F, M) and ``z`` (B, F), written into the given device
    arrays or new float64 ones; returns ``(S, z)`` (ValueError when the shapes do not match)."""
    B, F, M1 = (int(s) for s in H.shape)
    if S is None:
        S = cuda.device_array((B, F, M1 - 1), dtype=_F64)
    if z is None:
        z = cuda.device_array((B, F), dtype=_F64)
    if tuple(S.shape) != (B, F, M1 - 1) or tuple(z.shape) != (B, F):
        raise ValueError(f"H {tuple(H.shape)} does not split into S {tuple(S.shape)} and z {tuple(z.shape)}")
    if H.size:
        HK.state_copy_kernel[helper_grid(H.size)](S, z, H, False)
    return S, z


# ---------------------------------------------------------------------------
# What the front end asks: views and copies of device arrays, limits, the scan's fill
# ---------------------------------------------------------------------------
def view4(x):
    """A 4-d view (B1, B2, rows, cols) of a device array of any ndim >= 1 without a copy, or None
    when its leading dimensions cannot be merged (:func:`linattn_nb.ops.cuda.views.as_4d`)."""
    if x.ndim == 1:
        n = int(x.shape[0])
        s = int(x.strides[0])
        return strided_view(x, (1, 1, 1, n), (n * s, n * s, n * s, s))
    return as_4d(x)


def view4_strided(x, shape, strides):
    """:func:`view4` of the view of device array ``x`` (element 0 kept) with ``shape`` and byte
    ``strides`` (0 broadcasts a dimension), or None."""
    return as_4d(strided_view(x, shape, strides))


def copy(src, dst):
    """``dst[...] = src[...]`` on the GPU (equal shapes, any strides and dtypes; leading dimensions
    that cannot be merged are copied 4-d slice by slice); returns ``dst``."""
    if int(np.prod(src.shape, dtype=np.int64)) == 0:
        return dst
    s4, d4 = view4(src), view4(dst)
    if s4 is None or d4 is None:
        for idx in np.ndindex(*src.shape[:-3]):
            copy(src[idx], dst[idx])
        return dst
    HK.copy4d_kernel[helper_grid(s4.size)](s4, d4)
    return dst


def check_limits(f: int, m: int, dtype, rule: int = RULE_ADDITIVE) -> None:
    """Raise ValueError (before any work) when the sequence kernel of rule code ``rule`` has no launch
    configuration for D_phi = ``f``, M = ``m`` and inputs of ``dtype`` (:func:`linattn_nb.ops.cuda.plan.seq_config`)."""
    seq_config(f, m, np.dtype(acc_name(dtype)).itemsize, rule)


def scan_fill(batch: int, f: int, m: int, dtype, rule: int = RULE_ADDITIVE, *, sms: int) -> str:
    """How the scan's blocks (``batch`` x column blocks), in the layout :func:`seq_layout` gives it,
    fill ``sms`` multiprocessors: ``"owner"`` for the owner layout at ``config.CUDA_AUTO_SCAN_BLOCKS_PER_SM``
    blocks per multiprocessor or more, ``"warps"`` for the tile or row-group layout at
    ``config.CUDA_AUTO_SCAN_MIN_WARPS_PER_SM`` warps per multiprocessor or more, ``""`` when they do not."""
    item = np.dtype(acc_name(dtype)).itemsize
    layout = seq_layout(batch, f, m, item, rule, sms=sms)
    R, C, G, MB, T = seq_config(f, m, item, rule, layout)
    blocks = batch * -(-m // MB)
    if layout == "owner" and owner_fits(f, m, item, rule):
        return "owner" if blocks >= int(config.CUDA_AUTO_SCAN_BLOCKS_PER_SM) * sms else ""
    warps = blocks * -(-threads_per_block(R, C, G, MB, rule) // 32)
    return "warps" if warps >= int(config.CUDA_AUTO_SCAN_MIN_WARPS_PER_SM) * sms else ""
