"""`verifypd-loadgen run`'s parsed arguments checked and resolved into a session Plan and the
config block of the results JSON (docs/loadgen.md)."""

from __future__ import annotations

import sys

from verifypd_loadgen.datasets import DatasetError, load_dataset
from verifypd_loadgen.multi_turn import MultiTurnWorkload
from verifypd_loadgen.procs import default_procs
from verifypd_loadgen.runner import LoadPoint
from verifypd_loadgen.workload import Workload


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
