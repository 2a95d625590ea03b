"""The row-group layout of the sequence kernel (``G > 1``, and the delta rules where the tiles do not fit).

Each thread keeps an ``R x C`` tile of the state; see ``docs/cuda_kernels.md``, "Thread
layouts" and "Delta rules in the row-group layout".
"""
from __future__ import annotations

import math

from numba import cuda, uint32, uint64

from .._codes import NORM_FLOOR, NORM_NONE, RULE_GATE, RULE_GATED_DELTA
from .._cuda_common import fill4, is_delta_rule, is_row_map, rule_factor_rows, stage, stage4
from .blocks import block_segment, normalize_staged_rows, rescale_tile
from .plan import ACC_TYPES, CACHE, RESCALE_MIN_F32, RESCALE_MIN_F64, VEC_QK, VEC_V


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _update_read(st, w, ac, sk, sq, t, row0, R, C):
    """One token on a row-group thread's R x C register tile ``st``: ``S += phi(k_t) w^T`` over its
    rows, and ``ac[j] += phi(q_t)^T S[:, j]`` with the updated elements (``w``: the staged values of
    its C columns, or the delta rules' corrections).  Inlined with compile-time R, C: the loops unroll
    and the tile stays in registers."""
    for r in range(R):
        kr = sk[t, row0 + r]
        qr = sq[t, row0 + r]
        for j in range(C):
            s = st[r * C + j] + kr * w[j]
            st[r * C + j] = s
            ac[j] += qr * s


def rows_kernel(R, C, G, MB, T, acc, rule, code, off32, vec):
    """The row-group layout (``G`` groups of ``R`` rows, ``C`` columns a thread; the delta rules' sums of
    ``k^T H`` across the groups by warp shuffles or in shared memory): :func:`.seq.seq_kernel` makes it."""
    acc_t = ACC_TYPES[acc]
    IDX = uint32 if off32 else uint64  # element offsets within a sequence (docs/cuda_kernels.md)
    VQK = bool(vec & VEC_QK)  # q, k: four features per vector load (docs/cuda_kernels.md)
    VV = bool(vec & VEC_V)  # v: four columns per vector load
    MAP = -1 if code is None else code  # the feature map, when specialised
    FP = G * R  # padded feature rows
    MBP = -(-(MB + 1) // C) * C  # value columns + normaliser column, padded
    NCG = MBP // C  # column groups
    NTH = G * NCG  # threads per block
    RC = R * C
    zero = acc_t(0.0)
    one = acc_t(1.0)
    # per-token factors (compile-time): none (additive: sa is one unused
    # element), one per token (decay) or one per feature row (gate)
    FACTORS = rule_factor_rows(rule, FP) > 0
    PER_ROW = rule == RULE_GATE
    # delta rules: per token the factor (gated delta; 1 for the delta rule)
    # and the write strength beta, and a double buffer of the partial sums
    # k^T H[:, m] of the G row groups (the reduction before the update)
    DELTA = is_delta_rule(rule)
    GATED = rule == RULE_GATED_DELTA
    SAT = T if FACTORS else 1
    SAW = FP if PER_ROW else (2 if DELTA else 1)
    SPW = FP if PER_ROW else 1
    # delta rules with G a power of two up to 32: the G row groups of a column are G adjacent lanes
    # of one warp, and k^T H[:, m] is summed by log2(G) xor-shuffles, with no barrier per token
    WARP_SUM = DELTA and G <= 32 and (G & (G - 1)) == 0
    LOG2G = G.bit_length() - 1
    PU = (2, G, MBP) if DELTA and not WARP_SUM else (1, 1, 1)
    # decay and gate: rescaled tiles as in the owner layout (docs/cuda_kernels.md); the gated delta
    # rule rescales its tiles too (q_t P_t and v_t / P_t: the delta rule's step on them)
    RESCALE = FACTORS and not DELTA
    TAU = acc_t(RESCALE_MIN_F32 if acc == "float32" else RESCALE_MIN_F64)
    FPV = -(-FP // 4)  # groups of four feature rows
    MBV = -(-MBP // 4)  # groups of four columns

    @cuda.jit(cache=CACHE)
    def kernel(q, k, v, out, qs, ks, vs, os_, nf, nm, H, Hout, lf, n, seg_len, nseg_per_b, state_div, b2n,
               code, eps, norm, read_state, update, write_out, write_state, flags):
        sq = cuda.shared.array((T, FP), acc_t)
        sk = cuda.shared.array((T, FP), acc_t)
        sv = cuda.shared.array((T, MBP), acc_t)
        sa = cuda.shared.array((SAT, SAW), acc_t)  # the tokens' factors exp(log-factor)
        part = cuda.shared.array((T, G, MBP), acc_t)
        sden = cuda.shared.array(T, acc_t)  # the normaliser of every token of the tile
        pu = cuda.shared.array(PU, acc_t)  # delta rules: partial k^T H per (token parity, row group, column)
        sp = cuda.shared.array(SPW, acc_t)  # a rescaled tile's factor of each state row (the gate)
        st = cuda.local.array(RC, acc_t)  # st[r * C + j]: row row0 + r, column c0 + j
        vt = cuda.local.array(C, acc_t)
        ac = cuda.local.array(C, acc_t)
        ut = cuda.local.array(C, acc_t)  # delta rules: k^T H, then the correction, per column

        cd = code if MAP < 0 else MAP  # a specialised kernel's map is a constant: its branches fold
        F = nf
        M = nm
        tid = cuda.threadIdx.x
        if WARP_SUM:  # row group fastest: a column's G groups share a warp
            tg = tid % G
            c0 = (tid // G) * C
        else:
            tg = tid // NCG
            c0 = (tid - tg * NCG) * C
        # the lanes of this thread's warp that exist (the last warp of the block may be partial)
        nlanes = min(32, NTH - (tid // 32) * 32)
        lanes = uint32(0xFFFFFFFF) if nlanes == 32 else uint32((1 << nlanes) - 1)
        # the batch entry's sequences from their first element (64-bit, once per block), then
        # element offsets of IDX within them: token x token stride + column x column stride
        b, c, sidx, m0, qb, kb, vb, ob, check, cqk = block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n,
                                                                    state_div, MB, flags)
        qn, qf, kn, kf = IDX(qs[2]), IDX(qs[3]), IDX(ks[2]), IDX(ks[3])
        vn, vf, on, of = IDX(vs[2]), IDX(vs[3]), IDX(os_[2]), IDX(os_[3])
        row0 = uint32(tg * R)  # unsigned: no wraparound, and the compiler sees its alignment
        Fu = uint32(F)
        Mu = uint32(M)
        m0u = uint32(m0)
        epsa = acc_t(eps)

        # block column j < MB is value column m0 + j, j == MB the normaliser
        # (state column M), j > MB padding
        for j in range(C):
            jj = c0 + j
            col = M if jj == MB else m0 + jj
            ok = read_state and (jj == MB or (jj < MB and m0 + jj < M))
            for r in range(R):
                x = zero
                if ok and row0 + r < F:
                    x = acc_t(H[sidx, row0 + r, col])
                st[r * C + j] = x

        t_begin = c * seg_len
        t_end = min(n, t_begin + seg_len)
        for t0 in range(t_begin, t_end, T):
            nt = min(T, t_end - t0)
            # ---- stage the tile: phi(q), phi(k) (zero-padded rows), v and 1;
            # unsigned indices (no negative-index wraparound; divisions by
            # compile-time constants; every operand unsigned, as a signed one
            # would make the sum a float)
            t0u = uint32(t0)
            if VQK:  # four feature rows of one token per thread, one vector load each
                for idx in range(tid, nt * FPV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(FPV)
                    i4 = (iu - t * uint32(FPV)) * uint32(4)
                    if write_out and i4 < Fu:
                        stage4(sq, t, i4, qb, IDX((t0u + t) * qn + i4), flags, 0, cqk, True, cd, zero, one)
                    else:
                        fill4(sq, t, i4, FP, zero, FP, zero)
                    if update and i4 < Fu:
                        stage4(sk, t, i4, kb, IDX((t0u + t) * kn + i4), flags, 1, cqk, True, cd, zero, one)
                    else:
                        fill4(sk, t, i4, FP, zero, FP, zero)
            for idx in range(tid, nt * FP if (PER_ROW and update) or not VQK else 0, NTH):
                iu = uint32(idx)
                t = iu // uint32(FP)
                i = iu - t * uint32(FP)
                if not VQK:  # the feature map (ops._cuda_common.phi, inlined)
                    if write_out and i < Fu:
                        stage(sq, t, i, qb[IDX((t0u + t) * qn + i * qf)], flags, 0, cqk, True, cd, zero, one)
                    else:
                        sq[t, i] = zero
                    if update and i < Fu:
                        stage(sk, t, i, kb[IDX((t0u + t) * kn + i * kf)], flags, 1, cqk, True, cd, zero, one)
                    else:
                        sk[t, i] = zero
                if PER_ROW and update:  # gate: the factor of row i (1 on padding rows, whose state is 0)
                    sa[t, i] = math.exp(acc_t(lf[b, t0u + t, i])) if i < Fu else one
            if FACTORS and not PER_ROW and not DELTA and update:  # decay: one factor per token
                for t in range(tid, nt, NTH):
                    sa[t, 0] = math.exp(acc_t(lf[b, t0 + t, 0]))
            if DELTA and update:  # delta rules: the factor (1 without a gate), then beta
                for t in range(tid, nt, NTH):
                    sa[t, 0] = math.exp(acc_t(lf[b, t0 + t, 0])) if GATED else one
                    sa[t, 1] = acc_t(lf[b, t0 + t, 1])
            if update and VV:  # four columns of one token per thread, one vector load each
                for idx in range(tid, nt * MBV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MBV)
                    j4 = (iu - t * uint32(MBV)) * uint32(4)
                    if j4 < uint32(MB) and m0u + j4 < Mu:
                        stage4(sv, t, j4, vb, IDX((t0u + t) * vn + m0u + j4), flags, 2, check, False, cd, zero, one)
                    else:  # past the values: the normaliser's column of ones, then padding
                        fill4(sv, t, j4, MBP, zero, MB, one)
            elif update:
                for idx in range(tid, nt * MBP, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MBP)
                    jj = iu - t * uint32(MBP)
                    col = m0u + jj
                    if jj < uint32(MB) and col < Mu:
                        stage(sv, t, jj, vb[IDX((t0u + t) * vn + col * vf)], flags, 2, check, False, cd, zero, one)
                    else:
                        sv[t, jj] = one if jj == uint32(MB) else zero
            cuda.syncthreads()
            # ---- row maps (L2, SiLU then L2): normalise every staged row,
            # one thread per row (code is uniform over the block)
            if is_row_map(cd):
                normalize_staged_rows(sq, sk, nt, tid, NTH, F, update, write_out)
                cuda.syncthreads()
            # ---- decay, gate, gated delta: a rescaled tile (gated delta: v_t / P_t), or one token at a
            # time (docs/cuda_kernels.md, "Rescaled tiles")
            whole = not (RESCALE or GATED)
            ptile = one
            if (RESCALE or GATED) and update:
                whole, ptile = rescale_tile(sq, sk, sv, sa, sp, nt, tid, NTH, FP, MBP, PER_ROW, RESCALE, GATED,
                                             TAU, one)
            # ---- per token: update the R x C state tile, partial phi(q)^T S
            if DELTA and update:
                # delta rules: k^T H[:, m] summed over the G row groups by xor-shuffles (WARP_SUM, no
                # barrier) or through shared memory (one syncthreads per token: buffer t & 1 is
                # rewritten two tokens later, after the next token's barrier); then the correction
                for seg_t in range(1 if whole else nt):  # the whole tile, or one token at a time
                    ta = 0 if whole else seg_t
                    if not whole:  # the direct form: the token's factor on the state first
                        ft = sa[ta, 0]
                        for r in range(R):
                            for j in range(C):
                                st[r * C + j] *= ft
                    for t in range(ta, nt if whole else seg_t + 1):
                        bt = sa[t, 1]
                        for j in range(C):
                            ut[j] = zero
                        for r in range(R):
                            kr = sk[t, row0 + r]
                            for j in range(C):
                                ut[j] += kr * st[r * C + j]
                        if WARP_SUM:
                            for j in range(C):
                                x = ut[j]
                                for lvl in range(LOG2G):
                                    x += cuda.shfl_xor_sync(lanes, x, G >> (lvl + 1))
                                ut[j] = bt * (sv[t, c0 + j] - x)  # beta (w - k^T H): the column's correction
                                ac[j] = zero
                        else:
                            buf = t & 1
                            for j in range(C):
                                pu[buf, tg, c0 + j] = ut[j]
                            cuda.syncthreads()
                            for j in range(C):
                                x = zero
                                for g in range(G):
                                    x += pu[buf, g, c0 + j]
                                ut[j] = bt * (sv[t, c0 + j] - x)  # beta (w - k^T H): the column's correction
                                ac[j] = zero
                        _update_read(st, ut, ac, sk, sq, t, row0, R, C)
                        if write_out:
                            for j in range(C):
                                part[t, tg, c0 + j] = ac[j]
                if GATED and whole:
                    for r in range(R):
                        for j in range(C):
                            st[r * C + j] *= ptile
            elif update:
                # additive, decay, gate: the additive token loop over one segment
                # (the whole tile: the additive rule, a rescaled tile), or over one
                # token at a time with the token's factors on the state first
                for seg_t in range(1 if whole else nt):
                    ta = 0 if whole else seg_t
                    te = nt if whole else seg_t + 1
                    if not whole:
                        ua = uint32(ta)
                        for r in range(R):
                            fr = sa[ua, row0 + r] if PER_ROW else sa[ua, 0]
                            for j in range(C):
                                st[r * C + j] *= fr
                    if write_out:
                        for tt in range(ta, te):
                            t = uint32(tt)
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                                ac[j] = zero
                            _update_read(st, vt, ac, sk, sq, t, row0, R, C)
                            for j in range(C):
                                part[t, tg, c0 + j] = ac[j]
                    else:
                        for tt in range(ta, te):
                            t = uint32(tt)
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                            for r in range(R):
                                kr = sk[t, row0 + r]
                                for j in range(C):
                                    st[r * C + j] += kr * vt[j]
                if RESCALE and whole:
                    for r in range(R):
                        fr = sp[row0 + r] if PER_ROW else ptile
                        for j in range(C):
                            st[r * C + j] *= fr
            else:
                for t in range(nt):
                    for j in range(C):
                        ac[j] = zero
                    for r in range(R):
                        qr = sq[t, row0 + r]
                        for j in range(C):
                            ac[j] += qr * st[r * C + j]
                    for j in range(C):
                        part[t, tg, c0 + j] = ac[j]
            cuda.syncthreads()
            # ---- the normaliser of every token (its G partials, once per
            # token), then the G partials per value column divided by it
            # (part is rewritten only after the next tile's first sync);
            # unsigned indices: no wraparound, division by a constant
            if write_out:
                for t in range(tid, nt, NTH):
                    den = zero
                    for g in range(G):
                        den += part[t, g, MB]
                    if norm == NORM_FLOOR and den < epsa:
                        den = epsa
                    sden[t] = den
                cuda.syncthreads()
                for idx in range(tid, nt * MB, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MB)
                    jj = iu - t * uint32(MB)
                    col = uint32(m0) + jj  # all unsigned: a signed operand would make it a float
                    if col < uint32(M):
                        num = zero
                        for g in range(G):
                            num += part[t, g, jj]
                        if norm != NORM_NONE:  # normalize=False writes the numerator
                            num = num / sden[t]
                        ob[IDX((uint32(t0) + t) * on + col * of)] = num

        if write_state:
            for j in range(C):
                jj = c0 + j
                col = M if jj == MB else m0 + jj
                # the normaliser column is written by the first column block only
                ok = (jj == MB and cuda.blockIdx.y == 0) or (jj < MB and m0 + jj < M)
                if ok:
                    for r in range(R):
                        if row0 + r < F:
                            Hout[sidx, row0 + r, col] = st[r * C + j]

    return kernel
