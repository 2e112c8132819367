"""How fast one `verifypd-loadgen` command can stream: the real CLI (`--backend openai`, closed
loop, `--duration`) against bench/serving/fake_sse_server.py, a fake OpenAI-compatible server in
processes of its own that paces every stream at `--itl-ms` per event and costs little per event.
The offered rate is concurrency * tokens-per-event / itl; what loadgen reports as output tok/s,
against it, is loadgen's ceiling at that `--procs` (its summary's client CPU says which side ran
out). One token per event, so tok/s = SSE events/s: the hardest case for a client.

    python bench/serving/loadgen_ceiling.py --concurrency 256 --procs 1,2,4,8 --out bench/results

The target for a 16-core GPU host is >= 25,000 tok/s over HTTP. Nothing here is a model: the
tokens are the fake server's (SIMULATED server; no GPU used).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
for sub in ("bench", "bench/serving"):
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)

import fake_sse_server  # noqa: E402
from bench_meta import metadata, write_result  # noqa: E402


def run_loadgen(url: str, args, procs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [
            sys.executable,
            "-m",
            "verifypd_loadgen",
            "--backend",
            "openai",
            "--url",
            url,
            "--model",
            "fake",
            "--concurrency",
            str(args.concurrency),
            "--duration",
            str(args.duration),
            "--drain-timeout",
            "10",
            "--input-len",
            "16",
            "--output-len",
            str(args.tokens),
            "--procs",
            str(procs),
            "--no-progress",
            "--out",
            out,
        ]
        env = dict(os.environ)
        paths = [os.path.join(ROOT, p) for p in ("services", "loadgen")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.duration + 120)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"loadgen exited {proc.returncode}: {proc.stderr[-2000:]}")
        s = json.load(open(out))["runs"][0]["summary"]
    return {
        "procs": procs,
        "command": " ".join(cmd[2:]),
        "output_tokens_per_s": round(s["throughput"]["output_tokens_per_s"], 1),
        "requests_completed": s["requests"]["completed"],
        "requests_failed": s["requests"]["failed"],
        "errors": s["errors"],
        "client_cpu_util": s["client"]["cpu_util"],
        "client_cpu_util_max": s["client"]["cpu_util_max"],
        "itl_token_p50_ms": s["latency_ms"]["itl_token"]["p50"],
        "itl_token_p99_ms": s["latency_ms"]["itl_token"]["p99"],
        "ttft_p50_ms": s["latency_ms"]["ttft"]["p50"],
        # events arriving in bursts (median gap far below the pacing) mean the fake server fell
        # behind: then the row measures the server, not loadgen; add --server-procs
        "server_kept_pace": (s["latency_ms"]["itl_token"]["p50"] or 0) >= 0.5 * args.itl_ms,
        "command_wall_s": round(wall, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--procs", default="1,2,4,8", help="loadgen --procs values to measure")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of sending per point")
    p.add_argument("--tokens", type=int, default=256, help="output tokens per request (one per event)")
    p.add_argument("--itl-ms", type=float, default=5.0, help="the fake server's gap between a stream's events")
    p.add_argument("--server-procs", type=int, default=max(1, (os.cpu_count() or 2) // 4))
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script on a CPU box")
    p.add_argument("--out", help="directory for the JSON result")
    args = p.parse_args()
    if args.smoke:
        args.concurrency, args.duration, args.tokens, args.server_procs, args.procs = 8, 2.0, 32, 1, "1,2"
    workers, port = fake_sse_server.start(procs=args.server_procs, itl_s=args.itl_ms / 1e3)
    url = f"http://127.0.0.1:{port}/v1"
    rows = []
    try:
        time.sleep(0.3)
        for procs in [int(x) for x in args.procs.split(",")]:
            rows.append(run_loadgen(url, args, procs))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for w in workers:
            w.terminate()
    offered = args.concurrency / (args.itl_ms / 1e3)
    result = {
        **metadata(),
        "what": "one verifypd-loadgen command's sustained streamed tok/s (--backend openai, closed loop) "
        "against a fake SSE server (SIMULATED server, no model)",
        "concurrency": args.concurrency,
        "tokens_per_request": args.tokens,
        "tokens_per_event": 1,
        "itl_ms": args.itl_ms,
        "offered_tokens_per_s": offered,
        "server_procs": args.server_procs,
        "duration_s": args.duration,
        "cpu_count": os.cpu_count(),
        "rows": rows,
        "best_output_tokens_per_s": max(r["output_tokens_per_s"] for r in rows),
    }
    write_result(args.out, "loadgen_ceiling", result)


if __name__ == "__main__":
    main()
