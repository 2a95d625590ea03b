"""Chunk plan, segment prefix and cross-segment combine of the blocked CPU kernels, written once.

When the batch is smaller than the thread count, the chunked causal and the non-causal kernels split
each sequence into segments: the pieces' contributions are summed in parallel from zero states,
combined in order through :func:`linattn_nb.ops._rules.carry` (:func:`segment_states`,
:func:`absorb_parts`), and the segments' outputs computed in parallel from those states.  Design:
``docs/design-cpu.md``, "Chunked causal attention".
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit

from .. import config
from ._rules import carry


def check_chunk_arrays(label: str, arrays, dtype, chunk: int) -> None:
    """Raise ValueError unless each ``(name, array, shape)`` of ``arrays`` is a C-contiguous ``dtype`` array of
    that shape (per-chunk values a forward saves for its backward; ``label`` the argument's name)."""
    for name, x, shape in arrays:
        if not (isinstance(x, np.ndarray) and x.shape == shape and x.dtype == dtype and x.flags.c_contiguous):
            raise ValueError(f"{label}: {name} must be a C-contiguous {dtype} array of shape {shape} (chunk {chunk}), "
                             f"got {getattr(x, 'dtype', type(x).__name__)} {getattr(x, 'shape', '')}")


def segments(batch: int, units: int, *, threads=None, min_units: int = 1, split=None) -> int:
    """Segments per sequence for ``batch`` sequences of ``units`` units each.

    ``ceil(threads / batch)`` segments when the batch is below the thread count (``split`` None;
    at least 2 when True), at most as many as leave ``min_units`` units each; 1 below 2.
    """
    T = int(threads if threads is not None else numba.get_num_threads())
    if split is None:
        split = batch < T
    if not split or batch <= 0 or units <= 0:
        return 1
    P = max(2, -(-T // batch))
    P = min(P, units // max(1, int(min_units)))
    return P if P >= 2 else 1


def plan(batch: int, n: int, *, chunk: int, threads=None, seq_parallel=None):
    """Segments per sequence ``P`` and pass-1 pieces per segment ``sub`` of a chunked causal call.

    Sequences are split when the batch is below the thread count (``seq_parallel=None``) and every
    segment keeps ``config.CPU_CHUNKED_MIN_SEGMENT_CHUNKS`` chunks; the segments before the last are
    summed in ``(P - 1) * sub`` pieces, one per thread at least.
    """
    T = int(threads if threads is not None else numba.get_num_threads())
    nch = -(-n // chunk) if n > 0 else 0
    P = segments(batch, nch, threads=T, min_units=config.CPU_CHUNKED_MIN_SEGMENT_CHUNKS, split=seq_parallel)
    if P == 1:
        return 1, 1
    return P, max(1, -(-T // (batch * (P - 1))))


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def part_range(j, parts, u0, u1):
    """Units [lo, hi) of part ``j`` when units [u0, u1) are split into ``parts`` near-equal parts."""
    return u0 + j * (u1 - u0) // parts, u0 + (j + 1) * (u1 - u0) // parts


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def token_range(lo, hi, unit, n):
    """Tokens [lo * unit, min(hi * unit, n)) of units [lo, hi)."""
    return lo * unit, min(hi * unit, n)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _combine(rule, parts, facs, j0, sub, acc, seg, segf):
    """acc <- the state after the ``sub`` consecutive pieces ``parts[j0:j0 + sub]`` (seg, segf: scratch).

    ``facs[j]`` (G,): piece j's factor of the state before it (G = 0 for the
    additive rule).  The pieces are combined with each other first, in order
    (contributions through the rule's ``carry``, factors multiplied), then
    carried into ``acc`` (for the additive rule: ``acc + (p0 + p1 + ...)``).
    """
    seg[:, :] = parts[j0]
    segf[:] = facs[j0]
    for r in range(1, sub):
        carry(rule, seg, parts[j0 + r], facs[j0 + r])
        for g in range(segf.shape[0]):
            segf[g] *= facs[j0 + r, g]
    carry(rule, acc, seg, segf)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _prefix(rule, parts, facs, sub, Hst):
    """Hst[b, p] for p >= 1 from Hst[b, 0] and the pieces' contributions, ``sub`` pieces per segment."""
    B, P, F, M1 = Hst.shape
    seg = np.empty((F, M1))
    segf = np.empty(facs.shape[2])
    for b in range(B):
        for p in range(1, P):
            Hst[b, p] = Hst[b, p - 1]
            _combine(rule, parts[b], facs[b], (p - 1) * sub, sub, Hst[b, p], seg, segf)


@njit(fastmath=config.FASTMATH, cache=config.CACHE)
def _absorb_all(rule, H, parts, facs):
    B, F, M1 = H.shape
    seg = np.empty((F, M1))
    segf = np.empty(facs.shape[2])
    for b in range(B):
        _combine(rule, parts[b], facs[b], 0, parts.shape[1], H[b], seg, segf)


def _no_factors(parts):
    return np.empty(parts.shape[:2] + (0,))


def segment_states(rule, H, parts, sub: int, nseg: int, factors=None) -> np.ndarray:
    """States at the start of ``nseg`` consecutive segments: ``Hst`` (B, nseg, F, M + 1) float64.

    ``Hst[:, 0] = H`` (B, F, M + 1), the state before the first segment;
    segment ``p`` (p < nseg - 1) contributed the ``sub`` pieces
    ``parts[:, p * sub:(p + 1) * sub]`` (each from a zero state, in order),
    and ``Hst[:, p + 1]`` is the state after it.  ``factors`` (B, pieces, G)
    float64: each piece's factor of the state before it (scalar, G = 1, or
    per row, G = F); None or G = 0 for the additive rule.
    """
    B, F, M1 = H.shape
    Hst = np.empty((B, nseg, F, M1))
    Hst[:, 0] = H
    facs = _no_factors(parts) if factors is None else factors
    _prefix(np.int64(rule), parts, facs, np.int64(sub), Hst)
    return Hst


def absorb_parts(rule, H, parts, factors=None) -> None:
    """H (B, F, M + 1) <- the state after all the pieces ``parts`` (B, P, F, M + 1), in order, in place.

    ``factors``: as for :func:`segment_states` (None for the additive rule).
    """
    _absorb_all(np.int64(rule), H, parts, _no_factors(parts) if factors is None else factors)
