#!/usr/bin/env bash
# Every CUDA check in one command: the `gpu` pytest marker (the engine's CUDA paths, the decode
# batch on the device, the fault harness's CUDA OOM, two data-parallel engines sharing the device,
# engines joining and leaving a serving client, the CI campaign and the quick fault matrix
# with the engine on CUDA), then the engine-step benchmark on the device (figures only, never
# judged). Exits non-zero if CUDA is missing or a test fails; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# From the repo root, its enginewire/ folder would shadow an installed (non-editable) package.
export PYTHONSAFEPATH=1
# The project's venv where bootstrap made one, else the interpreter on PATH (PYTHON overrides).
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
"$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device visible to torch")
print("gpu_check:", torch.cuda.get_device_name(0), "torch", torch.__version__)
PY
"$PYTHON" -m pytest -q -m gpu tests -p no:cacheprovider "$@"
"$PYTHON" -m enginewire.benchmarks.engine_step --cuda
