"""The tile layout of the sequence kernel (``G == 0``): the chunkwise form inside a tile, every rule.

See ``docs/cuda_kernels.md``, "Thread layouts" (the tile layout and its decay, gate and delta
rules).
"""
from __future__ import annotations

import math

from numba import cuda, float32, uint32, uint64

from .._codes import NORM_FLOOR, NORM_NONE, RULE_ADDITIVE, RULE_DECAY, RULE_GATE, RULE_GATED_DELTA
from .._cuda_common import fill4, is_delta_rule, is_row_map, stage, stage4
from .blocks import block_segment, normalize_staged_rows
from .plan import ACC_TYPES, CACHE, MAX_SEQ_THREADS, SIM, VEC_QK, VEC_V, gate_rows


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _triangle_entry(iu):
    """Entry ``iu`` (uint32) of a lower triangle stored row by row -> ``(t, s)``, ``s <= t``: the
    float32 root rounded down, then corrected by one where the rounding missed."""
    t = uint32((math.sqrt(float32(uint32(8) * iu + uint32(1))) - float32(1.0)) * float32(0.5))
    if (t + uint32(1)) * (t + uint32(2)) // uint32(2) <= iu:
        t = uint32(t + uint32(1))
    elif t * (t + uint32(1)) // uint32(2) > iu:
        t = uint32(t - uint32(1))
    return t, uint32(iu - t * (t + uint32(1)) // uint32(2))


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _tile_state_read(ac, sq, sst, tt, j0, FP):
    """``ac[j] += phi(q_tt)^T [S | z][:, j0 + j]``, j < 4: token ``tt``'s read of the tile's start state."""
    iu = uint32(0)
    while iu < uint32(FP):
        for a in range(4):
            x = sq[tt, iu + uint32(a)]
            for j in range(4):
                ac[j] += x * sst[iu + uint32(a), j0 + uint32(j)]
        iu += uint32(4)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _row_dot(x, y, t, s, FP, zero):
    """``x[t, :FP] . y[s, :FP]`` (uint32 rows), four features a step."""
    d = zero
    iu = uint32(0)
    while iu < uint32(FP):
        for a in range(4):
            d += x[t, iu + uint32(a)] * y[s, iu + uint32(a)]
        iu = uint32(iu + uint32(4))
    return d


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _interval_row(lo, hi, NB):
    """The gate's row of ``sz`` holding ``beta_lo ... beta_{hi-1}``, the product of the factors of the
    tile's 4-token blocks ``lo .. hi - 1`` (uint32; row 0, all ones, when ``lo >= hi``)."""
    if lo >= hi:
        return uint32(0)
    return uint32(uint32(1 + 3 * NB) + lo * (uint32(2 * NB + 1) - lo) // uint32(2) + (hi - lo - uint32(1)))


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _gate_score_rows(t, s, T, NB):
    """The rows ``(of sq, of sk, of sz)`` whose product, summed over the features, is the gate's score
    ``sum_f phi(q_t)_f phi(k_s)_f a_{s+1,f} ... a_{t,f}``, ``s <= t`` (uint32; see :func:`tiles_kernel`):
    another 4-token block's key: ``(q_t pi_t) (k_s sigma_s)`` and the blocks between; in the block,
    ``t`` its last token: ``q_t (k_s sigma_s)``; else ``q_t k_s`` and the pair's own product (1 on
    the diagonal)."""
    bt = t // uint32(4)
    bs = s // uint32(4)
    if bs < bt:
        return uint32(T) + t, uint32(T) + s, _interval_row(bs + uint32(1), bt, NB)
    if s == t:
        return t, s, uint32(0)
    if t == min(bt * uint32(4) + uint32(3), uint32(T - 1)):
        return t, uint32(T) + s, uint32(0)
    return t, s, uint32(1) + bt * uint32(3) + s + t - bt * uint32(8) - uint32(1)


@cuda.jit(device=True, inline=True)  # inlined: no device-function compile, which needs a GPU
def _log_sum(sl, lo, hi, zero):
    """``sl[lo] + ... + sl[hi - 1]`` (uint32 bounds; 0 when ``lo >= hi``): a sum of log-factors, never a
    difference, so a reset (``-inf``) gives ``-inf`` and its ``exp`` 0, not NaN."""
    g = zero
    u = lo
    while u < hi:
        g += sl[u]
        u = uint32(u + uint32(1))
    return g


def tiles_kernel(FP, MB, acc, code, off32, vec, rule=RULE_ADDITIVE):
    """The tile layout (``G == 0``; every rule of :data:`TILES_RULES`).  The gate rule's products over
    blocks of 4 tokens and the delta rules' WY/UT solve per tile: ``docs/cuda_kernels.md``, "Tiles".
    """
    acc_t = ACC_TYPES[acc]
    # one log-factor per token (the decay rule; the gated delta rule's column 0): the tile's weights,
    # start-state reads, key shares
    DECAY = rule == RULE_DECAY or rule == RULE_GATED_DELTA
    GATE = rule == RULE_GATE  # one log-factor per token and feature row: the products of the docstring
    DL = is_delta_rule(rule)  # the delta rules: the tile's values replaced by U' (the docstring's WY form)
    TD = FP // 4 if DECAY else 1  # per-token factor arrays (a one-element stand-in without factors)
    IDX = uint32 if off32 else uint64  # element offsets within a sequence (docs/cuda_kernels.md)
    VQK = bool(vec & VEC_QK)  # q, k: four features per vector load (docs/cuda_kernels.md)
    VV = bool(vec & VEC_V)  # v: four columns per vector load
    MAP = -1 if code is None else int(code)  # the feature map, when specialised (seq_kernel)
    MP = -(-(MB + 1) // 4) * 4  # value columns + the normaliser column, padded to 4
    NCG = MP // 4  # column groups of four
    RG = FP // 4  # row groups of four
    T = RG  # tokens per tile: one (token, column group) of the tile's outputs per thread
    NTH = RG * NCG  # threads per block
    FPK = FP + 4  # row stride of the staged phi(q), phi(k): 16-byte rows of one token in distinct banks
    NTRI = T * (T + 1) // 2  # entries of the tile's lower triangle (token s <= token t)
    SVW = 4 if T % 4 == 0 else 1  # scores per step of the tile tokens' product with [v | 1]
    FPV = FP // 4  # groups of four feature rows
    MBV = MP // 4  # groups of four columns
    NB = -(-FP // 16)  # the gate's blocks of 4 tokens in a tile
    TQ = 2 * T if GATE else T  # rows of the staged phi(q), phi(k): the gate's scaled copies after them
    NZ = gate_rows(FP) if GATE else 1  # the gate's product rows (docs/cuda_kernels.md; a stand-in otherwise)
    ZW = FPK if GATE else 1
    KR = T if GATE else 0  # first row of sk the state update reads (the gate: the keys' staged shares)
    NL = T * (T - 1) // 2  # the delta rules: entries of the strict lower triangle L of the tile
    zero = acc_t(0.0)
    one = acc_t(1.0)
    # more than MAX_SEQ_THREADS threads (272 at D_phi = M = 64): a register cap keeps registers x
    # threads within a block's 65,536 (a launch bound, .maxntid 272, made ptxas 12.9 take 96
    # registers and spill; uncapped it takes 133, and 178 for strided inputs, spilling nothing)
    nwarps = -(-NTH // 32)
    cap = {} if SIM or NTH <= MAX_SEQ_THREADS else {"max_registers": (65536 // (32 * nwarps)) // 8 * 8}

    @cuda.jit(cache=CACHE, **cap)
    def kernel(q, k, v, out, qs, ks, vs, os_, nf, nm, H, Hout, lf, n, seg_len, nseg_per_b, state_div, b2n,
               code, eps, norm, read_state, update, write_out, write_state, flags):
        sq = cuda.shared.array((TQ, FPK), acc_t)
        sk = cuda.shared.array((TQ, FPK), acc_t)
        sz = cuda.shared.array((NZ, ZW), acc_t)  # gate: ones, the in-block products, the blocks' runs
        sv = cuda.shared.array((T, MP), acc_t)
        sa = cuda.shared.array((T, T), acc_t)  # phi(q_t)^T phi(k_s) for s <= t, 0 above the diagonal
        sst = cuda.shared.array((FP, MP), acc_t)  # the state at the tile's start, [S | z | 0]
        sden = cuda.shared.array(T, acc_t)  # the normaliser of every token of the tile
        sl = cuda.shared.array(TD, acc_t)  # decay: log a_t of the tile's tokens (0 past the sequence)
        sfp = cuda.shared.array(TD, acc_t)  # decay: a_0 ... a_t, token t's factor of the start state
        ssh = cuda.shared.array(TD, acc_t)  # decay: a_{s+1} ... a_{T-1}, key s's share of the end state
        # the delta rules' arrays (the other rules never touch them: names for arrays they have)
        sb = cuda.shared.array(T, acc_t) if DL else sl  # beta of the tile's tokens (0 past the sequence)
        sL = cuda.shared.array((T, T), acc_t) if DL else sa  # beta_t a_{s+1} ... a_t phi(k_t)^T phi(k_s), s < t
        sw = cuda.shared.array((T, T), acc_t) if DL else sa  # W = L^-1 diag(beta) (L with its unit diagonal)
        sU = cuda.shared.array((T, MP), acc_t) if DL else sv  # U' = W Y, the values the tile's products read
        st = cuda.local.array(16, acc_t)  # st[a * 4 + j]: state row r0 + a, column j0 + j
        ga = cuda.local.array(4, acc_t)  # gate: the factors of one block's tokens, one feature row
        ac = cuda.local.array(4, acc_t)
        kk = cuda.local.array(4, acc_t)
        vv = cuda.local.array(4, acc_t)

        cd = code if MAP < 0 else MAP  # a specialised kernel's map is a constant: its branches fold
        F = nf
        M = nm
        Fu = uint32(F)
        Mu = uint32(M)
        tid = cuda.threadIdx.x
        rg = uint32(tid) // uint32(NCG)
        cg = uint32(tid) - rg * uint32(NCG)
        r0 = rg * uint32(4)  # this thread's state rows r0 .. r0 + 3
        j0 = cg * uint32(4)  # and block columns j0 .. j0 + 3 (j < MB: value column m0 + j, MB: z)
        tt = rg  # the token of the tile whose outputs j0 .. j0 + 3 this thread sums
        b, c, sidx, m0, qb, kb, vb, ob, check, cqk = block_segment(q, k, v, out, qs, ks, vs, os_, nseg_per_b, b2n,
                                                                    state_div, MB, flags)
        m0u = uint32(m0)
        epsa = acc_t(eps)
        qn, qf, kn, kf = IDX(qs[2]), IDX(qs[3]), IDX(ks[2]), IDX(ks[3])
        vn, vf, on, of = IDX(vs[2]), IDX(vs[3]), IDX(os_[2]), IDX(os_[3])

        for a in range(4):
            r = r0 + uint32(a)
            for j in range(4):
                jj = j0 + uint32(j)
                x = zero
                if read_state and r < Fu:
                    if jj < uint32(MB) and m0u + jj < Mu:
                        x = acc_t(H[sidx, r, m0u + jj])
                    elif jj == uint32(MB):
                        x = acc_t(H[sidx, r, M])
                st[a * 4 + j] = x
                sst[r, jj] = x
        for idx in range(tid, T * T, NTH):  # above the diagonal: 0 for good
            sa[uint32(idx) // uint32(T), uint32(idx) % uint32(T)] = zero
        my_t, my_s = _triangle_entry(uint32(tid) if tid < NTRI else uint32(0))
        # the delta rules' entries of L: thread NTRI + e takes entry e first (the threads of the scores last)
        lrot = (tid + NTH - NTRI % NTH) % NTH if DL else 0
        my_lt, my_ls = _triangle_entry(uint32(lrot) if DL and lrot < NL else uint32(0))
        my_lt = uint32(my_lt + uint32(1))
        my_x, my_y, my_z = _gate_score_rows(my_t, my_s, T, NB)
        if GATE:
            for f in range(tid, FP, NTH):
                sz[0, uint32(f)] = one

        t_begin = c * seg_len
        t_end = min(n, t_begin + seg_len)
        for t0 in range(t_begin, t_end, T):
            ntu = uint32(min(T, t_end - t0))
            t0u = uint32(t0)
            # ---- stage the tile's T tokens (past the sequence: zero): phi(q), phi(k), [v | 1 | 0]
            if VQK:
                for idx in range(tid, T * FPV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(FPV)
                    i4 = (iu - t * uint32(FPV)) * uint32(4)
                    if write_out and t < ntu and i4 < Fu:
                        stage4(sq, t, i4, qb, IDX((t0u + t) * qn + i4), flags, 0, cqk, True, cd, zero, one)
                    else:
                        fill4(sq, t, i4, FP, zero, FP, zero)
                    if update and t < ntu and i4 < Fu:
                        stage4(sk, t, i4, kb, IDX((t0u + t) * kn + i4), flags, 1, cqk, True, cd, zero, one)
                    else:
                        fill4(sk, t, i4, FP, zero, FP, zero)
            else:
                for idx in range(tid, T * FP, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(FP)
                    i = iu - t * uint32(FP)
                    if write_out and t < ntu and i < Fu:
                        stage(sq, t, i, qb[IDX((t0u + t) * qn + i * qf)], flags, 0, cqk, True, cd, zero, one)
                    else:
                        sq[t, i] = zero
                    if update and t < ntu and i < Fu:
                        stage(sk, t, i, kb[IDX((t0u + t) * kn + i * kf)], flags, 1, cqk, True, cd, zero, one)
                    else:
                        sk[t, i] = zero
            if update and VV:
                for idx in range(tid, T * MBV, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MBV)
                    j4 = (iu - t * uint32(MBV)) * uint32(4)
                    if t < ntu and j4 < uint32(MB) and m0u + j4 < Mu:
                        stage4(sv, t, j4, vb, IDX(m0u + j4 + (t0u + t) * vn), flags, 2, check, False, cd, zero, one)
                    else:  # past the values: the normaliser's column of ones (live tokens), then padding
                        fill4(sv, t, j4, MP, zero, MB, one if t < ntu else zero)
            elif update:
                for idx in range(tid, T * MP, NTH):
                    iu = uint32(idx)
                    t = iu // uint32(MP)
                    jj = iu - t * uint32(MP)
                    col = m0u + jj
                    if t < ntu and jj < uint32(MB) and col < Mu:
                        stage(sv, t, jj, vb[IDX((t0u + t) * vn + col * vf)], flags, 2, check, False, cd, zero, one)
                    else:
                        sv[t, jj] = one if jj == uint32(MB) and t < ntu else zero
            if DECAY and update:
                for t in range(tid, T, NTH):
                    tu = uint32(t)
                    sl[tu] = acc_t(lf[b, t0u + tu, 0]) if tu < ntu else zero
            if DL and update:  # beta (column 1 of the delta rules' inputs; column 0 the log-decay)
                for t in range(tid, T, NTH):
                    tu = uint32(t)
                    sb[tu] = acc_t(lf[b, t0u + tu, 1]) if tu < ntu else zero
            cuda.syncthreads()
            if is_row_map(cd):  # L2, SiLU then L2: one thread per staged row
                normalize_staged_rows(sq, sk, T, tid, NTH, F, update, write_out)
                cuda.syncthreads()
            if GATE and update:  # the products of the factors, a thread per feature row (docstring)
                for f in range(tid, FP, NTH):
                    fu = uint32(f)
                    for bb in range(NB):
                        for l in range(4):
                            r = uint32(4 * bb + l)
                            ga[l] = one
                            if 4 * bb + l < T and r < ntu and fu < Fu:
                                ga[l] = math.exp(acc_t(lf[b, t0u + r, fu]))
                        x = one
                        for l in range(4):  # pi: the block's factors up to each token, inclusive
                            if 4 * bb + l < T:
                                x *= ga[l]
                                sq[T + 4 * bb + l, fu] = sq[4 * bb + l, fu] * x
                        # the runs of whole blocks ending with this one, each the previous run times it
                        sz[1 + 3 * NB + bb * (2 * NB + 1 - bb) // 2, fu] = x
                        for lo in range(bb):
                            sz[1 + 3 * NB + lo * (2 * NB + 1 - lo) // 2 + bb - lo, fu] = (
                                sz[1 + 3 * NB + lo * (2 * NB + 1 - lo) // 2 + bb - lo - 1, fu] * x)
                        x = one
                        for l in range(3, -1, -1):  # sigma: the block's factors after each token
                            if 4 * bb + l < T:
                                sk[T + 4 * bb + l, fu] = sk[4 * bb + l, fu] * x
                                x *= ga[l]
                        sz[1 + 3 * bb, fu] = ga[1]  # the in-block pairs (0, 1), (0, 2), (1, 2)
                        sz[2 + 3 * bb, fu] = ga[1] * ga[2]
                        sz[3 + 3 * bb, fu] = ga[2]
                cuda.syncthreads()
            # ---- the tile's causal scores phi(q_t)^T phi(k_s), s <= t: one per thread of the first
            # NTRI (no lane idles on the masked half); a thread sums its own dot product
            if update and write_out:
                for idx in range(tid, NTRI, NTH):
                    if NTRI <= NTH:  # one score per thread: its (t, s), found once before the tiles
                        t, s = my_t, my_s
                        xr, yr, zr = my_x, my_y, my_z
                    else:
                        t, s = _triangle_entry(uint32(idx))
                        xr, yr, zr = _gate_score_rows(t, s, T, NB)
                    x = zero
                    iu = uint32(0)
                    while iu < uint32(FP):  # 32-bit counter, four rows a step (the loops below likewise)
                        for a in range(4):
                            if GATE:  # the weight of every feature row: one product row of sz
                                x += sq[xr, iu + uint32(a)] * sk[yr, iu + uint32(a)] * sz[zr, iu + uint32(a)]
                            else:
                                x += sq[t, iu + uint32(a)] * sk[s, iu + uint32(a)]
                        iu = uint32(iu + uint32(4))
                    if DECAY:  # weight a_{s+1} ... a_t: exp of a sum of the tile's log-factors (1 on the diagonal)
                        x *= math.exp(_log_sum(sl, uint32(s + uint32(1)), uint32(t + uint32(1)), zero))
                    sa[t, s] = x
            if DL and update:  # the entries of L, from thread NTRI on (the scores' threads come last)
                for idx in range(lrot, NL, NTH):
                    if NTRI + NL <= NTH:  # at most one entry per thread, found once before the tiles
                        t, s = my_lt, my_ls
                    else:
                        t, s = _triangle_entry(uint32(idx))
                        t = uint32(t + uint32(1))
                    w = sb[t]  # beta_t, times a_{s+1} ... a_t
                    if DECAY:
                        s1 = uint32(s + uint32(1))
                        w *= math.exp(_log_sum(sl, s1, uint32(t + uint32(1)), zero))
                    sL[t, s] = w * _row_dot(sk, sk, t, s, FP, zero)
            if DECAY and update:  # each token's factor of the start state and each key's share of the end state
                for t in range(tid, T, NTH):
                    tu = uint32(t)
                    sfp[tu] = math.exp(_log_sum(sl, uint32(0), uint32(tu + uint32(1)), zero))
                    ssh[tu] = math.exp(_log_sum(sl, uint32(tu + uint32(1)), uint32(T), zero))
            if update and (write_out or DECAY or DL):
                cuda.syncthreads()
            if DL and update:
                # W = L^-1 diag(beta): column j solved forwards by thread j alone (it reads only the
                # rows of its own column it wrote; L's entries are broadcasts), x_j = beta_j and
                # x_t = -sum_{s<t} L_ts x_s (0 above the diagonal)
                if tid < T:
                    ju = uint32(tid)
                    for t in range(T):
                        tu = uint32(t)
                        x = sb[ju] if tu == ju else zero
                        for s in range(t):
                            x -= sL[tu, uint32(s)] * sw[uint32(s), ju]
                        sw[tu, ju] = x
                # Y = [V | 1] - (a_0 ... a_t phi(k_t))^T [S | z], in place: this thread's token and columns
                for j in range(4):
                    ac[j] = zero
                _tile_state_read(ac, sk, sst, tt, j0, FP)
                bt = sfp[tt] if DECAY else one  # a_0 ... a_tt (the delta rule: 1)
                for j in range(4):
                    sv[tt, j0 + uint32(j)] -= bt * ac[j]
                cuda.syncthreads()
                # U' = W Y: the tile's values for the products below (the additive and decay rules' loops)
                for j in range(4):
                    ac[j] = zero
                uu = uint32(0)
                while uu < uint32(T):
                    for a in range(SVW):
                        x = sw[tt, uu + uint32(a)]
                        for j in range(4):
                            ac[j] += x * sv[uu + uint32(a), j0 + uint32(j)]
                    uu = uint32(uu + uint32(SVW))
                for j in range(4):
                    sU[tt, j0 + uint32(j)] = ac[j]
                cuda.syncthreads()
            if GATE and update:  # the scores read, the scaled rows become q_t a_0 ... a_t and k_s a_{s+1} ... a_{T-1}
                for idx in range(tid, 2 * T * FPV, NTH):  # four rows of one token at a time
                    iu = uint32(idx)
                    keys = iu >= uint32(T * FPV)
                    if keys:
                        iu = uint32(iu - uint32(T * FPV))
                    t = iu // uint32(FPV)
                    i4 = (iu - t * uint32(FPV)) * uint32(4)
                    if keys:  # sigma_t and the blocks after t's
                        zr = _interval_row(t // uint32(4) + uint32(1), uint32(NB), NB)
                        for a in range(4):
                            sk[uint32(T) + t, i4 + uint32(a)] *= sz[zr, i4 + uint32(a)]
                    else:  # pi_t and the blocks before t's
                        zr = _interval_row(uint32(0), t // uint32(4), NB)
                        for a in range(4):
                            sq[uint32(T) + t, i4 + uint32(a)] *= sz[zr, i4 + uint32(a)]
                cuda.syncthreads()
            # ---- outputs of token tt, columns j0 .. j0 + 3: the tile's own tokens, then the start
            # state ((Q K^T masked) [V | 1] + Q [S | z]; column MB is the normaliser)
            if write_out:
                for j in range(4):
                    ac[j] = zero
                if DECAY and update:  # the start state's term first, scaled by a_0 ... a_tt
                    _tile_state_read(ac, sq, sst, tt, j0, FP)
                    x = sfp[tt]
                    for j in range(4):
                        ac[j] *= x
                if update:
                    su = uint32(0)
                    while su < uint32(T):
                        for a in range(SVW):  # four scores a step (one 16-byte load) where T allows
                            x = sa[tt, su + uint32(a)]
                            for j in range(4):  # sU: U' for the delta rules, [v | 1] (sv itself) otherwise
                                ac[j] += x * sU[su + uint32(a), j0 + uint32(j)]
                        su = uint32(su + uint32(SVW))
                if GATE and update:  # phi(q_tt) a_0 ... a_tt, staged
                    _tile_state_read(ac, sq, sst, uint32(T) + tt, j0, FP)
                elif not (DECAY and update):
                    _tile_state_read(ac, sq, sst, tt, j0, FP)
                for j in range(4):
                    if j0 + uint32(j) == uint32(MB):
                        x = ac[j]
                        if norm == NORM_FLOOR and x < epsa:
                            x = epsa
                        sden[tt] = x
            # ---- the state: S += phi(K)^T [V | 1 | 0] over the tile, this thread's 4 x 4 tile
            if update:
                if DECAY:  # S <- a_0 ... a_{T-1} S + sum_s (a_{s+1} ... a_{T-1} k_s) [v_s | 1]^T
                    x = sfp[T - 1]
                    for i in range(16):
                        st[i] *= x
                if GATE:  # every row by its a_0 ... a_{T-1}: the run of all the tile's blocks
                    zr = _interval_row(uint32(0), uint32(NB), NB)
                    for a in range(4):
                        x = sz[zr, r0 + uint32(a)]
                        for j in range(4):
                            st[a * 4 + j] *= x
                sb0 = uint32(0)
                while sb0 < uint32(T):
                    for e in range(SVW):  # SVW keys a step where T allows
                        su = uint32(sb0 + uint32(e))
                        for a in range(4):  # the gate: key su times a_{su+1} ... a_{T-1}, staged
                            kk[a] = sk[uint32(KR) + su, r0 + uint32(a)]
                        if DECAY:
                            x = ssh[su]
                            for a in range(4):
                                kk[a] *= x
                        for j in range(4):
                            vv[j] = sU[su, j0 + uint32(j)]
                        for a in range(4):
                            for j in range(4):
                                st[a * 4 + j] += kk[a] * vv[j]
                    sb0 = uint32(sb0 + uint32(SVW))
            cuda.syncthreads()
            if update:
                for a in range(4):
                    for j in range(4):
                        sst[r0 + uint32(a), j0 + uint32(j)] = st[a * 4 + j]
            if write_out and tt < ntu:
                den = sden[tt]
                for j in range(4):
                    jj = j0 + uint32(j)
                    col = m0u + jj
                    if jj < uint32(MB) and col < Mu:
                        x = ac[j]
                        if norm != NORM_NONE:
                            x = x / den
                        ob[IDX((t0u + tt) * on + col * of)] = x
            # the next tile's staging rewrites sq, sk, sv only after every thread has read them
            # (the barrier above); its first barrier orders these state writes before their reads

        if write_state:
            for a in range(4):
                r = r0 + uint32(a)
                if r < Fu:
                    for j in range(4):
                        jj = j0 + uint32(j)
                        if jj < uint32(MB) and m0u + jj < Mu:
                            Hout[sidx, r, m0u + jj] = st[a * 4 + j]
                        elif jj == uint32(MB) and cuda.blockIdx.y == 0:
                            Hout[sidx, r, M] = st[a * 4 + j]

    return kernel
