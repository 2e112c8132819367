"""What a user receives against what the engine can do, in one run on one machine.

For each mode (k0: `--draft none`; a07: TinyLlama-shape draft with SIMULATED acceptance 0.7,
adaptive k; `-split` suffix: serve --topology split) and each concurrency c:
  * engine alone: the in-process Engine (no gRPC, no gateway) in a subprocess, c requests in
    flight, each finished one replaced at once (closed loop), steady-state tokens/s;
  * served: `verifypd serve` with the same engine flags, driven closed loop by the loadgen library
    over gRPC and over the OpenAI HTTP API (`/v1/completions`, token-id prompts), steady-state
    tokens/s counted from the chunks received inside the measured window.
Each row: concurrency, both tok/s, served_over_engine, TTFT p50, ITL p99, GPU busy share (NVML
utilisation mean over the window, when pynvml is there), and the CPU seconds the gateway and the
engine-core processes spent per streamed token (from /proc: `*_cpu_us_per_token` over the whole
point, ramp and drain included, against every token streamed; `*_window` over the measured window
against the tokens counted in it); from the core's own timers on /metrics,
read at the window's edges: steps/s (verify calls), calls/s and mean ms per lane call, the core-side
TTFT mean, the share of verify steps launched ahead (`chained_share`, engine.overlap) and of those
carrying a prefill of admitted requests (`chained_prefill_share`). `--py-spy BIN --py-spy-at MODE:API:C`
samples the gateway, the core and the split lanes over that point's window. Prompt 128 random token ids,
128 generated, EOS ignored. Random bf16 weights: real compute; speculative rows' acceptance is SIMULATED.
Modes: k0, a07, `-split` (serve --topology split), `-split-mps` (with --mps on).

Arrivals. The engine alone starts its c requests together, so with a fixed output length they
finish together and are re-prefilled together in a step where nothing decodes (the router's idle
prefill budget: one large prefill, no staggered tail): lockstep. Served clients' requests arrive
one by one over the channel and soon spread out, so served steps carry small prefills beside
decode. `--stagger-modes k0` also measures the engine alone with its first requests ending at
staggered lengths (finishes spread as in the served steady state): `served_over_engine_staggered`
compares the serving path with the engine under the same arrival pattern. The client processes
connect first and start together; requests still in flight after the window are cancelled.

    python bench/serving/serving_vs_engine.py --modes k0,a07 --concurrency 1,64,128 --out bench/results
    python bench/serving/serving_vs_engine.py --device cpu --target TINY_MODEL_DIR --vocab 90 --modes k0 \
        --concurrency 4 --prompt 16 --gen 16   (CPU smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "loadgen", "bench", "bench/seed_study", "bench/serving"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_meta import metadata, write_result  # noqa: E402
from seed_serving import Nvml, ServeProcess, UtilSampler, free_port  # noqa: E402
from serving_window import Window, cpu_seconds, percentile_ms  # noqa: E402

DRAFTS = {"k0": ("none", None), "a07": ("random:tinyllama-1.1b", 0.7)}
DRAIN_S = 0.5  # after the window, requests still in flight are cancelled (their tokens were not counted)


def base_mode(mode: str) -> str:
    """k0, a07 from k0-split, a07-split-mps, ... (`-split`: serve --topology split; `-mps`: with --mps on)."""
    return mode.split("-")[0]


def engine_flags(args, mode: str) -> list[str]:
    draft, alpha = DRAFTS[base_mode(mode)]
    flags = [
        "--target",
        args.target,
        "--draft",
        args.draft or draft if alpha is not None else draft,
        "--device",
        args.device,
        "--max-context",
        str(args.prompt + args.gen + 64),
        "--max-running",
        str(max(256, max(args.concurrency))),
    ]
    if alpha is not None:
        flags += ["--simulated-acceptance", str(alpha)]
    if args.overlap != "on":
        flags += ["--overlap", args.overlap]
    if args.graph_buckets:
        flags += ["--graph-buckets", args.graph_buckets]
    if args.num_blocks:
        flags += ["--num-blocks", str(args.num_blocks)]
    return flags


def id_range(vocab: int) -> tuple[int, int]:
    """Prompt token ids are drawn from [lo, hi): clear of special tokens at both ends."""
    lo = min(100, vocab // 8)
    return lo, vocab - lo


def prompt_ids(n: int, length: int, vocab: int) -> list[int]:
    lo, hi = id_range(vocab)
    return [(7 * n + 13 * j) % (hi - lo) + lo for j in range(length)]


# -- engine alone (subprocess: `--engine-alone MODE`) ------------------------------------------
def engine_alone(args) -> None:
    """Prints one JSON line per concurrency: steady-state tok/s of the engine alone."""
    from verifypd.cli import build_parser
    from verifypd.domain.requests import RequestSpec
    from verifypd.engine import Engine
    from verifypd.launch.serve_args import engine_options

    serve_args = build_parser().parse_args(["serve", *engine_flags(args, args.engine_alone)])
    engine = Engine(engine_options(serve_args))
    router, made, steps, chained = engine.router, [0], [0], [None]
    sync = (lambda: __import__("torch").cuda.synchronize()) if args.device.startswith("cuda") else (lambda: None)

    def submit(max_tokens: int | None = None) -> None:
        made[0] += 1
        router.add_request(
            RequestSpec(
                tuple(prompt_ids(made[0], args.prompt, router.vocab_size)),
                max_tokens=max_tokens or args.gen,
                stop_at_eos=False,
                request_id=str(made[0]),
            )
        )

    def run(seconds: float) -> tuple[int, float]:
        tokens, t0 = 0, time.perf_counter()
        steps[0] = 0
        while time.perf_counter() - t0 < seconds:
            steps[0] += 1
            for out in router.step():
                tokens += len(out.token_ids)
                if out.finished:
                    submit()
        sync()
        return tokens, time.perf_counter() - t0

    def measure(c: int, staggered: bool) -> tuple[float, float]:
        for seq in router.sequences():
            router.abort(seq.request_id)
        for n in range(c):
            # Staggered: the first requests end 1, 1 + gen/c, ... tokens in, so finishes (and the
            # replacements' prefills) spread over the steps as a served closed loop's do; lockstep:
            # all c start together, finish together, and are re-prefilled in one idle-engine step.
            submit(1 + n * args.gen // c if staggered else args.gen)
        run(args.warmup)
        print("READY", flush=True)  # the parent samples the GPU over the next window
        ahead = router.overlap.steps
        tokens, wall = run(args.seconds)
        chained[0] = round((router.overlap.steps - ahead) / max(steps[0], 1), 3)  # launched ahead per step()
        return tokens / wall, steps[0] / wall

    stagger = base_mode(args.engine_alone) in args.stagger_modes
    for c in args.concurrency:
        tok_s, steps_s = measure(c, staggered=False)
        row = {
            "concurrency": c,
            "engine_tok_s": round(tok_s, 1),
            "engine_steps_per_s": round(steps_s, 1),
            "engine_chained_share": chained[0],
        }
        if stagger and c > 1:
            tok_s, steps_s = measure(c, staggered=True)
            row.update(engine_staggered_tok_s=round(tok_s, 1), engine_staggered_steps_per_s=round(steps_s, 1))
        print(json.dumps(row), flush=True)
    router.close()


def run_engine_alone(args, mode: str, nvml) -> dict[int, dict]:
    cmd = [sys.executable, __file__, "--engine-alone", mode, *sys.argv[1:]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    rows: dict[int, dict] = {}
    sampler = None
    busy: list = []
    for line in proc.stdout:
        if line.startswith("READY"):
            if sampler is not None:  # the lockstep window of a concurrency that is also staggered
                sampler.__exit__()
                busy.append(sampler.result()["gpu_util_mean_pct"])
            sampler = UtilSampler(nvml).__enter__()
        elif line.startswith("{"):
            row = json.loads(line)
            if sampler is not None:
                sampler.__exit__()
                busy.append(sampler.result()["gpu_util_mean_pct"])
                sampler = None
            row["engine_gpu_busy_pct"] = busy[0] if busy else None
            if len(busy) > 1:
                row["engine_staggered_gpu_busy_pct"] = busy[1]
            busy = []
            rows[row["concurrency"]] = row
            print(f"  engine alone {mode} c={row['concurrency']}: {row['engine_tok_s']} tok/s", flush=True)
    proc.wait()
    return rows


# -- served ------------------------------------------------------------------------------------
def wait_for_start() -> float:
    """A client process of drive_clients: says READY (imported, connected), reads the wall-clock start."""
    print("READY", flush=True)
    return float(sys.stdin.readline())


async def drive(args, api: str, target: str, c: int, seed: int) -> dict:
    """Closed loop for warmup + seconds (then requests still in flight are cancelled) from the
    wall-clock start the parent sends (every client process of a point starts together, so their
    windows are one window); what the measured window saw: tokens, TTFTs and inter-token gaps of
    the chunks received inside it (steady state)."""
    from verifypd_loadgen import openai_backend as ob
    from verifypd_loadgen.runner import LoadPoint, Runner
    from verifypd_loadgen.workload import Distribution, Workload

    work = Workload(
        input_len=Distribution("fixed", (args.prompt,)),
        output_len=Distribution("fixed", (args.gen,)),
        vocab_range=id_range(args.vocab),
        ignore_eos=True,
        seed=seed,
    )
    total = args.warmup + args.seconds

    async def go(runner) -> dict:
        start_at = await asyncio.get_running_loop().run_in_executor(None, wait_for_start)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        # Request ids unique across the point's client processes (gRPC refuses a duplicate in flight).
        res = await runner.run(
            LoadPoint("closed", concurrency=c), work.requests(stream=1), None, total, f"c{c}s{seed}", 0
        )
        lo, hi = t0 + args.warmup, t0 + total
        inside = [
            (r, t, n) for r in res.records for t, n in zip(r.chunk_times, r.chunk_tokens, strict=False) if lo <= t < hi
        ]
        gaps = [
            b - a for r in res.records for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False) if lo <= b < hi
        ]
        ttfts = [r.chunk_times[0] - r.start for r in res.records if r.chunk_times and lo <= r.chunk_times[0] < hi]
        errors: dict = {}
        for r in res.records:
            if r.error is not None and not r.cancelled:
                errors[r.error] = errors.get(r.error, 0) + 1
        return {
            "tokens": sum(n for _, _, n in inside),
            "all_tokens": sum(sum(r.chunk_tokens) for r in res.records),
            "ttft_s": ttfts,
            "gap_s": gaps,
            "errors": errors,
            "client_cpu_s": time.process_time() - cpu0,
            "draft": sum(r.draft_tokens for r in res.records),
            "accepted": sum(r.accepted_tokens for r in res.records),
        }

    if api == "grpc":
        import grpc

        from verifypd.v1 import generate_pb2_grpc

        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(channel.channel_ready(), 30)
            return await go(Runner(generate_pb2_grpc.GenerationStub(channel), 300, DRAIN_S))  # ids: see --drive
    client = ob.new_client(f"http://{target}/v1")
    try:
        backend = ob.OpenAIBackend(client, f"http://{target}/v1", args.target, "completions")
        return await go(Runner(backend, 300, DRAIN_S, execute=ob.execute))
    finally:
        await client.close()


def drive_clients(args, api: str, target: str, c: int, on_start, argv: list[str] | None = None) -> dict:
    """`--client-procs` loadgen processes, c split among them (a Python client saturates first
    over HTTP); once every one is READY (imported, connected) they start together at a wall-clock
    time, told to `on_start(start_at)` first (the server-side window): their samples merged.
    `argv`: this script's flags for the client processes (default: the ones it was run with)."""
    procs = max(1, min(args.client_procs, c))
    shares = [c // procs + (i < c % procs) for i in range(procs)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--drive", f"{api},{target},{share},{i}", *(argv or sys.argv[1:])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i, share in enumerate(shares)
    ]
    for child in children:
        if child.stdout.readline().strip() != "READY":
            raise SystemExit(f"a {api} client process did not start (exit {child.wait()})")
    start_at = time.time() + 0.5
    on_start(start_at)
    for child in children:
        child.stdin.write(f"{start_at}\n")
        child.stdin.flush()
    parts = [json.loads(child.communicate()[0].strip().splitlines()[-1]) for child in children]
    merged = {
        "tokens": 0,
        "all_tokens": 0,
        "ttft_s": [],
        "gap_s": [],
        "errors": {},
        "client_cpu_s": 0.0,
        "draft": 0,
        "accepted": 0,
    }
    for part in parts:
        for key in ("tokens", "all_tokens", "client_cpu_s", "draft", "accepted"):
            merged[key] += part[key]
        merged["ttft_s"] += part["ttft_s"]
        merged["gap_s"] += part["gap_s"]
        for name, n in part["errors"].items():
            merged["errors"][name] = merged["errors"].get(name, 0) + n
    return merged


def start_py_spy(args, mode: str, api: str, c: int, pids: dict, start_at: float) -> list:
    """`--py-spy BIN --py-spy-at MODE:API:C`: samples the gateway and the engine core over the
    measured window of that point (collapsed stacks, --nonblocking: the process is not paused)."""
    if not args.py_spy or f"{mode}:{api}:{c}" not in args.py_spy_at.split(","):
        return []
    procs = []
    for name, pid in pids.items():
        if pid is None:
            continue
        Path(args.out or ".").mkdir(parents=True, exist_ok=True)
        out = Path(args.out or ".") / f"pyspy_{mode}_{api}_c{c}_{name}.txt"
        # the window opens after the warm-up
        cmd = [
            "sh",
            "-c",
            f"sleep {max(0.0, start_at + args.warmup - time.time()):.2f}; "
            f"exec {args.py_spy} record --pid {pid} --duration {int(args.seconds)} --rate 250 --nonblocking "
            f"--threads --format raw --output {out}",
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def staggered_columns(engine: dict, served_tok_s: float) -> dict:
    """The engine alone with staggered arrivals (`--stagger-modes`), when measured at this point."""
    staggered = engine.get("engine_staggered_tok_s")
    if not staggered:
        return {}
    return {
        "engine_staggered_tok_s": staggered,
        "served_over_engine_staggered": round(served_tok_s / staggered, 3),
        "engine_staggered_steps_per_s": engine.get("engine_staggered_steps_per_s"),
        "gpu_busy_pct_engine_staggered": engine.get("engine_staggered_gpu_busy_pct"),
    }


def run_served(args, mode: str, nvml, engine_rows: dict[int, dict], on_row=lambda rows: None) -> list[dict]:
    port, http_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--max-queue",
        "1024",
        "--drain-timeout",
        "5",
        *engine_flags(args, mode),
    ]
    if "-split" in mode:
        cmd += ["--topology", "split"]
    if mode.endswith("-mps"):
        cmd += ["--mps", "on"]
    server = ServeProcess(cmd, echo=args.echo)
    rows = []
    try:
        why = server.wait_ready(args.ready_timeout)
        if why:
            raise SystemExit(f"serve {mode} did not start: {why}\n" + "\n".join(server.tail()))
        core_pid = next(
            (
                int(line.rsplit("engine core pid ", 1)[1].rstrip(")"))
                for line in server.lines
                if "engine core pid" in line
            ),
            None,
        )
        for api in args.apis:
            target = server.address if api == "grpc" else f"127.0.0.1:{http_port}"
            for c in args.split_concurrency if "-split" in mode else args.concurrency:
                cpu0 = (cpu_seconds(server.proc.pid), cpu_seconds(core_pid))
                lane_pids = {
                    f"{m.group(1)}_lane": int(m.group(2))
                    for m in (re.search(r"verifypd: (\w+) lane pid=(\d+)", line) for line in server.lines)
                    if m
                }
                started: dict = {}

                def on_start(start_at: float) -> None:  # the clients are connected and start then
                    pids = {"gateway": server.proc.pid, "core": core_pid, **lane_pids}  # noqa: B023
                    started["window"] = Window(args, http_port, nvml, start_at, (server.proc.pid, core_pid))  # noqa: B023
                    started["spy"] = start_py_spy(args, mode, api, c, pids, start_at)  # noqa: B023

                seen = drive_clients(args, api, target, c, on_start)
                for p in started["spy"]:
                    p.wait()
                cpu1 = (cpu_seconds(server.proc.pid), cpu_seconds(core_pid))
                window = started["window"]
                lanes, busy = window.result()
                window_tokens = max(seen["tokens"], 1)
                tok_s = seen["tokens"] / args.seconds
                streamed = max(seen["all_tokens"], 1)  # the CPU times cover the whole run, ramp and drain too
                engine = engine_rows.get(c, {}).get("engine_tok_s")
                rows.append(
                    {
                        "mode": mode,
                        "api": api,
                        "concurrency": c,
                        "served_tok_s": round(tok_s, 1),
                        "engine_tok_s": engine,
                        "served_over_engine": round(tok_s / engine, 3) if engine else None,
                        "ttft_p50_ms": percentile_ms(seen["ttft_s"], 50),
                        "itl_p99_ms": percentile_ms(seen["gap_s"], 99),
                        "gpu_busy_pct_served": busy,
                        "gpu_busy_pct_engine": engine_rows.get(c, {}).get("engine_gpu_busy_pct"),
                        "engine_steps_per_s": engine_rows.get(c, {}).get("engine_steps_per_s"),
                        "engine_chained_share": engine_rows.get(c, {}).get("engine_chained_share"),
                        **staggered_columns(engine_rows.get(c, {}), tok_s),
                        "gateway_cpu_us_per_token": round((cpu1[0] - cpu0[0]) / streamed * 1e6, 1),
                        "core_cpu_us_per_token": round((cpu1[1] - cpu0[1]) / streamed * 1e6, 1),
                        # over the measured window only (no connect, ramp or drain):
                        "gateway_cpu_us_per_token_window": round(window.cpu[0] / window_tokens * 1e6, 1),
                        "core_cpu_us_per_token_window": round(window.cpu[1] / window_tokens * 1e6, 1),
                        "client_procs": max(1, min(args.client_procs, c)),
                        "client_cpu_pct": round(seen["client_cpu_s"] / (args.warmup + args.seconds) * 100, 1),
                        "errors": seen["errors"],
                        "acceptance": round(seen["accepted"] / seen["draft"], 3) if seen["draft"] else None,
                        "acceptance_kind": "SIMULATED" if DRAFTS[base_mode(mode)][1] else None,
                        "steps_per_s": lanes.pop("steps_per_s", None),
                        "chained_share": lanes.pop("chained_share", None),
                        "chained_prefill_share": lanes.pop("chained_prefill_share", None),
                        "core_ttft_mean_ms": lanes.pop("core_ttft_mean_ms", None),
                        "lane_calls": lanes,
                    }
                )
                print("  " + json.dumps(rows[-1]), flush=True)
                on_row(rows)  # saved at once: a run cut short keeps every point it measured
                if seen["errors"]:  # say why, from the server's own log
                    print("\n".join("  [serve] " + line for line in server.tail(30)), flush=True)
    finally:
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="k0,a07", help="k0, a07, k0-split, a07-split, k0-split-mps (serve --mps on)")
    ap.add_argument("--apis", default="grpc,openai")
    ap.add_argument("--concurrency", default="1,64,128")
    ap.add_argument("--target", default="random:llama-2-7b")
    ap.add_argument("--draft", default=None, help="replaces the a07 modes' draft (e.g. for a CPU smoke test)")
    ap.add_argument("--vocab", type=int, default=32000, help="prompt token ids are drawn below this")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=15.0, help="measured window per point")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument(
        "--overlap",
        choices=("on", "off", "ahead"),
        default="on",
        help="serve --overlap for the engine alone and the served rows (docs/engine.md 'Overlapped scheduling')",
    )
    ap.add_argument("--graph-buckets", default=None)
    ap.add_argument("--num-blocks", type=int, default=None)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--no-engine-alone", action="store_true")
    ap.add_argument("--echo", action="store_true", help="echo the servers' logs")
    ap.add_argument("--split-concurrency", default=None, help="-split modes: these points only (default: all)")
    ap.add_argument("--client-procs", type=int, default=4, help="loadgen processes sharing each point's concurrency")
    ap.add_argument(
        "--stagger-modes",
        default="",
        help="base modes (k0,a07) whose engine alone is also measured with staggered arrivals at c > 1 "
        "(engine_staggered_tok_s, served_over_engine_staggered)",
    )
    ap.add_argument("--engine-alone", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--drive", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--py-spy", default=None, help="py-spy binary: sample the served processes at --py-spy-at")
    ap.add_argument("--py-spy-at", default="", help="MODE:API:C[,...] points to sample (e.g. a07:openai:128)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.apis = args.apis.split(",")
    args.stagger_modes = [m for m in args.stagger_modes.split(",") if m]
    args.split_concurrency = (
        [int(c) for c in args.split_concurrency.split(",")] if args.split_concurrency else args.concurrency
    )
    if args.engine_alone:
        return engine_alone(args)
    if args.drive:  # one loadgen process of drive_clients
        api, target, share, index = args.drive.split(",")
        print(json.dumps(asyncio.run(drive(args, api, target, int(share), int(share) * 1000 + int(index)))))
        return
    nvml, rows, engine_rows = Nvml(), [], {}
    for mode in args.modes.split(","):
        base = base_mode(mode)  # a split mode's engine alone is its colocated mode's
        if not args.no_engine_alone and base not in engine_rows:
            engine_rows[base] = run_engine_alone(args, base, nvml)
        try:
            done = list(rows)
            rows += run_served(
                args,
                mode,
                nvml,
                engine_rows.get(base, {}),
                on_row=lambda mode_rows: save(args, nvml, done + mode_rows),  # noqa: B023
            )
        except SystemExit as exc:  # a mode that does not start: say so, measure the others
            print(f"mode {mode} failed: {exc}", flush=True)
            rows.append({"mode": mode, "error": str(exc)[-2000:]})
            save(args, nvml, rows)
            continue
        save(args, nvml, rows)  # after every mode: a run cut short keeps what it measured
    print(
        f"\n{'mode':10} {'api':7} {'c':>4} {'engine':>8} {'served':>8} {'ratio':>6} {'ttft50':>7} {'itl99':>7} "
        f"{'gpu%':>5} {'gw us/tok':>9} {'core us/tok':>11} {'steps/s':>8} {'eng st/s':>8} {'chained':>7}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['mode']:10} failed")
            continue
        print(
            f"{r['mode']:10} {r['api']:7} {r['concurrency']:>4} {r['engine_tok_s'] or '-':>8} {r['served_tok_s']:>8} "
            f"{r['served_over_engine'] or '-':>6} {r['ttft_p50_ms'] or 0:>7.1f} {r['itl_p99_ms'] or 0:>7.1f} "
            f"{r['gpu_busy_pct_served'] or '-':>5} {r['gateway_cpu_us_per_token']:>9} {r['core_cpu_us_per_token']:>11} "
            f"{r['steps_per_s'] or '-':>8} {r['engine_steps_per_s'] or '-':>8} {r.get('chained_share') or '-':>7}"
        )


def save(args, nvml, rows: list[dict]) -> None:
    write_result(
        args.out,
        "serving_vs_engine",
        {
            **metadata(),
            "gpu_util_note": nvml.error,
            "label": "engine alone vs served (closed loop, steady state); a07 rows: SIMULATED acceptance 0.7",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
