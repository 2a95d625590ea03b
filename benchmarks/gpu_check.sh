#!/usr/bin/env bash
# One-command GPU check for linattn_nb (issue 4), meant for ONE call on a machine with a GPU:
#   bash benchmarks/gpu_check.sh
# 1. environment (GPU, versions);  2. the CUDA tests on the real GPU;  3. the causal benchmark
# (benchmarks/gpu_bench.py: B=8, H=16, D=M=64, N=1024..65536 float32 vs torch SDPA and the CPU path).
# Needs python3 with numba, numba-cuda, numpy, scipy, tqdm, pytest, hypothesis (torch, CuPy optional);
# installs nothing and runs the package from the source tree (PYTHONPATH).  Writes gpu_check.log and
# gpu_bench.json to $OUT when set, else to benchmarks/results/.  Budget: under 5 minutes in all
# (tests <= 140 s, benchmark <= 150 s of measurements); a stage that runs over its limit is stopped
# and the next one still runs.
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
from linattn_nb.device import cuda_status
print("linattn_nb cuda_status:", cuda_status())
if cuda_status() == "gpu":
    from numba import cuda
    d = cuda.get_current_device()
    print("device:", d.name, "cc", d.compute_capability, "SMs", d.MULTIPROCESSOR_COUNT)
PYEOF
  echo "== [$(( $(date +%s) - T0 )) s] CUDA tests on the GPU"
  timeout 140 $PY -m pytest tests/test_cuda.py tests/test_device.py -q -p no:cacheprovider -rs --durations=8
  echo "pytest exit status: $?  (124 = stopped at the time limit)"
  echo "== [$(( $(date +%s) - T0 )) s] benchmark"
  timeout 200 $PY benchmarks/gpu_bench.py --budget-s 150 --json "$DEST/gpu_bench.json"
  echo "benchmark exit status: $?  (124 = stopped at the time limit)"
  echo "== [$(( $(date +%s) - T0 )) s] done"
} 2>&1 | tee "$LOG"
