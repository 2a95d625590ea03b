"""The CUDA side of a request (``device="cuda"``): what the front end asks of the GPU.

See ``docs/cuda_kernels.md``, "The front end's CUDA side".
"""
from __future__ import annotations

import numpy as np

from . import _validate as V
from . import config
from .device import cuda_status, is_device_array, is_simulator_array, on_device, require_cuda
from .rules import get_rule, rule_for
from .ops.registry import select_auto

def _cuda():
    from numba import cuda

    return cuda


def _launch():
    """:mod:`linattn_nb.ops._cuda_launch`, the one CUDA module of ops/ this one calls (imported on first use:
    importing this module touches no numba.cuda)."""
    from .ops import _cuda_launch

    return _cuda_launch


# ---------------------------------------------------------------------------
# Device arrays
# ---------------------------------------------------------------------------
def wrap(name, x):
    """A Numba device array (or simulator array) viewing ``x``'s GPU memory; ValueError naming ``name`` for a
    reversed view (a negative stride), which the kernels cannot read or write in place."""
    return _forward_strides(name, _wrap(name, x))


def _forward_strides(name, x):
    strides = tuple(int(s) for s in x.strides)
    if any(s < 0 for s in strides):
        raise ValueError(f"{name} is a GPU array with negative strides {strides} (a reversed view, such as x[:, ::-1] "
                         "or cupy.flip(x)), which the CUDA kernels cannot read or write in place: pass a contiguous "
                         "copy (cupy.ascontiguousarray(x), tensor.contiguous())")
    return x


def _wrap(name, x):
    if is_simulator_array(x):
        return x
    if cuda_status() == "simulator":
        raise RuntimeError(
            f"{name} lives in GPU memory but NUMBA_ENABLE_CUDASIM=1 is set: the simulator cannot "
            "read GPU memory; unset it, or pass host arrays"
        )
    require_cuda()  # no usable GPU: the documented error, not a DLPack fallback's message
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


class meta:
    """shape (a plain tuple), ndim and dtype of an array, for the shared validators."""

    def __init__(self, x):
        self.shape = tuple(int(s) for s in x.shape)
        self.ndim = len(self.shape)
        self.dtype = np.dtype(x.dtype)


def view4(x):
    """4-d view (B1, B2, rows, cols) of a device array of any ndim >= 1, or None."""
    return _launch().view4(x)


def copy_device(src, dst):
    """dst[...] = src[...] on the GPU (equal shapes, any strides and dtypes)."""
    return _launch().copy(src, dst)


def contiguous(x, dtype=None):
    """A C-contiguous copy of device array ``x`` (in ``dtype``), copied on the device."""
    dtype = np.dtype(dtype or x.dtype)
    dst = _cuda().device_array(tuple(int(s) for s in x.shape), dtype=dtype)
    return copy_device(x, dst)


def input_4d(x):
    x4 = view4(x)
    return x4 if x4 is not None else view4(contiguous(x))


# ---------------------------------------------------------------------------
# Method selection
# ---------------------------------------------------------------------------
def multiprocessor_count() -> int:
    """Streaming multiprocessors of the current GPU (1 on the simulator or without one)."""
    if cuda_status() != "gpu":
        return 1
    return _launch().multiprocessor_count()


def select_auto_cuda(*, rule, causal, batch, n, f, m, dtype, sms=None) -> str:
    """Resolve ``method="auto"`` on the GPU: causal, ``"scan"`` when its blocks fill the GPU
    (:func:`linattn_nb.ops._cuda_launch.scan_fill`, ``sms`` multiprocessors, default the current
    GPU's), else the rows of ``config.AUTO_METHODS[(rule, causal, "cuda")]``.  A scan that fills the GPU
    only through its tile or row-group warps gives way to those rows from
    ``config.CUDA_AUTO_TILES_CHUNKED_MIN_N`` tokens on, for the rules that have them (the chunked
    kernels were faster there on an H200: docs/guide/configuration.md)."""
    if causal:
        sms = multiprocessor_count() if sms is None else int(sms)
        how = _launch().scan_fill(batch, f, m, dtype, get_rule(rule).code, sms=sms)
        long_tiles = (how == "warps" and n >= int(config.CUDA_AUTO_TILES_CHUNKED_MIN_N)
                      and (rule, True, "cuda") in config.AUTO_METHODS)
        if how and not long_tiles:
            return "scan"
    return select_auto(rule=rule, causal=causal, device="cuda", n=n, dtype=dtype)


# ---------------------------------------------------------------------------
# What the front end asks of the device
# ---------------------------------------------------------------------------
def check_limits(f: int, m: int, dtype, rule: str = "additive") -> None:
    """Raise (before any work) when D_phi or M exceed what the sequence kernel of ``rule`` can launch."""
    _launch().check_limits(f, m, dtype, get_rule(rule).code)


#: dtypes of the rule inputs the kernels read in place (:func:`device_rule_inputs`).
_IN_PLACE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def device_rule_inputs(decay, log_decay, beta, batch_shape, n: int, f: int):
    """``(rule, plan)`` for GPU ``decay`` / ``log_decay`` / ``beta`` the kernels can use without the host,
    else None (the host path, which also raises the shape errors).  ``plan`` maps the kernels' input
    names to ``(argument name, array, in_place)``: a (B, N) / (B, N, D_phi) view read in place, or a
    4-d view to convert.  Which forms qualify: docs/cuda_kernels.md, "The front end's CUDA side".
    """
    L = _launch()
    bs = tuple(int(s) for s in batch_shape)
    nb = len(bs)
    b = int(np.prod(bs, dtype=np.int64))
    given = {nm: x for nm, x in (("decay", decay), ("log_decay", log_decay), ("beta", beta)) if x is not None}
    if not given or not all(on_device(x) for x in given.values()) or ("decay" in given and "log_decay" in given):  # not a rule
        return None
    if b * int(n) == 0:  # nothing to read: the host path checks the shapes of empty inputs
        return None

    def plan_of(name, x, features_ok):
        """(kernel shape, (name, array, in_place)) or None."""
        x = wrap(name, x)
        shape = tuple(int(s) for s in x.shape)
        strides = tuple(int(s) for s in x.strides)
        if np.dtype(x.dtype).kind != "f" or any(s < 0 for s in strides):
            return None
        if len(shape) in (0, nb):  # per sequence
            lead, lead_s, per_feature = shape, strides, False
            tail, tail_s = (n, 1), (0, 0)
        elif len(shape) == nb + 1 and shape[-1] == n:  # per token
            lead, lead_s, per_feature = shape[:-1], strides[:-1], False
            tail, tail_s = (n, 1), (strides[-1], 0)
        elif features_ok and len(shape) == nb + 2 and shape[-2:] == (n, f):  # per token and feature
            lead, lead_s, per_feature = shape[:-2], strides[:-2], True
            tail, tail_s = (n, f), strides[-2:]
        else:
            return None
        kshape = (b, n, f) if per_feature else (b, n)  # a gate of one feature (f = 1) too: the host's rule
        if (name != "decay" and np.dtype(x.dtype) in _IN_PLACE_DTYPES and x.is_c_contiguous() and len(shape) > nb  # not a rule
                and shape == bs + kshape[1:]):
            return kshape, (name, x.reshape(kshape), True)
        lead = (1,) * (nb - len(lead)) + lead  # a 0-d array: every batch axis broadcast
        lead_s = (0,) * (nb - len(lead_s)) + lead_s
        if any(d != t and d != 1 for d, t in zip(lead, bs)):
            return None
        view_s = tuple(0 if d == 1 else st for d, st in zip(lead, lead_s)) + tail_s
        x4 = L.view4_strided(x, bs + tail, view_s)
        if x4 is None:
            return None
        return kshape, (name, x4, False)

    beta_plan = lg = factor = None
    if "beta" in given:
        beta_plan = plan_of("beta", given["beta"], False)
        if beta_plan is None:
            return None
    name = "log_decay" if "log_decay" in given else "decay"  # not a rule: the argument given
    if name in given:
        lg = plan_of(name, given[name], beta_plan is None)  # a per-feature gate with beta: the host path raises
        if lg is None:
            return None
        factor = "scalar" if len(lg[0]) == 2 else "feature"
    rule = rule_for(factor=factor, beta=beta_plan is not None)
    return rule.name, rule.kernel_arguments(None if lg is None else lg[1], None if beta_plan is None else beta_plan[1])


def device_rule_values(plan, batch: int, n: int, f: int) -> dict:
    """The kernels' rule inputs of a :func:`device_rule_inputs` plan: arrays read in place (float32
    or float64) get their range counted (NaN or > 0 log-factors, ``beta`` outside [0, 2]: one kernel each), the
    others are converted into pooled float64 workspaces and counted in the same kernel; the call's
    single read of the counters raises ValueError naming the argument."""
    L = _launch()
    out = {}
    for key, (name, x, in_place) in plan.items():
        if in_place:
            lo, hi = (0.0, 2.0) if name == "beta" else (-np.inf, 0.0)
            L.count_out_of_range(name, x, lo, hi)
            out[key] = x
        else:
            shape = (batch, n, f) if key == "log_gate" else (batch, n)
            out[key] = L.rule_input(name, x, shape)
    return out


def zero_state(b, f, m):
    """The zero initial state ``H`` (b, f, m + 1) float64: a pooled workspace zeroed on the device,
    valid until the thread's next call with the same shape."""
    return _launch().zeros((b, f, m + 1), np.float64, tag="linear.H")


def to_device(x):
    return _cuda().to_device(np.ascontiguousarray(x))


def to_host(name, x) -> np.ndarray:
    """A host copy of a GPU (or simulator) array."""
    if is_simulator_array(x):
        return np.array(x._ary)
    return contiguous(wrap(name, x)).copy_to_host()


def device_out(out, shape, dtype):
    """The caller's ``out`` viewed as a device array (checked), or a new device array."""
    if out is None:
        return _cuda().device_array(shape, dtype=dtype)
    dout = wrap("out", out)
    if tuple(dout.shape) != tuple(shape):
        raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(dout.shape)}")
    if np.dtype(dout.dtype) != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {np.dtype(dout.dtype)}")
    return dout


def pack_state(S0, z0, position, batch_shape, b, f, m, *, check_finite):
    """A float64 device ``H`` (B, F, M + 1) = [S | z] from device arrays S (..., F, M), z (..., F), in the
    pooled workspace of :func:`zero_state`; ``check_finite`` counts the NaN/inf of S and z on the
    device, read with those of q, k, v by the launch (or :func:`finish_checks`)."""
    S0 = wrap("initial_state.S", S0)
    z0 = wrap("initial_state.z", z0)
    V.check_state_arrays(S0, z0, position, batch_shape, f, m)
    S3 = (S0 if S0.is_c_contiguous() else contiguous(S0)).reshape((b, f, m))
    z2 = (z0 if z0.is_c_contiguous() else contiguous(z0)).reshape((b, f))
    L = _launch()
    return L.pack_state(S3, z2, L.workspace("linear.H", (b, f, m + 1), np.float64), check_finite=check_finite)


def finish_checks():
    """Read the finiteness counters if a kernel counted since the last read (ValueError naming the input)."""
    _launch().raise_if_nonfinite()


def discard_checks():
    """Forget pending counts of a call that failed before reading them."""
    _launch().discard_counts()


def unpack_state(H, batch_shape, f, m):
    """C-contiguous float64 device arrays S (..., F, M) and z (..., F) of a device ``H``."""
    S, z = _launch().unpack_state(H)
    return S.reshape(tuple(batch_shape) + (f, m)), z.reshape(tuple(batch_shape) + (f,))


def run_host(impl, qf, kf, vf, H, result, *, code, eps, inputs=None, normalize=True):
    """Host inputs on the GPU: copy (B, N, ·) inputs and ``H`` over, launch, copy result and ``H`` back
    (``inputs``: host float64 arrays, copied by the launchers)."""
    cuda = _cuda()
    b, n, _ = qf.shape
    m = vf.shape[2]
    dH = cuda.to_device(H)
    dout = cuda.device_array((b, n, m), dtype=result.dtype)
    impl.forward(cuda.to_device(qf), cuda.to_device(kf), cuda.to_device(vf), dH, dout, code=code, eps=eps,
                 inputs=inputs, normalize=normalize)
    result[...] = dout.copy_to_host().reshape(result.shape)
    H[...] = dH.copy_to_host()


def run_device(impl, q4, k4, v4, H, dout, out_shape, *, code, eps, inputs=None, normalize=True,
               check_finite=False, scratch=False):
    """Device inputs: launch on 4-d views; an ``out`` whose batch dims cannot be merged, or that overlaps
    an input (``scratch``), is computed into a workspace and copied in after the launch."""
    o4 = None if scratch else view4(dout)
    tmp = None if o4 is not None else _launch().workspace("linear.out", out_shape, dout.dtype)
    impl.forward(q4, k4, v4, H, o4 if tmp is None else view4(tmp), code=code, eps=eps, inputs=inputs,
                 normalize=normalize, check_finite=check_finite)
    finish_checks()
    if tmp is not None:  # out's batch dims cannot be merged: compute, then copy in
        copy_device(tmp, dout)
