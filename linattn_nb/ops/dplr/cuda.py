"""The CUDA scan of the DPLR recurrence: one block per sequence, one thread per state column.

Arrays as in :mod:`linattn_nb.ops.dplr`; the state and the outputs are float64.  Design:
``docs/dplr.md``, "Kernels".
"""
from __future__ import annotations

import math

import numpy as np
from numba import config as _nbconfig
from numba import cuda, float64

from ... import config
from .._codes import NORM_FLOOR, NORM_NONE
from ..cuda.views import is_sim_array

#: The kernels are cached on disk (``config.CACHE``), never on the simulator.
CACHE = bool(config.CACHE) and not bool(getattr(_nbconfig, "ENABLE_CUDASIM", 0))
#: Threads of a block at most: ``MAX_THREADS - 1`` value columns and the normaliser's.
MAX_THREADS = 256
#: The largest feature dimension D_phi the kernel holds (its columns are local arrays).
F_LIMIT = 256

_KERNELS = {}


def on_device(x) -> bool:
    """A GPU array (the CUDA array interface) or a simulator device array."""
    return is_sim_array(x) or hasattr(x, "__cuda_array_interface__")

def feature_capacity(F: int) -> int:
    """``FMAX`` of the kernel for ``F`` features: the next power of two >= F (at least 8).

    Raises
    ------
    ValueError
        For ``F`` > :data:`F_LIMIT`.
    """
    F = int(F)
    if F > F_LIMIT:
        raise ValueError(f"the CUDA DPLR scan holds at most {F_LIMIT} features per state column "
                         f"(D_phi = {F}); use device='cpu'")
    cap = 8
    while cap < F:
        cap *= 2
    return cap


def dplr_kernel(FMAX: int):
    """The ``cuda.jit`` scan kernel for at most ``FMAX`` features (built once per ``FMAX``)."""
    kern = _KERNELS.get(FMAX)
    if kern is None:
        kern = _KERNELS[FMAX] = _build(FMAX)
    return kern


def _build(FMAX):
    @cuda.jit(cache=CACHE)
    def kernel(fq, ld, A, Bv, KW, VW, H, Hout, out, flag, norm, eps):  # pragma: no cover - compiled
        """Grid (B, column blocks), ``nv + 1`` threads: thread ``tid < nv`` owns value column
        ``blockIdx.y * nv + tid`` (idle past M), thread ``nv`` the normaliser column.  Reads the
        state from ``H``, stores the final one in ``Hout`` (the same array with one column block:
        with more, block 0 would overwrite the normaliser column before another block reads it)."""
        b = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nt = cuda.blockDim.x
        nv = nt - 1
        N = fq.shape[1]
        F = fq.shape[2]
        M = VW.shape[3]
        r = A.shape[2]
        W = ld.shape[2]
        w = KW.shape[2]
        zcol = tid == nv
        m = M if zcol else cuda.blockIdx.y * nv + tid
        active = zcol or m < M
        sq = cuda.shared.array(FMAX, float64)
        sa = cuda.shared.array(FMAX, float64)
        sb = cuda.shared.array(FMAX, float64)
        sd = cuda.shared.array(FMAX, float64)
        sk = cuda.shared.array(FMAX, float64)
        sden = cuda.shared.array(1, float64)
        h = cuda.local.array(FMAX, float64)
        bad = 0
        if active:
            for i in range(F):
                h[i] = H[b, i, m]
        for t in range(N):
            acc = 0.0
            for j in range(r):
                write = w == r or j == r - 1
                jj = j if w == r else 0
                for i in range(tid, F, nt):
                    sa[i] = A[b, t, j, i]
                    sb[i] = Bv[b, t, j, i]
                    if j == 0 and W > 0:
                        sd[i] = math.exp(ld[b, t, i if W > 1 else 0])
                    else:
                        sd[i] = 1.0
                    if write:
                        sk[i] = KW[b, t, jj, i]
                    if j == 0:
                        sq[i] = fq[b, t, i]
                cuda.syncthreads()
                if active:
                    p = 0.0
                    for i in range(F):
                        p += sa[i] * h[i]
                    for i in range(F):
                        h[i] = sd[i] * h[i] + sb[i] * p
                    if write:
                        x = 1.0 if zcol else VW[b, t, jj, m]
                        for i in range(F):
                            h[i] += sk[i] * x
                    if j == r - 1:  # the read-out's sum, before the next token restages sq
                        acc = 0.0
                        for i in range(F):
                            acc += sq[i] * h[i]
                        if zcol:
                            if norm == NORM_FLOOR:
                                acc = max(acc, eps)
                            sden[0] = acc
                cuda.syncthreads()
            if active and not zcol:
                o = acc if norm == NORM_NONE else acc / sden[0]
                out[b, t, m] = o
                if not (o == o and abs(o) < math.inf):
                    bad = 1
        if active:
            for i in range(F):
                x = h[i]
                if not (x == x and abs(x) < math.inf):
                    bad = 1
                if not zcol or cuda.blockIdx.y == 0:
                    Hout[b, i, m] = x
        if bad != 0:
            flag[b] = 1

    return kernel


def launch_grid(B: int, M: int):
    """(grid, threads): ``min(M, MAX_THREADS - 1)`` value columns per block (at least 1) and the
    normaliser's thread; as many column blocks as the value columns need."""
    nv = max(1, min(int(M), int(MAX_THREADS) - 1))
    return (int(B), max(1, -(-int(M) // nv))), nv + 1


def _device(x):
    """A device array of ``x``: itself (a view of it) when it lives on the device, else a float64 copy
    of the host array."""
    if on_device(x):
        return x if hasattr(x, "copy_to_host") else cuda.as_cuda_array(x)
    return cuda.to_device(np.ascontiguousarray(x, dtype=np.float64))


def dplr_scan_cuda(fq, ld, A, Bv, KW, VW, H, out, norm, eps):
    """Run every sequence from its state ``H[b]`` on the GPU, as :func:`linattn_nb.ops.dplr.cpu.dplr_scan`.

    Device arrays are used in place (``H``, ``out`` float64); host arrays are copied
    in once and ``H``, ``out`` copied back.  Returns a (B,) uint8 host array: 1 where
    the sequence's outputs or final state hold NaN or inf.

    Raises
    ------
    ValueError
        For more than :data:`F_LIMIT` features, or a device ``H`` or ``out`` that is not float64.
    """
    B, N, F = (int(s) for s in fq.shape)
    M = int(VW.shape[3])
    kern = dplr_kernel(feature_capacity(F))
    if B == 0:
        return np.zeros(0, np.uint8)
    dfq, dld, dA, dBv, dKW, dVW = (_device(x) for x in (fq, ld, A, Bv, KW, VW))
    H_host = not on_device(H)
    out_host = not on_device(out)
    dH = _device(H)
    dout = cuda.device_array((B, N, M), dtype=np.float64) if out_host else _device(out)
    for name, x in (("H", dH), ("out", dout)):
        if np.dtype(x.dtype) != np.float64:
            raise ValueError(f"{name} must be float64 on the device, got {np.dtype(x.dtype)}")
    flag = cuda.to_device(np.zeros(B, np.int32))
    grid, threads = launch_grid(B, M)
    dHout = dH if grid[1] == 1 else cuda.device_array((B, F, M + 1), dtype=np.float64)
    kern[grid, threads](dfq, dld, dA, dBv, dKW, dVW, dH, dHout, dout, flag, np.int64(norm), np.float64(eps))
    if H_host:
        H[...] = dHout.copy_to_host()
    elif dHout is not dH:
        dH.copy_to_device(dHout)
    if out_host:
        with np.errstate(over="ignore"):
            out[...] = dout.copy_to_host()
    return (flag.copy_to_host() != 0).astype(np.uint8)
