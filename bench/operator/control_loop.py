"""Does the operator's k rewriting help? One `verifypd serve` (through the CLI),
an open-loop Poisson rate sweep (verifypd-loadgen) from light load to past saturation, goodput
(requests/s meeting BOTH SLOs) and p95 latencies for three ways to pick k:

  fixed_k4            UpdateConfig k_min = k_initial = k_max = 4, adaptive off
  adaptive            the router's own draft-length controller, k in [--k-min, --k-max] (default
                      [0, 8], the router's own range: it may stop drafting)
  adaptive_operator   the same, plus the operator's loop: the operator's OTLP receiver
                      (verifypd_operator.otlp_receiver, in this process) takes the server's own
                      exports (every 1 s); every --interval-s the operator's decision function
                      (verifypd_operator.decision.decide, with the timer's status bookkeeping from
                      verifypd_operator.status) runs and its knobs go out through the operator's
                      ControlClient with the admin key. Everything the Kubernetes operator does,
                      minus Kubernetes (no scaling: one replica, minReplicas = maxReplicas = 1).

One server serves every point (CUDA graphs, allocator and the router's step-cost model warm up in
an unrecorded first point). Rate by rate, light to heavy, every mode runs at each rate, the mode
order rotated per rate. Every point starts from its mode's knobs (pushed before it) and, for the
loop, a fresh operator state and metrics window. Then a priority-mix run at the top rate (20 %
priority 10, 80 % priority 0) with the adaptive knobs. Acceptance is SIMULATED
(`--simulated-acceptance`, default 0.7): outputs are not the model's. Loop latency: from the first
export whose window breaches an SLO (a watcher polls the receiver every 0.25 s) to UpdateConfig
returning. `targets` in the result checks the control loop's targets from the rows (docs/kubernetes.md).

GPU (one device call, about 6-7 minutes on an H200):
  python3 bench/operator/control_loop.py --out bench/results
CPU smoke:   python3 bench/operator/control_loop.py --smoke --out /tmp/control-loop
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[2]
for sub in ("services", "operator", "loadgen", "bench", "bench/seed_study"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_meta import metadata, write_result  # noqa: E402
from seed_serving import ServeProcess, free_port  # noqa: E402

NAME = "bench"
ADMIN_KEY = "control-loop-bench-admin-key-0123456789"
MODES = ("fixed_k4", "adaptive", "adaptive_operator")
BREACH_ACTIONS = ("lower-k", "prefill-boost", "scale-up")


def spec_for(args):
    from verifypd_operator.spec import parse_spec

    return parse_spec(
        {
            "topology": "colocated",
            "colocated": {"replicas": 1, "minReplicas": 1, "maxReplicas": 1},
            "speculation": {"kMin": args.k_min, "kInitial": 4, "kMax": args.k_max, "adaptive": True},
            "slo": {"ttftP95Ms": args.slo_ttft_ms, "itlP95Ms": args.slo_itl_ms},
            "autoscaling": {
                "intervalSeconds": args.interval_s,
                "windowSeconds": args.window_s,
                "breachPeriods": 1,
                "headroomPeriods": 2,
                "minSamples": args.min_samples,
                "configCooldownSeconds": args.interval_s,
                "staleAfterSeconds": max(5, 4 * args.interval_s),
            },
        }
    )


class OperatorLoop:
    """The operator's timer, minus Kubernetes: observe -> decide -> UpdateConfig, status kept in a dict."""

    def __init__(self, spec, store, control, target: str):
        from verifypd_operator.decision import spec_knobs
        from verifypd_operator.status import knobs_to_status

        self.spec, self.store, self.control, self.target = spec, store, control, target
        self.status = {"applied": knobs_to_status(spec_knobs(spec))}
        self.decisions: list[dict] = []
        self.breach_seen: float | None = None  # export time of the first breaching window not yet acted on
        self.stop_flag = threading.Event()

    def _watch_breach(self, now: float) -> None:
        o = self.store.observe(NAME, NAME, now, self.spec.autoscaling.window_s)
        slo = self.spec.slo
        if (
            o.samples >= self.spec.autoscaling.min_samples
            and o.age_s is not None
            and self.breach_seen is None
            and ((o.itl_p95_s or 0) * 1000 > slo.itl_p95_ms or (o.ttft_p95_s or 0) * 1000 > slo.ttft_p95_ms)
        ):
            self.breach_seen = now - o.age_s

    def tick(self, now: float) -> None:
        from verifypd_operator import status as st
        from verifypd_operator.decision import decide

        before = st.current_from_status(self.spec, self.status, now)
        observed = self.store.observe(NAME, NAME, now, self.spec.autoscaling.window_s)
        d = decide(self.spec, observed, before)
        self.status["autoscaler"] = st.autoscaler_status(self.spec, before, d, observed, dict(before.replicas), now)
        if d.knobs is None:
            return
        try:
            self.control.update(self.target, d.knobs, f"operator/{NAME}", d.reason, admin_key=ADMIN_KEY)
        except grpc.RpcError as e:  # like the operator: the next tick tries again
            self.decisions.append(
                {
                    "t": time.time(),
                    "action": d.action,
                    "k_max": d.knobs.k_max,
                    "loop_latency_s": None,
                    "error": f"{e.code().name}: {e.details()}",
                }
            )
            return
        applied = time.time()
        self.status["applied"] = st.knobs_to_status(d.knobs)
        # Loop latency is timed for the actions that answer a breach (lower-k, prefill-boost).
        answers_breach = d.action in BREACH_ACTIONS
        latency = applied - self.breach_seen if answers_breach and self.breach_seen is not None else None
        if answers_breach:
            self.breach_seen = None
        self.decisions.append(
            {
                "t": applied,
                "action": d.action,
                "reason": d.reason,
                "k_max": d.knobs.k_max,
                "prefill_priority": d.knobs.prio_prefill,
                "prefill_token_budget": d.knobs.prefill_token_budget,
                "loop_latency_s": latency,
            }
        )

    def run(self) -> None:
        next_eval = time.time()
        while not self.stop_flag.wait(0.25):
            now = time.time()
            self._watch_breach(now)
            if now >= next_eval:
                self.tick(now)
                next_eval = now + self.spec.autoscaling.interval_s

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """No tick may land after this returns (the next point's reset push would race it)."""
        self.stop_flag.set()
        self.thread.join()


def push(control, target: str, knobs) -> None:
    control.update(target, knobs, "bench", "reset before a rate point", admin_key=ADMIN_KEY)


def mode_knobs(spec, mode: str):
    import dataclasses

    from verifypd_operator.decision import spec_knobs

    base = spec_knobs(spec)
    return dataclasses.replace(base, k_min=4, k_max=4, k_initial=4, adaptive=False) if mode == "fixed_k4" else base


def run_point(
    args,
    address: str,
    rate: float,
    out: Path,
    priority_mix: str | None = None,
    duration: float | None = None,
    seed: int = 1,
) -> dict:
    from verifypd_loadgen.cli import main as loadgen

    duration = duration or args.duration
    argv = [
        "--server",
        address,
        "--rate",
        str(rate),
        "--duration",
        str(duration),
        "--input-len",
        args.input_len,
        "--output-len",
        args.output_len,
        "--slo-ttft-ms",
        str(args.slo_ttft_ms),
        "--slo-itl-ms",
        str(args.slo_itl_ms),
        "--out",
        str(out),
        "--no-progress",
        "--seed",
        str(seed),
        "--timeout",
        str(max(60.0, 4 * duration, duration + (args.drain_s or duration) + 30)),
        "--drain-timeout",
        str(args.drain_s or duration),
    ]  # a request's deadline outlasts the drain
    if args.vocab_size:
        argv += ["--vocab-size", str(args.vocab_size)]
    if priority_mix:
        argv += ["--priority-mix", priority_mix]
    if loadgen(argv) != 0:
        raise RuntimeError(f"loadgen failed at rate {rate}")
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    lat = summary["latency_ms"]
    return {
        "rate": rate,
        "goodput_rps": summary["goodput"]["requests_per_s"],
        "goodput_fraction": summary["goodput"]["fraction"],
        "throughput_rps": summary["throughput"]["requests_per_s"],
        "output_tok_s": summary["throughput"]["output_tokens_per_s"],
        # ITL as the SLO and the operator see it: each request's mean inter-token time (TPOT).
        "ttft_p95_ms": lat["ttft"]["p95"],
        "itl_p95_ms": lat["tpot"]["p95"],
        "itl_token_p95_ms": lat["itl_token"]["p95"],
        "acceptance": summary["speculation"]["acceptance_rate"],
        "applied_k": summary["speculation"]["applied_k"],
        "failed": summary["requests"]["failed"],
        "cancelled": summary["requests"]["cancelled"],
        "errors": summary["errors"],
        "by_priority": summary["by_priority"],
    }


def start_server(args, work: Path, otlp_port: int):
    key_file = work / "admin-key"
    key_file.write_text(ADMIN_KEY)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "verifypd.cli",
        "serve",
        "--port",
        str(port),
        "--http-port",
        "0",
        "--target",
        args.target,
        "--draft",
        args.draft,
        "--simulated-acceptance",
        str(args.alpha),
        "--admin-key-file",
        str(key_file),
        "--k-min",
        str(args.k_min),
        "--k-max",
        str(args.k_max),
        *args.serve_arg,
    ]
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        "OTEL_RESOURCE_ATTRIBUTES": f"verifypd.config.name={NAME},k8s.namespace.name={NAME},k8s.pod.name={NAME}-0",
    }
    server = ServeProcess(cmd, env=env)
    problem = server.wait_ready(args.start_timeout)
    if problem:
        server.stop()
        raise SystemExit(f"verifypd serve did not start: {problem}\n" + "\n".join(server.tail()))
    return server, f"127.0.0.1:{port}"


def smoke_models(work: Path) -> tuple[str, str]:
    """Tiny random Llama target + draft (the tests' writer), for a CPU run of the whole script."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("engine_helpers", ROOT / "tests" / "support" / "engine_helpers.py")
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers.write_target_and_draft(work)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="random:llama-2-7b")
    ap.add_argument("--draft", default="random:tinyllama-1.1b")
    ap.add_argument("--alpha", type=float, default=0.7, help="SIMULATED acceptance rate")
    ap.add_argument("--rates", default="4,12,20,28,40,56", help="requests/s, comma-separated, light to past saturation")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per rate point")
    ap.add_argument(
        "--drain-s",
        type=float,
        default=None,
        help="seconds a point waits for its stragglers "
        "after the arrivals end before cancelling them (default: --duration)",
    )
    ap.add_argument("--warmup-s", type=float, default=6.0, help="unrecorded warm-up point at the middle rate (0: none)")
    ap.add_argument("--settle-s", type=float, default=1.0, help="pause between points")
    ap.add_argument("--k-min", type=int, default=0, help="k bounds of the adaptive modes (the router's defaults)")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument(
        "--priority-rate", type=float, default=None, help="offered rate of the priority run (default: top rate)"
    )
    ap.add_argument("--input-len", default="uniform:256,768")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--vocab-size", type=int, default=None)
    ap.add_argument("--slo-ttft-ms", type=float, default=500.0)
    ap.add_argument("--slo-itl-ms", type=float, default=40.0)
    ap.add_argument("--interval-s", type=int, default=1, help="the operator loop's evaluation period")
    ap.add_argument("--window-s", type=int, default=5, help="the operator loop's metrics window")
    ap.add_argument("--min-samples", type=int, default=10, help="the operator loop's minSamples")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--priority-mix", default="10:0.2,0:0.8", help="'' = skip the priority run")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `verifypd serve` argument")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random models, tiny sweep")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--recheck", default=None, help="recompute a result file's targets and plot, run nothing")
    args = ap.parse_args(argv)
    if args.smoke:
        args.rates, args.duration, args.input_len, args.output_len, args.vocab_size = "4", 5.0, "8", "12", 96
        args.interval_s, args.window_s, args.min_samples, args.start_timeout = 1, 5, 2, 180.0
        # A shared 2-core CI box can fall behind even this: let stragglers finish, never cancel them.
        args.warmup_s, args.drain_s, args.settle_s = 0.0, 60.0, 2.0
        # Any prefill breaches this TTFT SLO and ITL keeps its headroom: the operator loop must act
        # (a prefill boost; with adaptive k it leaves k to the router).
        args.slo_ttft_ms, args.slo_itl_ms = 0.5, 60000.0
        args.serve_arg += ["--device", "cpu", "--num-blocks", "256", "--block-size", "4", "--max-context", "256"]
    return args


def point_order(rates: list[float], modes: list[str]) -> list[tuple[float, str]]:
    """Rate by rate (light to heavy); at each rate every mode, the mode order rotated one step per
    rate, so that no mode always runs right after another on the one shared, warm server (the
    router's step-cost model carries over between points)."""
    out = []
    for i, rate in enumerate(rates):
        shift = i % len(modes)
        out += [(rate, m) for m in modes[shift:] + modes[:shift]]
    return out


def run_mode_point(args, spec, store, control, address: str, rate: float, mode: str, path: Path) -> dict:
    push(control, address, mode_knobs(spec, mode))
    loop = None
    if mode == "adaptive_operator":
        store.unregister(NAME, NAME)  # a fresh window: the previous point's telemetry is gone
        store.register(NAME, NAME)
        loop = OperatorLoop(spec, store, control, address)
        loop.start()
    try:
        row = run_point(args, address, rate, path)
    finally:
        if loop is not None:
            loop.stop()
    if loop is not None:
        row["decisions"] = loop.decisions
    return row


def check_targets(result: dict) -> dict:
    """The control loop's targets from the rows. Past saturation: offered rates above fixed k = 4's
    capacity, the most requests/s it completed at any rate of the sweep (a comparison with each
    point's own offered rate misreads light points: Poisson arrivals in 10 s vary by +-15 %)."""
    out = priority_target(result.get("priority_mix"))
    modes = result["modes"]
    if not all(modes.get(m) for m in MODES):
        return out
    by_rate = {m: {r["rate"]: r for r in rows} for m, rows in modes.items()}
    rates = sorted(set.intersection(*(set(v) for v in by_rate.values())))
    per_rate, saturated = [], []
    capacity = max(r["throughput_rps"] for r in modes["fixed_k4"])
    for rate in rates:
        g = {m: by_rate[m][rate]["goodput_rps"] or 0.0 for m in MODES}
        past = rate > capacity
        best_other = max(g["fixed_k4"], g["adaptive"])
        per_rate.append(
            {
                "rate": rate,
                "past_saturation": past,
                **{f"goodput_{m}": g[m] for m in MODES},
                "c_over_best_of_a_b": g["adaptive_operator"] / best_other if best_other else None,
                "c_over_a": g["adaptive_operator"] / g["fixed_k4"] if g["fixed_k4"] else None,
            }
        )
        if past:
            saturated.append(rate)
    latencies = [
        d["loop_latency_s"]
        for r in modes["adaptive_operator"]
        for d in r.get("decisions", [])
        if d.get("loop_latency_s") is not None
    ]
    interval = result["operator"]["interval_s"]
    out |= {
        "per_rate": per_rate,
        "c_ge_best_of_a_b_every_rate": all(
            x["goodput_adaptive_operator"] >= max(x["goodput_fixed_k4"], x["goodput_adaptive"]) for x in per_rate
        ),
        "c_ge_1.15a_past_saturation": (
            all(
                x["goodput_adaptive_operator"] >= 1.15 * x["goodput_fixed_k4"] for x in per_rate if x["past_saturation"]
            )
            if saturated
            else None
        ),
        "past_saturation_rates": saturated,
        "fixed_k4_capacity_rps": capacity,
        "loop_latency_s": sorted(latencies),
        "loop_latency_target_s": 2 * interval,
        "loop_latency_met": bool(latencies) and max(latencies) <= 2 * interval,
    }
    return out


def priority_target(prio: dict | None) -> dict:
    """High- over low-priority TTFT p95 in the priority run (target <= 0.5)."""
    if not prio or len(prio["by_priority"]) < 2:
        return {}
    bp = prio["by_priority"]
    hi, lo = (bp[str(p)]["ttft_ms"]["p95"] for p in (max(map(int, bp)), min(map(int, bp))))
    return {
        "priority_ttft_p95_ratio_high_over_low": hi / lo if hi and lo else None,
        "priority_target_met": bool(hi and lo and hi <= 0.5 * lo),
    }


def recheck(path: Path) -> int:
    """--recheck FILE: the targets and the plot again from a result file's rows (no server)."""
    result = json.loads(path.read_text())
    result["targets"] = check_targets(result)
    result["targets_rechecked"] = {
        "git_revision": metadata()["git_revision"],
        "why": "check_targets changed after the run",
    }
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    print(json.dumps(result["targets"]))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.recheck:
        return recheck(Path(args.recheck))
    from verifypd_operator.control_client import ControlClient
    from verifypd_operator.otlp_receiver import MetricsStore, serve

    work = Path(tempfile.mkdtemp(prefix="control-loop-"))
    if args.smoke:
        args.target, args.draft = smoke_models(work)
    spec = spec_for(args)
    store = MetricsStore()
    store.register(NAME, NAME)
    receiver, otlp_port = serve(store, "127.0.0.1:0")
    control = ControlClient(timeout_s=30)
    t_start = time.time()
    server, address = start_server(args, work, otlp_port)
    rates = [float(r) for r in args.rates.split(",")]
    modes = args.modes.split(",")
    result = {
        **metadata(),
        "label": f"SIMULATED acceptance alpha={args.alpha} (--simulated-acceptance): outputs are not the "
        f"model's; "
        + (
            "tiny random Llama target + noisy-copy draft (--smoke)"
            if args.smoke
            else f"{args.target} target, {args.draft} draft (random weights)"
        ),
        "slo": {
            "ttft_p95_ms": args.slo_ttft_ms,
            "itl_p95_ms": args.slo_itl_ms,
            "goodput": "requests/s whose TTFT and mean ITL both meet the SLO, over the point's wall "
            "time from first send to last finish (loadgen)",
        },
        "operator": {
            "interval_s": args.interval_s,
            "window_s": args.window_s,
            "breach_periods": 1,
            "headroom_periods": 2,
            "min_samples": args.min_samples,
            "k_bounds": [args.k_min, args.k_max],
            "otel_export_interval_s": 1.0,
        },
        "workload": {
            "arrival": "poisson",
            "duration_s": args.duration,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "warmup_s": args.warmup_s,
            "order": "rate by rate, light to heavy; every mode at each rate, order rotated per rate; "
            "one server for all points; knobs reset (UpdateConfig) before every point",
        },
        "modes": {m: [] for m in modes},
    }
    out_file = (
        Path(args.out)
        / f"control_loop_{'cpu' if result['device'].startswith('cpu') else result['device'].split()[-1].lower()}.json"
    )
    try:
        result["server_start_s"] = round(time.time() - t_start, 1)
        if args.warmup_s:
            # Not recorded: CUDA graphs, allocator and the router's step-cost model warm up before
            # the first measured point.
            push(control, address, mode_knobs(spec, "adaptive"))
            run_point(args, address, rates[len(rates) // 2], work / "warmup.json", duration=args.warmup_s)
        for rate, mode in point_order(rates, modes):
            time.sleep(args.settle_s)
            row = run_mode_point(args, spec, store, control, address, rate, mode, work / f"{mode}_{rate}.json")
            result["modes"][mode].append(row)
            result["modes"][mode].sort(key=lambda r: r["rate"])
            print(
                f"{mode:18s} rate {rate:6.1f}/s goodput {row['goodput_rps'] or 0:6.2f}/s "
                f"TTFT p95 {row['ttft_p95_ms'] or 0:7.1f} ms ITL p95 {row['itl_p95_ms'] or 0:6.1f} ms "
                f"done {row['throughput_rps']:6.2f}/s k {row['applied_k']} t+{time.time() - t_start:.0f}s",
                flush=True,
            )
            write_result(args.out, "control_loop", result)  # partial results survive a timeout
        if args.priority_mix:
            time.sleep(args.settle_s)
            push(control, address, mode_knobs(spec, "adaptive"))
            prio_rate = args.priority_rate or max(rates)
            # Seed 2: its first requests already mix both classes (seed 1's first 20 are all priority 0).
            row = run_point(args, address, prio_rate, work / "priority.json", args.priority_mix, seed=2)
            result["priority_mix"] = {
                "mix": args.priority_mix,
                "rate": prio_rate,
                "knobs": "adaptive (b)",
                "seed": 2,
                "failed": row["failed"],
                "cancelled": row["cancelled"],
                "goodput_rps": row["goodput_rps"],
                "throughput_rps": row["throughput_rps"],
                "by_priority": row["by_priority"],
            }
        result["targets"] = check_targets(result)
        result["wall_s"] = round(time.time() - t_start, 1)
        write_result(args.out, "control_loop", result)
        print(json.dumps(result["targets"], indent=None))
        plot(result, out_file.with_suffix(".png"))
    finally:
        server.stop()
        receiver.stop(None)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prio = result.get("priority_mix")
    fig, axes = plt.subplots(1, 4 if prio else 3, figsize=(20 if prio else 15, 4))
    for mode, rows in result["modes"].items():
        xs = [r["rate"] for r in rows]
        for ax, key in zip(axes, ("goodput_rps", "ttft_p95_ms", "itl_p95_ms"), strict=False):
            ax.plot(xs, [r[key] or 0 for r in rows], marker="o", label=mode)
    titles = ("goodput (req/s meeting both SLOs)", "TTFT p95 (ms)", "ITL p95 (ms, per-request mean)")
    for ax, title in zip(axes, titles, strict=False):
        ax.set_xlabel("offered rate (req/s, Poisson)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax, key in ((axes[1], "ttft_p95_ms"), (axes[2], "itl_p95_ms")):
        ax.axhline(result["slo"][key], color="red", linestyle="--", linewidth=1, label="SLO")
    axes[0].legend()
    if prio:
        classes = sorted(prio["by_priority"], key=int, reverse=True)
        axes[3].bar(
            [f"priority {p}" for p in classes], [prio["by_priority"][p]["ttft_ms"]["p95"] or 0 for p in classes]
        )
        axes[3].set_title(f"TTFT p95 (ms), mix {prio['mix']} at {prio['rate']:g} req/s")
    fig.suptitle(result["label"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
