"""Serving sweep of the seed study's comparison: schedules x concurrency through the real server.

For each (draft -> target pair, mode) this starts `verifypd serve` as a subprocess (random weights of the
named shapes, SIMULATED ACCEPTANCE alpha: real draft and verify compute, each draft token kept with
probability alpha), waits for its "serving" line, and drives it over gRPC Generate with the loadgen
library (verifypd_loadgen: Workload, Runner, metrics.summarize) at every concurrency. Modes:

  * k0        no speculation (`--draft none`): the floor every schedule is held against;
  * baseline | pd | pdv   `--schedule MODE` (speculative decoding; the study's three systems).

"Concurrency N" is a closed loop: N clients, each sending its next request the moment its previous one
ends (zero think time), so exactly N requests are in flight. Prompts are random token ids (random
weights have no tokenizer), every request generates exactly --max-tokens tokens (EOS ignored), greedy.

Per point: output tok/s, mean/P95/P99 end-to-end latency, TTFT P95, ITL P95 (per token), acceptance
rate, mean applied k (over the stream's token-bearing messages) and GPU utilisation (NVML, sampled every
100 ms in a background thread during the point; null where NVML is missing). A server that fails to
start, or a point that errors, is recorded with its error and the sweep goes on. The JSON is rewritten
after every point, so a run cut short keeps what it measured.

One pair per GPU call (a call is limited to 10 minutes), then merge:

    python bench/seed_study/seed_comparison.py --pairs 'tinyllama-1.1b->llama-2-7b' --tag llama2 --out $OUT
    python bench/seed_study/seed_comparison.py --pairs 'tinyllama-1.1b->tinyllama-1.1b' --tag tinyllama --out $OUT
    python bench/seed_study/seed_comparison.py --report-only A.json B.json --out bench/results

Writes DIR/seed_comparison_<device>[_<tag>].json and .md (tables per pair, ratios vs k0 and vs pd, the
study's own figures beside ours, marked as theirs, and the PASS/MISS targets) and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "loadgen", "bench", "bench/seed_study"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_meta import git_revision  # noqa: E402

# render_report stays importable from here: the tests render reports through this module.
from seed_report import (  # noqa: E402
    merge,
    output_paths,
    render_report,  # noqa: F401
    write_json,
    write_report,
)
from seed_rows import LOAD_MODEL  # noqa: E402
from seed_serving import RANDOM_NAMES, Nvml, ServeProcess, device_info, drive, free_port, serve_command  # noqa: E402

DEFAULT_PAIRS = "tinyllama-1.1b->llama-2-7b,tinyllama-1.1b->tinyllama-1.1b,tinyllama-1.1b->codellama-34b"
DEFAULT_MODES = "k0,baseline,pd,pdv"
DEFAULT_CONCURRENCY = "1,2,4,8,16,32,64,96,128"
# Targets that only fit a large GPU (bf16 weights + KV pools): GB of GPU memory needed.
MIN_GPU_GB = {"codellama-34b": 120}


def parse_pairs(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        draft, sep, target = item.partition("->")
        if not sep or not draft.strip() or not target.strip():
            raise argparse.ArgumentTypeError(f"pair {item!r}: expected DRAFT->TARGET")
        pairs.append((draft.strip(), target.strip()))
    return pairs


def pair_name(pair: tuple[str, str]) -> str:
    return f"{pair[0]}->{pair[1]}"


# ----------------------------------------------------------------------------------------------- sweep


def run_sweep(args) -> dict:
    nvml = Nvml()
    device, device_slug, mem_gb = device_info(nvml)
    results = {
        "command": " ".join(["python"] + [shlex.quote(a) for a in sys.argv]),
        "device": device,
        "device_slug": device_slug,
        "gpu_memory_GB": None if mem_gb is None else round(mem_gb, 1),
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "nvml": "ok" if nvml.handle is not None else nvml.error,
        "weights": "random (shapes of the named models); no tokenizer: random token-id prompts",
        "label": f"simulated acceptance α={args.alpha:g}",
        "parameters": {
            "alpha": args.alpha,
            "modes": args.modes,
            "concurrency": args.concurrency,
            "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens,
            "seconds_per_point": None if args.requests_per_point else args.seconds_per_point,
            "requests_per_point": args.requests_per_point,
            "warmup_requests": args.warmup_requests,
            "sampling": "greedy, EOS ignored",
            "load": LOAD_MODEL,
            "schedule_flag": args.schedule_flag,
            "serve_args": args.serve_args,
            "k0_args": args.k0_args,
            "mode_args": args.mode_args,
        },
        "servers": [],
        "skipped": [],
        "rows": [],
    }
    if nvml.handle is None:
        print(f"# {nvml.error}", file=sys.stderr)
    out = output_paths(args.out, device_slug, args.tag)
    save = lambda: write_json(results, out["json"])  # noqa: E731
    t_sweep = time.monotonic()
    out_of_time = lambda: args.time_budget is not None and time.monotonic() - t_sweep > args.time_budget  # noqa: E731
    for pair in args.pairs:
        need = MIN_GPU_GB.get(pair[1])
        if need and (mem_gb is None or mem_gb < need):
            note = (
                f"skipped: target {pair[1]} needs a GPU with >= {need} GB (an H200); this device "
                f"({device}) has {'unknown' if mem_gb is None else f'{mem_gb:.0f} GB'}"
            )
            results["skipped"].append({"pair": pair_name(pair), "note": note})
            print(f"# {pair_name(pair)}: {note}", flush=True)
            save()
            continue
        for mode in args.modes:
            base = {
                "pair": pair_name(pair),
                "draft": pair[0],
                "target": pair[1],
                "mode": mode,
                "simulated_acceptance": None if mode == "k0" else args.alpha,
                "label": "no speculation (k=0)" if mode == "k0" else f"simulated acceptance α={args.alpha:g}",
            }
            cmd = serve_command(args, pair, mode, free_port())
            entry = {"pair": pair_name(pair), "mode": mode, "command": " ".join(shlex.quote(c) for c in cmd)}
            if out_of_time():
                entry.update(status="error", error=f"not started: --time-budget {args.time_budget:g} s spent")
                results["servers"].append(entry)
                results["rows"] += [
                    dict(base, concurrency=c, status="error", error=entry["error"]) for c in args.concurrency
                ]
                save()
                continue
            print(f"# {pair_name(pair)} {mode}: starting {entry['command']}", flush=True)
            t0 = time.monotonic()
            server = ServeProcess(cmd, echo=args.echo_server_logs)
            try:
                reason = server.wait_ready(args.startup_timeout)
                entry["startup_s"] = round(time.monotonic() - t0, 1)
                if reason is not None:
                    entry.update(status="error", error=reason, log_tail=server.tail())
                    print(f"# {pair_name(pair)} {mode}: {reason}\n  " + "\n  ".join(server.tail(12)), flush=True)
                    for c in args.concurrency:
                        results["rows"].append(
                            dict(base, concurrency=c, status="error", error=f"server failed to start: {reason}")
                        )
                    continue

                def on_row(row):
                    results["rows"].append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "summary"}), flush=True)
                    save()

                entry["server_info"] = asyncio.run(
                    drive(
                        args,
                        server.address,
                        base,
                        nvml,
                        on_row,
                        alive=lambda: server.proc.poll() is None,  # noqa: B023
                        out_of_time=out_of_time,
                    )
                )
                entry["status"] = "ok" if server.proc.poll() is None else "error"
                if entry["status"] == "error":
                    entry.update(
                        error=f"server exited with code {server.proc.returncode} during the sweep",
                        log_tail=server.tail(),
                    )
            except Exception as exc:
                entry.update(status="error", error=f"{type(exc).__name__}: {exc}", log_tail=server.tail())
                done = {r["concurrency"] for r in results["rows"] if r["pair"] == base["pair"] and r["mode"] == mode}
                for c in args.concurrency:
                    if c not in done:
                        results["rows"].append(dict(base, concurrency=c, status="error", error=entry["error"]))
            finally:
                server.stop()
                entry["total_s"] = round(time.monotonic() - t0, 1)
                results["servers"].append(entry)
                save()
    results["sweep_seconds"] = round(time.monotonic() - t_sweep, 1)
    save()
    return results


# ----------------------------------------------------------------------------------------------- main


def int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("every value must be >= 1")
    return values


def mode_args(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        mode, sep, extra = item.partition("=")
        if not sep:
            raise SystemExit(f"error: --mode-args {item!r}: expected MODE=ARGS")
        out[mode.strip()] = extra
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument(
        "--pairs",
        type=parse_pairs,
        default=parse_pairs(DEFAULT_PAIRS),
        help=f"DRAFT->TARGET,... (random shapes {', '.join(RANDOM_NAMES)} or model paths); default {DEFAULT_PAIRS}",
    )
    ap.add_argument(
        "--modes", default=DEFAULT_MODES, help=f"k0 and `serve --schedule` values (default {DEFAULT_MODES})"
    )
    ap.add_argument("--concurrency", type=int_list, default=int_list(DEFAULT_CONCURRENCY))
    ap.add_argument("--alpha", type=float, default=0.7, help="simulated acceptance of the speculative modes")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    per = ap.add_mutually_exclusive_group()
    per.add_argument(
        "--seconds-per-point",
        type=float,
        default=6.0,
        help="each point sends for this long, then lets in-flight requests finish (default 6)",
    )
    per.add_argument("--requests-per-point", type=int, default=None, help="instead: this many requests (at least c)")
    ap.add_argument(
        "--warmup-requests",
        type=int,
        default=32,
        help="per server, before the first point: requests of up to 32 tokens (0 = none)",
    )
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for a server to start")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: start no server and no point after this (they are recorded as not run), so a "
        "run under a hard time limit still ends with its JSON and report written",
    )
    ap.add_argument("--device", default="auto", help="serve --device (default auto)")
    ap.add_argument("--vocab-range", default="100:31000", help="LO:HI of the random prompt token ids")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `verifypd serve` arguments for every server")
    ap.add_argument("--k0-args", default="--draft none", help="serve arguments of mode k0 (default: --draft none)")
    ap.add_argument("--mode-args", action="append", metavar="MODE=ARGS", help="extra serve arguments of one mode")
    ap.add_argument(
        "--no-schedule-flag",
        dest="schedule_flag",
        action="store_false",
        help="do not pass --schedule MODE (for servers without the flag: every mode runs serve's default)",
    )
    ap.add_argument("--echo-server-logs", action="store_true")
    ap.add_argument("--tag", default=None, help="file-name suffix (e.g. one per pair, merged with --report-only)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output directory")
    ap.add_argument(
        "--report-only", nargs="+", metavar="JSON", help="merge these runs' JSON into one report; run nothing"
    )
    args = ap.parse_args(argv)
    if args.report_only:
        docs = [json.loads(Path(p).read_text()) for p in args.report_only]
        doc = docs[0] if len(docs) == 1 else merge(docs)
        out = output_paths(args.out, doc.get("device_slug", "x"), args.tag)
        if len(docs) > 1:
            write_json(doc, out["json"])
            print(f"merged: {out['json']}")
        write_report(doc, out)
        return 0
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.mode_args = mode_args(args.mode_args)
    lo, _, hi = args.vocab_range.partition(":")
    args.vocab_range = (int(lo), int(hi))
    if not 0 <= args.alpha <= 1:
        ap.error("--alpha must be in [0, 1]")
    results = run_sweep(args)
    out = output_paths(args.out, results["device_slug"], args.tag)
    print(f"results: {out['json']}")
    write_report(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
