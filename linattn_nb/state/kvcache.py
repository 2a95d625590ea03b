"""Softmax attention's decoding cache (:class:`KVCache`), the baseline of the linear state
(docs/guide/decoding.md)."""
from __future__ import annotations

import math

import numpy as np

from .. import _validate as V
from .._blas import parallel_calls
from .. import config
from ..device import check_device_arg, on_device
from ..ops._finite import NonFiniteResult
from ..ops.step import cpu as _cpu
from ._checks import check_batch_shape, check_dim, check_state_dtype, host_tokens, raise_nonfinite

__all__ = ["KVCache"]


class KVCache:
    r"""Softmax attention's decoding cache: every key and value, grown geometrically.

    The baseline of :class:`LinearAttentionState`, with its API; a step's cost grows with the
    context.  Full buffers grow to ``max(needed, config.KV_GROWTH * capacity)`` (docs/guide/decoding.md).

    Parameters
    ----------
    key_dim, value_dim : int
    batch_shape : tuple of int, default ()
    dtype : {numpy.float64, numpy.float32}
        Dtype of the cached keys and values (and of the scores).
    scale : float, optional
        Score scale, default ``1 / sqrt(key_dim)`` (as
        :func:`linattn_nb.softmax_attention`).
    capacity : int, optional
        Tokens to allocate up front (default ``config.KV_INITIAL_CAPACITY``); TypeError when not an
        integer, ValueError when negative.
    device : {"auto", "cpu"}
        A CPU kernel only; GPU inputs raise ValueError.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import KVCache, softmax_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(3, 2, 12, 4))         # (heads=2, T=12, D=4)
    >>> cache = KVCache(4, 4, batch_shape=(2,))
    >>> cache.prefill(k[:, :10], v[:, :10])
    >>> out = cache.step(q[:, 10:], k[:, 10:], v[:, 10:])
    >>> bool(np.allclose(out, softmax_attention(q, k, v, causal=True)[:, 10:])), cache.length
    (True, 12)
    """

    def __init__(self, key_dim, value_dim, *, batch_shape=(), dtype=np.float64, scale=None, capacity=None,
                 device="auto"):
        self._d = check_dim("key_dim", key_dim)
        self._m = check_dim("value_dim", value_dim)
        self._bs = check_batch_shape(batch_shape)
        self._nb = len(self._bs)
        self._B = int(np.prod(self._bs, dtype=np.int64))
        self._dtype = check_state_dtype(dtype, "the cache's keys and values")
        check_device_arg(device)
        if device == "cuda":
            raise ValueError("KVCache has a CPU kernel only (like softmax_attention); use device='cpu'")
        self._scale = V.check_scale(scale, self._d)
        cap = V.check_int("capacity", config.KV_INITIAL_CAPACITY if capacity is None else capacity)
        self._len = 0
        self._K = np.empty((self._B, int(cap), self._d), dtype=self._dtype)
        self._V = np.empty((self._B, int(cap), self._m), dtype=self._dtype)
        self._q1 = self._bs + (1, self._d)
        self._v1 = self._bs + (1, self._m)
        self._qk3 = (self._B, 1, self._d)
        self._o1 = (self._B, 1, self._m)

    # -- properties -------------------------------------------------------------------
    key_dim = property(lambda self: self._d)
    value_dim = property(lambda self: self._m)
    batch_shape = property(lambda self: self._bs)
    dtype = property(lambda self: self._dtype)
    scale = property(lambda self: self._scale)

    @property
    def length(self) -> int:
        """Tokens cached."""
        return self._len

    position = length

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold before the next growth."""
        return self._K.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the allocated key and value buffers (capacity, not just length)."""
        return self._K.nbytes + self._V.nbytes

    @property
    def keys(self) -> np.ndarray:
        """The cached keys, ``(*batch_shape, length, key_dim)`` (read-only view)."""
        view = self._K[:, :self._len].reshape(self._bs + (self._len, self._d))
        view.flags.writeable = False
        return view

    @property
    def values(self) -> np.ndarray:
        """The cached values, ``(*batch_shape, length, value_dim)`` (read-only view)."""
        view = self._V[:, :self._len].reshape(self._bs + (self._len, self._m))
        view.flags.writeable = False
        return view

    def __repr__(self) -> str:
        return (f"KVCache(key_dim={self._d}, value_dim={self._m}, batch_shape={self._bs}, "
                f"dtype={self._dtype.name}, length={self._len}, capacity={self.capacity}, nbytes={self.nbytes})")

    # -- buffers -----------------------------------------------------------------------
    def reserve(self, tokens) -> None:
        """Make room for ``tokens`` cached tokens in total (no growth until then).

        Raises
        ------
        TypeError
            ``tokens`` is not an integer (a float, a string, None, a bool).
        ValueError
            ``tokens`` is negative.
        """
        if isinstance(tokens, (bool, np.bool_)) or not isinstance(tokens, (int, np.integer)):
            raise TypeError(f"tokens must be an integer, got {type(tokens).__name__}")
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        tokens = int(tokens)
        if tokens > self.capacity:
            self._grow_to(tokens)

    def _grow_to(self, cap):
        K = np.empty((self._B, cap, self._d), dtype=self._dtype)
        Vb = np.empty((self._B, cap, self._m), dtype=self._dtype)
        K[:, :self._len] = self._K[:, :self._len]
        Vb[:, :self._len] = self._V[:, :self._len]
        self._K, self._V = K, Vb

    def _make_room(self, need):
        """Grow the buffers geometrically when ``need`` tokens do not fit (amortised O(1) appends)."""
        if need > self.capacity:
            self._grow_to(max(need, int(math.ceil(self.capacity * max(config.KV_GROWTH, 1.0)))))

    def _append(self, k3, v3):
        need = self._len + k3.shape[1]
        self._make_room(need)
        self._K[:, self._len:need] = k3
        self._V[:, self._len:need] = v3
        self._len = need

    def _float64_outputs(self, q, length, causal_new, dtype):
        """The outputs of the queries ``q`` (B, T, D) against the first ``length`` cached tokens, recomputed in
        float64: finite inputs whose scores overflow the cache's dtype (``q . k`` beyond float32's range) gave
        NaN there.  A softmax average of the values fits their dtype; NonFiniteResult if even float64 fails."""
        K = np.ascontiguousarray(self._K[:, :length], dtype=np.float64)
        Vc = np.ascontiguousarray(self._V[:, :length], dtype=np.float64)
        out = np.empty(q.shape[:2] + (self._m,))
        _cpu.kv_attend(np.ascontiguousarray(q, dtype=np.float64), K, Vc, length, out, scale=self._scale,
                       causal_new=causal_new)
        res = out.astype(dtype)
        if not np.isfinite(res).all():
            held = [n for n, x in (("keys", K), ("values", Vc)) if not np.isfinite(x).all()]
            if held:  # appended with check_finite=False: not an overflow of finite scores
                raise NonFiniteResult(f"KVCache: the outputs are not finite because the cached {' and '.join(held)} "
                                      "hold NaN or inf (appended with check_finite=False); reset() or truncate() "
                                      f"the cache (length {length})")
            raise NonFiniteResult(f"KVCache: the outputs of these finite inputs are not finite even in float64 "
                                  f"(their scores q . k exceed its range); the tokens are in the cache "
                                  f"(length {length})")
        return res

    def _prepare(self, pairs, check_finite):
        if any(on_device(x) for _, x, _ in pairs):
            raise ValueError("KVCache has a CPU kernel only; copy the GPU inputs "
                             f"({', '.join(n for n, x, _ in pairs if on_device(x))}) to the host first")
        arrs, T, dtype = host_tokens(self._bs, pairs)
        if check_finite:
            for n, a, _ in arrs:
                V.check_finite(n, a)
        with np.errstate(over="ignore"):
            flat = [V.flatten_batch(a, self._dtype) for _, a, _ in arrs]
        if check_finite:
            for (n, a, _), x in zip(arrs, flat):  # finite, beyond a narrower cache's range: refused, none appended
                if np.dtype(a.dtype).itemsize > np.dtype(self._dtype).itemsize and not np.isfinite(x).all():
                    raise ValueError(f"{n} has {int(np.size(x) - np.isfinite(x).sum())} finite value(s) beyond the "
                                     f"range of the {self._dtype} cache (largest magnitude "
                                     f"{float(np.max(np.abs(a))):.3g}); use a float64 cache (dtype=np.float64) or "
                                     "rescale them")
        return flat, T, dtype

    # -- the API --------------------------------------------------------------------
    def prefill(self, k, v, *, check_finite=True) -> None:
        """Append a prompt's keys and values (no outputs).

        Parameters
        ----------
        k : array_like, shape ``(*batch_shape, T, key_dim)``
        v : array_like, shape ``(*batch_shape, T, value_dim)``
        check_finite : bool, default True
            Raise ValueError (nothing appended) on NaN or inf; TypeError when not True or False.
        """
        check_finite = V.check_bool("check_finite", check_finite)
        (k3, v3), _, _ = self._prepare([("k", k, self._d), ("v", v, self._m)], check_finite)
        self._append(k3, v3)

    def step(self, q, k, v, *, check_finite=True):
        """Append T tokens and return their outputs: row t attends to the cache and new tokens <= t.

        Equals the last T rows of ``softmax_attention(..., causal=True)`` over
        the whole sequence.

        Parameters
        ----------
        q, k : array_like, shape ``(*batch_shape, T, key_dim)``
        v : array_like, shape ``(*batch_shape, T, value_dim)``
        check_finite : bool, default True
            Raise ValueError (nothing appended) on NaN or inf; outputs of finite inputs that are not
            finite in the cache's dtype (scores ``q . k`` beyond float32's range) are recomputed in
            float64 from the cached tokens.  TypeError when not True or False.

        Returns
        -------
        ndarray, shape ``(*batch_shape, T, value_dim)``, in the promoted input dtype.
        """
        if check_finite is not True:  # one identity test on the decode loop's path
            check_finite = V.check_bool("check_finite", check_finite)
        dt = self._dtype
        if (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray and q.dtype is dt
                and k.dtype is dt and v.dtype is dt and q.shape == self._q1 and k.shape == self._q1
                and v.shape == self._v1 and q.flags.carray and k.flags.carray and v.flags.carray):
            # Fast path (the decode loop), as lean as LinearAttentionState.step's.  ``carray``: C-contiguous,
            # aligned and writeable, as one flag; a read-only token (another Numba type, every kernel compiled
            # once more) takes the general path, which hands the kernels a writeable view of it.
            if self._nb != 1:
                q, k, v = q.reshape(self._qk3), k.reshape(self._qk3), v.reshape(self._o1)
            T = 1
            res = None
        else:
            (q, k, v), T, dtype = self._prepare([("q", q, self._d), ("k", k, self._d), ("v", v, self._m)],
                                                check_finite)
            res = dtype
        block = config.knob_int("KV_BLOCK")
        if block < 1:
            raise ValueError(f"config.KV_BLOCK must be >= 1, got {block}")
        self._make_room(self._len + T)
        out = np.empty((self._B, T, self._m), dtype=dt)
        if self._B:
            kern = _cpu.pick_kv_kernel(self._B, T, self._len + T, self._d, self._m)
            with parallel_calls(kern is not _cpu.kv_step_serial):  # one thread at a time under workqueue
                bad = kern(q, k, v, self._K, self._V, np.int64(self._len), out, self._scale,
                           np.int64(block), bool(check_finite and res is None), bool(check_finite))
            if bad == _cpu.RESULT_NOT_FINITE:  # the tokens were appended
                out[...] = self._float64_outputs(q, self._len + T, True, out.dtype)
            elif bad:
                raise_nonfinite(("q", "k", "v")[bad - 1])
        self._len += T
        out = out.reshape(self._bs + (T, self._m))
        if res is not None and out.dtype != res:
            out = out.astype(res)
        return out

    def query(self, q, *, check_finite=True):
        """Attend T queries to every cached token without appending anything (``check_finite`` as :meth:`step`'s)."""
        check_finite = V.check_bool("check_finite", check_finite)
        (q3,), T, dtype = self._prepare([("q", q, self._d)], check_finite)
        if self._len == 0 and T > 0:  # no queries: an empty result, as step and softmax_attention give
            raise ValueError("the cache is empty: a softmax over no keys is undefined")
        out = np.empty((self._B, T, self._m), dtype=self._dtype)
        if T and self._B:
            _cpu.kv_attend(q3, self._K, self._V, self._len, out, scale=self._scale, causal_new=False)
            if check_finite and not np.isfinite(out).all():
                out[...] = self._float64_outputs(q3, self._len, False, out.dtype)
        out = out.reshape(self._bs + (T, self._m))
        return out if out.dtype == dtype else out.astype(dtype)

    def truncate(self, length) -> None:
        """Keep the first ``length`` tokens (e.g. to roll back rejected draft tokens); buffers kept."""
        if isinstance(length, (bool, np.bool_)) or not isinstance(length, (int, np.integer)):
            raise TypeError(f"length must be an integer, got {type(length).__name__}")
        if not 0 <= length <= self._len:
            raise ValueError(f"length must be in [0, {self._len}], got {length}")
        self._len = int(length)

    def reset(self) -> None:
        """Forget every token (buffers kept)."""
        self._len = 0

    def __copy__(self) -> "KVCache":
        # a shallow copy would share the key and value buffers that step appends to in place
        return self.copy()

    def copy(self) -> "KVCache":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._K = self._K[:, :self._len].copy()
        new._V = self._V[:, :self._len].copy()
        return new
