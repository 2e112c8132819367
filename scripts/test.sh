#!/usr/bin/env bash
# Installs verifypd with its test dependencies, checks the code, then runs the test suite (CPU) in
# tiers (tests/README.md says what goes where):
#   1. ruff check .          lint          } the first failure stops the script
#   2. ruff format --check . formatting    }
#   3. mypy                  type check    }
#   4. the fast unit tier:   -m "not slow and not live and not serial"
#   5. the rest:             -m "(slow or live) and not serial"
#   6. serial:               -m serial, alone on the machine
# Stages 4-6 all run even when one fails; the exit status is the first failing one's.
#
#   bash scripts/test.sh [--fast] [PYTEST ARGS...]
#   --fast (or VERIFYPD_TEST_FAST=1): stages 1-4 only (lint and the fast tier), for developers.
#   VERIFYPD_TEST_WORKERS: pytest-xdist workers (default 2; 0 runs in one process).
#   PYTEST ARGS go to every pytest run (e.g. a file or -k EXPR).
# Two workers: most slow tests wait on subprocesses (servers, lanes, model loading), so two keep a
# 2-core machine busy. --dist worksteal: each worker starts on its half of the tier in file order (a
# module's shared servers start once per worker that runs part of it) and takes tests from the other
# when it runs dry. Tests marked `serial` (live control loops whose decisions follow measured
# latency) run last in one process, alone on the machine: beside the other worker they timed out
# now and then.
set -euo pipefail
cd "$(dirname "$0")/.."

fast="${VERIFYPD_TEST_FAST:-0}"
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then fast=1; else args+=("$a"); fi
done
workers="${VERIFYPD_TEST_WORKERS:-2}"
MYPY_PATHS=(services/verifypd operator/verifypd_operator loadgen/verifypd_loadgen)

total_start=$SECONDS
stage_start=$SECONDS
stage() {  # stage NAME: prints the wall time of the stage that just ended
  echo "test.sh: $1: $((SECONDS - stage_start)) s" >&2
  stage_start=$SECONDS
}

bash scripts/install.sh test
stage "install"

python3 -m ruff check .
stage "ruff check"
python3 -m ruff format --check .
stage "ruff format --check"
python3 -m mypy "${MYPY_PATHS[@]}"
stage "mypy"

status=0
run() {  # pytest's exit status 5 means "no test selected" (e.g. a file argument with no test of the tier)
  local name=$1 rc=0
  shift
  python3 -m pytest "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && [ "$status" -eq 0 ]; then status=$rc; fi
  stage "$name (pytest exit $rc)"
}
run "fast tier" -q -n "$workers" --dist worksteal -m "not slow and not live and not serial" ${args[@]+"${args[@]}"}
if [ "$fast" != "1" ]; then
  run "slow and live tier" -q -n "$workers" --dist worksteal -m "(slow or live) and not serial" ${args[@]+"${args[@]}"}
  run "serial tier" -q -m serial ${args[@]+"${args[@]}"}
fi
echo "test.sh: total: $((SECONDS - total_start)) s" >&2
exit $status
