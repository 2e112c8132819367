"""Two `verifypd-loadgen` runs (separate OS processes, same flags and seed) against one server at
once lose no request: each reports all of its requests completed, the server received every one of
both runs (warm-up included), and no request id repeats across them (a real gateway refuses an id
already in flight: the run tag is random per run and client process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_loadgen_processes_against_one_server_lose_no_requests(fake, tmp_path):
    servicer, addr = fake(ttft_s=0.002, itl_s=0.001)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "loadgen"), str(ROOT / "services"), env.get("PYTHONPATH", "")])
    flags = ["--server", addr, "--requests", "20", "--concurrency", "4", "--warmup", "2", "--output-len", "6"]
    flags += ["--seed", "5", "--no-progress", "--raw-records"]
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "verifypd_loadgen", *flags, "--out", str(tmp_path / f"r{i}.json")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for run in runs:
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-2000:]
    ids = []
    for i in range(2):
        point = json.loads((tmp_path / f"r{i}.json").read_text())["runs"][0]
        assert point["summary"]["requests"] == {"sent": 20, "completed": 20, "failed": 0, "cancelled": 0}
        assert point["summary"]["tokens"]["output_total"] == 20 * 6
        ids += [r["request_id"] for r in point["records"]]
    received = [request.request_id for _, request in servicer.received]
    assert len(received) == 2 * (20 + 2)  # both runs' requests and warm-ups reached the server
    assert len(set(received)) == len(received)  # no id repeated across the two runs
    assert set(ids) <= set(received)
