"""Command line: `verifypd-loadgen [run] ...`, `compare A.json B.json ...`, `fake-server`."""

from __future__ import annotations

import argparse
import math
import sys
import time

from rich.console import Console

from verifypd_loadgen import __version__
from verifypd_loadgen.datasets import DatasetError, load_dataset
from verifypd_loadgen.multi_turn import WORKLOADS, MultiTurnWorkload
from verifypd_loadgen.procs import CONCURRENCY_PER_PROC, default_procs
from verifypd_loadgen.runner import LoadPoint
from verifypd_loadgen.workload import DIST_HELP, Workload, parse_distribution, parse_priority_mix


def _arg(fn, what: str):
    """Wraps a parser so a bad value becomes an argparse error naming the flag's value."""

    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: {e}") from None

    parse.__name__ = what
    return parse


def _positive(cast, allow_inf: bool = False):
    def parse(text: str):
        v = cast(text)
        if not v > 0 or (math.isinf(v) and not allow_inf):
            raise ValueError("must be > 0")
        return v

    return parse


def _list(cast):
    return lambda text: [cast(t) for t in text.split(",") if t.strip()]


def _endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected HOST:PORT")
    return text


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")) or len(text.split("://", 1)[1].strip("/")) == 0:
        raise ValueError("expected http://HOST:PORT/v1 or https://...")
    return text


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise ValueError("must be in (0, 1]")
    return v


def _share(text: str) -> float:
    v = float(text)
    if not 0 <= v <= 1:
        raise ValueError("must be in [0, 1]")
    return v


def _procs(text: str) -> int | str:
    if text == "auto":
        return text
    n = int(text)
    if n < 1:
        raise ValueError("must be >= 1 or auto")
    return n


def _vocab_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.replace(",", ":").partition(":")
    lo_i, hi_i = int(lo), int(hi)
    if not 0 <= lo_i < hi_i:
        raise ValueError("expected LO:HI with 0 <= LO < HI")
    return lo_i, hi_i


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="verifypd-loadgen",
        description="Load generator for the verifypd Generate protocol. Other commands: "
        "`verifypd-loadgen compare A.json B.json ...`, `verifypd-loadgen fake-server`.",
    )
    p.add_argument("--version", action="version", version=f"verifypd-loadgen {__version__}")
    p.add_argument(
        "--server",
        type=_arg(_endpoint, "endpoint"),
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
        type=_arg(_url, "URL"),
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
    n.add_argument("--requests", type=_arg(_positive(int), "count"), help="requests per load point (default 100)")
    n.add_argument(
        "--duration",
        type=_arg(_positive(float), "duration"),
        help="seconds of sending per load point; then in-flight requests get --drain-timeout seconds to finish",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_arg(_list(_positive(int)), "concurrency list"),
        help="closed loop: C[,C...] requests always in flight (default 1)",
    )
    load.add_argument(
        "--rate",
        type=_arg(_list(_positive(float, True)), "rate list"),
        help="open loop: R[,R...] requests/s ('inf': all at once)",
    )
    p.add_argument(
        "--procs",
        type=_arg(_procs, "process count"),
        default="auto",
        help="client processes sharing the load, started together, merged into one report "
        f"(default auto: ceil(largest concurrency / {CONCURRENCY_PER_PROC}), at most the cores)",
    )
    p.add_argument(
        "--arrival", choices=("poisson", "gamma"), default="poisson", help="open-loop arrival process (default poisson)"
    )
    p.add_argument(
        "--burstiness",
        type=_arg(_positive(float), "burstiness"),
        default=None,
        help="gamma shape: <1 burstier, >1 smoother than Poisson (default 1)",
    )
    p.add_argument(
        "--max-concurrency",
        type=_arg(_positive(int), "count"),
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
        type=_arg(_fraction, "fraction"),
        default=0.1,
        help="--workload mixed: share of long prompts (default 0.1)",
    )
    d.add_argument(
        "--long-input-len",
        type=_arg(parse_distribution, "distribution"),
        default=parse_distribution("2048"),
        help="--workload mixed: long prompt length (default 2048)",
    )
    d.add_argument("--turns", type=_arg(_positive(int), "count"), default=4, help="multi-turn: turns per conversation")
    d.add_argument(
        "--conversations",
        type=_arg(_positive(int), "count"),
        default=8,
        help="multi-turn: conversations taken turn by turn, round-robin (default 8)",
    )
    d.add_argument(
        "--input-len",
        type=_arg(parse_distribution, "distribution"),
        help=f"synthetic prompt length: {DIST_HELP} (default 128)",
    )
    d.add_argument(
        "--output-len",
        type=_arg(parse_distribution, "distribution"),
        help="max_tokens distribution (default 128; overrides dataset lengths)",
    )
    d.add_argument(
        "--vocab-range",
        type=_arg(_vocab_range, "range"),
        default=(100, 10000),
        help="synthetic token ids are drawn from [LO, HI) (default 100:10000)",
    )
    d.add_argument(
        "--vocab-size", type=_arg(_positive(int), "size"), help="bound synthetic token ids below this vocabulary size"
    )
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    d.add_argument(
        "--priority-mix",
        type=_arg(parse_priority_mix, "priority mix"),
        help="PRIORITY:WEIGHT[,...], e.g. 0:0.8,10:0.2 (default all 0)",
    )
    d.add_argument(
        "--ignore-eos", action="store_true", help="dataset prompts: send stop_at_eos=false (synthetic always does)"
    )
    s = p.add_argument_group("SLOs and timing")
    s.add_argument("--slo-ttft-ms", type=_arg(_positive(float), "SLO"))
    s.add_argument(
        "--slo-itl-ms", type=_arg(_positive(float), "SLO"), help="bound on a request's mean inter-token latency (TPOT)"
    )
    s.add_argument("--warmup", type=int, default=0, help="warm-up requests, not measured")
    s.add_argument(
        "--timeout",
        type=_arg(_positive(float), "timeout"),
        default=300.0,
        help="per-request deadline in seconds (default 300)",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="duration mode: seconds to let in-flight requests finish (default 30)",
    )
    s.add_argument("--connect-timeout", type=_arg(_positive(float), "timeout"), default=10.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--trace-ratio",
        type=_arg(_share, "share"),
        default=0.0,
        help="share of requests sent with a sampled W3C traceparent of a new trace (gRPC metadata or "
        "HTTP header): the server traces them whatever its own sample ratio (default 0)",
    )
    s.add_argument(
        "--trace-alternate",
        type=_arg(_positive(float), "seconds"),
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


def build_plan(args, parser, argv: list[str] | None = None):
    """(Plan, config block of the results). `argv`: the run's arguments as given (default: sys.argv's)."""
    from verifypd.net.tls import TlsError, client_tls
    from verifypd_loadgen.session import Plan

    if args.backend == "grpc" and (args.server is None or args.url or args.model):
        parser.error("--backend grpc needs --server HOST:PORT (--url and --model are for --backend openai)")
    if args.backend == "openai" and (args.url is None or not args.model or args.server):
        parser.error("--backend openai needs --url http://HOST:PORT/v1 and --model M (not --server)")
    if args.burstiness is not None and (args.rate is None or args.arrival != "gamma"):
        parser.error("--burstiness applies to --rate with --arrival gamma")
    if args.max_concurrency is not None and args.rate is None:
        parser.error("--max-concurrency applies to open loop (--rate)")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.trace_alternate is not None and args.trace_ratio:
        parser.error("--trace-alternate and --trace-ratio both choose which requests are traced: give one")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    lo, hi = args.vocab_range
    if args.vocab_size is not None:
        hi = min(hi, args.vocab_size)
        lo = min(lo, hi // 2)  # tiny vocabularies: keep a non-empty range
    prompts = None
    if args.dataset != "synthetic":
        if args.input_len is not None:
            parser.error("--input-len applies to the synthetic dataset only")
        try:
            prompts = load_dataset(args.dataset)
        except DatasetError as e:
            parser.error(str(e))
    if args.workload == "multi-turn" and prompts is not None:
        parser.error("--workload multi-turn builds synthetic conversations: leave --dataset synthetic")
    multi = {"turns": args.turns, "conversations": args.conversations} if args.workload == "multi-turn" else {}
    workload = (MultiTurnWorkload if multi else Workload)(
        prompts=prompts,
        output_len=args.output_len,
        vocab_range=(lo, hi),
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        priority_mix=args.priority_mix or [(0, 1.0)],
        seed=args.seed,
        **multi,
    )
    if args.input_len is not None:
        workload.input_len = args.input_len
    if args.workload == "mixed":
        if prompts is not None:
            parser.error("--workload mixed applies to the synthetic dataset only")
        workload.long_fraction, workload.long_input_len = args.long_fraction, args.long_input_len
    if args.rate is not None:
        loads = [
            LoadPoint(
                "open",
                rate=r,
                arrival=args.arrival,
                burstiness=args.burstiness or 1.0,
                max_concurrency=args.max_concurrency,
            )
            for r in args.rate
        ]
    else:
        loads = [LoadPoint("closed", concurrency=c) for c in (args.concurrency or [1])]
    if not loads:
        parser.error("empty load list")
    try:
        tls = client_tls(args.tls_ca_file, args.tls_cert_file, args.tls_key_file)
    except TlsError as e:
        parser.error(str(e))
    if tls is not None and args.backend == "openai" and not args.url.startswith("https://"):
        parser.error("--tls-ca-file with --backend openai needs an https:// --url")
    requests = args.requests if args.requests or args.duration else 100
    n_procs = default_procs(loads) if args.procs == "auto" else args.procs
    plan = Plan(
        server=args.server,
        loads=loads,
        workload=workload,
        requests=requests,
        duration=args.duration,
        warmup=args.warmup,
        timeout=args.timeout,
        drain_timeout=args.drain_timeout,
        connect_timeout=args.connect_timeout,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms,
        seed=args.seed,
        backend=args.backend,
        url=args.url,
        model=args.model,
        openai_api=args.openai_api,
        raw_records=args.raw_records,
        tls=tls,
        procs=n_procs,
        trace_ratio=args.trace_ratio,
        trace_slot_s=args.trace_alternate,
    )
    config = {
        "server": args.server or args.url,
        "backend": args.backend,
        "url": args.url,
        "model": args.model,
        "openai_api": args.openai_api if args.backend == "openai" else None,
        "raw_records": args.raw_records,
        "argv": sys.argv[1:] if argv is None else argv,
        "mode": loads[0].mode,
        "requests": requests,
        "duration_s": args.duration,
        "concurrency": args.concurrency or ([1] if args.rate is None else None),
        "rate": args.rate,
        "arrival": args.arrival if args.rate else None,
        "burstiness": (args.burstiness or 1.0) if args.rate else None,
        "max_concurrency": args.max_concurrency,
        "dataset": workload.describe() if isinstance(workload, MultiTurnWorkload) else args.dataset,
        "workload": args.workload,
        "long_fraction": args.long_fraction if args.workload == "mixed" else None,
        "long_input_len": str(args.long_input_len) if args.workload == "mixed" else None,
        "input_len": str(workload.input_len) if prompts is None else None,
        "output_len": str(args.output_len)
        if args.output_len
        else (str(Workload.DEFAULT_OUTPUT) if prompts is None else None),
        "vocab_range": [lo, hi] if prompts is None else None,
        "temperature": args.temperature,
        "priority_mix": [[p, w] for p, w in workload.priority_mix],
        "ignore_eos": args.ignore_eos,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_itl_ms": args.slo_itl_ms,
        "warmup": args.warmup,
        "timeout_s": args.timeout,
        "drain_timeout_s": args.drain_timeout,
        "seed": args.seed,
        "trace_ratio": args.trace_ratio,
        "trace_alternate_s": args.trace_alternate,
        "procs": n_procs,
    }
    return plan, config


def _stdout_console() -> Console:
    console = Console()
    # Piped or captured output would be squeezed to 80 columns; tables need more.
    return console if console.is_terminal else Console(width=max(console.width, 120))


def cmd_run(argv: list[str]) -> int:
    from verifypd_loadgen.session import Outputs, run_session

    parser = run_parser()
    args = parser.parse_args(argv)
    plan, config = build_plan(args, parser, argv)
    outputs = Outputs(out=args.out, csv=args.csv, plot=args.plot, label=args.label, progress=not args.no_progress)
    return run_session(plan, config, outputs, _stdout_console(), argv, client_process)


def _plan_of(argv: list[str]):
    parser = run_parser()
    return build_plan(parser.parse_args(argv), parser, argv)[0]


def client_process(argv: list[str], index: int, procs: int, barrier, conn) -> None:
    """The entry of each `--procs` client process (spawned: a module-level function)."""
    from verifypd_loadgen import session

    session.client_process(_plan_of, argv, index, procs, barrier, conn)


def cmd_compare(argv: list[str]) -> int:
    from verifypd_loadgen.compare import run_compare

    p = argparse.ArgumentParser(
        prog="verifypd-loadgen compare", description="Compare results files; the first is the baseline."
    )
    p.add_argument("results", nargs="+", help="results JSON files from --out")
    p.add_argument("--plot", metavar="DIR", help="write comparison PNG plots into DIR")
    args = p.parse_args(argv)
    return run_compare(args.results, args.plot, _stdout_console())


def cmd_fake_server(argv: list[str]) -> int:
    from verifypd_loadgen import fake_server

    p = argparse.ArgumentParser(
        prog="verifypd-loadgen fake-server", description="Deterministic Generate server for smoke tests."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50151)
    p.add_argument("--ttft-ms", type=float, default=10.0)
    p.add_argument("--prefill-us-per-token", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=2.0, help="delay per output token")
    p.add_argument(
        "--burst",
        type=_arg(_list(_positive(int)), "burst list"),
        default=[1],
        help="tokens per message, cycled, e.g. 1,3,4",
    )
    p.add_argument("--k", type=int, default=0, help="applied_k reported on verify steps")
    p.add_argument(
        "--fail",
        action="append",
        default=[],
        type=_arg(fake_server.FailRule.parse, "fail rule"),
        help="CODE[,match=REGEX][,every=N][,after=T] (repeatable)",
    )
    p.add_argument("--final-empty", action="store_true")
    p.add_argument("--no-server-info", action="store_true")
    p.add_argument("--max-workers", type=int, default=256)
    p.add_argument("--run-for", type=float, help="stop after this many seconds")
    a = p.parse_args(argv)
    cfg = fake_server.FakeConfig(
        ttft_s=a.ttft_ms / 1e3,
        prefill_s_per_token=a.prefill_us_per_token / 1e6,
        itl_s=a.itl_ms / 1e3,
        burst=tuple(a.burst),
        k=a.k,
        fail=a.fail,
        final_empty=a.final_empty,
        server_info=not a.no_server_info,
    )
    try:
        server, _, port = fake_server.start(cfg, a.host, a.port, a.max_workers)
    except (OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"fake verifypd Generate server on {a.host}:{port} (Ctrl-C to stop)", flush=True)
    try:
        if a.run_for is not None:
            time.sleep(a.run_for)
        else:
            server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    server.stop(0)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"compare": cmd_compare, "fake-server": cmd_fake_server, "run": cmd_run}
    try:
        if argv and argv[0] in commands:
            return commands[argv[0]](argv[1:])
        return cmd_run(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
