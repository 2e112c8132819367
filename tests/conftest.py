"""Settings for every test directory (each directory's fixtures live in its own conftest.py)."""

from __future__ import annotations

import os
import sys

# One torch intra-op thread per test process, and in the servers and lanes the tests start (they
# inherit the environment). pytest-xdist already runs a worker per core; torch's default of a thread
# per core on top makes every small op wait for a thread that another process holds: on a shared,
# loaded 2-core machine the fast tier took 217 s with it and 66 s without. OMP_NUM_THREADS=N overrides.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
