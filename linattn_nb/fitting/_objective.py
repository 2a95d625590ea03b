"""The fitting losses and their gradients with respect to the features (streamed over row blocks).

:class:`WeightsLoss` evaluates the cross-entropy (or KL) between softmax and linear weights and its
gradients with respect to the features without holding an ``N x N`` matrix; the output MSE goes through
``linear_attention`` and its vjp instead.  Design: docs/design-cpu.md ("Fitting losses").
"""
from __future__ import annotations

import numpy as np

from .. import config
from . import _kernels as K

LOSSES = ("cross_entropy", "kl", "mse")


def row_block(n: int, block_bytes: int | None = None) -> int:
    """Query rows per block: two ``rows x n`` float64 matrices in ``FIT_BLOCK_BYTES``."""
    budget = config.FIT_BLOCK_BYTES if block_bytes is None else block_bytes
    return int(max(1, min(max(n, 1), budget // (16 * max(n, 1)))))


class WeightsLoss:
    """Cross-entropy (``kl=False``) or KL between softmax and linear weights, mean over rows.

    Parameters
    ----------
    q, k : ndarray, shape (B, N, d), float32 or float64
        The working precision of the weights (the losses are summed in float64).
    scale : float
        Softmax temperature.
    causal : bool
    floor : float
        Floor of the linear weights (0: none).
    kl : bool
        Subtract the softmax rows' entropy: KL instead of the cross-entropy.
    """

    def __init__(self, q, k, *, scale, causal, floor, kl, block_bytes=None, cache_bytes=None):
        self.q, self.k = q, k
        self.scale = float(scale)
        self.causal = bool(causal)
        self.floor = float(floor)
        self.kl = bool(kl)
        b, n, _ = q.shape
        self.rows = b * n
        self.block = row_block(n, block_bytes)
        cache = config.FIT_CACHE_BYTES if cache_bytes is None else cache_bytes
        self._cache = {} if b * n * n * q.dtype.itemsize <= cache else None
        self._entropy = None  # sum of the softmax rows' entropies, once known
        self._buffers = None

    def _weights(self, bi, r0, r1, kend, want_h):
        key = (bi, r0)
        if self._cache is not None and key in self._cache:
            return self._cache[key], None
        S = self.q[bi, r0:r1] @ self.k[bi, :kend].T
        S *= S.dtype.type(self.scale)
        h = np.empty(r1 - r0 if want_h else 0)
        K.softmax_rows(S, r0, self.causal, h)
        if self._cache is not None:
            self._cache[key] = S
        return S, h

    def _scratch(self, rows, keys, dtype):
        """Two ``rows x keys`` scratch blocks, allocated once and reused (fresh large
        allocations page-fault on every evaluation)."""
        buf = self._buffers
        if buf is None or buf[0].dtype != dtype or buf[0].shape[0] < rows * keys:
            buf = self._buffers = (np.empty(self.block * self.q.shape[1], dtype),
                                   np.empty(self.block * self.q.shape[1], dtype))
        return tuple(x[:rows * keys].reshape(rows, keys) for x in buf)

    def __call__(self, fq, fk, want_grad=True):
        """``(loss, dfq, dfk)``: the mean loss over rows and its gradients (None without ``want_grad``).

        ``fq``, ``fk``: features ``(B, N, F)`` in the dtype of the queries.  An infinite loss comes
        with zero gradients.
        """
        b, n, _ = self.q.shape
        want_h = self.kl and self._entropy is None
        entropy = 0.0
        total = 0.0
        dfq = np.zeros_like(fq) if want_grad else None
        dfk = np.zeros_like(fk) if want_grad else None
        for bi in range(b):
            for r0 in range(0, n, self.block):
                r1 = min(n, r0 + self.block)
                kend = r1 if self.causal else n
                P, h = self._weights(bi, r0, r1, kend, want_h)
                if want_h:
                    if h is None:  # cached without entropy: recompute this block's once
                        S = self.q[bi, r0:r1] @ self.k[bi, :kend].T
                        S *= S.dtype.type(self.scale)
                        h = np.empty(r1 - r0)
                        K.softmax_rows(S, r0, self.causal, h)
                    entropy += float(h.sum())
                A, T = self._scratch(r1 - r0, kend, fq.dtype)
                np.matmul(fq[bi, r0:r1], fk[bi, :kend].T, out=A)
                den = np.empty(r1 - r0)
                loss = np.empty(r1 - r0)
                if self.floor == 0.0:  # log T = log a - log den: no pass for T
                    with np.errstate(divide="ignore", invalid="ignore"):  # a <= 0 is never read
                        np.log(A, out=T)
                    K.cross_entropy_rows_unfloored(P, A, T, r0, self.causal, want_grad, den, loss)
                else:
                    K.log_floored_weights(A, r0, self.causal, self.floor, T, den)
                    K.cross_entropy_rows(P, A, T, den, r0, self.causal, self.floor, want_grad, loss)
                total += float(loss.sum())
                if want_grad:
                    np.matmul(A, fk[bi, :kend], out=dfq[bi, r0:r1])
                    dfk[bi, :kend] += A.T @ fq[bi, r0:r1]
        if want_h:
            self._entropy = entropy
        if self.kl:
            total -= self._entropy
        rows = max(self.rows, 1)
        if not np.isfinite(total):
            if want_grad:
                dfq[...] = 0.0
                dfk[...] = 0.0
            return float("inf"), dfq, dfk
        if want_grad:
            dfq /= rows
            dfk /= rows
        return total / rows, dfq, dfk
