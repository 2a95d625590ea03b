"""The CUDA side of :func:`linattn_nb.linear_attention` (``device="cuda"``).

:func:`linattn_nb.attention.linear_attention` resolves the device
(:mod:`linattn_nb.device`) and, for ``"cuda"``, hands its arguments to
:func:`linear_attention_cuda`.  Two paths:

* **device inputs** (Numba device arrays, CuPy arrays, PyTorch CUDA tensors,
  anything with ``__cuda_array_interface__`` or a CUDA ``__dlpack__``; on the
  simulator its ``FakeCUDAArray``): zero-copy.  The leading batch dimensions
  are viewed as one or two batch axes without a copy whenever their strides
  allow (any contiguous array, and transposes such as ``(B, N, H, D) ->
  (B, H, N, D)``); otherwise a contiguous copy is made on the GPU.  The result
  is a Numba device array of shape ``(..., N, M)``, or the caller's ``out``.
  The final state (``return_state=True``) holds float64 Numba device arrays.
  The feature map must have an inline form (``kernel_code``: "elu", "relu",
  "squared_relu", "identity", or ``None``); others raise ValueError
  (compute the features yourself and pass ``feature_map=None``, or pass host
  arrays).  ``check_finite`` runs a counting kernel over q, k, v (one extra
  read of the inputs; ``check_finite=False`` skips it).
* **host inputs** with ``device="cuda"``: validated and (for maps without an
  inline form) featurised on the host as on the CPU path, copied to the GPU,
  and the result and the state copied back: NumPy in, NumPy out.

The kernels are the launchers registered in the method table under
``device="cuda"`` (:mod:`linattn_nb.ops.methods`).
"""
from __future__ import annotations

import numpy as np

from . import _validate as V
from . import config
from . import feature_maps as fm
from .device import cuda_status, is_device_array, is_simulator_array, on_device
from .ops.registry import get_method, select_auto

_SM_COUNT = None


def _cuda():
    from numba import cuda

    return cuda


def _kernels():
    from .ops import _cuda_kernels

    return _cuda_kernels


# ---------------------------------------------------------------------------
# Device arrays
# ---------------------------------------------------------------------------
def _wrap(name, x):
    """A Numba device array (or simulator array) viewing ``x``'s GPU memory."""
    if is_simulator_array(x):
        return x
    if cuda_status() == "simulator":
        raise RuntimeError(
            f"{name} lives in GPU memory but NUMBA_ENABLE_CUDASIM=1 is set: the simulator cannot "
            "read GPU memory; unset it, or pass host arrays"
        )
    cuda = _cuda()
    if type(x).__module__.startswith("numba.cuda") and hasattr(x, "__cuda_array_interface__"):
        return x
    err = None
    try:
        x.__cuda_array_interface__
        return cuda.as_cuda_array(x)
    except Exception as exc:  # e.g. torch tensors that require grad
        err = exc
    if is_device_array(x):  # a CUDA __dlpack__ without a readable array interface
        for mod in ("cupy", "torch"):
            try:
                lib = __import__(mod)
                return cuda.as_cuda_array(lib.from_dlpack(x))
            except ImportError:
                continue
            except Exception as exc:
                err = exc
                break
    raise TypeError(
        f"{name}: cannot read this GPU array ({type(x).__module__}.{type(x).__name__}): {err}. "
        "Pass an array with a readable __cuda_array_interface__ (for a PyTorch tensor that "
        "requires grad: tensor.detach()), or install CuPy to import DLPack arrays"
    )


class _meta:
    """shape (a plain tuple), ndim and dtype of an array, for the shared validators."""

    def __init__(self, x):
        self.shape = tuple(int(s) for s in x.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(x.dtype)


def _view4(x):
    """4-d view (B1, B2, rows, cols) of a device array of any ndim >= 1, or None."""
    K = _kernels()
    if x.ndim == 1:
        n = int(x.shape[0])
        s = int(x.strides[0])
        return K.strided_view(x, (1, 1, 1, n), (n * s, n * s, n * s, s))
    return K.as_4d(x)


def _copy_device(src, dst):
    """dst[...] = src[...] on the GPU (equal shapes, any strides and dtypes)."""
    K = _kernels()
    if int(np.prod(src.shape, dtype=np.int64)) == 0:
        return dst
    s4, d4 = _view4(src), _view4(dst)
    if s4 is None or d4 is None:  # unmergeable leading dims: copy 4-d slice by slice
        for idx in np.ndindex(*src.shape[:-3]):
            _copy_device(src[idx], dst[idx])
        return dst
    K.copy4d_kernel[K.helper_grid(s4.size)](s4, d4)
    return dst


def _contiguous(x, dtype=None):
    dtype = np.dtype(dtype or x.dtype)
    dst = _cuda().device_array(tuple(int(s) for s in x.shape), dtype=dtype)
    return _copy_device(x, dst)


def _input_4d(x):
    x4 = _view4(x)
    return x4 if x4 is not None else _view4(_contiguous(x))


def _count_nonfinite(x4) -> int:
    K = _kernels()
    cuda = _cuda()
    counter = cuda.to_device(np.zeros(1, dtype=np.int64))
    K.count_nonfinite_kernel[K.helper_grid(x4.size)](x4, counter)
    return int(counter.copy_to_host()[0])


def _check_finite_device(name, x4):
    if x4.size == 0:
        return
    bad = _count_nonfinite(x4)
    if bad:
        raise ValueError(
            f"{name} contains {bad} non-finite value(s) (NaN or inf); "
            "pass check_finite=False to skip this check"
        )


# ---------------------------------------------------------------------------
# Method selection
# ---------------------------------------------------------------------------
def multiprocessor_count() -> int:
    """Streaming multiprocessors of the current GPU (1 on the simulator)."""
    global _SM_COUNT
    if _SM_COUNT is None:
        try:
            if cuda_status() != "gpu":
                return 1
            _SM_COUNT = int(_cuda().get_current_device().MULTIPROCESSOR_COUNT)
        except Exception:  # pragma: no cover - exotic drivers
            _SM_COUNT = 1
    return _SM_COUNT


def select_method_cuda(method, *, causal, batch, n, f, m, dtype) -> str:
    """Resolve ``method`` for the CUDA launchers.

    ``"auto"``, causal: ``"scan"`` when its ``batch x column-block`` blocks
    give at least ``config.CUDA_AUTO_SCAN_BLOCKS_PER_SM`` blocks per
    multiprocessor, else the rows of ``config.AUTO_METHODS[(True, "cuda")]``
    by sequence length.  Non-causal: ``config.AUTO_METHODS[(False, "cuda")]``.
    """
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    if method != "auto":
        return method
    if causal:
        K = _kernels()
        MB = K.seq_config(f, m, np.dtype(K.acc_name(dtype)).itemsize)[3]
        blocks = batch * -(-m // MB)
        if blocks >= int(config.CUDA_AUTO_SCAN_BLOCKS_PER_SM) * multiprocessor_count():
            return "scan"
    return select_auto(causal=causal, device="cuda", batch=batch, n=n, d=f, m=m, dtype=dtype)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------
def linear_attention_cuda(q, k, v, *, feature_map, causal, method, eps, check_finite, out,
                          initial_state, return_state, host_inputs):
    """Run :func:`linattn_nb.linear_attention` on the GPU (arguments as there).

    ``host_inputs``: q, k, v are host arrays (copied over and back).
    """
    from .attention import _check_eps

    fmap = fm.resolve(feature_map)
    eps = _check_eps(eps)
    causal = bool(causal)
    if not isinstance(method, str):
        raise TypeError(f"method must be a string, got {type(method).__name__}")
    if host_inputs:
        return _run_host(q, k, v, fmap, causal, method, eps, check_finite, out, initial_state, return_state)
    return _run_device(q, k, v, fmap, causal, method, eps, check_finite, out, initial_state, return_state)


def _run_host(q, k, v, fmap, causal, method, eps, check_finite, out, initial_state, return_state):
    from .attention import LinearState, _check_state

    cuda = _cuda()
    K = _kernels()
    q, k, v, (batch_shape, n, d, m, dtype) = V.host_qkv(q, k, v, check_finite=check_finite)
    f = int(fmap.output_dim(d))
    K.seq_config(f, m, np.dtype(K.acc_name(dtype)).itemsize)  # F limit: fail before any work
    out_shape = batch_shape + (n, m)
    if out is not None:
        V.check_out(out, out_shape, dtype)
    b = int(np.prod(batch_shape, dtype=np.int64))
    name = select_method_cuda(method, causal=causal, batch=b, n=n, f=f, m=m, dtype=dtype)
    impl = get_method(name, causal=causal, device="cuda")
    if initial_state is not None:
        S, z, position = _check_state(_host_state(initial_state), batch_shape, f, m, check_finite)
    else:
        S = np.zeros((b, f, m))
        z = np.zeros((b, f))
        position = 0
    result = out if out is not None else np.empty(out_shape, dtype=dtype)
    if n > 0 and b > 0:
        if fmap.kernel_code is not None:
            code = int(fmap.kernel_code)
            qf = V.flatten_batch(q, dtype)
            kf = V.flatten_batch(k, dtype)
        else:
            code = 0
            work = np.dtype(np.float32) if dtype == np.float16 else dtype
            kw = dict(causal=causal, offset=position, total_length=position + n)
            qf = V.flatten_batch(fmap.apply(np.asarray(q, dtype=work), role="query", **kw), work)
            kf = V.flatten_batch(fmap.apply(np.asarray(k, dtype=work), role="key", **kw), work)
            if qf.shape[-1] != f or kf.shape[-1] != f:
                raise ValueError(
                    f"feature map {fmap.name!r} returned {qf.shape[-1]} features for D={d}, "
                    f"but output_dim({d}) says {f}"
                )
        vf = V.flatten_batch(v, dtype)
        dS = cuda.to_device(S)
        dz = cuda.to_device(z)
        dout = cuda.device_array((b, n, m), dtype=dtype)
        impl.launcher(cuda.to_device(qf), cuda.to_device(kf), cuda.to_device(vf), dS, dz, dout,
                      code=code, eps=eps)
        result[...] = dout.copy_to_host().reshape(out_shape)
        S = dS.copy_to_host()
        z = dz.copy_to_host()
    if not return_state:
        return result
    return result, LinearState(S.reshape(batch_shape + (f, m)), z.reshape(batch_shape + (f,)), position + n)


def _state_parts(initial_state):
    from .attention import LinearState

    if isinstance(initial_state, LinearState) or (
        isinstance(initial_state, tuple) and len(initial_state) in (2, 3)
    ):
        return initial_state[0], initial_state[1], (int(initial_state[2]) if len(initial_state) == 3 else 0)
    if hasattr(initial_state, "S") and hasattr(initial_state, "z"):
        return initial_state.S, initial_state.z, int(getattr(initial_state, "position", 0))
    raise TypeError(
        "initial_state must be a LinearState (or a tuple (S, z[, position])), "
        f"got {type(initial_state).__name__}"
    )


def _host_state(initial_state):
    """The initial state with any device arrays copied to the host."""
    S0, z0, position = _state_parts(initial_state)
    S0, z0 = (_to_host(x) if on_device(x) else x for x in (S0, z0))
    return (S0, z0, position)


def _to_host(x):
    if is_simulator_array(x):
        return np.array(x._ary)
    return _contiguous(_wrap("initial_state", x)).copy_to_host()


def _device_state(initial_state, batch_shape, b, f, m, check_finite):
    """float64 C-contiguous device copies (B, F, M), (B, F) of the initial state."""
    from .attention import _check_state

    cuda = _cuda()
    S0, z0, position = _state_parts(initial_state)
    if not (on_device(S0) and on_device(z0)):
        S, z, position = _check_state(_host_state(initial_state), batch_shape, f, m, check_finite)
        return cuda.to_device(S), cuda.to_device(z), position
    S0 = _wrap("initial_state.S", S0)
    z0 = _wrap("initial_state.z", z0)
    position = V.check_state_arrays(S0, z0, position, batch_shape, f, m)
    S = _contiguous(S0, np.float64).reshape((b, f, m))
    z = _contiguous(z0, np.float64).reshape((b, f))
    if check_finite and b > 0:
        _check_finite_device("initial_state.S", S.reshape((1, b, f, m)))
        _check_finite_device("initial_state.z", z.reshape((1, 1, b, f)))
    return S, z, position


def _run_device(q, k, v, fmap, causal, method, eps, check_finite, out, initial_state, return_state):
    from .attention import LinearState

    cuda = _cuda()
    K = _kernels()
    dq, dk, dv = _wrap("q", q), _wrap("k", k), _wrap("v", v)
    batch_shape, n, d, m, dtype = V.check_qkv(_meta(dq), _meta(dk), _meta(dv))
    if fmap.kernel_code is None:
        raise ValueError(
            f"feature map {fmap.name!r} has no inline CUDA form (only maps with a kernel_code: "
            f"{', '.join(repr(x) for x in _inline_maps())}); for GPU inputs compute the features "
            "yourself and pass feature_map=None, or pass host (NumPy) arrays with device='cuda'"
        )
    code = int(fmap.kernel_code)
    f = d
    K.seq_config(f, m, np.dtype(K.acc_name(dtype)).itemsize)  # F limit: fail before any work
    out_shape = batch_shape + (n, m)
    if out is not None:
        dout = _wrap("out", out)
        if tuple(dout.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {tuple(dout.shape)}")
        if np.dtype(dout.dtype) != dtype:
            raise TypeError(f"out must have dtype {dtype}, got {np.dtype(dout.dtype)}")
    else:
        dout = cuda.device_array(out_shape, dtype=dtype)
    b = int(np.prod(batch_shape, dtype=np.int64))
    name = select_method_cuda(method, causal=causal, batch=b, n=n, f=f, m=m, dtype=dtype)
    impl = get_method(name, causal=causal, device="cuda")
    empty = n == 0 or b == 0
    if not empty:
        q4, k4, v4 = _input_4d(dq), _input_4d(dk), _input_4d(dv)
        if check_finite:
            for nm, x4 in (("q", q4), ("k", k4), ("v", v4)):
                _check_finite_device(nm, x4)
    if initial_state is not None:
        S, z, position = _device_state(initial_state, batch_shape, b, f, m, check_finite)
    else:
        S = cuda.to_device(np.zeros((b, f, m)))
        z = cuda.to_device(np.zeros((b, f)))
        position = 0
    if not empty:
        o4 = _view4(dout)
        tmp = None if o4 is not None else cuda.device_array(out_shape, dtype=dtype)
        impl.launcher(q4, k4, v4, S, z, o4 if tmp is None else _view4(tmp), code=code, eps=eps)
        if tmp is not None:  # out's batch dims cannot be merged: compute, then copy in
            _copy_device(tmp, dout)
    result = out if out is not None else dout
    if not return_state:
        return result
    return result, LinearState(S.reshape(batch_shape + (f, m)), z.reshape(batch_shape + (f,)), position + n)


def _inline_maps():
    names = []
    for nm in fm.available():
        try:
            if fm.get(nm).kernel_code is not None:
                names.append(nm)
        except Exception:  # maps that need parameters
            continue
    return names
