"""bench/chaos.py --smoke: split serve under load while lanes are killed / stopped, ports flooded and
garbage sent, after a short fault-free control phase (a short run; the 10-minute CPU run is
bench/results/chaos_cpu.json)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from verifypd.lanes.processes import child_env

pytestmark = pytest.mark.slow  # serve + lane subprocesses for ~a minute (tests/README.md)

BENCH = pathlib.Path(__file__).parents[2] / "bench" / "chaos.py"


def test_chaos_smoke_loses_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--seed", "3", "--control-seconds", "5", "--out", str(out)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == "random weights" and result["git_revision"]
    assert result["reference_deterministic"] and result["served_the_reference_after_the_chaos"]
    assert result["faults"], "no fault was injected"
    assert result["requests"]["sent"] > 0
    assert result["requests"]["lost"] == 0 and result["requests"]["wrong"] == 0, result["lost_examples"]
    assert set(result["status_counts"]) == {"OK"}
    # the fault-free control phase, and every output re-scored: none differs on the CPU (float32)
    assert result["control"]["requests"]["ok"] > 0 and result["control"]["requests"]["differ"] == 0
    classified = result["classification"]
    assert classified["reference_check"]["wrong"] == 0 and set(classified["phases"]) == {"control", "chaos"}
    assert all(p["differ"] == 0 for p in classified["phases"].values())
    assert result["log"]["tracebacks"] == 0 and result["serve_exit_code"] == 0
