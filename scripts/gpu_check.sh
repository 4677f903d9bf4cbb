#!/usr/bin/env bash
# The GPU check, in one go (< 8 minutes on one H200): what the machine has, the GPU tests
# (tests/kernels/test_gpu.py: every backend vs the torch_ref oracle, the executor's greedy
# tokens vs transformers), then benchmarks/gpu_bench.py (Llama-3-8B shapes, random bf16
# weights: decode vs the HBM floor, prefill vs the bf16 peak), then its decode steps again with
# torch's norms instead of the Triton add + RMSNorm (the A/B of chunkserve_kernels/triton_norm.py).
#
#   scripts/gpu_check.sh            # on a GPU machine
#   scripts/gpu_check.sh --tiny     # anywhere: checks this script (tests skip, tiny bench on CPU)
#   scripts/gpu_check.sh --idle     # instead: the executor's idle time between steps, plain vs
#                                   # --async-output-processing vs --async-scheduling (issue 17
#                                   # item 5; benchmarks/step_idle.py on a tiny model with a byte
#                                   # tokenizer, real servers: needs the scheduler's wheels, GPU.md)
#
# It uses whatever Python already has torch (.venv/bin/python, else python3; with CUDA
# unless --tiny) and installs nothing by default: GPU boxes are often offline.
#   - Wheels in .whl/ are installed first, offline, into /tmp/site (e.g. protobuf and
#     grpcio as new as chunkserve's generated code; see benchmarks/GPU.md).
#   - GPU_CHECK_INSTALL=1 pip-installs missing pytest/transformers/triton from the index.
# The repo is used in place (no pip install of chunkserve): its root goes first on PYTHONPATH.
# Logs and gpu_bench.json go to $OUT (default benchmarks/out/gpu). Exit status: the tests'
# (0 = passed), or 2 if no usable Python.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TINY=0
IDLE=0
[ "${1:-}" = "--tiny" ] && TINY=1
[ "${1:-}" = "--idle" ] && IDLE=1
OUT=${OUT:-$ROOT/benchmarks/out/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

echo "== nvidia-smi"
nvidia-smi || echo "(nvidia-smi not available)"

echo "== python"
PY=""
for cand in "$ROOT/.venv/bin/python" python3 python; do
  command -v "$cand" >/dev/null 2>&1 || continue
  if [ $TINY = 1 ] || [ $IDLE = 1 ]; then check="import torch"; else check="import torch, sys; sys.exit(not torch.cuda.is_available())"; fi
  if "$cand" -c "$check" >/dev/null 2>&1; then PY=$cand; break; fi
  echo "$cand: no torch with CUDA ($("$cand" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1))"
done
if [ -z "$PY" ]; then
  echo "FAIL: no Python with a CUDA-enabled torch found (tried .venv/bin/python, python3, python)."
  echo "Install one, e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128"
  exit 2
fi
echo "using $PY"

if ls .whl/*.whl >/dev/null 2>&1; then
  echo "== installing carried wheels from .whl/ into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  for pkg in pytest transformers triton; do
    "$PY" -c "import $pkg" 2>/dev/null || timeout 180 "$PY" -m pip install -q "$pkg" || echo "could not install $pkg"
  done
fi
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}

"$PY" - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib, platform, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", "sm", f"{p.major}.{p.minor}", p.multi_processor_count, "SMs")
for name in ("triton", "flash_attn", "transformers", "google.protobuf", "grpc", "pytest"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as e:
        print(name, "MISSING:", repr(e)[:120])
from chunkserve_kernels import choose_backend
dev = "cuda" if torch.cuda.is_available() else "cpu"
print("auto backend:", {bs: choose_backend(dev, torch.bfloat16, bs) for bs in (16, 256)})
EOF

if [ $IDLE = 1 ]; then
  echo "== executor idle time between steps (benchmarks/step_idle.py)"
  timeout 400 "$PY" benchmarks/step_idle.py --model tiny-bytes --streams 32 --input-len 64 --output-len 128 --rounds 2 \
    2>&1 | tee "$OUT/step_idle.log"
  exit "${PIPESTATUS[0]}"
fi

echo "== GPU tests"
timeout 270 "$PY" -m pytest tests/kernels/test_gpu.py -q -rs --confcutdir=tests/kernels -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu_tests.log"
TESTS=${PIPESTATUS[0]}
echo "tests exit status: $TESTS"

echo "== benchmark"
if [ $TINY = 1 ]; then BENCH=(--tiny); else BENCH=(); fi
timeout 180 "$PY" benchmarks/gpu_bench.py "${BENCH[@]}" --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.log"
echo "benchmark exit status: ${PIPESTATUS[0]}"
if [ $TINY = 0 ]; then
  echo "== the same decode steps with torch's norms (the A/B of the Triton add + RMSNorm)"
  timeout 120 "$PY" benchmarks/gpu_bench.py --torch-norms --backends triton --batches 1 32 \
    --prefill-seqs 1 --prefill-len 256 --json "$OUT/gpu_bench_torch_norms.json" 2>&1 | tee "$OUT/gpu_bench_torch_norms.log"
  echo "benchmark exit status: ${PIPESTATUS[0]}"
fi
exit "$TESTS"
