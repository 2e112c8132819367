"""Prefix caching under a multi-turn load: `verifypd serve` driven by loadgen's `--workload
multi-turn`, with the prefix cache on (the default) and off (`--no-prefix-cache`).

Each turn of a conversation resends the conversation so far plus a new user message (loadgen's
synthetic multi-turn: docs/loadgen.md), so with the cache a turn prefills only its new tokens (and
the reply tokens, which are synthetic ids, not the server's answer). Per mode: one server process,
`--conversations` conversations in flight (closed loop, concurrency = conversations), `--turns`
turns each, all requests of the run measured (loadgen's warm-up requests first). Reports loadgen's
TTFT p50 / p90 and output tok/s, and the cached over uncached ratios.

    python bench/serving/prefix_cache_multi_turn.py --device cuda --target $G --out bench/results     # GPU
    python bench/serving/prefix_cache_multi_turn.py --device cuda --target random:llama-2-7b --out bench/results
    python bench/serving/prefix_cache_multi_turn.py --smoke --target TINY_DIR --out /tmp/x             # CPU test

Random-weight targets (`random:...`) are labelled so: their prefill cost is real, their tokens are not.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "bench"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_meta import metadata, write_result  # noqa: E402

READY_LINE = "OpenAI-compatible HTTP API on"  # the last port serve opens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    paths = [str(ROOT / "services"), str(ROOT / "loadgen")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}


def start_server(args, port: int, http_port: int, cache: bool) -> tuple[subprocess.Popen, list[str]]:
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--target",
        args.target,
        "--draft",
        args.draft,
        "--device",
        args.device,
        "--max-context",
        str(args.max_context),
        *([] if cache else ["--no-prefix-cache"]),
    ]
    proc = subprocess.Popen(cmd, env=child_env(), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if READY_LINE in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    t0 = time.monotonic()
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() - t0 > args.start_timeout:
            proc.kill()
            raise SystemExit("verifypd serve did not start:\n" + "".join(lines[-30:]))
    return proc, lines


def drive(args, port: int, vocab: int, label: str) -> dict:
    """One loadgen run (multi-turn) against the server; its runs[0].summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [
            sys.executable,
            "-m",
            "verifypd_loadgen",
            "run",
            "--server",
            f"127.0.0.1:{port}",
            "--workload",
            "multi-turn",
            "--turns",
            str(args.turns),
            "--conversations",
            str(args.conversations),
            "--concurrency",
            str(args.conversations),
            "--requests",
            str(args.turns * args.conversations),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--vocab-size",
            str(vocab),
            "--warmup",
            str(args.warmup),
            "--label",
            label,
            "--no-progress",
            "--out",
            str(out),
        ]
        subprocess.run(cmd, env=child_env(), check=True, timeout=args.run_timeout)
        return json.loads(out.read_text())["runs"][0]["summary"]


def prefix_hit_tokens(http_port: int) -> float:
    """The server's verifypd_prefix_cache_hit_tokens counter (/metrics): prompt tokens served cached."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=30).read().decode()
    values = [
        float(m.group(1)) for m in re.finditer(r"^verifypd_prefix_cache_hit_tokens(?:_total)?\S* (\S+)$", text, re.M)
    ]
    return sum(values)


def row(summary: dict, hit_tokens: float) -> dict:
    ttft = summary["latency_ms"]["ttft"]
    return {
        "prefix_cache_hit_tokens": hit_tokens,
        "ttft_p50_ms": ttft["p50"],
        "ttft_p90_ms": ttft["p90"],
        "output_tok_s": summary["throughput"]["output_tokens_per_s"],
        "requests": summary["requests"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--draft", default="ngram")
    p.add_argument("--device", default="auto")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--input-len", type=int, default=256, help="new user tokens per turn")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens and resent reply length per turn")
    p.add_argument("--vocab-size", type=int, default=32000, help="synthetic token ids below this (the target's)")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--run-timeout", type=float, default=300)
    p.add_argument("--smoke", action="store_true", help="small sizes (a CPU test of the script)")
    p.add_argument("--out", default=None, help="directory for prefix_cache_multi_turn_<device>.json")
    args = p.parse_args(argv)
    if args.smoke:
        args.conversations, args.turns, args.input_len, args.output_len = 2, 3, 8, 4
        args.vocab_size, args.max_context, args.warmup = min(args.vocab_size, 96), 256, 1

    modes = {}
    for mode, cache in (("uncached", False), ("cached", True)):
        port, http_port = free_port(), free_port()
        proc, _ = start_server(args, port, http_port, cache)
        try:
            summary = drive(args, port, args.vocab_size, mode)
            modes[mode] = row(summary, prefix_hit_tokens(http_port))
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"{mode}: {modes[mode]}")
    c, u = modes["cached"], modes["uncached"]
    result = {
        **metadata(),
        "what": "loadgen --workload multi-turn against verifypd serve, prefix cache on vs --no-prefix-cache",
        "weights": "RANDOM (the shape only): real prefill cost, meaningless tokens"
        if args.target.startswith("random:")
        else f"as given: {args.target}",
        "target": args.target,
        "draft": args.draft,
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "input_len": args.input_len,
            "output_len": args.output_len,
        },
        "smoke": args.smoke,
        "modes": modes,
        "ttft_p50_cached_over_uncached": c["ttft_p50_ms"] / u["ttft_p50_ms"],
        "output_tok_s_cached_over_uncached": c["output_tok_s"] / u["output_tok_s"],
    }
    print(json.dumps(result, indent=1))
    write_result(args.out, "prefix_cache_multi_turn", result)
    failed = c["requests"].get("failed", 0) + u["requests"].get("failed", 0)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
