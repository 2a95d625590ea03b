"""Where arrays live and which backend runs (linattn_nb.device): no kernels run here.

GPU arrays are stood in for by small objects that expose the two protocols the
dispatcher reads: ``__cuda_array_interface__`` (Numba, CuPy, PyTorch CUDA
tensors) and ``__dlpack_device__`` (DLPack device type 2 = CUDA, 13 = CUDA
managed, 1 = CPU; dlpack.h).
"""
from __future__ import annotations

import numpy as np
import pytest

import linattn_nb.device as device


class CAIArray:
    """Exposes a readable CUDA array interface (as CuPy and Numba device arrays do)."""

    __cuda_array_interface__ = {"shape": (2, 3), "typestr": "<f4", "data": (0, False), "version": 3}


class TorchLikeCPU:
    """Like a PyTorch CPU tensor: the attribute exists, reading it raises."""

    @property
    def __cuda_array_interface__(self):
        raise AttributeError("Can't get __cuda_array_interface__ on non-CUDA tensor type")

    def __dlpack_device__(self):
        return (1, 0)


class TorchLikeGradCUDA:
    """Like a PyTorch CUDA tensor that requires grad: the interface raises, DLPack says CUDA."""

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")

    def __dlpack_device__(self):
        return (2, 0)


class DLPackOnly:
    def __init__(self, kind):
        self.kind = kind

    def __dlpack_device__(self):
        return (self.kind, 0)


def test_is_device_array():
    assert device.is_device_array(CAIArray())
    assert device.is_device_array(TorchLikeGradCUDA())
    assert device.is_device_array(DLPackOnly(2))
    assert device.is_device_array(DLPackOnly(13))
    assert not device.is_device_array(DLPackOnly(1))
    assert not device.is_device_array(DLPackOnly(3))  # pinned host memory
    assert not device.is_device_array(TorchLikeCPU())
    assert not device.is_device_array(np.zeros(3))
    assert not device.is_device_array([1.0, 2.0])
    assert not device.is_device_array(None)


def test_resolve_device_follows_the_data():
    x = np.zeros((2, 3))
    assert device.resolve_device("auto", x, x, None) == "cpu"
    assert device.resolve_device("cpu", x, TorchLikeCPU()) == "cpu"
    with pytest.raises(ValueError, match=r"q, v on the GPU, k on the host"):
        device.resolve_device("auto", CAIArray(), x, CAIArray(), names=("q", "k", "v"))
    with pytest.raises(ValueError, match="device='cpu' but q live on the GPU"):
        device.resolve_device("cpu", CAIArray(), names=("q",))
    with pytest.raises(ValueError, match="device must be one of"):
        device.resolve_device("gpu", x)


def test_gpu_inputs_need_a_gpu(monkeypatch):
    monkeypatch.setattr(device, "cuda_status", lambda: "none")
    with pytest.raises(RuntimeError, match="need a usable CUDA GPU"):
        device.resolve_device("auto", CAIArray())
    with pytest.raises(RuntimeError, match="NUMBA_ENABLE_CUDASIM"):
        device.resolve_device("cuda", np.zeros(3))
    monkeypatch.setattr(device, "cuda_status", lambda: "gpu")
    assert device.resolve_device("auto", CAIArray(), DLPackOnly(2)) == "cuda"
    assert device.resolve_device("cuda", np.zeros(3)) == "cuda"


def test_simulator_arrays(monkeypatch):
    """Simulator device arrays are host memory: 'auto' runs them on the CPU, 'cuda' on the
    simulator; the simulator never counts as a GPU for 'auto'."""
    class FakeCUDAArray:  # same name and module as the simulator's class
        pass

    FakeCUDAArray.__module__ = "numba.cuda.simulator.cudadrv.devicearray"
    sim = FakeCUDAArray()
    x = np.zeros(3)
    assert device.is_simulator_array(sim) and not device.is_device_array(sim)
    assert device.array_location(sim) == "simulator" and device.on_device(sim)
    assert device.array_location(x) == "host" and not device.on_device(x)
    assert device.array_location(CAIArray()) == "cuda"
    monkeypatch.setattr(device, "cuda_status", lambda: "simulator")
    assert device.resolve_device("auto", sim, x) == "cpu"
    assert device.resolve_device("cuda", sim, sim) == "cuda"
    with pytest.raises(ValueError, match="different devices"):
        device.resolve_device("cuda", sim, x)
    assert device.resolve_device("cpu", sim) == "cpu"


def test_cuda_status_values():
    assert device.cuda_status() in ("gpu", "simulator", "none")


def test_a_gpu_initial_state_without_a_gpu_gets_the_documented_error():
    """With no usable GPU (and no simulator), a GPU ``initial_state`` beside host q, k, v reached the DLPack fallback
    and its message ("from_dlpack received an invalid capsule ..."), where every other GPU input gets the
    documented RuntimeError.  Run in a subprocess: the suite itself runs with the simulator switched on."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import numpy as np
        import linattn_nb as la
        from linattn_nb.device import cuda_status
        if cuda_status() != "none":
            print("SKIP"); raise SystemExit
        class GpuLike:  # an array interface another library could hand over
            def __init__(self, a):
                self.a, self.shape, self.dtype, self.ndim = a, a.shape, a.dtype, a.ndim
            @property
            def __cuda_array_interface__(self):
                return {"shape": self.a.shape, "typestr": self.a.dtype.str, "data": (self.a.ctypes.data, False),
                        "version": 3, "strides": None}
        x = np.ones((1, 5, 3))
        try:
            la.linear_attention(x, x, x, causal=True, initial_state=(GpuLike(np.zeros((1, 3, 3))),
                                                                      GpuLike(np.zeros((1, 3)))))
        except RuntimeError as exc:
            print(exc)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    if res.stdout.strip() == "SKIP":
        pytest.skip("a CUDA GPU is present")
    assert "the CUDA kernels need a usable CUDA GPU" in res.stdout
