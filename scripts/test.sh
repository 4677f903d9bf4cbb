#!/usr/bin/env bash
# Sets up (scripts/setup.sh), checks lint and formatting (ruff), then runs the whole test
# suite, the real-model tests included (CI runs exactly this).
#   scripts/test.sh --fast      skips the tests marked slow (real model, real server
#                               processes): a few minutes, for the edit-test loop
# Other arguments go to pytest (e.g. scripts/test.sh --fast tests/scheduler_svc -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
args=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then args+=(-m "not slow"); else args+=("$arg"); fi
done
exec .venv/bin/python -m pytest "${args[@]}"
