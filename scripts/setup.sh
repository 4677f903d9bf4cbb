#!/usr/bin/env bash
# Creates .venv and installs chunkserve with the executor and test dependencies.
# Idempotent: a second run only checks. torch is installed first, pinned, so that a CPU
# machine never resolves a multi-GB CUDA build. A .venv left broken (a first run interrupted
# while creating it: no python, or no pip) is made again.
#   scripts/setup.sh --venv-only   makes or repairs .venv and installs nothing (tests use it)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
venv_ok() {
  [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1
}
if ! venv_ok; then
  if [ -e .venv ]; then
    echo "setup: .venv is broken (no python or no pip, e.g. an interrupted first run): making it again" >&2
    rm -rf .venv
  fi
  "$PYTHON" -m venv .venv
fi
if [ "${1:-}" = "--venv-only" ]; then
  exit 0
fi
if ! .venv/bin/python -c "import torch, chunkserve, chunkserve_kernels, transformers, pytest" 2>/dev/null \
   || [ pyproject.toml -nt .venv/.chunkserve-installed ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[executor,dev,bench]"
  touch .venv/.chunkserve-installed
fi
