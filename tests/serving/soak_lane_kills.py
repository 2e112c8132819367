"""Bounded soak on CPU: `verifypd serve --topology split` (tiny random models) under closed-loop
load while lanes are SIGKILLed in rotation. Prints requests sent / OK / lost, lane kills, and
whether every stream equals the fault-free output. Not collected by pytest (run it by hand):

    PYTHONPATH=$PWD/services python3 tests/serving/soak_lane_kills.py --requests 120 --kills 6
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "support"))

import grpc
from services_helpers import (
    BLOCK_SIZE,
    MAX_CONTEXT,
    Server,
    _engine_models,
    engine_options,
    free_port,
    offline_outputs,
    random_prompts,
    wait_until,
)
from test_serving_lane_failure import CONCURRENCY, MAX_TOKENS, closed_loop

from verifypd.domain.requests import RequestSpec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--kills", type=int, default=6)
    args = ap.parse_args()
    models = _engine_models.write_target_and_draft(pathlib.Path(tempfile.mkdtemp(prefix="soak-")))
    prompts = random_prompts(args.requests, seed=5, max_len=20)
    expected = offline_outputs(
        engine_options(*models), [RequestSpec(tuple(p), max_tokens=MAX_TOKENS, stop_at_eos=False) for p in prompts]
    )
    port = free_port()
    server = Server(
        [
            sys.executable,
            "-m",
            "verifypd.cli",
            "serve",
            "--topology",
            "split",
            "--port",
            str(port),
            "--target",
            models[0],
            "--draft",
            models[1],
            "--device",
            "cpu",
            "--num-blocks",
            "64",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-context",
            str(MAX_CONTEXT),
            "--max-running",
            "4",
            "--k-initial",
            "4",
            "--no-adaptive",
            "--max-lane-restarts",
            "5",
            "--http-port",
            "0",
        ]
    )
    assert server.ready.wait(180)
    results: dict = {}
    stop = threading.Event()
    t0 = time.monotonic()
    workers = closed_loop(f"127.0.0.1:{port}", prompts, results, stop)
    for t in workers:
        t.start()
    kills, lanes = [], ("draft", "verify", "prefill")
    every = max(1, args.requests // (args.kills + 1))
    for n in range(args.kills):
        if not wait_until(lambda n=n: len(results) >= every * (n + 1), 600):
            break
        # The last kill's recovery is over (the lane watchdog may add recoveries: Server.recovered_since).
        wait_until(lambda n=n: server.recoveries() >= n and not server.recovering(), 300)
        lane = lanes[n % 3]
        os.kill(server.lane_pids()[lane], signal.SIGKILL)
        kills.append(lane)
    for t in workers:
        t.join(900)
    stop.set()
    ok = sum(1 for code, _ in results.values() if code == grpc.StatusCode.OK)
    exact = sum(1 for n, (code, chunks) in results.items() if [t for m in chunks for t in m.token_ids] == expected[n])
    report = {
        "requests_sent": args.requests,
        "completed_ok": ok,
        "lost": args.requests - ok,
        "streams_equal_fault_free": exact,
        "lane_kills": len(kills),
        "killed": kills,
        "restarts": server.count(r"lane restarted, pid"),
        "recoveries": server.count(r"lanes recovered after"),
        "concurrency": CONCURRENCY,
        "max_tokens": MAX_TOKENS,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    server.proc.send_signal(signal.SIGTERM)
    server.proc.wait(60)
    print(json.dumps(report))
    return 0 if report["lost"] == 0 and exact == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
