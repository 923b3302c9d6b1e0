#!/usr/bin/env bash
# On a real NVIDIA machine: print what the driver sees, then run the `gpu` tests (our snapshot vs
# nvidia-smi; %gpu pick in a real kernel; the device torch/cupy opens has the picked UUID; a pick
# after torch.cuda.is_available() is refused). It expects a working driver and torch or cupy:
# where nvidia-smi is missing or fails, or neither framework is installed, the tests FAIL (exit
# status 1), never "skipped" (AUTOGPU_EXPECT_GPU=1; set it to 0 to let them skip).
#
#   scripts/gpu-check.sh            # uses .venv/bin/python when present, else python3
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export AUTOGPU_EXPECT_GPU=${AUTOGPU_EXPECT_GPU:-1}
# Never test the real driver through the fakes or the simulation.
unset FAKE_NVML_SCENARIO AUTOGPU_SIMULATE CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER AUTOGPU_PICKED

echo "== nvidia-smi -L"
nvidia-smi -L || echo "(nvidia-smi failed or is missing: no NVIDIA driver here)"
echo "== nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used --format=csv"
nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used --format=csv || true
echo "== autogpu's view (NVML backend)"
PYTHONPATH=$PWD "$PY" - <<'PY' || true
from autogpu_jupyter.core.backends.nvml import NvmlBackend
from autogpu_jupyter.core.units import format_bytes
snap = NvmlBackend().snapshot()
print("driver", snap.driver_version)
for d in snap.devices:
    print(f"{d.label:12} {d.uuid} {d.name} total {format_bytes(d.memory_total_bytes)} "
          f"used {format_bytes(d.memory_used_bytes)} util {d.utilization_pct}")
PY
echo "== torch / cupy"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null \
  || "$PY" -c "import cupy; print('cupy', cupy.__version__)" 2>/dev/null \
  || echo "neither torch nor cupy installed: the framework checks fail (AUTOGPU_EXPECT_GPU=0 skips them)"
echo "== pytest -m gpu"
exec "$PY" -m pytest -m gpu -v -rs -s -p no:cacheprovider tests/gpu/test_hardware.py
