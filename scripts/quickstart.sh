#!/usr/bin/env bash
# Installs verifypd, starts the local stack (gateway process + engine core: router and prefill/draft/verify lanes) on the
# embedded model (SmolLM2-135M-Instruct), answers one sample Generate, and stops the stack.
#   bash scripts/quickstart.sh ["PROMPT"] [--topology split]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PROMPT="${1:-What is the capital of France?}"
shift || true
PORT="${VERIFYPD_PORT:-50051}"
LOG="$(mktemp -t verifypd-serve.XXXX.log)"
verifypd serve --port "$PORT" "$@" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "starting verifypd on 127.0.0.1:$PORT (log: $LOG) ..." >&2
for _ in $(seq 1 180); do
  if python3 - "$PORT" <<'PY' 2>/dev/null; then break; fi
import sys, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel(f"127.0.0.1:{sys.argv[1]}") as ch:
    status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
sys.exit(0 if status == health_pb2.HealthCheckResponse.SERVING else 1)
PY
  kill -0 $SERVER 2>/dev/null || { cat "$LOG" >&2; exit 1; }
  sleep 1
done
echo "> $PROMPT" >&2
verifypd generate --server "127.0.0.1:$PORT" "$PROMPT" --max-tokens 64
