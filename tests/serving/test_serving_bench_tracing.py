"""The tracing benches run and their spans arrive: bench/serving/tracing_core_loop.py (the core's
tracing hooks under a simulated step loop, seconds) and bench/serving/tracing_overhead.py --smoke
(two `verifypd serve` processes, off and on, in paired segments; slow)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from verifypd.lanes.processes import child_env

SERVING = pathlib.Path(__file__).parents[2] / "bench" / "serving"


def run(tmp_path, script: str, *args: str, timeout: int, **env: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(SERVING / script), *args, "--out", str(tmp_path)],
        env={**child_env(), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = tmp_path.glob("*.json")
    return json.loads(out.read_text())


def test_core_loop_bench_pairs_off_and_on_and_its_spans_arrive(tmp_path):
    args = ("--pairs", "2", "--seconds", "0.5", "--flush-wait", "2", "--concurrency", "8", "--gen", "4")
    result = run(tmp_path, "tracing_core_loop.py", *args, timeout=120, OTEL_BSP_SCHEDULE_DELAY="100")
    assert [r["traced"] for r in result["rows"]] == [False, True, True, False]  # order alternates
    assert result["spans_received"] > 0 and len(result["paired_ratios"]) == 2
    assert "SIMULATED" in result["what"]


@pytest.mark.slow  # two serve processes load the embedded model on the CPU (~100 s)
def test_tracing_overhead_smoke(tmp_path):
    result = run(tmp_path, "tracing_overhead.py", "--smoke", timeout=900)
    rows = result["rows"]
    assert [r["traced"] for r in rows] == [False, True, True, False]
    assert all(r["completed"] > 0 and r["failed"] == 0 and r["itl_chunk_max_ms"] > 0 for r in rows)
    assert result["spans_total"] > 0 and len(result["paired_ratios"]) == 2
    ratios = result["paired_ratios"]
    assert result["overhead"] == pytest.approx(1 - (ratios[0] + ratios[1]) / 2, abs=1e-3)  # the median of two
