"""The arguments of `verifypd-loadgen [run]`: its parser (run_plan.py resolves what it parses)."""

from __future__ import annotations

import argparse

from verifypd_loadgen import __version__
from verifypd_loadgen.arg_types import (
    comma_list,
    endpoint,
    flag_type,
    fraction,
    http_url,
    positive,
    proc_count,
    ratio,
    vocab_range,
)
from verifypd_loadgen.multi_turn import WORKLOADS
from verifypd_loadgen.procs import CONCURRENCY_PER_PROC
from verifypd_loadgen.workload import DIST_HELP, parse_distribution, parse_priority_mix


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verifypd-loadgen",
        description="Load generator for the verifypd Generate protocol. Other commands: "
        "`verifypd-loadgen compare A.json B.json ...`, `verifypd-loadgen fake-server`.",
    )
    p.add_argument("--version", action="version", version=f"verifypd-loadgen {__version__}")
    p.add_argument(
        "--server",
        type=flag_type(endpoint, "endpoint"),
        help="--backend grpc: HOST:PORT of the verifypd gateway; the only endpoint loadgen talks to",
    )
    p.add_argument(
        "--backend",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: verifypd Generate (default); openai: any OpenAI-compatible HTTP server",
    )
    p.add_argument(
        "--url",
        type=flag_type(http_url, "URL"),
        help="--backend openai: base URL, e.g. http://127.0.0.1:8000/v1 (the only endpoint)",
    )
    p.add_argument("--model", help="--backend openai: the model id to request")
    p.add_argument(
        "--tls-ca-file",
        help="PEM CA the server's certificate must chain to: gRPC over TLS, or the "
        "CA for an https:// --url (default there: the system's CAs)",
    )
    p.add_argument("--tls-cert-file", help="with --tls-ca-file: client certificate (PEM) to present")
    p.add_argument("--tls-key-file", help="the private key of --tls-cert-file")
    p.add_argument(
        "--openai-api",
        choices=("auto", "chat", "completions"),
        default="auto",
        help="--backend openai: auto = chat prompts to /chat/completions, others to "
        "/completions; chat = text prompts too as a user message",
    )
    n = p.add_mutually_exclusive_group()
    n.add_argument("--requests", type=flag_type(positive(int), "count"), help="requests per load point (default 100)")
    n.add_argument(
        "--duration",
        type=flag_type(positive(float), "duration"),
        help="seconds of sending per load point; then in-flight requests get --drain-timeout seconds to finish",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=flag_type(comma_list(positive(int)), "concurrency list"),
        help="closed loop: C[,C...] requests always in flight (default 1)",
    )
    load.add_argument(
        "--rate",
        type=flag_type(comma_list(positive(float, True)), "rate list"),
        help="open loop: R[,R...] requests/s ('inf': all at once)",
    )
    p.add_argument(
        "--procs",
        type=flag_type(proc_count, "process count"),
        default="auto",
        help="client processes sharing the load, started together, merged into one report "
        f"(default auto: ceil(largest concurrency / {CONCURRENCY_PER_PROC}), at most the cores)",
    )
    p.add_argument(
        "--arrival", choices=("poisson", "gamma"), default="poisson", help="open-loop arrival process (default poisson)"
    )
    p.add_argument(
        "--burstiness",
        type=flag_type(positive(float), "burstiness"),
        default=None,
        help="gamma shape: <1 burstier, >1 smoother than Poisson (default 1)",
    )
    p.add_argument(
        "--max-concurrency",
        type=flag_type(positive(int), "count"),
        help="open loop: cap on requests in flight (later arrivals wait)",
    )
    d = p.add_argument_group("workload")
    d.add_argument(
        "--dataset", default="synthetic", help="'synthetic' (token-id prompts), a JSONL prompt file or ShareGPT JSON"
    )
    d.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="uniform",
        help="uniform: independent prompts, synthetic ones from --input-len (default); mixed: a "
        "--long-fraction share of them from --long-input-len (long prefills among streaming decodes); "
        "multi-turn: conversations whose turns resend the conversation so far (synthetic; --turns, "
        "--conversations), to measure a server's prefix cache",
    )
    d.add_argument(
        "--long-fraction",
        type=flag_type(fraction, "fraction"),
        default=0.1,
        help="--workload mixed: share of long prompts (default 0.1)",
    )
    d.add_argument(
        "--long-input-len",
        type=flag_type(parse_distribution, "distribution"),
        default=parse_distribution("2048"),
        help="--workload mixed: long prompt length (default 2048)",
    )
    d.add_argument(
        "--turns", type=flag_type(positive(int), "count"), default=4, help="multi-turn: turns per conversation"
    )
    d.add_argument(
        "--conversations",
        type=flag_type(positive(int), "count"),
        default=8,
        help="multi-turn: conversations taken turn by turn, round-robin (default 8)",
    )
    d.add_argument(
        "--input-len",
        type=flag_type(parse_distribution, "distribution"),
        help=f"synthetic prompt length: {DIST_HELP} (default 128)",
    )
    d.add_argument(
        "--output-len",
        type=flag_type(parse_distribution, "distribution"),
        help="max_tokens distribution (default 128; overrides dataset lengths)",
    )
    d.add_argument(
        "--vocab-range",
        type=flag_type(vocab_range, "range"),
        default=(100, 10000),
        help="synthetic token ids are drawn from [LO, HI) (default 100:10000)",
    )
    d.add_argument(
        "--vocab-size",
        type=flag_type(positive(int), "size"),
        help="bound synthetic token ids below this vocabulary size",
    )
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    d.add_argument(
        "--priority-mix",
        type=flag_type(parse_priority_mix, "priority mix"),
        help="PRIORITY:WEIGHT[,...], e.g. 0:0.8,10:0.2 (default all 0)",
    )
    d.add_argument(
        "--ignore-eos", action="store_true", help="dataset prompts: send stop_at_eos=false (synthetic always does)"
    )
    s = p.add_argument_group("SLOs and timing")
    s.add_argument("--slo-ttft-ms", type=flag_type(positive(float), "SLO"))
    s.add_argument(
        "--slo-itl-ms",
        type=flag_type(positive(float), "SLO"),
        help="bound on a request's mean inter-token latency (TPOT)",
    )
    s.add_argument("--warmup", type=int, default=0, help="warm-up requests, not measured")
    s.add_argument(
        "--timeout",
        type=flag_type(positive(float), "timeout"),
        default=300.0,
        help="per-request deadline in seconds (default 300)",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="duration mode: seconds to let in-flight requests finish (default 30)",
    )
    s.add_argument("--connect-timeout", type=flag_type(positive(float), "timeout"), default=10.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--trace-ratio",
        type=flag_type(ratio, "share"),
        default=0.0,
        help="share of requests sent with a sampled W3C traceparent of a new trace (gRPC metadata or "
        "HTTP header): the server traces them whatever its own sample ratio (default 0)",
    )
    s.add_argument(
        "--trace-alternate",
        type=flag_type(positive(float), "seconds"),
        default=None,
        metavar="SECONDS",
        help="instead of --trace-ratio: trace every request started in odd slots of SECONDS (all client "
        "processes switch together) and none in even ones; the raw records' traceparent says which, "
        "for an A/B of tracing's cost in one run (bench/serving/tracing_overhead.py --interleave)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", help="results JSON file")
    o.add_argument("--csv", help="CSV file, one row per load point")
    o.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    o.add_argument("--label", help="name of this configuration (used by compare)")
    o.add_argument(
        "--raw-records",
        action="store_true",
        help="also write every request's timings into the results JSON (runs[].records)",
    )
    o.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return p
