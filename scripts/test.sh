#!/usr/bin/env bash
# Installs verifypd with its test dependencies and runs the whole test suite (CPU) on two pytest-xdist
# workers: most tests wait on subprocesses (servers, lanes, model loading), so two workers keep a
# 2-core machine busy. VERIFYPD_TEST_WORKERS=0 runs it in one process; extra arguments go to pytest.
# --dist worksteal: each worker starts on its half of the suite in file order (a module's shared
# servers start once per worker that runs part of it) and takes tests from the other when it runs dry.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
python3 -m pytest -q -n "${VERIFYPD_TEST_WORKERS:-2}" --dist worksteal "$@"
