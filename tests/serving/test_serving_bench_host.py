"""bench/engine/router_host_overhead.py, bench/serving/serving_host_ceiling.py and bench/engine/profile_step.py
--closed-loop on the CPU (their real use is on the GPU host's CPU): they run, write their results with the metadata
every benchmark records, and measure what they say (the router batches the concurrent streams; a pipelined pdv step
verifies about half of them)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from verifypd.lanes.processes import child_env

pytestmark = pytest.mark.slow  # the bench scripts as subprocesses (tests/README.md)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(script: str, *argv: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_router_host_overhead(tmp_path):
    run("engine/router_host_overhead.py", "--batch", "1,16", "--steps", "20", "--out", str(tmp_path))
    result = json.loads((tmp_path / "router_host_overhead_cpu.json").read_text())
    assert {"command", "git_revision", "date", "device"} <= result.keys() and "SIMULATED" in result["label"]
    rows = {(r["schedule"], r["batch"]): r for r in result["rows"]}
    assert set(rows) == {("pd", 1), ("pdv", 1), ("pd", 16), ("pdv", 16)}
    for r in rows.values():
        assert r["host_us_per_step"] > 0 and r["tokens"] >= r["steps"]
    # pd verifies all 16 every step, pipelined pdv one group of 8: about half the tokens per step
    assert 1.5 < rows["pd", 16]["tokens"] / rows["pdv", 16]["tokens"] < 2.5


@pytest.mark.parametrize("api", ["grpc", "openai"])
def test_serving_host_ceiling(tmp_path, api):
    run(
        "serving/serving_host_ceiling.py",
        "--concurrency",
        "1,8",
        "--seconds",
        "1.5",
        "--verify-ms",
        "5",
        "--api",
        api,
        "--out",
        str(tmp_path),
    )
    name = "serving_host_ceiling_pd_5ms_cpu.json" if api == "grpc" else "serving_host_ceiling_openai_pd_5ms_cpu.json"
    result = json.loads((tmp_path / name).read_text())
    assert all(r["api"] == api for r in result["rows"])
    assert result["verify_ms"] == 5 and "SIMULATED" in result["label"]
    one, eight = result["rows"]
    assert one["concurrency"] == 1 and eight["concurrency"] == 8
    for r in result["rows"]:
        assert r["client_output_tok_s"] > 0 and r["steps_per_s"] < 1000 / 5  # each step waits 5 ms
    assert eight["tokens_per_step"] > 3 * one["tokens_per_step"]  # the eight streams share steps


def test_profile_step_closed_loop(tiny_models, tmp_path):
    """The engine alone under a closed loop: three passes (prefill beside verify on, off, on), each
    keeping every request slot busy, written with the metadata every benchmark records."""
    target, draft = tiny_models
    run(
        "engine/profile_step.py",
        "--target",
        target,
        "--draft",
        draft,
        "--k",
        "3",
        "--batch",
        "4",
        "--device",
        "cpu",
        "--closed-loop",
        "0.5",
        "--prompt",
        "16",
        "--max-tokens",
        "16",
        "--out",
        str(tmp_path),
    )
    result = json.loads((tmp_path / "closed_loop_engine_cpu.json").read_text())
    assert {"command", "git_revision", "date", "device"} <= result.keys()
    assert [r["prefill_beside_verify"] for r in result["rows"]] == [True, False, True]
    for r in result["rows"]:
        assert r["output_tok_s"] > 0 and r["tokens_per_step"] > 1  # four requests decode in each step


def test_engine_throughput_adaptive_fallback_rows_on_cpu(tiny_models, tmp_path):
    """bench/engine/engine_throughput.py's issue-22 command (plain decoding against SIMULATED acceptance 0.1
    with adaptive k), as a CPU smoke run on tiny checkpoints: it runs, every row counts the k
    decisions (drafting on merit, probes), and the adaptive rows carry their ratio to k = 0."""
    target, draft = tiny_models
    out = tmp_path / "engine_throughput_cpu.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "engine" / "engine_throughput.py"),
            "--device",
            "cpu",
            "--target",
            target,
            "--draft",
            draft,
            "--rows",
            "plain,simulated",
            "--alphas",
            "",
            "--fallback-alphas",
            "0.1",
            "--batches",
            "1,2",
            "--prompt-len",
            "16",
            "--gen-len",
            "16",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "git_revision", "date", "device"} <= result.keys() and result["device"] == "cpu"
    rows = {(r["system"], r["batch"]) for r in result["rows"]}
    fallback = "SIMULATED acceptance 0.1, k=adaptive"
    # --overlap defaults to on (serve's default): the plain rows are the overlapped ones
    assert rows == {(s, b) for s in ("k=0 (plain decoding), overlapped", fallback) for b in (1, 2)}
    for r in result["rows"]:
        assert r["tokens"] == 16 * r["batch"] and r["speedup_vs_k0"] > 0
        assert r["k_decisions"] >= 15 and r["drafting_decisions"] + r["probe_decisions"] <= r["k_decisions"]
        if r["system"].startswith("k=0"):
            assert r["drafting_decisions"] == r["probe_decisions"] == r["draft_calls"] == 0
