#!/usr/bin/env bash
# Installs verifypd and runs the main job on the embedded model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
verifypd generate --offline "${1:-What is speculative decoding?}" --max-tokens 48
