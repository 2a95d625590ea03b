"""Where arrays live and which backend runs: the one dispatcher of the package.

``device="auto"`` follows the data: inputs that live on a GPU (anything that
exposes ``__cuda_array_interface__``, or a ``__dlpack__`` whose device is a
CUDA device) run on the GPU; NumPy (and other host) inputs run on the CPU.
Mixing host and device inputs is an error.  ``device="cpu"`` and
``device="cuda"`` force the backend.
"""
from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")

# DLPack device types (dlpack.h): kDLCUDA = 2, kDLCUDAHost = 3 (pinned host
# memory, readable from the CPU), kDLCUDAManaged = 13.
_DLPACK_CUDA = 2
_DLPACK_CUDA_MANAGED = 13


def is_device_array(x) -> bool:
    """True when ``x`` lives in GPU memory (CUDA array interface or CUDA DLPack)."""
    if x is None:
        return False
    if hasattr(x, "__cuda_array_interface__"):
        try:
            x.__cuda_array_interface__
        except Exception:  # e.g. torch raises for CPU tensors on access
            return False
        return True
    dev = getattr(x, "__dlpack_device__", None)
    if dev is not None:
        try:
            kind = int(dev()[0])
        except Exception:
            return False
        return kind in (_DLPACK_CUDA, _DLPACK_CUDA_MANAGED)
    return False


def check_device_arg(device) -> str:
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(repr(d) for d in DEVICES)}, got {device!r}")
    return device


def resolve_device(device: str, *arrays, names=None) -> str:
    """Return ``"cpu"`` or ``"cuda"`` for ``device`` and the given inputs.

    ``None`` entries are ignored.  Raises ValueError when host and device
    inputs are mixed, naming the arguments on each side.
    """
    check_device_arg(device)
    names = list(names) if names is not None else [f"argument {i}" for i in range(len(arrays))]
    on_gpu = [n for n, a in zip(names, arrays) if a is not None and is_device_array(a)]
    on_host = [n for n, a in zip(names, arrays) if a is not None and not is_device_array(a)]
    if on_gpu and on_host:
        raise ValueError(
            f"inputs live on different devices: {', '.join(on_gpu)} on the GPU, "
            f"{', '.join(on_host)} on the host; move them to one device first"
        )
    if device == "auto":
        return "cuda" if on_gpu else "cpu"
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
            "device='cuda' but no usable CUDA GPU was found (numba.cuda.is_available() is False). "
            "Install the 'cuda' extra on a machine with an NVIDIA driver, or set "
            "NUMBA_ENABLE_CUDASIM=1 before importing numba to run the kernels on the simulator."
        )
