#!/usr/bin/env bash
# The CUDA checks of the engine and of the fault harness's CUDA OOM, in one command (the `gpu`
# pytest marker). Exits non-zero if CUDA is missing or a test fails; extra arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch")
print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
python -m pytest -q -m gpu tests/runtime/test_gpu.py tests/faults/test_cuda_oom.py \
    -p no:cacheprovider "$@"
