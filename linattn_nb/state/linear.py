"""Recurrent decoding: the linear-attention state and the softmax KV cache.

Causal linear attention is an RNN (Katharopoulos et al. 2020, "Transformers
are RNNs", Eqs. 18-19): generation keeps a fixed-size state

.. math:: S = \\sum_j \\phi(k_j) v_j^\\top, \\qquad z = \\sum_j \\phi(k_j),

and each new token costs ``O(D_phi * M)`` whatever the context length.
Softmax attention keeps every key and value instead (:class:`KVCache`), so a
step costs ``O(L * (D + M))`` at context length L.  Both objects share the
``prefill`` / ``step`` / ``query`` / ``nbytes`` API so that studies compare
like with like (``benchmarks/decode.py``).
"""
from __future__ import annotations

import inspect
import json
import math
import os
import tempfile
import zipfile

import numpy as np

from .. import _validate as V
from .. import config
from .. import feature_maps as fm
from .._frontend import LinearState
from ..device import check_device_arg, is_device_array, resolve_device
from ..ops.step import cpu as _cpu

__all__ = ["LinearAttentionState", "KVCache", "StateFileError"]

FORMAT_NAME = "linattn_nb.LinearAttentionState"
FORMAT_VERSION = 1
_STATE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_REQUIRED_KEYS = ("format", "version", "S", "z", "position", "key_dim", "value_dim", "batch_shape",
                  "eps", "feature_map", "feature_map_params", "feature_map_rebuild_error",
                  "feature_map_probe")


class StateFileError(ValueError):
    """A saved state that cannot be loaded: corrupted, truncated, from another
    format version, inconsistent, or not what the caller expected."""


# ---------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------
def _check_dim(name, x) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{name} must be an integer >= 1, got {type(x).__name__}")
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return int(x)


def _check_batch_shape(batch_shape) -> tuple:
    if isinstance(batch_shape, (int, np.integer)) and not isinstance(batch_shape, (bool, np.bool_)):
        batch_shape = (batch_shape,)
    try:
        bs = tuple(batch_shape)
    except TypeError:
        raise TypeError(f"batch_shape must be a tuple of integers, got {type(batch_shape).__name__}") from None
    for x in bs:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
            raise ValueError(f"batch_shape must hold non-negative integers, got {bs}")
    return tuple(int(x) for x in bs)


def _check_state_dtype(dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be float32 or float64, got {dtype!r}") from None
    if dt not in _STATE_DTYPES:
        raise TypeError(f"dtype must be float32 or float64 (the state's accumulation precision), got {dt}")
    return dt


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """float16 inputs are computed in float32 (Numba has no float16 on the CPU)."""
    return np.dtype(np.float32) if dtype == _F16 else dtype


def _cuda_mod():
    from ..ops.step import cuda as _scuda

    return _scuda


def _is_sim_array(x) -> bool:
    return "simulator" in type(x).__module__ and hasattr(x, "copy_to_host")


def _on_gpu(x) -> bool:
    return is_device_array(x) or _is_sim_array(x)


def _as_device_array(name, x):
    """A Numba device array viewing ``x`` (zero copy)."""
    if _is_sim_array(x) or type(x).__module__.startswith("numba.cuda"):
        return x
    from numba import cuda

    try:
        return cuda.as_cuda_array(x)
    except Exception as exc:
        raise TypeError(f"{name}: cannot view this GPU array through __cuda_array_interface__ ({exc})") from exc


def _check_shapes(batch_shape, pairs):
    """pairs: [(name, array, last_dim)]: batch shape, last dims and equal T (axis -2). Returns T."""
    nb = len(batch_shape)
    T = None
    for name, x, last in pairs:
        shp = tuple(x.shape)
        if len(shp) != nb + 2 or shp[:nb] != batch_shape or shp[-1] != last:
            label = "value_dim" if name == "v" else "key_dim"
            raise ValueError(
                f"{name} must have shape {batch_shape + ('T', last)} (batch_shape {batch_shape}, "
                f"T tokens, {label} {last}), got {shp}"
            )
        if T is None:
            T = shp[-2]
        elif shp[-2] != T:
            raise ValueError(
                f"{', '.join(n for n, _, _ in pairs)} must have the same number of tokens T (axis -2), "
                f"got shapes {', '.join(str(tuple(a.shape)) for _, a, _ in pairs)}"
            )
    return int(T)


def _aligned_zeros(shape, dtype, align=64):
    """Zeros whose data starts on a cache-line boundary (NumPy only guarantees 16 bytes):
    a decode step streams every row of S, and unaligned 256-byte rows touch five lines, not four."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    buf = np.zeros(n * dtype.itemsize + align, dtype=np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n * dtype.itemsize].view(dtype).reshape(shape)


def _flat(x, dtype, shape):
    """C-contiguous ``dtype`` copy (or view) of ``x`` reshaped to ``shape`` (B, T, F)."""
    return np.ascontiguousarray(x, dtype=dtype).reshape(shape)


class _Inputs:
    """Validated, flattened inputs of one call."""

    __slots__ = ("arrays", "T", "dtype", "work", "device_inputs")


# ---------------------------------------------------------------------------
# Feature-map description for save/load
# ---------------------------------------------------------------------------
def _probe(d: int) -> np.ndarray:
    """A fixed input on which a rebuilt feature map must reproduce the saved one."""
    return np.linspace(-2.0, 2.0, 3 * d).reshape(3, d)


def _probe_features(fmap, d: int) -> np.ndarray:
    x = _probe(d)
    return np.asarray(fmap.apply(x, role="key", causal=True, offset=0, total_length=3), dtype=np.float64)


def _feature_map_spec(fmap, d: int):
    """(params_json, arrays, rebuild_error): how to rebuild ``fmap`` through the registry."""
    cls = type(fmap)
    name = getattr(fmap, "name", "")
    if not name:
        return "", {}, f"{cls.__name__} has no registry name"
    params, arrays = {}, {}
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        for p in list(sig.parameters.values())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            for attr in (p.name, "_" + p.name):
                if hasattr(fmap, attr):
                    val = getattr(fmap, attr)
                    break
            else:
                return "", {}, (f"parameter {p.name!r} of {cls.__name__} is not stored as an attribute "
                                f"({p.name!r} or '_{p.name}')")
            if isinstance(val, np.ndarray):
                if val.dtype.kind not in "biuf":
                    return "", {}, f"parameter {p.name!r} is a {val.dtype} array"
                arrays[p.name] = val
                continue
            if isinstance(val, np.generic):
                val = val.item()
            if isinstance(val, tuple):
                val = list(val)
            try:
                json.dumps(val, allow_nan=False)
            except (TypeError, ValueError):
                return "", {}, f"parameter {p.name!r} ({type(val).__name__}) cannot be written to a file"
            params[p.name] = val
    try:
        rebuilt = fm.get(name, **params, **arrays)
    except Exception as exc:
        return "", {}, f"feature_maps.get({name!r}, ...) failed: {type(exc).__name__}: {exc}"
    if type(rebuilt) is not cls:
        return "", {}, (f"the registry builds {type(rebuilt).__name__} for {name!r}, "
                        f"not {cls.__name__}")
    try:
        same = np.array_equal(_probe_features(rebuilt, d), _probe_features(fmap, d), equal_nan=True)
    except Exception as exc:
        return "", {}, f"the rebuilt map fails on a probe input: {type(exc).__name__}: {exc}"
    if not same:
        return "", {}, "the map rebuilt from its parameters gives different features (hidden state?)"
    return json.dumps(params, allow_nan=False, sort_keys=True), arrays, ""


def _atomic_savez(path, arrays: dict) -> None:
    """``np.savez`` into a temporary file in the target's directory, then ``os.replace``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
            os.chmod(tmp, mode)
        except OSError:  # pragma: no cover - exotic file systems
            pass
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---------------------------------------------------------------------------
# The linear-attention state
# ---------------------------------------------------------------------------
class LinearAttentionState:
    r"""Recurrent state of causal linear attention, for decoding and segment-wise processing.

    Holds ``S = sum_j phi(k_j) v_j^T`` (shape ``(*batch_shape, D_phi, M)``),
    ``z = sum_j phi(k_j)`` (``(*batch_shape, D_phi)``) and the number of
    tokens absorbed (``position``), for the feature map it was built with.
    Memory and time per token are constant in the context length
    (Katharopoulos et al. 2020, §3.4).

    Parameters
    ----------
    key_dim : int
        D, the last dimension of queries and keys.
    value_dim : int
        M, the last dimension of values.
    batch_shape : tuple of int, default ()
        Leading dimensions of every input, e.g. ``(batch, heads)``.
    feature_map : str, FeatureMap or None, default "elu"
        As in :func:`linattn_nb.linear_attention`; ``None`` when queries and
        keys already are features.
    dtype : {numpy.float64, numpy.float32}
        Precision of the state and of the kernels' accumulation.  float64
        reproduces :func:`linattn_nb.linear_attention` (whose state is
        float64) to round-off; float32 halves memory and time.
    device : {"auto", "cpu", "cuda"}
        Where the state lives.  ``"auto"`` is decided by the first inputs
        (:mod:`linattn_nb.device`): GPU arrays move the state to the GPU,
        anything else keeps it on the host; it is then fixed.
    eps : float or None, default 1e-8
        Floor of the normaliser, as in :func:`linattn_nb.linear_attention`.

    Attributes
    ----------
    S, z : ndarray
        Read-only views of the state (device arrays on the GPU).
    position : int
        Tokens absorbed so far (the position of the next token; position-
        dependent feature maps use it as the offset).
    nbytes : int
        Bytes of ``S`` and ``z``: constant in the context length.

    Notes
    -----
    Every method takes all batch entries and heads in one Numba kernel call.
    On the CPU, ``S`` is stored transposed (one ``(M, D_phi)`` block per batch
    entry) so that a decode step fuses the update and the read into one
    contiguous pass (:mod:`linattn_nb.ops.step`); :attr:`S` shows the
    canonical ``(D_phi, M)`` view.

    Examples
    --------
    >>> import numpy as np
    >>> from linattn_nb import LinearAttentionState, linear_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.normal(size=(2, 4, 10, 8))          # (heads=4, T=10, D=8)
    >>> v = rng.normal(size=(4, 10, 6))
    >>> st = LinearAttentionState(8, 6, batch_shape=(4,))
    >>> st.prefill(k[:, :7], v[:, :7])                  # a prompt of 7 tokens
    >>> out = st.step(q[:, 7:], k[:, 7:], v[:, 7:])     # then 3 more
    >>> ref = linear_attention(q, k, v, causal=True)
    >>> bool(np.allclose(out, ref[:, 7:])), st.position
    (True, 10)
    """

    def __init__(self, key_dim, value_dim, *, batch_shape=(), feature_map="elu", dtype=np.float64,
                 device="auto", eps=config.DEFAULT_EPS):
        d = _check_dim("key_dim", key_dim)
        m = _check_dim("value_dim", value_dim)
        bs = _check_batch_shape(batch_shape)
        fmap = fm.resolve(feature_map)
        dt = _check_state_dtype(dtype)
        eps = V.check_eps(eps)
        check_device_arg(device)
        f = int(fmap.output_dim(d))
        if f < 1:
            raise ValueError(f"feature map {fmap.name!r} has output_dim({d}) = {f}; it must be >= 1")
        self._init_fields(d, m, f, bs, fmap, dt, eps)
        B = self._B
        self._S = _aligned_zeros((B, m, f), dt)
        self._z = _aligned_zeros((B, f), dt)
        self._feat = _aligned_zeros((2, B, f), dt)
        self._work = _aligned_zeros((2, B * f), np.float64)
        self._position = 0
        self._device = None
        if device != "auto":
            self._set_device(resolve_device(device))

    def _init_fields(self, d, m, f, bs, fmap, dt, eps):
        self._d, self._m, self._f = d, m, f
        self._bs = bs
        self._nb = len(bs)
        self._B = int(np.prod(bs, dtype=np.int64))
        self._fmap = fmap
        self._code = None if fmap.kernel_code is None else int(fmap.kernel_code)
        self._dtype = dt
        self._eps = eps
        self._eps_f = _cpu.eps_arg(eps)
        self._c_code = np.int64(self._code if self._code is not None else 0)
        self._vtail = (m,)
        self._kern1 = _cpu.pick_step_kernel(self._B, 1, m, f)
        self._q1 = bs + (1, d)
        self._v1 = bs + (1, m)
        self._qk3 = (self._B, 1, d)
        self._o1 = (self._B, 1, m)
        self._entry = {}
        self._fast = self._code is not None

    # -- device ---------------------------------------------------------------
    def _set_device(self, dev):
        """Fix the device; move the (host) state to the GPU for "cuda"."""
        if dev == "cuda":
            from numba import cuda

            S = np.ascontiguousarray(self._S.transpose(0, 2, 1))
            self._S = cuda.to_device(S)
            self._z = cuda.to_device(self._z)
            self._feat = cuda.device_array((self._B, 3, self._f), dtype=self._dtype)
            self._fast = False
        self._device = dev

    def _resolve(self, arrays, names):
        """The device these inputs run on (the state's, or for "auto" the data's); refuses
        inputs from the other side.  Does not fix an undecided device: :meth:`_prepare`
        does that once the inputs are valid."""
        gpu = [n for n, a in zip(names, arrays) if _on_gpu(a)]
        if self._device is None:
            if gpu and len(gpu) != len(arrays):
                host = [n for n in names if n not in gpu]
                raise ValueError(f"inputs live on different devices: {', '.join(gpu)} on the GPU, "
                                 f"{', '.join(host)} on the host; move them to one device first")
            return resolve_device("cuda") if gpu else "cpu"
        if self._device == "cpu" and gpu:
            raise ValueError(f"this state lives on the host (device='cpu') but {', '.join(gpu)} live on "
                             "the GPU; copy them to the host first (or build the state with device='cuda')")
        return self._device

    # -- properties -------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self._d

    @property
    def value_dim(self) -> int:
        return self._m

    @property
    def feature_dim(self) -> int:
        """D_phi = feature_map.output_dim(key_dim)."""
        return self._f

    @property
    def batch_shape(self) -> tuple:
        return self._bs

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def feature_map(self):
        return self._fmap

    @property
    def eps(self):
        return self._eps

    @property
    def device(self) -> str:
        """"cpu", "cuda", or "auto" while no input has decided it."""
        return self._device or "auto"

    @property
    def position(self) -> int:
        return self._position

    @property
    def nbytes(self) -> int:
        """Bytes held by S and z (scratch excluded): independent of the context length."""
        item = self._dtype.itemsize
        return self._B * self._f * (self._m + 1) * item

    @property
    def S(self):
        """``sum_j phi(k_j) v_j^T``, shape ``(*batch_shape, D_phi, M)`` (a read-only view on the host)."""
        if self._device == "cuda":
            return self._S.reshape(self._bs + (self._f, self._m))
        view = self._S.transpose(0, 2, 1).reshape(self._bs + (self._f, self._m))
        view.flags.writeable = False
        return view

    @property
    def z(self):
        """``sum_j phi(k_j)``, shape ``(*batch_shape, D_phi)``."""
        if self._device == "cuda":
            return self._z.reshape(self._bs + (self._f,))
        view = self._z.reshape(self._bs + (self._f,))
        view.flags.writeable = False
        return view

    def _host_arrays(self):
        """Canonical host copies: S (*bs, F, M), z (*bs, F)."""
        if self._device == "cuda":
            S = self._S.copy_to_host()
            z = self._z.copy_to_host()
        else:
            S = np.ascontiguousarray(self._S.transpose(0, 2, 1))
            z = self._z.copy()
        return S.reshape(self._bs + (self._f, self._m)), z.reshape(self._bs + (self._f,))

    def __repr__(self) -> str:
        return (f"LinearAttentionState(key_dim={self._d}, value_dim={self._m}, batch_shape={self._bs}, "
                f"feature_map={self._fmap!r}, dtype={self._dtype.name}, device={self.device!r}, "
                f"position={self._position}, nbytes={self.nbytes})")

    # -- input handling ----------------------------------------------------------
    def _prepare(self, pairs, check_finite, roles):
        """Validate and flatten inputs; return an _Inputs (host or device arrays of (B, T, *))."""
        names = [n for n, _, _ in pairs]
        dev = self._resolve([x for _, x, _ in pairs], names)
        res = self._prepare_on(dev, pairs, names, check_finite, roles)
        if self._device is None:
            self._set_device(dev)
        return res

    def _prepare_on(self, dev, pairs, names, check_finite, roles):
        res = _Inputs()
        if dev == "cuda" and any(_on_gpu(x) for _, x, _ in pairs):
            if not all(_on_gpu(x) for _, x, _ in pairs):
                host = [n for n, x, _ in pairs if not _on_gpu(x)]
                raise ValueError(f"inputs live on different devices: {', '.join(host)} on the host")
            arrs = [(n, _as_device_array(n, x), last) for n, x, last in pairs]
            T = _check_shapes(self._bs, arrs)
            dts = {np.dtype(a.dtype) for _, a, _ in arrs}
            if len(dts) != 1 or next(iter(dts)) not in _STATE_DTYPES:
                raise TypeError(
                    "GPU inputs must share one dtype, float32 or float64 (no conversion on the device), "
                    f"got {', '.join(f'{n}: {a.dtype}' for n, a, _ in arrs)}"
                )
            out = []
            for n, a, last in arrs:
                if not a.is_c_contiguous():
                    raise ValueError(f"{n} must be C-contiguous on the GPU")
                out.append(a.reshape((self._B, T, last)))
            res.arrays, res.T = out, T
            res.dtype = res.work = next(iter(dts))
            res.device_inputs = True
            if self._code is None:
                raise ValueError(
                    f"feature map {self._fmap.name!r} has no inline (elementwise) form for the GPU "
                    "kernels; pass host arrays, or compute the features and use feature_map=None"
                )
            if check_finite:
                bad = _cuda_mod().check_nonfinite(*out)
                if bad:
                    self._raise_nonfinite(names[bad - 1])
            return res
        arrs = []
        for n, x, last in pairs:
            x = V.as_host_array(n, x)
            V.check_float_dtype(n, x.dtype)
            arrs.append((n, x, last))
        T = _check_shapes(self._bs, arrs)
        dtype = np.dtype(np.result_type(*[a.dtype for _, a, _ in arrs]))
        work = _work_dtype(dtype)
        flat = []
        if self._code is None:
            if check_finite:
                for n, a, _ in arrs:
                    V.check_finite(n, a)
            kw = dict(causal=True, offset=self._position, total_length=self._position + T)
            for (n, a, last), role in zip(arrs, roles):
                if role is None:
                    flat.append(_flat(a, work, (self._B, T, last)))
                    continue
                feats = self._fmap.apply(np.asarray(a, dtype=work), role=role, **kw)
                feats = np.asarray(feats)
                if feats.shape != a.shape[:-1] + (self._f,):
                    raise ValueError(
                        f"feature map {self._fmap.name!r} returned features of shape {feats.shape} for "
                        f"{n} of shape {a.shape}; output_dim({self._d}) says {self._f}"
                    )
                flat.append(_flat(feats, work, (self._B, T, self._f)))
        else:
            for n, a, last in arrs:
                flat.append(_flat(a, work, (self._B, T, last)))
        res.arrays, res.T, res.dtype, res.work = flat, T, dtype, work
        res.device_inputs = False
        return res

    def _finish(self, out, inp):
        """Reshape (B, T, M) to the batch shape; cast float16 back; host copy for host inputs."""
        shape = self._bs + (inp.T, self._m)
        if self._device == "cuda" and not inp.device_inputs:
            out = out.copy_to_host()
        if inp.device_inputs:
            return out.reshape(shape)
        out = out.reshape(shape)
        if out.dtype != inp.dtype:
            out = out.astype(inp.dtype)
        return out

    def _to_dev(self, arrays):
        from numba import cuda

        return [cuda.to_device(np.ascontiguousarray(a)) for a in arrays]

    # -- the API ------------------------------------------------------------------------
    def step(self, q, k, v, *, check_finite=True):
        """Absorb T new tokens and return their outputs, exactly as the causal kernel would.

        Token t first updates the state, then reads it (its output includes
        itself), as in :func:`linattn_nb.linear_attention` with
        ``causal=True``.

        Parameters
        ----------
        q, k : array_like, shape (*batch_shape, T, key_dim)
        v : array_like, shape (*batch_shape, T, value_dim)
            float16/32/64 (mixed dtypes promote to the widest), host or GPU
            arrays (GPU arrays: one dtype, float32 or float64).  T >= 0.
        check_finite : bool, default True
            Raise ValueError, leaving the state untouched, when an input
            holds NaN or inf.  On the CPU the check runs inside the kernel
            (a few hundred nanoseconds per decode step).

        Returns
        -------
        ndarray, shape (*batch_shape, T, value_dim)
            In the promoted input dtype (a device array for GPU inputs).

        Raises
        ------
        ValueError
            Shapes that do not match the state, non-finite inputs, inputs on
            another device than the state.
        TypeError
            Non-floating inputs.

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState
        >>> st = LinearAttentionState(4, 3, dtype=np.float32)
        >>> x = np.ones((1, 4), dtype=np.float32)
        >>> st.step(x, x, np.ones((1, 3), dtype=np.float32)).tolist()
        [[1.0, 1.0, 1.0]]
        """
        # Fast path (the decode loop): host NumPy arrays of one native dtype, C-contiguous,
        # an elementwise map, a host state.  A few tuple compares, one allocation, one call.
        if self._fast and type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray:
            dt = q.dtype
            shp = q.shape
            if (k.dtype is dt and v.dtype is dt and (dt is _F32 or dt is _F64) and k.shape == shp
                    and q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous):
                if shp == self._q1 and v.shape == self._v1:
                    T = 1
                    res = out = np.empty(self._o1, dt)
                    if self._nb != 1:
                        q, k, v = q.reshape(self._qk3), k.reshape(self._qk3), v.reshape(self._o1)
                        res = out.reshape(self._v1)
                    ep = self._entry.get(dt)
                    if ep is None:
                        ep = self._entry_point(dt, (q, k, v, out))
                    bad = ep(q, k, v, self._S, self._z, out, self._feat, self._work, self._c_code,
                             self._eps_f, check_finite)
                elif (len(shp) == self._nb + 2 and shp[-1] == self._d and shp[:-2] == self._bs
                        and v.shape == shp[:-1] + self._vtail):
                    T = shp[-2]
                    B = self._B
                    res = np.empty(shp[:-1] + self._vtail, dtype=dt)
                    out = res.reshape(B, T, self._m)
                    kern = _cpu.pick_step_kernel(B, T, self._m, self._f)
                    bad = kern(q.reshape(B, T, self._d), k.reshape(B, T, self._d), v.reshape(B, T, self._m),
                               self._S, self._z, out, self._feat, self._work, self._c_code, self._eps_f,
                               check_finite)
                else:
                    T = -1
                if T >= 0:
                    if bad:
                        self._raise_nonfinite(("q", "k", "v")[bad - 1])
                    self._position += T
                    if self._device is None:
                        self._device = "cpu"
                    return res
        inp = self._prepare([("q", q, self._d), ("k", k, self._d), ("v", v, self._m)], check_finite,
                            ("query", "key", None))
        qf, kf, vf = inp.arrays
        T = inp.T
        if self._device == "cuda":
            from numba import cuda

            if not inp.device_inputs:
                if check_finite and self._code is not None:
                    for n, a in zip("qkv", (qf, kf, vf)):
                        V.check_finite(n, a)
                qf, kf, vf = self._to_dev((qf, kf, vf))
            out = cuda.device_array((self._B, T, self._m), dtype=inp.work)
            _cuda_mod().state_step(qf, kf, vf, self._S, self._z, out, self._feat,
                                   code=self._c_code, eps=self._eps)
        else:
            out = np.empty((self._B, T, self._m), dtype=inp.work)
            kern = _cpu.pick_step_kernel(self._B, T, self._m, self._f)
            bad = kern(qf, kf, vf, self._S, self._z, out, self._feat, self._work, self._c_code,
                       self._eps_f, bool(check_finite and self._code is not None))
            if bad:
                self._raise_nonfinite(("q", "k", "v")[bad - 1])
        self._position += T
        return self._finish(out, inp)

    def _entry_point(self, dt, arrays):
        """The compiled single-token kernel for input dtype ``dt``, called without Numba's
        dispatch (about 0.3 us of a ~10 us decode step).  Only used on the fast path, whose
        checks fix every argument type (C-contiguous 3-D arrays of ``dt``, the state's own
        arrays, int64, float64, bool)."""
        from numba import typeof

        q, k, v, out = arrays
        sig = tuple(typeof(a) for a in (q, k, v, self._S, self._z, out, self._feat, self._work,
                                        self._c_code, self._eps_f, True))
        ep = self._kern1.compile(sig)  # loads from the on-disk cache, or compiles once
        self._entry[dt] = ep
        return ep

    @staticmethod
    def _raise_nonfinite(name):
        raise ValueError(f"{name} contains non-finite values (NaN or inf); nothing was changed. "
                         "Pass check_finite=False to skip this check")

    def query(self, q, *, check_finite=True):
        """Read the state for T queries without changing it.

        Every query sees the same state (the tokens absorbed so far); for
        position-dependent maps the queries take positions from
        :attr:`position` on, like the next tokens would.

        Parameters
        ----------
        q : array_like, shape (*batch_shape, T, key_dim)
        check_finite : bool, default True

        Returns
        -------
        ndarray, shape (*batch_shape, T, value_dim)
            ``phi(q)^T S / max(phi(q)^T z, eps)`` in the input dtype.

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState
        >>> st = LinearAttentionState(2, 2)
        >>> st.prefill(np.zeros((1, 2)), np.array([[1.0, 2.0]]))
        >>> st.query(np.zeros((1, 2))).tolist(), st.position
        ([[1.0, 2.0]], 1)
        """
        inp = self._prepare([("q", q, self._d)], check_finite, ("query",))
        (qf,) = inp.arrays
        if self._device == "cuda":
            from numba import cuda

            if not inp.device_inputs:
                if check_finite and self._code is not None:
                    V.check_finite("q", qf)
                (qf,) = self._to_dev((qf,))
            out = cuda.device_array((self._B, inp.T, self._m), dtype=inp.work)
            _cuda_mod().state_query(qf, self._S, self._z, out, self._feat, code=self._c_code, eps=self._eps)
        else:
            if check_finite and self._code is not None:
                V.check_finite("q", qf)
            out = np.empty((self._B, inp.T, self._m), dtype=inp.work)
            _cpu.state_query(qf, self._S, self._z, out, self._feat, code=self._c_code, eps=self._eps)
        return self._finish(out, inp)

    def prefill(self, k, v, *, check_finite=True):
        """Absorb a prompt: afterwards the state equals the causal kernels' final state.

        Parameters
        ----------
        k : array_like, shape (*batch_shape, T, key_dim)
        v : array_like, shape (*batch_shape, T, value_dim)
        check_finite : bool, default True
            Raise ValueError (state untouched) on NaN or inf.

        Returns
        -------
        None

        Examples
        --------
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState, linear_attention
        >>> rng = np.random.default_rng(1)
        >>> k, v = rng.normal(size=(2, 50, 4))
        >>> st = LinearAttentionState(4, 4)
        >>> st.prefill(k, v)
        >>> _, ref = linear_attention(k, k, v, causal=True, return_state=True)
        >>> bool(np.allclose(st.S, ref.S)), bool(np.allclose(st.z, ref.z)), st.position
        (True, True, 50)
        """
        inp = self._prepare([("k", k, self._d), ("v", v, self._m)], check_finite, ("key", None))
        kf, vf = inp.arrays
        if self._device == "cuda":
            if not inp.device_inputs:
                if check_finite and self._code is not None:
                    for n, a in (("k", kf), ("v", vf)):
                        V.check_finite(n, a)
                kf, vf = self._to_dev((kf, vf))
            _cuda_mod().state_prefill(kf, vf, self._S, self._z, code=self._c_code)
        else:
            if check_finite and self._code is not None:
                bad = _cpu.first_nonfinite(kf, kf, vf)
                if bad:
                    self._raise_nonfinite("k" if bad < 3 else "v")
            _cpu.state_prefill(kf, vf, self._S, self._z, code=self._c_code)
        self._position += inp.T

    def reset(self) -> None:
        """Back to the zero state at position 0 (device and buffers kept)."""
        if self._device == "cuda":
            from numba import cuda

            self._S = cuda.to_device(np.zeros((self._B, self._f, self._m), dtype=self._dtype))
            self._z = cuda.to_device(np.zeros((self._B, self._f), dtype=self._dtype))
        else:
            self._S[...] = 0
            self._z[...] = 0
        self._position = 0

    def copy(self) -> "LinearAttentionState":
        """An independent copy (same device)."""
        new = object.__new__(type(self))
        new._init_fields(self._d, self._m, self._f, self._bs, self._fmap, self._dtype, self._eps)
        new._position = self._position
        new._device = self._device
        new._fast = self._fast
        if self._device == "cuda":
            from numba import cuda

            new._S = cuda.device_array_like(self._S)
            new._S.copy_to_device(self._S)
            new._z = cuda.device_array_like(self._z)
            new._z.copy_to_device(self._z)
            new._feat = cuda.device_array((self._B, 3, self._f), dtype=self._dtype)
        else:
            new._S = _aligned_zeros(self._S.shape, self._dtype)
            new._S[...] = self._S
            new._z = self._z.copy()
            new._feat = _aligned_zeros(self._feat.shape, self._dtype)
            new._work = _aligned_zeros(self._work.shape, np.float64)
        return new

    def to_linear_state(self) -> LinearState:
        """The state as a float64 host :class:`~linattn_nb.LinearState` (for ``initial_state=``)."""
        S, z = self._host_arrays()
        return LinearState(np.asarray(S, dtype=np.float64), np.asarray(z, dtype=np.float64), self._position)

    @classmethod
    def from_linear_state(cls, state, key_dim, *, feature_map="elu", dtype=np.float64, device="auto",
                          eps=config.DEFAULT_EPS) -> "LinearAttentionState":
        """Build a state from ``linear_attention(..., return_state=True)``'s result.

        The batch shape and value dimension come from ``state.S``; the feature
        map must be the one that produced it (its ``output_dim(key_dim)`` must
        equal ``S.shape[-2]``).
        """
        S = V.as_host_array("state.S", state[0] if isinstance(state, tuple) else state.S)
        z = V.as_host_array("state.z", state[1] if isinstance(state, tuple) else state.z)
        position = int(state[2] if isinstance(state, tuple) and len(state) > 2 else getattr(state, "position", 0))
        if S.ndim < 2:
            raise ValueError(f"state.S must have shape (..., D_phi, M), got {S.shape}")
        new = cls(key_dim, S.shape[-1], batch_shape=S.shape[:-2], feature_map=feature_map, dtype=dtype,
                  device="cpu", eps=eps)
        new._load_arrays(S, z, position, "state")
        if device != "cpu":
            new._device = None
            if device == "cuda":
                new._set_device(resolve_device("cuda"))
        return new

    def _load_arrays(self, S, z, position, what):
        want_S = self._bs + (self._f, self._m)
        want_z = self._bs + (self._f,)
        if tuple(S.shape) != want_S or tuple(z.shape) != want_z:
            raise ValueError(f"{what}: S must have shape {want_S} and z {want_z} (feature map "
                             f"{self._fmap.name!r}, D_phi={self._f}), got {tuple(S.shape)} and {tuple(z.shape)}")
        V.check_float_dtype(f"{what}.S", S.dtype)
        V.check_float_dtype(f"{what}.z", z.dtype)
        V.check_finite(f"{what}.S", S)
        V.check_finite(f"{what}.z", z)
        if position < 0:
            raise ValueError(f"{what}: position must be >= 0, got {position}")
        self._S[...] = np.asarray(S).reshape((self._B, self._f, self._m)).transpose(0, 2, 1)
        self._z[...] = np.asarray(z).reshape((self._B, self._f))
        self._position = int(position)

    # -- files ---------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the state to ``path`` (.npz, format version :data:`FORMAT_VERSION`).

        The file holds S and z bit for bit, the position, the dimensions, eps,
        and the feature map's registry name and parameters (with the features
        of a fixed probe input, so that :meth:`load` can check the rebuilt
        map).  A map that cannot be rebuilt from the registry is recorded as
        such; loading then needs ``feature_map=``.  The write is atomic: a
        temporary file in the same directory, fsync'ed, then ``os.replace``,
        so an interrupted save never leaves a half-written file at ``path``.

        Examples
        --------
        >>> import os, tempfile
        >>> import numpy as np
        >>> from linattn_nb import LinearAttentionState
        >>> st = LinearAttentionState(4, 2, batch_shape=(3,), dtype=np.float32)
        >>> st.prefill(np.ones((3, 5, 4)), np.ones((3, 5, 2)))
        >>> path = os.path.join(tempfile.mkdtemp(), "state.npz")
        >>> st.save(path)
        >>> back = LinearAttentionState.load(path)
        >>> back.position, back.dtype, bool(np.array_equal(back.S, st.S))
        (5, dtype('float32'), True)
        """
        S, z = self._host_arrays()
        params, parrays, err = _feature_map_spec(self._fmap, self._d)
        try:
            probe = _probe_features(self._fmap, self._d)
        except Exception:  # pragma: no cover - a map that cannot featurise the probe
            probe = np.zeros((0, self._f))
        arrays = {
            "format": np.array(FORMAT_NAME),
            "version": np.array(FORMAT_VERSION, dtype=np.int64),
            "S": S,
            "z": z,
            "position": np.array(self._position, dtype=np.int64),
            "key_dim": np.array(self._d, dtype=np.int64),
            "value_dim": np.array(self._m, dtype=np.int64),
            "batch_shape": np.array(self._bs, dtype=np.int64).reshape(-1),
            "eps": np.array(np.nan if self._eps is None else self._eps, dtype=np.float64),
            "feature_map": np.array(getattr(self._fmap, "name", "") or ""),
            "feature_map_class": np.array(f"{type(self._fmap).__module__}.{type(self._fmap).__qualname__}"),
            "feature_map_params": np.array(params),
            "feature_map_rebuild_error": np.array(err),
            "feature_map_probe": probe,
        }
        for name, arr in parrays.items():
            arrays["feature_map_param__" + name] = arr
        _atomic_savez(path, arrays)

    @classmethod
    def load(cls, path, *, feature_map=None, device="auto", key_dim=None, value_dim=None, batch_shape=None,
             dtype=None) -> "LinearAttentionState":
        """Read a state written by :meth:`save`.

        Parameters
        ----------
        path : str or os.PathLike
        feature_map : str or FeatureMap, optional
            Use this map instead of rebuilding the saved one; it must give the
            saved features on the probe input.
        device : {"auto", "cpu", "cuda"}
        key_dim, value_dim, batch_shape, dtype : optional
            When given, the file must match them.

        Returns
        -------
        LinearAttentionState

        Raises
        ------
        StateFileError (a ValueError)
            The file is not a readable .npz (corrupted or truncated), is not a
            state file, has another format version, misses entries, holds
            inconsistent shapes or dtypes or non-finite values, its feature
            map cannot be rebuilt, or it does not match the expectations.
        FileNotFoundError
            No file at ``path``.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no state file at {path!r}")
        try:
            with np.load(path, allow_pickle=False) as npz:
                keys = set(npz.files)
                if "format" not in keys or "version" not in keys:
                    raise StateFileError(f"{path}: not a LinearAttentionState file (no format/version entries; "
                                         f"entries: {sorted(keys)})")
                data = {name: npz[name] for name in keys}
        except StateFileError:
            raise
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, RuntimeError) as exc:
            raise StateFileError(f"{path}: cannot read the state file, it is corrupted or truncated "
                                 f"({type(exc).__name__}: {exc})") from exc
        except Exception as exc:  # zlib.error and friends
            raise StateFileError(f"{path}: cannot read the state file ({type(exc).__name__}: {exc})") from exc
        return cls._from_file_data(path, data, feature_map=feature_map, device=device,
                                   expect=dict(key_dim=key_dim, value_dim=value_dim,
                                               batch_shape=batch_shape, dtype=dtype))

    @classmethod
    def _from_file_data(cls, path, data, *, feature_map, device, expect):
        def bad(msg):
            return StateFileError(f"{path}: {msg}")

        def scalar(name, kind):
            a = data[name]
            if a.shape != () or a.dtype.kind not in kind:
                raise bad(f"entry {name!r} must be a scalar of kind {kind!r}, got dtype {a.dtype} shape {a.shape}")
            return a.item()

        fmt = data["format"]
        if fmt.dtype.kind != "U" or fmt.shape != () or str(fmt) != FORMAT_NAME:
            raise bad(f"not a LinearAttentionState file (format {fmt!r})")
        version = scalar("version", "iu")
        if version > FORMAT_VERSION:
            raise bad(f"format version {version} was written by a newer linattn_nb; this one reads "
                      f"versions up to {FORMAT_VERSION}")
        if version < 1:
            raise bad(f"invalid format version {version}")
        missing = [k for k in _REQUIRED_KEYS if k not in data]
        if missing:
            raise bad(f"missing entries {missing} (truncated or hand-edited file?)")
        d = scalar("key_dim", "iu")
        m = scalar("value_dim", "iu")
        position = scalar("position", "iu")
        eps = scalar("eps", "f")
        bs_arr = data["batch_shape"]
        if bs_arr.ndim != 1 or bs_arr.dtype.kind not in "iu" or (bs_arr < 0).any():
            raise bad(f"entry 'batch_shape' must be a 1-d array of non-negative integers, got {bs_arr!r}")
        bs = tuple(int(x) for x in bs_arr)
        if d < 1 or m < 1 or position < 0:
            raise bad(f"invalid dimensions key_dim={d}, value_dim={m}, position={position}")
        if not (math.isnan(eps) or (eps >= 0 and math.isfinite(eps))):
            raise bad(f"invalid eps {eps}")
        S, z = data["S"], data["z"]
        if S.dtype not in _STATE_DTYPES or z.dtype != S.dtype:
            raise bad(f"S and z must both be float32 or float64, got {S.dtype} and {z.dtype}")
        # The feature map.
        name = str(data["feature_map"])
        rebuild_error = str(data["feature_map_rebuild_error"])
        probe = data["feature_map_probe"]
        if feature_map is None:
            if rebuild_error:
                raise bad(f"its feature map {name!r} cannot be rebuilt from the file ({rebuild_error}); "
                          "pass feature_map= to load()")
            try:
                params = json.loads(str(data["feature_map_params"]))
                if not isinstance(params, dict):
                    raise ValueError("parameters are not a JSON object")
            except ValueError as exc:
                raise bad(f"unreadable feature-map parameters ({exc})") from exc
            for key in data:
                if key.startswith("feature_map_param__"):
                    params[key[len("feature_map_param__"):]] = data[key]
            try:
                fmap = fm.get(name, **params)
            except Exception as exc:
                raise bad(f"cannot rebuild feature map {name!r} with {sorted(params)}: "
                          f"{type(exc).__name__}: {exc}") from exc
        else:
            fmap = fm.resolve(feature_map)
        f = int(fmap.output_dim(d))
        if S.shape != bs + (f, m) or z.shape != bs + (f,):
            raise bad(f"S has shape {S.shape} and z {z.shape}, expected {bs + (f, m)} and {bs + (f,)} "
                      f"(batch_shape {bs}, feature map {fmap.name!r} with D_phi={f}, value_dim {m})")
        if probe.size:
            try:
                same = np.array_equal(_probe_features(fmap, d), probe, equal_nan=True)
            except Exception as exc:
                raise bad(f"feature map {fmap.name!r} fails on the probe input: {exc}") from exc
            if not same:
                raise bad(f"feature map {fmap.name!r} gives other features than the map this state was "
                          "saved with")
        if not (np.isfinite(S).all() and np.isfinite(z).all()):
            raise bad("S or z holds non-finite values")
        # The caller's expectations.
        for key, got in (("key_dim", d), ("value_dim", m)):
            if expect[key] is not None and int(expect[key]) != got:
                raise bad(f"{key} is {got}, expected {expect[key]}")
        if expect["batch_shape"] is not None and _check_batch_shape(expect["batch_shape"]) != bs:
            raise bad(f"batch_shape is {bs}, expected {_check_batch_shape(expect['batch_shape'])}")
        if expect["dtype"] is not None and _check_state_dtype(expect["dtype"]) != S.dtype:
            raise bad(f"dtype is {S.dtype}, expected {np.dtype(expect['dtype'])}")
        new = cls(d, m, batch_shape=bs, feature_map=fmap, dtype=S.dtype, device="cpu",
                  eps=None if math.isnan(eps) else eps)
        new._S[...] = S.reshape((new._B, f, m)).transpose(0, 2, 1)
        new._z[...] = z.reshape((new._B, f))
        new._position = int(position)
        check_device_arg(device)
        if device != "cpu":
            new._device = None
            if device == "cuda":
                new._set_device(resolve_device("cuda"))
        return new


# ---------------------------------------------------------------------------
# The softmax baseline
# ---------------------------------------------------------------------------
def _kv_block() -> int:
    block = int(config.KV_BLOCK)
    if block < 1:
        raise ValueError(f"config.KV_BLOCK must be >= 1, got {block}")
    return block


class KVCache:
    r"""Softmax attention's decoding cache: every key and value, grown geometrically.

    The baseline :class:`LinearAttentionState` replaces: same ``prefill`` /
    ``step`` / ``query`` / ``nbytes`` API; a step attends to the whole cache,
    so its cost grows linearly with the context (Katharopoulos et al. 2020,
    §3.4 and Fig. 1).  Appends are amortised O(1): when the buffers are full
    they grow to ``max(needed, config.KV_GROWTH * capacity)``.

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
        Tokens to allocate up front (default ``config.KV_INITIAL_CAPACITY``).
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
        self._d = _check_dim("key_dim", key_dim)
        self._m = _check_dim("value_dim", value_dim)
        self._bs = _check_batch_shape(batch_shape)
        self._nb = len(self._bs)
        self._B = int(np.prod(self._bs, dtype=np.int64))
        self._dtype = _check_state_dtype(dtype)
        check_device_arg(device)
        if device == "cuda":
            raise ValueError("KVCache has a CPU kernel only (like softmax_attention); use device='cpu'")
        if scale is None:
            scale = 1.0 / math.sqrt(self._d)
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
        if not math.isfinite(float(scale)):
            raise ValueError(f"scale must be finite, got {scale}")
        self._scale = float(scale)
        cap = config.KV_INITIAL_CAPACITY if capacity is None else capacity
        if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, (int, np.integer)) or cap < 0:
            raise ValueError(f"capacity must be a non-negative integer, got {cap!r}")
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
        """Make room for ``tokens`` cached tokens in total (no growth until then)."""
        tokens = int(tokens)
        if tokens > self.capacity:
            self._grow_to(tokens)

    def _grow_to(self, cap):
        K = np.empty((self._B, cap, self._d), dtype=self._dtype)
        Vb = np.empty((self._B, cap, self._m), dtype=self._dtype)
        K[:, :self._len] = self._K[:, :self._len]
        Vb[:, :self._len] = self._V[:, :self._len]
        self._K, self._V = K, Vb

    def _append(self, k3, v3):
        T = k3.shape[1]
        need = self._len + T
        if need > self.capacity:
            self._grow_to(max(need, int(math.ceil(self.capacity * max(config.KV_GROWTH, 1.0)))))
        self._K[:, self._len:need] = k3
        self._V[:, self._len:need] = v3
        self._len = need

    def _prepare(self, pairs, check_finite):
        names = [n for n, _, _ in pairs]
        if any(_on_gpu(x) for _, x, _ in pairs):
            raise ValueError("KVCache has a CPU kernel only; copy the GPU inputs "
                             f"({', '.join(n for n, x, _ in pairs if _on_gpu(x))}) to the host first")
        resolve_device("cpu", *[x for _, x, _ in pairs], names=names)
        arrs = []
        for n, x, last in pairs:
            x = V.as_host_array(n, x)
            V.check_float_dtype(n, x.dtype)
            arrs.append((n, x, last))
        T = _check_shapes(self._bs, arrs)
        dtype = np.dtype(np.result_type(*[a.dtype for _, a, _ in arrs]))
        if check_finite:
            for n, a, _ in arrs:
                V.check_finite(n, a)
        flat = [_flat(a, self._dtype, (self._B, T, last)) for _, a, last in arrs]
        return flat, T, dtype

    def _attend(self, q3, T, causal_new, dtype):
        out = np.empty((self._B, T, self._m), dtype=self._dtype)
        if T and self._B:
            _cpu.kv_attend(q3, self._K, self._V, self._len, out, scale=self._scale, causal_new=causal_new)
        out = out.reshape(self._bs + (T, self._m))
        return out if out.dtype == dtype else out.astype(dtype)

    # -- the API --------------------------------------------------------------------
    def prefill(self, k, v, *, check_finite=True) -> None:
        """Append a prompt's keys and values (no outputs).

        Parameters
        ----------
        k : array_like, shape (*batch_shape, T, key_dim)
        v : array_like, shape (*batch_shape, T, value_dim)
        check_finite : bool, default True
        """
        (k3, v3), _, _ = self._prepare([("k", k, self._d), ("v", v, self._m)], check_finite)
        self._append(k3, v3)

    def step(self, q, k, v, *, check_finite=True):
        """Append T tokens and return their outputs: row t attends to the cache and new tokens <= t.

        Equals the last T rows of ``softmax_attention(..., causal=True)`` over
        the whole sequence.

        Parameters
        ----------
        q, k : array_like, shape (*batch_shape, T, key_dim)
        v : array_like, shape (*batch_shape, T, value_dim)
        check_finite : bool, default True

        Returns
        -------
        ndarray, shape (*batch_shape, T, value_dim), in the promoted input dtype.
        """
        dt = self._dtype
        if (type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray and q.dtype is dt
                and k.dtype is dt and v.dtype is dt and q.shape == self._q1 and k.shape == self._q1
                and v.shape == self._v1 and q.flags.c_contiguous and k.flags.c_contiguous
                and v.flags.c_contiguous):
            # Fast path (the decode loop), as lean as LinearAttentionState.step's.
            if self._nb != 1:
                q, k, v = q.reshape(self._qk3), k.reshape(self._qk3), v.reshape(self._o1)
            T = 1
            res = None
        else:
            (q, k, v), T, dtype = self._prepare([("q", q, self._d), ("k", k, self._d), ("v", v, self._m)],
                                                check_finite)
            res = dtype
        if self._len + T > self.capacity:
            self._grow_to(max(self._len + T, int(math.ceil(self.capacity * max(config.KV_GROWTH, 1.0)))))
        out = np.empty((self._B, T, self._m), dtype=dt)
        if self._B:
            kern = _cpu.pick_kv_kernel(self._B, T, self._len + T, self._d, self._m)
            bad = kern(q, k, v, self._K, self._V, np.int64(self._len), out, self._scale,
                       np.int64(_kv_block()), bool(check_finite and res is None))
            if bad:
                LinearAttentionState._raise_nonfinite(("q", "k", "v")[bad - 1])
        self._len += T
        out = out.reshape(self._bs + (T, self._m))
        if res is not None and out.dtype != res:
            out = out.astype(res)
        return out

    def query(self, q, *, check_finite=True):
        """Attend T queries to every cached token without appending anything."""
        (q3,), T, dtype = self._prepare([("q", q, self._d)], check_finite)
        if self._len == 0:
            raise ValueError("the cache is empty: a softmax over no keys is undefined")
        return self._attend(q3, T, False, dtype)

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

    def copy(self) -> "KVCache":
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._K = self._K[:, :self._len].copy()
        new._V = self._V[:, :self._len].copy()
        return new
