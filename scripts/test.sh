#!/usr/bin/env bash
# Installs verifypd with its test dependencies and runs the whole test suite (CPU) on two pytest-xdist
# workers: most tests wait on subprocesses (servers, lanes, model loading), so two workers keep a
# 2-core machine busy. VERIFYPD_TEST_WORKERS=0 runs it in one process; extra arguments go to pytest.
# --dist worksteal: each worker starts on its half of the suite in file order (a module's shared
# servers start once per worker that runs part of it) and takes tests from the other when it runs dry.
# Tests marked `serial` (live control loops whose decisions follow measured latency) run afterwards
# in one process, alone on the machine: beside the other worker they timed out now and then.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
status=0
run() {  # pytest's exit status 5 means "no test selected" (a file argument with no serial test in it)
  local rc=0
  python3 -m pytest "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}
run -q -n "${VERIFYPD_TEST_WORKERS:-2}" --dist worksteal -m "not serial" "$@"
run -q -m serial "$@"
exit $status
