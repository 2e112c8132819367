"""bench/serving/prefix_cache.py (with a second target, as `--also random:llama-2-7b` runs on the GPU) and
bench/serving/prefix_cache_multi_turn.py (loadgen multi-turn against `verifypd serve`, cache on and
off) in their --smoke mode on the CPU: they run, record the benchmark metadata, label the weights, and
measure what they say (the cached requests found their prefix cached; the uncached ones did not)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from verifypd.lanes.processes import child_env

pytestmark = pytest.mark.slow  # the bench scripts as subprocesses (tests/README.md)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run(script: str, *argv: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serving" / script), *argv],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_prefix_cache_with_a_second_target(tiny_models, tmp_path):
    target, second = tiny_models
    argv = ["--smoke", "--device", "cpu", "--target", target, "--also", second, "--breakdown", "--out", str(tmp_path)]
    run("prefix_cache.py", *argv)
    result = json.loads((tmp_path / "prefix_cache_cpu.json").read_text())
    assert {"command", "git_revision", "date", "device"} <= result.keys()
    for run_ in (result, result["also"]):
        assert run_["same_tokens"]
        cached = {r["request"]: r["cached_tokens"] for r in run_["modes"]["cached"]}
        assert cached["first"] == 0 and cached["second"] >= 48 and cached["repeat"] >= cached["second"]
        assert all(r["cached_tokens"] == 0 for r in run_["modes"]["uncached"])
        # --smoke: 2 prefixes, each a cold first request and 2 hits; the medians are of those rows
        kinds = [r["kind"] for r in run_["modes"]["cached"]]
        assert kinds.count("cold") == 2 and kinds.count("hit") == 4 and kinds.count("repeat") == 1
        for r in run_["modes"]["cached"]:
            assert (r["cached_tokens"] == 0) == (r["kind"] == "cold"), r
        assert [len(v) for v in run_["warmup_ttft_s"].values()] == [1, 1]  # --smoke: one full-length warm-up
        medians = run_["ttft_s_median"]["cached"]
        assert run_["second_over_first_ttft_cached"] == medians["hit"] / medians["cold"]
    for side in ("split_kv_on", "split_kv_off"):  # --breakdown: every measured request was a cache hit
        details = result["ttft_breakdown"][side]
        assert len(details["ttft_ms"]) == 2 and all(n >= 48 for n in details["cached_tokens"])
        assert details["host_phase_ms_median"].keys() == {
            "add_request",
            "plan",
            "prefill_launch",
            "prefill_forward",
            "first_token_wait",
            "commit",
        }
        assert all(v > 0 for v in details["host_phase_ms_median"].values())
    assert result["also"]["target"] == second and result["also"]["weights"] == f"as given: {second}"


def test_multi_turn_cache_on_and_off(tiny_models, tmp_path):
    target, draft = tiny_models
    argv = ["--smoke", "--device", "cpu", "--target", target, "--draft", draft, "--out", str(tmp_path)]
    run("prefix_cache_multi_turn.py", *argv)
    result = json.loads((tmp_path / "prefix_cache_multi_turn_cpu.json").read_text())
    assert {"command", "git_revision", "date", "device"} <= result.keys() and result["smoke"]
    for mode in ("cached", "uncached"):
        row = result["modes"][mode]
        assert row["requests"]["completed"] == row["requests"]["sent"] > 0 and row["requests"]["failed"] == 0
        assert row["ttft_p50_ms"] > 0 and row["output_tok_s"] > 0
    assert result["ttft_p50_cached_over_uncached"] > 0
    # later turns found the earlier ones cached (the server's /metrics), and nothing was without a cache
    assert result["modes"]["cached"]["prefix_cache_hit_tokens"] > 0
    assert result["modes"]["uncached"]["prefix_cache_hit_tokens"] == 0
