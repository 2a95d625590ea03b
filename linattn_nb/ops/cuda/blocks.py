"""Device functions every thread layout of the sequence kernel calls, inlined into the kernels: the
block's segment and views, the row maps' normalisation, the rescaled tiles (``docs/cuda_kernels.md``)."""
from __future__ import annotations

from numba import cuda, uint32

from .._cuda_common import l2_normalize_row


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _entry_views(q, k, v, out, qs, ks, vs, os_, b1, b2):
    """The 1-d views of q, k, v, out from batch entry (b1, b2)'s first element (element strides
    ``qs`` ...: the entry's first element is ``b1 * s[0] + b2 * s[1]``, in 64 bits)."""
    return (q[b1 * qs[0] + b2 * qs[1]:], k[b1 * ks[0] + b2 * ks[1]:], v[b1 * vs[0] + b2 * vs[1]:],
            out[b1 * os_[0] + b2 * os_[1]:])


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n, state_div, MB, flags):
    """What a sequence-kernel block works on: segment ``blockIdx.x`` is chunk ``c`` of batch entry
    ``b = b1 * B2 + b2`` (``nseg_per_b`` chunks per entry), reads and writes state ``sidx``, and its
    value columns start at ``m0 = blockIdx.y * MB``; the entry's 1-d views (:func:`_entry_views`);
    ``check``: count non-finite q, k, v (``flags`` of shape (3,)), ``cqk``: q and k here (the first
    column block only, so each value counts once).  Returns ``(b, c, sidx, m0, qb, kb, vb, ob, check,
    cqk)``."""
    seg = cuda.blockIdx.x
    b = seg // nseg_per_b
    c = seg - b * nseg_per_b
    b1 = b // b2n
    b2 = b - b1 * b2n
    qb, kb, vb, ob = _entry_views(q, k, v, out, qs, ks, vs, os_, b1, b2)
    check = flags.shape[0] > 1
    return (b, c, seg // state_div, cuda.blockIdx.y * MB, qb, kb, vb, ob, check,
            check and cuda.blockIdx.y == 0)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def normalize_staged_rows(sq, sk, nt, tid, nth, F, update, write_out):
    """The L2 half of the row maps (codes 4 and 5) on a staged tile: one thread per row of
    ``phi(k)`` (``update``) and ``phi(q)`` (``write_out``) of the ``nt`` tokens; the caller
    synchronises after it."""
    for idx in range(tid, 2 * nt, nth):
        t = idx >> 1
        if idx & 1:
            if update:
                l2_normalize_row(sk, t, F)
        elif write_out:
            l2_normalize_row(sq, t, F)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def rescale_tile(sq, sk, sv, sa, sp, nt, tid, nth, fp, mbp, per_row, keys, values, tau, one):
    """The staging side of a rescaled tile (docs/cuda_kernels.md, "Rescaled tiles"), for the whole block.

    Decides with one ``syncthreads_or`` whether every running factor ``P_t`` of the
    ``nt`` tokens stays >= ``tau``; if so scales the staged rows (``phi(q_t)`` by
    ``P_t``; ``phi(k_t)`` or, with ``values``, the value columns by ``1 / P_t``).
    Returns ``(whole, ptile)``: whether the tile is rescaled, and its factor.
    """
    low = 0
    for i in range(tid, fp, nth):
        p = one
        for t in range(nt):
            p *= sa[uint32(t), uint32(i) if per_row else 0]
        if not p >= tau:
            low = 1
    whole = cuda.syncthreads_or(low) == 0
    ptile = one
    if whole:
        for i in range(tid, fp, nth):
            iu = uint32(i)
            p = one
            for t in range(nt):
                tu = uint32(t)
                p *= sa[tu, iu if per_row else 0]
                sq[tu, iu] *= p
                if keys:
                    sk[tu, iu] /= p
            if per_row:
                sp[iu] = p
        if values:
            for jj in range(tid, mbp, nth):
                ju = uint32(jj)
                p = one
                for t in range(nt):
                    tu = uint32(t)
                    p *= sa[tu, 0]
                    sv[tu, ju] /= p
        if not per_row:
            for t in range(nt):
                ptile *= sa[uint32(t), 0]
        cuda.syncthreads()
    return whole, ptile
