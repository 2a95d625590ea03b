"""The owner layout of the sequence kernel (``G == 1``): a thread owns every state row of its value column.

See ``docs/cuda_kernels.md``, "Thread layouts".
"""
from __future__ import annotations

import math

from numba import cuda, uint32, uint64

from .._codes import NORM_FLOOR, NORM_NONE, RULE_GATE
from .._cuda_common import fill4, is_row_map, rule_factor_rows, stage, stage4
from .blocks import block_segment, normalize_staged_rows, rescale_tile
from .plan import ACC_TYPES, CACHE, RESCALE_MIN_F32, RESCALE_MIN_F64, VEC_QK, VEC_V, owner_row_pad


def owner_kernel(R, C, MB, T, acc, rule, code, off32, vec):
    """The owner layout (``G == 1``): see docs/cuda_kernels.md."""
    acc_t = ACC_TYPES[acc]
    IDX = uint32 if off32 else uint64  # element offsets within a sequence (docs/cuda_kernels.md)
    VQK = bool(vec & VEC_QK)  # q, k: four features per vector load (docs/cuda_kernels.md)
    VV = bool(vec & VEC_V)  # v: four columns per vector load
    MAP = -1 if code is None else int(code)  # the feature map, when specialised (seq_kernel)
    FP = R  # padded feature rows, all owned by every thread
    FPS = FP + owner_row_pad(8 if acc == "float64" else 4)  # rows of sq and sz: 16 bytes past FP
    MBP = -(-MB // C) * C  # value columns, padded (the normaliser's rows are split over the threads)
    NTH = MBP // C  # threads per block
    ZR = -(-FP // NTH)  # normaliser rows per thread: rows tid, tid + NTH, ...
    RC = R * C
    zero = acc_t(0.0)
    one = acc_t(1.0)
    FACTORS = rule_factor_rows(rule, FP) > 0
    PER_ROW = rule == RULE_GATE
    SAT = T if FACTORS else 1
    SAW = FP if PER_ROW else 1
    SPW = FP if PER_ROW else 1
    TAU = acc_t(RESCALE_MIN_F32 if acc == "float32" else RESCALE_MIN_F64)
    FPV = -(-FP // 4)  # groups of four feature rows
    MBV = -(-MBP // 4)  # groups of four value columns

    @cuda.jit(cache=CACHE)
    def kernel(q, k, v, out, qs, ks, vs, os_, nf, nm, H, Hout, lf, n, seg_len, nseg_per_b, state_div, b2n,
               code, eps, norm, read_state, update, write_out, write_state, flags):
        sq = cuda.shared.array((T, FPS), acc_t)
        sk = cuda.shared.array((T, FP), acc_t)
        sv = cuda.shared.array((T, MBP), acc_t)
        sa = cuda.shared.array((SAT, SAW), acc_t)
        sp = cuda.shared.array(SPW, acc_t)  # a rescaled tile's factor of each state row (the gate)
        num = cuda.shared.array((T, MBP), acc_t)  # phi(q)^T S per token and column
        sz = cuda.shared.array((T, FPS), acc_t)  # z after each token (its owners' rows), for the normaliser
        den = cuda.shared.array(T, acc_t)
        st = cuda.local.array(RC, acc_t)  # st[r * C + j]: row r, column c0 + j
        zt = cuda.local.array(ZR, acc_t)  # z[tid + u * NTH]
        vt = cuda.local.array(C, acc_t)
        ac = cuda.local.array(C, acc_t)

        cd = code if MAP < 0 else MAP  # a specialised kernel's map is a constant: its branches fold
        F = nf
        M = nm
        Fu = uint32(F)
        Mu = uint32(M)
        tid = cuda.threadIdx.x
        c0 = tid * C
        epsa = acc_t(eps)
        # the batch entry's sequences from their first element (64-bit, once per block), then
        # element offsets of IDX within them: token x token stride + column x column stride
        b, c, sidx, m0, qb, kb, vb, ob, check, cqk = block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n,
                                                                    state_div, MB, flags)
        qn, qf, kn, kf = IDX(qs[2]), IDX(qs[3]), IDX(ks[2]), IDX(ks[3])
        vn, vf, on, of = IDX(vs[2]), IDX(vs[3]), IDX(os_[2]), IDX(os_[3])

        for j in range(C):
            ok = read_state and c0 + j < MB and m0 + c0 + j < M
            for r in range(R):
                x = zero
                if ok and r < F:
                    x = acc_t(H[sidx, r, m0 + c0 + j])
                st[r * C + j] = x
        for u in range(ZR):
            i = tid + u * NTH
            x = zero
            if read_state and i < F:
                x = acc_t(H[sidx, i, M])
            zt[u] = x

        t_begin = c * seg_len
        t_end = min(n, t_begin + seg_len)
        for t0 in range(t_begin, t_end, T):
            nt = min(T, t_end - t0)
            # ---- stage phi(q), phi(k) (zero-padded rows), v, the factors: a
            # thread stages one feature row (value column) of every token of
            # the tile, so a warp reads consecutive addresses; unsigned
            # indices (no negative-index wraparound, a token index < 2^32)
            if VQK:  # four feature rows of one token per thread, one vector load each
                for idx in range(tid, nt * FPV, NTH):
                    iu = uint32(idx)
                    tu = iu // uint32(FPV)
                    i4 = (iu - tu * uint32(FPV)) * uint32(4)
                    tok = uint32(t0) + tu
                    if write_out and i4 < Fu:
                        stage4(sq, tu, i4, qb, IDX(tok * qn + i4), flags, 0, cqk, True, cd, zero, one)
                    else:
                        fill4(sq, tu, i4, FP, zero, FP, zero)
                    if update and i4 < Fu:
                        stage4(sk, tu, i4, kb, IDX(tok * kn + i4), flags, 1, cqk, True, cd, zero, one)
                    else:
                        fill4(sk, tu, i4, FP, zero, FP, zero)
            for i in range(tid, FP, NTH):
                iu = uint32(i)
                live = i < F
                if not VQK:
                    for t in range(nt):
                        tu = uint32(t)
                        tok = uint32(t0 + t)
                        if live and write_out:
                            stage(sq, tu, iu, qb[IDX(tok * qn + iu * qf)], flags, 0, cqk, True, cd, zero, one)
                        else:
                            sq[tu, iu] = zero
                        if live and update:
                            stage(sk, tu, iu, kb[IDX(tok * kn + iu * kf)], flags, 1, cqk, True, cd, zero, one)
                        else:
                            sk[tu, iu] = zero
                if PER_ROW and update:
                    for t in range(nt):
                        sa[uint32(t), iu] = math.exp(acc_t(lf[b, uint32(t0 + t), iu])) if live else one
            if FACTORS and not PER_ROW and update:
                for t in range(tid, nt, NTH):
                    sa[uint32(t), 0] = math.exp(acc_t(lf[b, uint32(t0 + t), 0]))
            if update and VV:  # four value columns of one token per thread, one vector load each
                for idx in range(tid, nt * MBV, NTH):
                    iu = uint32(idx)
                    tu = iu // uint32(MBV)
                    j4 = (iu - tu * uint32(MBV)) * uint32(4)
                    if j4 < uint32(MB) and uint32(m0) + j4 < Mu:
                        stage4(sv, tu, j4, vb, IDX((uint32(t0) + tu) * vn + uint32(m0) + j4), flags, 2, check, False,
                               cd, zero, one)
                    else:
                        fill4(sv, tu, j4, MBP, zero, MBP, zero)
            elif update:
                for jj in range(tid, MBP, NTH):
                    ju = uint32(m0 + jj)
                    live = jj < MB and m0 + jj < M
                    for t in range(nt):
                        if live:
                            stage(sv, uint32(t), uint32(jj), vb[IDX(uint32(t0 + t) * vn + ju * vf)], flags, 2, check,
                                  False, cd, zero, one)
                        else:
                            sv[uint32(t), uint32(jj)] = zero
            cuda.syncthreads()
            if is_row_map(cd):
                normalize_staged_rows(sq, sk, nt, tid, NTH, F, update, write_out)
                cuda.syncthreads()
            # ---- decay and gate: a rescaled tile when its running factors stay >= TAU, else one token
            # at a time (docs/cuda_kernels.md, "Rescaled tiles"); the token loop is the additive one
            whole = not FACTORS
            ptile = one
            if FACTORS and update:
                whole, ptile = rescale_tile(sq, sk, sv, sa, sp, nt, tid, NTH, FP, MBP, PER_ROW, True, False,
                                             TAU, one)
            # ---- per token: the thread's C columns over all rows, in registers
            if update:
                for seg_t in range(1 if whole else nt):  # one segment (additive: always), or one per token
                    ta = 0 if whole else seg_t
                    te = nt if whole else seg_t + 1
                    if not whole:  # the direct form: this token's factors on the state first
                        ua = uint32(ta)
                        for r in range(R):
                            fr = sa[ua, r] if PER_ROW else sa[ua, 0]
                            for j in range(C):
                                st[r * C + j] *= fr
                        for u in range(ZR):
                            i = tid + u * NTH
                            if i < FP:
                                zt[u] *= sa[ua, i] if PER_ROW else sa[ua, 0]
                    if write_out:
                        for tt in range(ta, te):
                            t = uint32(tt)  # unsigned: no negative-index wraparound in the addressing
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                                ac[j] = zero
                            for r in range(R):
                                kr = sk[t, r]
                                qr = sq[t, r]
                                for j in range(C):
                                    s = st[r * C + j] + kr * vt[j]
                                    st[r * C + j] = s
                                    ac[j] += qr * s
                            for j in range(C):
                                num[t, c0 + j] = ac[j]
                            for u in range(ZR):
                                i = uint32(tid + u * NTH)
                                if i < FP:
                                    s = zt[u] + sk[t, i]
                                    zt[u] = s
                                    sz[t, i] = s
                    else:
                        for tt in range(ta, te):
                            t = uint32(tt)
                            for j in range(C):
                                vt[j] = sv[t, c0 + j]
                            for r in range(R):
                                kr = sk[t, r]
                                for j in range(C):
                                    st[r * C + j] += kr * vt[j]
                            for u in range(ZR):
                                i = tid + u * NTH
                                if i < FP:
                                    zt[u] += sk[t, i]
                if FACTORS and whole:
                    for r in range(R):
                        fr = sp[r] if PER_ROW else ptile
                        for j in range(C):
                            st[r * C + j] *= fr
                    for u in range(ZR):
                        i = tid + u * NTH
                        if i < FP:
                            zt[u] *= sp[i] if PER_ROW else ptile
            elif write_out:
                for t in range(nt):
                    for j in range(C):
                        ac[j] = zero
                    for r in range(R):
                        qr = sq[t, r]
                        for j in range(C):
                            ac[j] += qr * st[r * C + j]
                    for j in range(C):
                        num[t, c0 + j] = ac[j]
                    for u in range(ZR):
                        i = uint32(tid + u * NTH)
                        if i < FP:
                            sz[uint32(t), i] = zt[u]
            if write_out:
                cuda.syncthreads()
                # ---- the normaliser of every token, phi(q_t)^T z_t, a thread's own dot product over the
                # rows of z_t its owners wrote (as it reads phi(q_t) other threads staged): no partial
                # sums of several threads are added; rows FPS apart keep a warp's reads off one bank
                for t in range(tid, nt, NTH):
                    tu = uint32(t)
                    x = zero
                    for i in range(FP):
                        x += sq[tu, uint32(i)] * sz[tu, uint32(i)]
                    if norm == NORM_FLOOR and x < epsa:
                        x = epsa
                    den[t] = x
                cuda.syncthreads()
                for j in range(C):
                    jj = c0 + j
                    if jj < MB and m0 + jj < M:
                        ju = uint32(m0 + jj)
                        for t in range(nt):
                            x = num[uint32(t), jj]
                            if norm != NORM_NONE:
                                x = x / den[uint32(t)]
                            ob[IDX(uint32(t0 + t) * on + ju * of)] = x
            else:
                cuda.syncthreads()

        if write_state:
            for j in range(C):
                jj = c0 + j
                if jj < MB and m0 + jj < M:
                    for r in range(R):
                        if r < F:
                            Hout[sidx, r, m0 + jj] = st[r * C + j]
            if cuda.blockIdx.y == 0:  # the normaliser column: the first column block only
                for u in range(ZR):
                    i = tid + u * NTH
                    if i < F:
                        Hout[sidx, i, M] = zt[u]

    return kernel
