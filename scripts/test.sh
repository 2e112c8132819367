#!/usr/bin/env bash
# Installs verifypd with its test dependencies and runs the whole test suite (CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m pytest -q "$@"
