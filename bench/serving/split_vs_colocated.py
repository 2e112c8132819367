"""Split (lanes in 3 processes, KV by CUDA IPC handle) vs colocated (one process), same workload.

    PYTHONPATH=services python bench/serving/split_vs_colocated.py --out FILE     # GPU: Llama-2-7B + TinyLlama,
                                                                         # simulated acceptance 0.7, batch 1 and 64
    PYTHONPATH=services python bench/serving/split_vs_colocated.py --k 0 --batches 64 --out FILE   # plain decoding
    PYTHONPATH=services python bench/serving/split_vs_colocated.py --device cpu --target DIR --draft DIR --batches 4
    PYTHONPATH=services python bench/serving/split_vs_colocated.py --smoke --k 0 --out FILE   # CPU, tiny random models

`--k 0` (no speculation) compares the chained plain steps of both topologies: colocated launches
step N + 1 before N's results reach the host (router/steps/overlapped.py), split sends it over the
call channel before N's reply, fed by reference to N's tokens on the verify lane's device
(lanes/rpc/call_pipeline.py). The `split_unpipelined` topology is the same split lanes with the
chain off (RuntimeConfig.overlap = False: each call waits for the one before), measured in the same
run as the before. Per topology: `chained_steps` (steps launched ahead) and why chains broke.

Random weights; with --alpha the verify lane keeps each draft token with that probability
(simulated acceptance: real draft and verify compute, seeded Bernoulli accept, labelled in the
output); without it, draft = target (acceptance ~1). Fixed k, greedy. Both topologies run the same
router over the same requests, interleaved run by run; the script checks the outputs are
identical (0 KV bytes may cross the wire with handles) and prints one JSON object with, per batch:
tokens/s of each topology and their ratio, median decode-step and lane-call times, and the
split's wire bytes. Also: lane start-up and the one-time pool wiring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta


class StepTimes:
    """EngineObserver recording lane call durations and step boundaries."""

    def __init__(self):
        self.lane: dict[str, list[float]] = {"prefill": [], "draft": [], "verify": []}
        self.steps = 0

    def on_lane_step(self, lane, seconds, batch):
        self.lane[lane].append(seconds)

    def on_verify(self, k, accepted):
        pass

    def on_request_finished(self, seq):
        pass

    def on_step(self, router):
        self.steps += 1


def chain_counts(router) -> dict:
    """The router's chained-step counters (Overlapped): steps launched ahead, why chains broke."""
    return {"chained_steps": router.overlap.steps, "breaks": dict(router.overlap.breaks)}


def run(router, specs, observer: StepTimes) -> tuple[list[list[int]], dict]:
    ids = [router.add_request(s) for s in specs]
    tokens = {i: [] for i in ids}
    decode_steps: list[float] = []
    t_start = time.perf_counter()
    while router.has_work():
        prefill_before = len(observer.lane["prefill"])
        t0 = time.perf_counter()
        outputs = router.step()
        dt = time.perf_counter() - t0
        if len(observer.lane["prefill"]) == prefill_before:  # decode-only step (draft + verify)
            decode_steps.append(dt)
        for out in outputs:
            tokens[out.request_id] += out.token_ids
    wall = time.perf_counter() - t_start
    generated = sum(len(t) for t in tokens.values())
    stats = {
        "wall_s": wall,
        "generated_tokens": generated,
        "tokens_per_s": generated / wall,
        "decode_steps": len(decode_steps),
        "decode_step_ms_median": 1e3 * statistics.median(decode_steps) if decode_steps else None,
        "lane_call_ms_median": {lane: (1e3 * statistics.median(v) if v else None) for lane, v in observer.lane.items()},
    }
    return [tokens[i] for i in ids], stats


def _median_or_none(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict:
    step = statistics.median(r["decode_step_ms_median"] for r in runs)
    verify = _median_or_none([r["lane_call_ms_median"]["verify"] for r in runs])
    return {
        "runs": len(runs),
        "decode_step_ms_median_of_runs": step,
        # where a decode step goes: waiting for the verify call's results (with a chain: the wait
        # left after the step launched behind it), and the rest (the router's host work, the other
        # lane calls, launching the next step)
        "verify_wait_ms_median_of_runs": verify,
        "rest_of_step_ms": step - verify if verify is not None else None,
        "tokens_per_s_median_of_runs": statistics.median(r["tokens_per_s"] for r in runs),
        "lane_call_ms_median_of_runs": {
            lane: _median_or_none([r["lane_call_ms_median"][lane] for r in runs])
            for lane in ("prefill", "draft", "verify")
        },
        "decode_steps": [r["decode_steps"] for r in runs],
    }


def interleaved(routers: dict, observers: dict, specs, reps: int):
    """One full-size warm-up each, then timed runs alternating between the topologies (so clock
    and thermal drift hit both alike). Fresh request ids every run."""
    outputs = {name: [] for name in routers}
    runs = {name: [] for name in routers}
    counts = {}
    for rep in range(-1, reps):
        for name, router in routers.items():
            observers[name].lane = {lane: [] for lane in observers[name].lane}
            before = chain_counts(router)
            tokens, stats = run(
                router, [replace(s, request_id=f"{rep}-{s.request_id}") for s in specs], observers[name]
            )
            if rep >= 0:
                outputs[name].append(tokens)
                runs[name].append(stats)
                after = chain_counts(router)
                counts.setdefault(name, []).append(after["chained_steps"] - before["chained_steps"])
    summary = {name: summarize(r) for name, r in runs.items()}
    for name in summary:
        summary[name]["chained_steps_per_run"] = counts[name]
        summary[name]["chain_breaks_total"] = chain_counts(routers[name])["breaks"]
    return outputs, summary


def mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=False))


def specs_for(args, vocab: int, batch: int):
    import random

    from verifypd.domain.requests import RequestSpec

    rng = random.Random(0)
    return [
        RequestSpec(
            tuple(rng.randrange(3, vocab) for _ in range(args.prompt_len)),
            max_tokens=args.max_tokens,
            stop_at_eos=False,
            request_id=f"r{n}",
        )
        for n in range(batch)
    ]


def smoke_models(args) -> None:
    """--smoke: tiny random Llama target and draft (tests/support/engine_helpers), CPU, small run."""
    import tempfile

    # one torch thread per process (the lanes inherit it), set before torch loads: idle lanes'
    # OpenMP threads spinning on 2 cores slowed the colocated engine 10-200 x here
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "support"))
    from engine_helpers import write_target_and_draft

    target, draft = write_target_and_draft(__import__("pathlib").Path(tempfile.mkdtemp(prefix="svc-")))
    args.target, args.draft = target, args.draft if args.draft in ("none", "same") else draft
    args.device = "cpu"
    if args.batches == "1,64":
        args.batches = "8"
    args.prompt_len, args.max_tokens, args.block_size = 16, 24, 4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="random:llama-2-7b")
    p.add_argument("--draft", default="random:tinyllama-1.1b", help="'same': draft = target (acceptance ~1)")
    p.add_argument("--alpha", type=float, default=0.7, help="simulated acceptance (negative: off)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-transport", default="handle", choices=["handle", "copy", "auto"])
    p.add_argument("--reps", type=int, default=3, help="timed runs per topology and batch (after one warm-up)")
    p.add_argument(
        "--schedule",
        default="pd",
        choices=["pd", "pdv"],
        help="router schedule of both topologies (pdv: pipelined draft/verify groups)",
    )
    p.add_argument("--label", default="", help="free text kept in the output (e.g. 'MPS on')")
    p.add_argument("--out", default=None)
    p.add_argument("--watchdog", type=float, default=0, help="dump every thread's stack and exit after S seconds")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU check of the script: tiny random models written to a temp dir, small batches, 1 rep",
    )
    p.add_argument("--no-unpipelined", action="store_true", help="leave out the split_unpipelined topology (chain off)")
    args = p.parse_args()
    if args.smoke:
        smoke_models(args)
    if args.watchdog:
        import faulthandler

        faulthandler.dump_traceback_later(args.watchdog, exit=True)
    if args.draft == "same":
        args.draft = args.target
    batches = [int(b) for b in args.batches.split(",")]
    alpha = args.alpha if args.alpha >= 0 and args.k > 0 else None  # k = 0: no drafts to accept

    from bench_meta import metadata

    from verifypd.core.assembly import connect_lanes
    from verifypd.domain.config import RuntimeConfig
    from verifypd.engine import Engine, EngineOptions
    from verifypd.gateway.server import load_codec
    from verifypd.lanes.processes import LaneProcesses
    from verifypd.lanes.rpc.lane_wiring import wire_pools
    from verifypd.router.router import Router

    config = RuntimeConfig(k_min=0, k_max=max(args.k, 1), k_initial=args.k, adaptive=False, schedule=args.schedule)
    context = args.prompt_len + args.max_tokens + 64
    num_blocks = max(batches) * (-(-context // args.block_size)) + 16
    options = EngineOptions(
        target=args.target,
        draft=args.draft,
        device=args.device,
        dtype=args.dtype,
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_context=context,
        max_running=max(batches),
        config=config,
        graph_buckets=tuple(batches),
        simulated_acceptance=alpha,
    )
    result: dict = {
        **metadata(),
        "label": args.label,
        "schedule": args.schedule,
        "target": args.target,
        "draft": args.draft,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "kv_transport": args.kv_transport,
        "rows": [],
        "acceptance": (
            f"simulated acceptance alpha={alpha} (real compute, seeded Bernoulli accept)"
            if alpha is not None
            else "~1 (draft = target, random weights)"
            if args.draft == args.target
            else "real"
        ),
    }

    # The lanes are spawned (exec), never forked, so this process may use CUDA as well.
    procs = LaneProcesses(options)
    t0 = time.perf_counter()
    addrs = procs.start(timeout_s=600)
    result["lane_start_s"] = time.perf_counter() - t0
    ok = True
    try:
        lanes = connect_lanes(addrs, timeout_s=600, secret=procs.secret)
        t0 = time.perf_counter()
        reply = wire_pools(*lanes, kv_transport=args.kv_transport)
        result["wiring_s"] = time.perf_counter() - t0
        result["import_s"] = reply.import_seconds
        result["pool_modes"] = sorted(set(reply.mode_by_pool.values()))
        result["kv_written_event"] = bool(reply.kv_written_event)
        result["draft_handoff"] = lanes[1].handoff is not None  # draft tokens stay on the device
        codec = load_codec(args.target)
        vocab = lanes[2].describe().vocab_size
        observers = {"split": StepTimes(), "colocated": StepTimes()}
        engine = Engine(options, observer=observers["colocated"], simulated_acceptance=alpha)
        routers = {
            "split": Router(
                *lanes,
                decode=codec.decode,
                eos_token_ids=(),
                config=config,
                max_running=max(batches),
                observer=observers["split"],
            ),
            "colocated": engine.router,
        }
        if not args.no_unpipelined:  # the same lanes, each call waiting for the one before
            observers["split_unpipelined"] = StepTimes()
            routers["split_unpipelined"] = Router(
                *lanes,
                decode=codec.decode,
                eos_token_ids=(),
                config=replace(config, overlap=False),
                max_running=max(batches),
                observer=observers["split_unpipelined"],
            )
        for batch in batches:
            before = {lane.lane: lane.wire_bytes for lane in lanes}
            outputs, summary = interleaved(routers, observers, specs_for(args, vocab, batch), args.reps)
            row = {"batch": batch, **summary}
            row["split"]["wire_bytes"] = {lane.lane: lane.wire_bytes - before[lane.lane] for lane in lanes}
            row["split"]["kv_bytes_copied"] = lanes[0].kv_bytes_copied
            # Run i of both topologies used the same request ids (simulated acceptance is seeded by
            # them): split run i must equal colocated run i token for token.
            row["split_vs_colocated_mismatched_requests"] = [
                mismatches(c, s_) for c, s_ in zip(outputs["colocated"], outputs["split"], strict=False)
            ]
            row["identical_output"] = not any(row["split_vs_colocated_mismatched_requests"])
            if "split_unpipelined" in outputs:
                row["split_unpipelined_vs_colocated_mismatched_requests"] = [
                    mismatches(c, s_) for c, s_ in zip(outputs["colocated"], outputs["split_unpipelined"], strict=False)
                ]
                row["identical_output"] &= not any(row["split_unpipelined_vs_colocated_mismatched_requests"])
                row["split_unpipelined_over_colocated_throughput"] = (
                    row["split_unpipelined"]["tokens_per_s_median_of_runs"]
                    / row["colocated"]["tokens_per_s_median_of_runs"]
                )
            ok &= row["identical_output"]
            c, s_ = row["colocated"], row["split"]
            row["split_over_colocated_throughput"] = (
                s_["tokens_per_s_median_of_runs"] / c["tokens_per_s_median_of_runs"]
            )
            row["per_step_overhead_ms"] = s_["decode_step_ms_median_of_runs"] - c["decode_step_ms_median_of_runs"]
            row["per_lane_call_overhead_ms"] = {
                lane: s_["lane_call_ms_median_of_runs"][lane] - c["lane_call_ms_median_of_runs"][lane]
                for lane in ("prefill", "draft", "verify")
                if s_["lane_call_ms_median_of_runs"][lane] is not None
            }
            result["rows"].append(row)
            print(
                json.dumps(
                    {
                        k: row.get(k)
                        for k in (
                            "batch",
                            "split_over_colocated_throughput",
                            "split_unpipelined_over_colocated_throughput",
                            "per_step_overhead_ms",
                            "identical_output",
                        )
                    }
                ),
                file=sys.stderr,
                flush=True,
            )
    finally:
        procs.terminate()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
