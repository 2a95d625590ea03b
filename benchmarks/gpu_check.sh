#!/usr/bin/env bash
# One-command GPU check for linattn_nb (the CUDA kernels on real hardware), meant for ONE call on a
# machine with a GPU:
#   bash benchmarks/gpu_check.sh
# 1. environment (GPU, versions, ptxas/nvdisasm);  2. the CUDA tests on the real GPU (tests/ops/*cuda*.py
# and tests/test_device.py, a pytest per file with its own time limit; the PTX-only tests are left to CI,
# which runs them without a GPU);
# 3. benchmarks/gpu_static.py (registers, spills, occupancy, SASS loop mix, modelled traffic; needs
# ptxas, skipped cleanly without);  4. benchmarks/gpu_bench.py (B=8, H=16, D=M=64 float32 causal,
# N=4096..65536 against the roofline and torch SDPA, the decode-step device time, and as time allows
# every rule's scan in row groups and in tiles).
# Needs python3 with numba, numba-cuda, numpy, scipy, tqdm, threadpoolctl (the package's dependencies);
# pytest and hypothesis for stage 2, torch for the SDPA rows (CuPy optional): a stage whose modules are
# missing says so and is skipped.  Installs nothing and runs the package from the source tree
# (PYTHONPATH).  Writes gpu_check.log, gpu_static.json and gpu_bench.json to $OUT when set, else to
# benchmarks/results/.  Budget: under 8 minutes in all (tests <= 200 s, static <= 90 s, benchmark
# <= 160 s); a stage that runs over its limit is stopped and the next one still runs.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${OUT:-benchmarks/results}
mkdir -p "$DEST"
LOG="$DEST/gpu_check.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/linattn_numba_cache}
export HYPOTHESIS_PROFILE=ci
unset NUMBA_ENABLE_CUDASIM
T0=$(date +%s)
have() { $PY -c "import $1" >/dev/null 2>&1; }
{
  echo "== gpu_check $(date -Is) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv 2>&1 || echo "(no nvidia-smi)"
  $PY - <<'PYEOF'
import importlib, platform
print("python", platform.python_version())
for m in ("numpy", "scipy", "numba", "numba_cuda", "torch", "cupy", "pytest", "hypothesis"):
    try:
        print(f"{m:<11}", getattr(importlib.import_module(m), "__version__", "installed"))
    except Exception as exc:
        print(f"{m:<11} MISSING ({type(exc).__name__}: {exc})")
import numpy
if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 5):
    print("WARNING: NumPy", numpy.__version__, "breaks numba-cuda 0.30.4 (np.row_stack is gone): every kernel "
          "compile fails; run with NumPy < 2.5 (the cuda extra pins it)")
from linattn_nb.device import cuda_status
print("linattn_nb cuda_status:", cuda_status())
if cuda_status() == "gpu":
    from numba import cuda
    d = cuda.get_current_device()
    print("device:", d.name, "cc", d.compute_capability, "SMs", d.MULTIPROCESSOR_COUNT)
import sys
sys.path.insert(0, "tools")  # the measuring tool, outside the package (tools/cuda_resources.py)
from cuda_resources import find_tool
print("ptxas:", find_tool("ptxas"), " nvdisasm:", find_tool("nvdisasm"), " cuobjdump:", find_tool("cuobjdump"))
PYEOF
  echo "== [$(( $(date +%s) - T0 )) s] CUDA tests on the GPU"
  if have pytest && have hypothesis; then
    # one pytest per file, each with its share of the 200 s (every kernel compiles on first use): a file
    # stopped at its limit loses only its own summary, and -v names every test as it finishes, so even a
    # stopped file's log says which tests passed; one process each (no pytest-xdist there)
    for spec in tests/ops/test_cuda.py:60 tests/ops/test_step_cuda.py:25 tests/ops/test_grad_cuda.py:25 \
                tests/ops/test_decay_cuda.py:35 tests/ops/test_delta_cuda.py:35 tests/test_device.py:20; do
      f=${spec%%:*}; limit=${spec##*:}
      timeout "$limit" $PY -m pytest "$f" -k "not to_ptx" -v --tb=short -p no:cacheprovider -rs --durations=5 \
        -o addopts=""
      echo "pytest $f exit status: $?  (124 = stopped at its limit of $limit s)"
    done
  else
    echo "pytest or hypothesis missing: CUDA tests skipped"
  fi
  echo "== [$(( $(date +%s) - T0 )) s] static resources (sm_90 registers, occupancy, SASS, traffic model)"
  timeout 90 $PY benchmarks/gpu_static.py --json "$DEST/gpu_static.json"
  echo "gpu_static exit status: $?  (124 = stopped at the time limit; 1 = no ptxas)"
  echo "== [$(( $(date +%s) - T0 )) s] benchmark"
  timeout 160 $PY benchmarks/gpu_bench.py --budget-s 120 --no-sweep --rule-layouts --json "$DEST/gpu_bench.json"
  echo "benchmark exit status: $?  (124 = stopped at the time limit)"
  echo "== [$(( $(date +%s) - T0 )) s] done"
} 2>&1 | tee "$LOG"
