"""Command line: `verifypd-loadgen [run] ...`, `compare A.json B.json ...`, `fake-server`.

The run's arguments are run_args.py's parser, resolved by run_plan.py; the session itself (probe,
load points, client processes, report) is session.py."""

from __future__ import annotations

import argparse
import sys
import time

from rich.console import Console

from verifypd_loadgen.arg_types import comma_list, flag_type, positive
from verifypd_loadgen.run_args import run_parser
from verifypd_loadgen.run_plan import build_plan


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
        type=flag_type(comma_list(positive(int)), "burst list"),
        default=[1],
        help="tokens per message, cycled, e.g. 1,3,4",
    )
    p.add_argument("--k", type=int, default=0, help="applied_k reported on verify steps")
    p.add_argument(
        "--fail",
        action="append",
        default=[],
        type=flag_type(fake_server.FailRule.parse, "fail rule"),
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
