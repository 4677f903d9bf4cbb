#!/usr/bin/env bash
# The scheduler benchmarks recorded in benchmarks/RESULTS.md, scaled to a 2-core CPU.
# Each run starts its own servers (default model, float32) and writes JSON and plots under
# benchmarks/out/<name>/. Usage: benchmarks/issue_benches.sh [chunking|capacity|capacity-seed2|sweep|prefix|prefix0|preemption]...
set -euo pipefail
cd "$(dirname "$0")/.."
B=".venv/bin/chunkserve bench --disable-tqdm --seed 1"
run() { mkdir -p "benchmarks/out/$1"; shift; "$@"; }
[ $# -gt 0 ] || set -- chunking prefix preemption sweep
for what in "$@"; do
  case $what in
  chunking)  # issue 4: chunked prefill on vs off on mixed traffic
    run chunking $B --workload mixed --num-prompts 24 --long-len 1024:2048 --short-len 16:128 --output-len 32 \
      --request-rate 0.25 --server-args "--dtype float32" --step-trace \
      --compare "--max-num-batched-tokens 512" "--no-enable-chunked-prefill --max-num-batched-tokens 2080" \
      --result-json benchmarks/out/chunking/report.json --plot-dir benchmarks/out/chunking ;;
  capacity)  # issue 4: the highest Poisson rate meeting a P99 TBT SLO, chunked (512) vs off
    # Each probe runs the whole mixed workload at one rate (24 requests: ~24/rate seconds).
    run capacity $B --workload mixed --num-prompts 24 --long-len 1024:2048 --short-len 16:128 --output-len 32 \
      --server-args "--dtype float32 --max-num-batched-tokens 512" --step-trace \
      --capacity --slo-p99-tbt-ms 2500 --max-median-queue-ms 2000 --request-rate 0.25 --capacity-probes 4 \
      --result-json benchmarks/out/capacity/chunked.json
    $B --workload mixed --num-prompts 24 --long-len 1024:2048 --short-len 16:128 --output-len 32 \
      --server-args "--dtype float32 --no-enable-chunked-prefill --max-num-batched-tokens 2080" --step-trace \
      --capacity --slo-p99-tbt-ms 2500 --max-median-queue-ms 2000 --request-rate 0.125 --capacity-probes 4 \
      --result-json benchmarks/out/capacity/unchunked.json ;;
  capacity-seed2)  # the same search on another sample of the traffic (later --seed wins)
    run capacity-seed2 $B --seed 2 --workload mixed --num-prompts 24 --long-len 1024:2048 --short-len 16:128 \
      --output-len 32 --server-args "--dtype float32 --max-num-batched-tokens 512" --step-trace \
      --capacity --slo-p99-tbt-ms 2500 --max-median-queue-ms 2000 --request-rate 0.5 --capacity-probes 4 \
      --result-json benchmarks/out/capacity-seed2/chunked.json
    $B --seed 2 --workload mixed --num-prompts 24 --long-len 1024:2048 --short-len 16:128 --output-len 32 \
      --server-args "--dtype float32 --no-enable-chunked-prefill --max-num-batched-tokens 2080" --step-trace \
      --capacity --slo-p99-tbt-ms 2500 --max-median-queue-ms 2000 --request-rate 0.25 --capacity-probes 4 \
      --result-json benchmarks/out/capacity-seed2/unchunked.json ;;
  sweep)  # issue 4: the chunk budget's trade-off
    run sweep $B --workload mixed --num-prompts 24 --long-len 1024:2048 --short-len 16:128 --output-len 32 \
      --request-rate 0.25 --server-args "--dtype float32" \
      --compare "--max-num-batched-tokens 256" "--max-num-batched-tokens 512" "--max-num-batched-tokens 1024" \
                "--max-num-batched-tokens 2048" "--max-num-batched-tokens 4096" --rounds 1 \
      --result-json benchmarks/out/sweep/report.json ;;
  prefix)  # issue 6: a long shared system prompt, caching on vs off
    run prefix $B --workload shared-prefix --num-prefixes 2 --users-per-prefix 8 --prefix-len 1024 \
      --suffix-len 16:64 --output-len 16 --request-rate 0.5 --server-args "--dtype float32" \
      --compare "--enable-prefix-caching" "--no-enable-prefix-caching" \
      --result-json benchmarks/out/prefix/report.json ;;
  prefix0)  # issue 6: what prefix caching costs when nothing hits (distinct prompts)
    run prefix0 $B --workload fixed --num-prompts 48 --input-len 256 --output-len 64 --max-concurrency 16 \
      --request-rate inf --server-args "--dtype float32" --rounds 4 \
      --compare "--enable-prefix-caching" "--no-enable-prefix-caching" \
      --result-json benchmarks/out/prefix0/report.json ;;
  preemption)  # issue 5: KV oversubscribed 3x by decode growth, recompute vs swap
    # Short prompts, long outputs: all 16 are admitted at once (3 blocks each) and then
    # outgrow the pool while decoding, so the run preempts continually.
    run preemption $B --workload fixed --num-prompts 16 --input-len 32 --output-len 256 --request-rate inf \
      --server-args "--dtype float32 --num-gpu-blocks-override 96 --swap-space 0.5 --max-num-batched-tokens 512" \
      --step-trace --compare "--preemption-mode recompute" "--preemption-mode swap" \
      --result-json benchmarks/out/preemption/report.json ;;
  *) echo "unknown benchmark $what" >&2; exit 2 ;;
  esac
done
