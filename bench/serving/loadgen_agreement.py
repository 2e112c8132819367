"""Does `verifypd-loadgen` report what serving_vs_engine.py measures? One `verifypd serve`, one
workload (closed loop at `--concurrency`, `--prompt` random token ids, `--gen` tokens with EOS
ignored, over the OpenAI HTTP API), driven alternately by:
  * serving_vs_engine's client (`drive_clients`: `--client-procs` processes, every one connected
    before a common start; tokens of the chunks received in [warmup, warmup + seconds] / seconds);
  * the loadgen CLI as a user runs it (`--procs` left to its default, `--duration warmup + seconds`,
    `--warmup C` requests first): its headline `output_tokens_per_s`, and from its raw records the
    same in-window count as serving_vs_engine's (`window_tok_s`), so a disagreement names its
    cause: window vs whole run (ramp and drain inside loadgen's duration), counting (tokens per
    chunk vs usage), or a saturated client (`client_cpu_util` near 1.0 per process).
Reports each tok/s, `ratio` = loadgen headline / serving_vs_engine (target within 5 %) and
`window_ratio`. Random prompts on a real model (--target a GGUF path or spec): no speculation
(--draft none unless given), nothing simulated.

    python bench/serving/loadgen_agreement.py --target "$G" --concurrency 128 --out bench/results
    python bench/serving/loadgen_agreement.py --smoke --out /tmp/r     (CPU check: embedded model, c=4)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "loadgen", "bench", "bench/seed_study", "bench/serving"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_meta import metadata, write_result  # noqa: E402
from seed_serving import ServeProcess, free_port  # noqa: E402
from serving_vs_engine import drive_clients  # noqa: E402


def chunk_times_s(record: dict) -> list[tuple[float, int]]:
    """(seconds after the point's first send, tokens) of each token-bearing chunk of a raw record."""
    if record["ttft_ms"] is None:
        return []
    t = record["start_ms"] + record["ttft_ms"]
    times = [t]
    for gap in record["itl_chunk_ms"]:
        t += gap
        times.append(t)
    return [(ms / 1e3, n) for ms, n in zip(times, record["chunk_tokens"], strict=False)]


def serving_vs_engine_client(args, url_host: str) -> dict:
    sve = SimpleNamespace(client_procs=args.client_procs)
    argv = ["--target", args.target, "--prompt", str(args.prompt), "--gen", str(args.gen), "--vocab", str(args.vocab)]
    argv += ["--seconds", str(args.seconds), "--warmup", str(args.warmup), "--client-procs", str(args.client_procs)]
    seen = drive_clients(sve, "openai", url_host, args.concurrency, lambda start_at: None, argv=argv)
    return {
        "client": "serving_vs_engine",
        "tok_s": round(seen["tokens"] / args.seconds, 1),
        "tokens_in_window": seen["tokens"],
        "client_cpu_s": round(seen["client_cpu_s"], 2),
        "errors": seen["errors"],
    }


def loadgen_cli(args, url_host: str) -> dict:
    duration = args.warmup + args.seconds
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        cmd = [sys.executable, "-m", "verifypd_loadgen", "--backend", "openai", "--url", f"http://{url_host}/v1"]
        cmd += ["--model", args.target, "--concurrency", str(args.concurrency), "--duration", str(duration)]
        cmd += ["--warmup", str(args.concurrency), "--input-len", str(args.prompt), "--output-len", str(args.gen)]
        cmd += ["--vocab-size", str(args.vocab), "--drain-timeout", "30", "--raw-records", "--no-progress"]
        cmd += ["--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 120)
        if done.returncode != 0:
            raise SystemExit(f"loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
        run = json.loads(out.read_text())["runs"][0]
    summary = run["summary"]
    chunks = [c for r in run["records"] for c in chunk_times_s(r)]
    lo, hi = args.warmup, args.warmup + args.seconds
    window_tokens = sum(n for t, n in chunks if lo <= t < hi)
    return {
        "client": "loadgen",
        "tok_s": round(summary["throughput"]["output_tokens_per_s"], 1),
        "duration_s": round(summary["duration_s"], 2),  # first send to last end: ramp and drain included
        "window_tok_s": round(window_tokens / args.seconds, 1),
        "load_tok_s": round(sum(n for t, n in chunks if t < duration) / duration, 1),  # whole load time, no drain
        "requests": summary["requests"],
        "output_total": summary["tokens"]["output_total"],
        "procs": summary["client"]["procs"],
        "client_cpu_util": summary["client"]["cpu_util"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="a GGUF path or model spec (its name is the served model)")
    p.add_argument("--draft", default="none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--seconds", type=float, default=15.0, help="measured window of each run")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the window")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--client-procs", type=int, default=4, help="serving_vs_engine's client processes")
    p.add_argument("--repeats", type=int, default=2, help="serving_vs_engine / loadgen pairs, alternating")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--echo", action="store_true", help="echo the server's log")
    p.add_argument("--smoke", action="store_true", help="CPU check: embedded model, c=4, 4 s windows, one pair")
    p.add_argument("--out", help="directory for the JSON result")
    args = p.parse_args()
    if args.smoke:
        args.device, args.concurrency, args.seconds, args.warmup = "cpu", 4, 4.0, 1.0
        args.prompt, args.gen, args.vocab, args.repeats, args.client_procs = 16, 16, 1000, 1, 2
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "verifypd.cli", "serve", "--port", str(port), "--http-port", str(http_port)]
    cmd += ["--target", args.target, "--draft", args.draft, "--device", args.device, "--max-queue", "1024"]
    cmd += ["--max-context", str(args.prompt + args.gen + 64), "--max-running", str(max(256, args.concurrency))]
    t0 = time.perf_counter()
    server = ServeProcess(cmd, echo=args.echo)
    rows = []
    try:
        why = server.wait_ready(args.ready_timeout)
        if why:
            raise SystemExit(f"serve did not start: {why}\n" + "\n".join(server.tail()))
        ready_s = time.perf_counter() - t0
        host = f"127.0.0.1:{http_port}"
        for _ in range(args.repeats):
            for run in (serving_vs_engine_client, loadgen_cli):
                rows.append(run(args, host))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    sve = [r["tok_s"] for r in rows if r["client"] == "serving_vs_engine"]
    lg = [r for r in rows if r["client"] == "loadgen"]
    mean_sve = sum(sve) / len(sve)
    mean_lg = sum(r["tok_s"] for r in lg) / len(lg)
    mean_window = sum(r["window_tok_s"] for r in lg) / len(lg)
    ratio = mean_lg / mean_sve if mean_sve else None
    result = {
        **metadata(),
        "what": "loadgen CLI (--procs default) vs serving_vs_engine's client against one `verifypd serve`, "
        "same workload over the OpenAI HTTP API; output tok/s",
        "target": args.target,
        "draft": args.draft,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "prompt": args.prompt,
        "gen": args.gen,
        "serve_ready_s": round(ready_s, 1),
        "rows": rows,
        "serving_vs_engine_tok_s": round(mean_sve, 1),
        "loadgen_tok_s": round(mean_lg, 1),
        "loadgen_window_tok_s": round(mean_window, 1),
        "ratio": round(ratio, 4) if ratio else None,
        "window_ratio": round(mean_window / mean_sve, 4) if mean_sve else None,
        "within_5pct": ratio is not None and abs(1 - ratio) <= 0.05,
    }
    keys = ("serving_vs_engine_tok_s", "loadgen_tok_s", "loadgen_window_tok_s", "ratio", "window_ratio", "within_5pct")
    print(json.dumps({k: result[k] for k in keys}))
    write_result(args.out, "loadgen_agreement", result)


if __name__ == "__main__":
    main()
