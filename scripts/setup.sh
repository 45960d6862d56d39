#!/usr/bin/env bash
# Installs mtpfactory (editable) and what it needs into the current Python environment.
#   bash scripts/setup.sh          # the package: hydra-core, omegaconf, torch, triton, safetensors
#   bash scripts/setup.sh --test   # and the test extra: pytest, pytest-xdist, hypothesis, transformers (an oracle), pins
# An installed torch is kept (a GPU user keeps their CUDA build). Without one, a machine with no NVIDIA GPU
# gets torch 2.13.0's CPU build (a bare `torch` requirement would pull a CUDA build of several GB).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q "torch>=2.11"
  else
    "$py" -m pip install -q "torch==2.13.0"
  fi
fi
extra=""
[[ "${1:-}" == "--test" ]] && extra="[test]"
"$py" -m pip install -q -e ".${extra}"
