#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite, the real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
