#!/usr/bin/env bash
# Creates .venv and installs chunkserve with the executor and test dependencies.
# Idempotent: a second run only checks. torch is installed first, pinned, so that a CPU
# machine never resolves a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, chunkserve, chunkserve_kernels, transformers, pytest" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.chunkserve-installed ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[executor,dev,bench]"
  touch .venv/.chunkserve-installed
fi
