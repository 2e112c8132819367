"""bench/operator/control_loop.py --smoke on the CPU (its real use is on the GPU): one server, the
three modes, the operator's loop acting on the server's own telemetry, the priority run, the
result file with the benchmark metadata."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from verifypd.lanes.processes import child_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.serial  # its decisions follow measured latency: run alone (scripts/test.sh)
def test_control_loop_bench_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "operator" / "control_loop.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "control_loop_cpu.json").read_text())
    assert {"command", "git_revision", "date", "device"} <= result.keys() and "SIMULATED" in result["label"]
    assert set(result["modes"]) == {"fixed_k4", "adaptive", "adaptive_operator"}
    fixed, adaptive, loop = (result["modes"][m][0] for m in ("fixed_k4", "adaptive", "adaptive_operator"))
    assert all(row["failed"] == 0 and row["throughput_rps"] > 0 for row in (fixed, adaptive, loop))
    # k = 4, less only near the end of a request (no drafts past max_tokens) or on its prefill step (0).
    ks = {int(k): n for k, n in fixed["applied_k"].items()}
    assert max(ks) == 4 and ks[4] == max(n for k, n in ks.items() if k)
    # The TTFT SLO is set so that any prefill breaches it (ITL keeps its headroom): the loop boosted
    # prefill, timing its reaction, and left k to the router's adaptive controller.
    boosts = [d for d in loop["decisions"] if d["action"] == "prefill-boost"]
    assert boosts and boosts[0]["prefill_token_budget"] > 512 and boosts[0]["loop_latency_s"] is not None
    assert all(d["k_max"] == 8 for d in loop["decisions"])
    # Both classes of the 20/80 mix were sent and served; the targets were checked from the rows.
    assert set(result["priority_mix"]["by_priority"]) == {"0", "10"} and (tmp_path / "control_loop_cpu.png").exists()
    targets = result["targets"]
    assert [x["rate"] for x in targets["per_rate"]] == [4.0]
    assert targets["loop_latency_s"] == sorted(
        d["loop_latency_s"] for d in loop["decisions"] if d["loop_latency_s"] is not None
    )
    assert targets["priority_ttft_p95_ratio_high_over_low"] is not None
