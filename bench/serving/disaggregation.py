"""Prefill/verify disaggregation on 2 GPUs against the same GPUs colocated, under a prefill-heavy mix.

Configurations (each one or two `verifypd serve` processes, started one configuration at a time):
  colocated-1gpu        one colocated server on GPU 0 (the single-GPU reference)
  split-pd-2gpu         --topology split: prefill lane on GPU 0; verify and draft lanes on GPU 1;
                        KV by the peer transport (staging on GPU 0, per-layer copies over NVLink)
  split-draft-own-gpu   the same, but the draft lane on GPU 0 (another GPU than verify's): drafts on
                        their own GPU vs beside verify (the line above)
  replicas-2gpu         two colocated servers, GPU 0 and GPU 1, the load split evenly between them
                        (each gets a Poisson stream at half the rate)

Load: loadgen's `--workload mixed` (open loop, Poisson at --rate req/s over --duration s): short
prompts streaming their decode, and a --long-fraction share of --long-len-token prompts whose
prefills land among them. Measured per configuration, from every request's raw records: ITL p99
(gaps between streamed messages, ms), TPOT p99, TTFT p50/p99 (all requests, and short ones only: the
ones a long prefill delays), goodput at the SLO (requests/s with TTFT <= --slo-ttft-ms and mean ITL
<= --slo-itl-ms, loadgen's definition), and, for split, the KV transport chosen and its per-transfer
log lines (bytes, time exposed after the forward). Then the peer-copy microbenchmark
(peer_copy_bandwidth.py: the copier's GB/s against a bulk cudaMemcpyPeer and NVLink's nominal).

Model: random-weight Llama-2-7B shape (bf16, real compute), draft a random TinyLlama-1.1B shape with
SIMULATED acceptance (--alpha, real draft and verify compute, seeded Bernoulli accept): outputs are not
a model's. NCCL_NVLS_ENABLE=0 (NVLink multicast stays off).

    python bench/serving/disaggregation.py --out bench/results/disaggregation_2xh100.json     (2 GPUs, < 8 min)
    python bench/serving/disaggregation.py --smoke --out /tmp/disagg_smoke.json               (CPU, tiny model)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "loadgen", "bench", "bench/seed_study", "bench/serving"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))
os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on these machines

from bench_meta import metadata  # noqa: E402
from seed_serving import ServeProcess, free_port  # noqa: E402

# In order of importance: a configuration not started within --budget-s is skipped (and says so).
CONFIGS = ("colocated-1gpu", "split-pd-2gpu", "replicas-2gpu", "split-draft-own-gpu")


def servers(args, config: str) -> list[list[str]]:
    """The serve command lines of one configuration (flags after `serve --port P`)."""
    g0, g1 = args.gpus
    base = ["--target", args.target, "--draft", args.draft, "--max-context", str(args.long_len + args.output_len + 64)]
    base += ["--max-running", "128", "--max-queue", "1024", "--http-port", "0", "--drain-timeout", "5"]
    if args.alpha >= 0:
        base += ["--simulated-acceptance", str(args.alpha)]
    if args.graph_buckets:
        base += ["--graph-buckets", args.graph_buckets]
    transport = ["--kv-transport", args.kv_transport]
    if config == "colocated-1gpu":
        return [[*base, "--device", g0]]
    if config == "replicas-2gpu":
        return [[*base, "--device", g0], [*base, "--device", g1]]
    draft = g1 if config == "split-pd-2gpu" else g0
    lanes = f"prefill={g0},verify={g1},draft={draft}"
    return [[*base, "--device", g0, "--topology", "split", "--lane-devices", lanes, *transport]]


def start(flags: list[str], timeout_s: float) -> ServeProcess:
    port = free_port()
    proc = ServeProcess([sys.executable, "-m", "verifypd.cli", "serve", "--port", str(port), *flags])
    why = proc.wait_ready(timeout_s)
    if why is not None:
        tail = "\n".join(proc.tail(30))
        proc.stop()
        raise RuntimeError(f"serve {' '.join(flags)}: {why}\n{tail}")
    return proc


def run_load(args, address: str, rate: float, seed: int, out: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "verifypd_loadgen", "--server", address, "--workload", "mixed"]
    cmd += ["--rate", repr(rate), "--duration", str(args.duration), "--drain-timeout", "15", "--procs", "1"]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--long-fraction", str(args.long_fraction), "--long-input-len", str(args.long_len)]
    cmd += ["--vocab-size", str(args.vocab), "--warmup", "2", "--seed", str(seed)]
    cmd += ["--raw-records", "--no-progress", "--out", out]
    ours = [str(ROOT / s) for s in ("loadgen", "services")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(ours + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def summarize(args, records: list[dict]) -> dict:
    ok = [r for r in records if r["ok"]]
    short = [r for r in ok if r["prompt_tokens"] < args.long_len]
    ttft = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    short_ttft = [r["ttft_ms"] for r in short if r["ttft_ms"] is not None]
    gaps = [g for r in ok for g in r["itl_chunk_ms"]]
    tpot = [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None]
    good = [
        r
        for r in ok
        if r["ttft_ms"] is not None
        and r["ttft_ms"] <= args.slo_ttft_ms
        and (r["tpot_ms"] is None or r["tpot_ms"] <= args.slo_itl_ms)
    ]
    return {
        "requests": len(records),
        "completed": len(ok),
        "long_prompts": len(ok) - len(short),
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "short_ttft_ms_p50": pct(short_ttft, 50),
        "short_ttft_ms_p99": pct(short_ttft, 99),
        "itl_ms_p50": pct(gaps, 50),
        "itl_ms_p99": pct(gaps, 99),
        "tpot_ms_p99": pct(tpot, 99),
        "output_tokens_per_s": sum(r["output_tokens"] for r in ok) / args.duration,
        "goodput_req_per_s": len(good) / args.duration,
        "slo_attainment": len(good) / len(records) if records else None,
    }


def transport_report(lines: list[str]) -> dict:
    """What the split server's log says about its KV transport (lanes wired: each pool's mode, direct or peer among
    them; peer copy lines: a direct pool copies nothing)."""
    wired = [ln for ln in lines if "lanes wired" in ln]
    copies = [ln for ln in lines if "peer KV copy" in ln]
    sizes = [int(m.group(1)) for ln in copies if (m := re.search(r" (\d+) bytes", ln))]
    exposed = [float(m.group(1)) for ln in copies if (m := re.search(r"([\d.]+) ms after the forward", ln))]
    return {
        "wired": wired[-1].split("lanes wired:", 1)[1].strip() if wired else None,
        "peer_copy_lines_seen": len(copies),  # of the server log's last lines kept, not every transfer
        "peer_copy_bytes_mean": sum(sizes) / len(sizes) if sizes else None,
        "peer_copy_exposed_ms_mean": sum(exposed) / len(exposed) if exposed else None,
    }


def run_config(args, config: str, tmp: str) -> dict:
    flags = servers(args, config)
    t0 = time.perf_counter()
    procs: list[ServeProcess] = []
    try:
        for f in flags:
            procs.append(start(f, args.start_timeout))
        started = time.perf_counter() - t0
        outs = [os.path.join(tmp, f"{config}-{n}.json") for n in range(len(procs))]
        loads = [
            run_load(args, p.address or "", args.rate / len(procs), n, out)
            for n, (p, out) in enumerate(zip(procs, outs, strict=True))
        ]
        codes = [load.wait() for load in loads]
        records = []
        for out in outs:
            for run in json.loads(Path(out).read_text())["runs"]:
                records.extend(run.get("records", []))
        row = {"config": config, "serve_flags": flags, "start_s": started, "loadgen_exit_codes": codes}
        row.update(summarize(args, records))
        if "split" in config:
            row["kv_transport"] = transport_report(procs[0].tail(200))
        return row
    finally:
        for p in procs:
            p.stop()


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in result["rows"] if "error" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [r["config"] for r in rows]
    for ax, key, label in zip(
        axes,
        ("itl_ms_p99", "ttft_ms_p99", "goodput_req_per_s"),
        ("ITL p99 (ms)", "TTFT p99 (ms)", "goodput at SLO (req/s)"),
        strict=True,
    ):
        ax.bar(names, [r[key] or 0 for r in rows])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{result['device']}: {result['workload']} (acceptance {result['acceptance']})", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--gpus", default="cuda:0,cuda:1", help="the two devices (GPU 0, GPU 1)")
    p.add_argument("--target", default="random:llama-2-7b")
    p.add_argument("--draft", default="random:tinyllama-1.1b")
    p.add_argument("--alpha", type=float, default=0.7, help="SIMULATED acceptance (negative: off)")
    p.add_argument(
        "--kv-transport",
        default="auto",
        help="split configurations (auto picks peer across GPUs, direct where a staging pool would not fit)",
    )
    p.add_argument("--rate", type=float, default=6.0, help="requests/s over all servers of a configuration")
    p.add_argument("--duration", type=float, default=25.0, help="seconds of sending per configuration")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--long-fraction", type=float, default=0.15)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-itl-ms", type=float, default=50.0)
    p.add_argument("--graph-buckets", default="1,2,4,8,16,32,64,128")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--budget-s", type=float, default=360.0, help="configurations not started by then are skipped")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny random checkpoint, short load")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from engine_helpers import VOCAB, write_target_and_draft  # tests/support: the tests' tiny checkpoints

        args.target, args.draft = write_target_and_draft(Path(tempfile.mkdtemp(prefix="disagg-models-")))
        args.gpus, args.kv_transport, args.graph_buckets = "cpu,cpu", "peer", ""
        args.vocab, args.rate, args.duration = VOCAB, 2.0, 6.0
        args.input_len, args.output_len, args.long_len = 8, 8, 48
        args.slo_ttft_ms, args.slo_itl_ms = 5000.0, 1000.0
    args.gpus = args.gpus.split(",")
    t_start = time.perf_counter()
    result: dict = {
        **metadata(),
        "target": args.target,
        "draft": args.draft,
        "acceptance": f"SIMULATED alpha={args.alpha}" if args.alpha >= 0 else "real (random weights: ~0)",
        "workload": (
            f"mixed open loop {args.rate} req/s for {args.duration} s: {args.input_len}-token prompts, "
            f"{args.long_fraction:.0%} of {args.long_len} tokens, {args.output_len} output tokens"
        ),
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms, "itl_is": "mean ITL per request (TPOT)"},
        "itl_ms_is": "gap between streamed messages (a message may carry several accepted tokens)",
        "rows": [],
    }
    with tempfile.TemporaryDirectory(prefix="disagg-") as tmp:
        for config in args.configs.split(","):
            if time.perf_counter() - t_start > args.budget_s:
                result["rows"].append({"config": config, "error": f"skipped: past --budget-s {args.budget_s}"})
                continue
            try:
                row = run_config(args, config, tmp)
            except (RuntimeError, OSError, KeyError, ValueError) as exc:
                row = {"config": config, "error": str(exc)[-2000:]}
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "serve_flags"}), file=sys.stderr, flush=True)
    from peer_copy_bandwidth import measure

    src, dst = args.gpus
    result["peer_copy"] = measure(
        src, dst, args.smoke, [4, 16] if args.smoke else [16, 128, 512], 2 if args.smoke else 5
    )
    result["wall_s"] = time.perf_counter() - t_start
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        result["plot"] = plot(result, str(Path(args.out).with_suffix(".png")))  # None: no matplotlib
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if all("error" not in r for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
