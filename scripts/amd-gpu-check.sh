#!/usr/bin/env bash
# On a real AMD machine (ROCm): print what amd-smi sees and autogpu's view of it, then run the
# `amdgpu` tests (our snapshot vs amd-smi; %gpu pick in a real kernel against the device PyTorch's
# ROCm build opens; a pick after HIP started is refused). It expects a working driver and
# PyTorch's ROCm build: where amd-smi is missing or fails, or torch is, the tests FAIL (exit
# status 1), never "skipped"
# (AUTOGPU_EXPECT_AMD_GPU=1; set it to 0 to let them skip on a machine without an AMD GPU).
#
#   scripts/amd-gpu-check.sh        # uses .venv/bin/python when present, else python3
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export AUTOGPU_EXPECT_AMD_GPU=${AUTOGPU_EXPECT_AMD_GPU:-1}
# Never test the real driver through the fakes, the simulation or an inherited selection.
unset FAKE_NVML_SCENARIO FAKE_AMDSMI_SCENARIO AUTOGPU_SIMULATE AUTOGPU_PICKED \
  ROCR_VISIBLE_DEVICES HIP_VISIBLE_DEVICES CUDA_VISIBLE_DEVICES GPU_DEVICE_ORDINAL
export AUTOGPU_BACKEND=amdsmi

echo "== amd-smi list"
amd-smi list || echo "(amd-smi failed or is missing: no AMD driver here)"
echo "== autogpu's view (amdsmi backend)"
PYTHONPATH=$PWD "$PY" - <<'PY' || true
from autogpu_jupyter.core.backends.amdsmi import AmdSmiBackend
from autogpu_jupyter.core.units import format_bytes
snap = AmdSmiBackend().snapshot()
print("driver", snap.driver_version)
for d in snap.devices:
    print(f"{d.label:8} {d.uuid} {d.runtime_uuid} {d.name} total "
          f"{format_bytes(d.memory_total_bytes)} used {format_bytes(d.memory_used_bytes)} "
          f"util {d.utilization_pct}")
PY
echo "== torch"
"$PY" -c "import torch; print('torch', torch.__version__, 'hip', torch.version.hip)" 2>/dev/null \
  || echo "PyTorch is not installed: the framework check fails (AUTOGPU_EXPECT_AMD_GPU=0 skips it)"
echo "== pytest -m amdgpu"
exec "$PY" -m pytest -m amdgpu -v -rs -s -p no:cacheprovider tests/gpu/test_amd_hardware.py
