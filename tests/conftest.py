"""Set-up shared by every test room: one torch thread per test process, tests/support on sys.path (the
helpers every room imports by name), the Triton interpreter chosen and patched before anything imports
triton, and the session fixtures of the tiny random checkpoints (helpers live in support/engine_helpers.py)."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

# One torch intra-op thread per test process, and in the servers and lanes the tests start (they
# inherit the environment). pytest-xdist already runs a worker per core; torch's default of a thread
# per core on top makes every small op wait for a thread that another process holds: on a shared,
# loaded 2-core machine the fast tier took 217 s with it and 66 s without. OMP_NUM_THREADS=N overrides.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

SUPPORT = str(pathlib.Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

# The Triton kernels run on CPU through Triton's interpreter; it must be chosen before triton loads.
if os.environ.get("VERIFYPD_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")


if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_triton_interpreter

    patch_triton_interpreter()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    from engine_helpers import write_target_and_draft

    return write_target_and_draft(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def hf_target(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models[0]).eval()
