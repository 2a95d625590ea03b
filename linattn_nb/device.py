"""Where arrays live and which backend runs: the one dispatcher of the package.

``device="auto"`` follows the data (GPU arrays run on the GPU, host arrays on the CPU, mixing them is
an error); the CUDA simulator never counts as a GPU for ``"auto"``.  Details: docs/frontend.md, "Devices".
"""
from __future__ import annotations

import numpy as np

DEVICES = ("auto", "cpu", "cuda")

# DLPack device types (dlpack.h): kDLCUDA = 2, kDLCUDAHost = 3 (pinned host
# memory, readable from the CPU), kDLCUDAManaged = 13.
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13


def is_simulator_array(x) -> bool:
    """True for a device array of the Numba CUDA simulator (``FakeCUDAArray``): host memory, so a host
    array for ``device="auto"`` and a device array for ``device="cuda"``."""
    t = type(x)
    return t.__name__ == "FakeCUDAArray" and t.__module__.startswith("numba.cuda.simulator")


def is_device_array(x) -> bool:
    """True when ``x`` lives in GPU memory: a readable ``__cuda_array_interface__`` (Numba, CuPy, PyTorch
    CUDA tensors) or a ``__dlpack_device__`` naming a CUDA device (a CUDA tensor that requires grad);
    never a simulator array."""
    if x is None or isinstance(x, np.ndarray) or is_simulator_array(x):
        return False
    if hasattr(type(x), "__cuda_array_interface__") or hasattr(x, "__cuda_array_interface__"):
        try:
            x.__cuda_array_interface__
            return True
        except Exception:  # e.g. torch raises for CPU tensors (and for requires_grad)
            pass
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            kind = int(dev()[0])
        except Exception:
            return False
        return kind in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED)
    return False


def array_location(x) -> str:
    """``"cuda"`` (GPU memory), ``"simulator"`` (a simulator device array) or ``"host"``."""
    if is_simulator_array(x):
        return "simulator"
    return "cuda" if is_device_array(x) else "host"


def on_device(x) -> bool:
    """A GPU array or a simulator device array: what ``device="cuda"`` runs zero-copy."""
    return array_location(x) != "host"


def check_device_arg(device) -> str:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(repr(d) for d in DEVICES)}, got {device!r}")
    return device


def resolve_device(device: str, *arrays, names=None) -> str:
    """Return ``"cpu"`` or ``"cuda"`` for ``device`` and the given inputs.

    ``None`` entries are ignored.  ``"auto"`` returns ``"cuda"`` when the inputs live on a GPU (not the
    simulator) and ``"cpu"`` otherwise; ``"cuda"`` requires a usable GPU or the simulator.

    Raises
    ------
    ValueError
        Host and device inputs mixed (naming them), or ``device="cpu"`` with GPU inputs.
    RuntimeError
        ``"cuda"`` asked for (or GPU inputs given) and neither a GPU nor the simulator can run kernels.
    """
    check_device_arg(device)
    names = list(names) if names is not None else [f"argument {i}" for i in range(len(arrays))]
    where = [(n, array_location(a)) for n, a in zip(names, arrays) if a is not None]
    on_gpu = [n for n, w in where if w == "cuda"]
    on_sim = [n for n, w in where if w == "simulator"]
    on_host = [n for n, w in where if w == "host"]
    dev_side = on_gpu + (on_sim if device == "cuda" else [])
    host_side = on_host + ([] if device == "cuda" else on_sim)
    if dev_side and host_side:
        raise ValueError(
            f"inputs live on different devices: {', '.join(dev_side)} on the GPU, "
            f"{', '.join(host_side)} on the host; move them to one device first"
        )
    if device == "auto":
        if on_gpu:
            require_cuda()
            return "cuda"
        return "cpu"
    if device == "cpu" and on_gpu:
        raise ValueError(
            f"device='cpu' but {', '.join(on_gpu)} live on the GPU; copy them to the host "
            "first (e.g. .copy_to_host(), cupy.asnumpy, tensor.cpu()) or use device='auto'"
        )
    if device == "cuda":
        require_cuda()
    return device


def cuda_status() -> str:
    """``"gpu"`` (a real, usable GPU), ``"simulator"`` (NUMBA_ENABLE_CUDASIM=1) or ``"none"``.

    The simulator never counts as a GPU for ``device="auto"``.
    """
    from numba import config as nbconfig

    if nbconfig.ENABLE_CUDASIM:
        return "simulator"
    try:
        from numba import cuda

        return "gpu" if cuda.is_available() else "none"
    except Exception:
        return "none"


def require_cuda() -> None:
    """Raise a clear error unless a GPU (or the CUDA simulator) can run kernels."""
    status = cuda_status()
    if status == "none":
        raise RuntimeError(
            "the CUDA kernels need a usable CUDA GPU and none was found "
            "(numba.cuda.is_available() is False). "
            "Install the 'cuda' extra on a machine with an NVIDIA driver, or set "
            "NUMBA_ENABLE_CUDASIM=1 before importing numba to run the kernels on the simulator."
        )
