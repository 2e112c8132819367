"""Host memory while loading (the loader's Done-when, measured, not assumed): a bf16 safetensors
checkpoint of a few hundred MB loaded on the CPU in bf16 raises the process's peak RSS by at most
1.25x the checkpoint's size, so no full-model copy (an fp32 host model alone would be 2x) is ever
made; and a tensor-parallel rank reads exactly the replicated tensors plus 1/W of the rest. Measured
by bench/engine/load_time.py --smoke in fresh processes (ru_maxrss against the RSS before the load)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from verifypd.lanes.processes import child_env

pytestmark = pytest.mark.slow  # writes a ~440 MB checkpoint and loads it in subprocesses

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_bf16_load_peak_host_memory_and_rank_reads(tmp_path):
    out = tmp_path / "load_time.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench/engine/load_time.py"), "--smoke", "--dir", str(tmp_path / "ckpt")]
        + ["--tensor-parallel", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    size = result["checkpoint_bytes"]
    assert size > 400e6 and result["shards"] > 1 and "random" in result["weights"]
    load = result["load"]
    assert load["weights_bytes_on_device"] == size == load["bytes_read"]  # bf16 in, bf16 held, read once
    assert load["rss_peak_above_baseline_bytes"] <= 1.25 * size, load
    (rank,) = result["tensor_parallel"]
    assert rank["bytes_read"] == result["analytic"]["as written"]["rank_bytes_read"]["2"] < 0.85 * size
    assert rank["rss_peak_above_baseline_bytes"] <= 1.25 * rank["bytes_read"], rank
