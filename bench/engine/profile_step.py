"""Where a decode step's time goes: torch.profiler over decode steps of the engine on random-weight
model shapes (top kernels by CUDA time, and how much of the step's wall time the GPU was busy), then
the host side: the router's own work against the time inside lane calls, and cProfile's top
functions.

    python bench/engine/profile_step.py --shape llama-2-7b --batch 64                       # plain decoding
    python bench/engine/profile_step.py --shape llama-2-7b --draft random:tinyllama-1.1b --k 3 \\
        --simulated-acceptance 0.7 --batch 128 --schedule pd                       # speculative, SIMULATED

`--target` takes any model spec instead of a shape (e.g. a tiny checkpoint to try it on the CPU).

`--closed-loop SECONDS` measures the engine alone (no gRPC) as the serving sweep loads it: `--batch`
requests in flight, each finished one replaced at once by a new prompt of `--prompt` tokens that
generates `--max-tokens`, so prefills keep arriving between decode steps; it prints output tok/s
with the prefill launched beside the verify call and without (router.overlap_prefill).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))

from verifypd.domain.config import SCHEDULES, RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.engine import Engine, EngineOptions

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench_meta
from bench_meta import metadata, write_result


class LaneTimer:
    """Wraps a lane method: wall time spent inside it (host preparation, launches and any sync)."""

    def __init__(self, lane, method: str):
        self.seconds, self._call = 0.0, getattr(lane, method)
        setattr(lane, method, self)

    def __call__(self, items):
        t0 = time.perf_counter()
        try:
            return self._call(items)
        finally:
            self.seconds += time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-2-7b", help="random-weight target shape")
    ap.add_argument("--target", default=None, help="a model spec instead of --shape")
    ap.add_argument("--draft", default="self:1", help="draft spec; with --k 0 it only sizes the draft lane")
    ap.add_argument("--k", type=int, default=0, help="draft tokens per step (fixed)")
    ap.add_argument(
        "--simulated-acceptance",
        type=float,
        default=None,
        help="SIMULATED per-token acceptance (random weights accept ~nothing)",
    )
    ap.add_argument("--schedule", default="pd", choices=SCHEDULES)
    ap.add_argument("--pipeline", action="store_true", help="pdv: pipeline the two groups")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--closed-loop",
        type=float,
        default=None,
        metavar="SECONDS",
        help="instead: closed-loop engine throughput, prefill beside verify on and off",
    )
    ap.add_argument("--prompt", type=int, default=128, help="--closed-loop: prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=128, help="--closed-loop: generated tokens per request")
    ap.add_argument("--out", default=None, help="--closed-loop: directory for closed_loop_engine_<device>.json")
    args = ap.parse_args()
    if args.closed_loop is not None:
        return closed_loop(args)
    cuda = args.device.startswith("cuda")
    budget = args.context + (args.steps * 3 + 10) * (args.k + 1)  # positions the measured steps can reach
    config = RuntimeConfig(
        k_min=args.k,
        k_max=max(args.k, 1),
        k_initial=args.k,
        adaptive=False,
        schedule=args.schedule,
        pipeline=args.pipeline,
    )
    opts = EngineOptions(
        target=args.target or f"random:{args.shape}",
        draft=args.draft,
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        num_blocks=args.batch * (budget // 16 + 4) + 16,
        max_context=budget + 64,
        graph_buckets=(args.batch,) if cuda else None,
        config=config,
        simulated_acceptance=args.simulated_acceptance,
    )
    engine = Engine(opts)
    router = engine.router
    vocab = router.vocab_size
    for i in range(args.batch):
        router.add_request(
            RequestSpec(
                tuple((100 + j) % vocab for j in range(args.context)),
                max_tokens=budget - args.context,
                stop_at_eos=False,
                request_id=str(i),
            )
        )
    while any(s.status.name != "DECODING" for s in router.sequences()):
        router.step()
    for _ in range(5):
        router.step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lanes = [LaneTimer(router.draft_lane, "draft"), LaneTimer(router.verify_lane, "verify")]
    sync()
    tokens, t0 = 0, time.perf_counter()
    for _ in range(args.steps):
        tokens += sum(len(o.token_ids) for o in router.step())
    sync()
    wall = time.perf_counter() - t0
    in_lanes = sum(t.seconds for t in lanes)
    label = (
        f"SIMULATED acceptance {args.simulated_acceptance}"
        if args.simulated_acceptance is not None
        else "real acceptance"
    )
    print(
        f"# {opts.target} draft {args.draft} k {args.k} {args.schedule} batch {args.batch} context {args.context} "
        f"({label}): {wall / args.steps * 1e3:.3f} ms per step, {tokens / wall:.0f} tok/s (unprofiled)"
    )
    overlap = args.pipeline and args.schedule == "pdv"  # draft calls run beside verify calls
    outside = (
        "router outside them: not separable (the calls overlap)"
        if overlap
        else f"router outside them {(wall - in_lanes) / args.steps * 1e3:.3f} ms per step"
    )
    print(
        f"# host: inside lane calls {in_lanes / args.steps * 1e3:.3f} ms per step (draft "
        f"{lanes[0].seconds / args.steps * 1e3:.3f}, verify {lanes[1].seconds / args.steps * 1e3:.3f}); {outside}"
    )
    if cuda:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                router.step()
            sync()
            profiled_wall = time.perf_counter() - t0
        events = prof.key_averages()
        busy_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"# GPU busy (sum of kernel times / wall, profiled): {busy_us / 1e6 / profiled_wall * 100:.0f} %")
        print(events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    host = cProfile.Profile()
    host.enable()
    for _ in range(args.steps):
        router.step()
    host.disable()
    print("# host time per function (cProfile, all steps):")
    pstats.Stats(host).sort_stats("tottime").print_stats(22)


def closed_loop(args) -> None:
    import json

    cuda = args.device.startswith("cuda")
    per_request = args.prompt + args.max_tokens + 8 * (args.k + 1)
    config = RuntimeConfig(
        k_min=0,
        k_max=max(args.k, 1),
        k_initial=args.k,
        adaptive=args.k > 0,
        schedule=args.schedule,
        pipeline=args.pipeline,
    )
    opts = EngineOptions(
        target=args.target or f"random:{args.shape}",
        draft=args.draft,
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        num_blocks=args.batch * (per_request // 16 + 2) + 16,
        max_context=per_request + 16,
        graph_buckets=tuple(sorted({1 << i for i in range(args.batch.bit_length())} | {args.batch})) if cuda else None,
        config=config,
        simulated_acceptance=args.simulated_acceptance,
    )
    engine = Engine(opts)
    router, vocab, made = engine.router, engine.router.vocab_size, [0]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def submit() -> None:
        n = made[0] = made[0] + 1
        ids = tuple((100 + 7 * n + 13 * j) % (vocab - 100) + 50 for j in range(args.prompt))
        router.add_request(RequestSpec(ids, max_tokens=args.max_tokens, stop_at_eos=False, request_id=str(n)))

    def run(seconds: float) -> tuple[int, int, float]:
        tokens, steps, t0 = 0, 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for out in router.step():
                tokens += len(out.token_ids)
                if out.finished:
                    submit()
            steps += 1
        sync()
        return tokens, steps, time.perf_counter() - t0

    for _ in range(args.batch):
        submit()
    label = (
        f"SIMULATED acceptance {args.simulated_acceptance}"
        if args.simulated_acceptance is not None
        else "real acceptance"
    )
    rows = []
    for overlap in (True, False, True):  # on twice: the first pass also warms up
        router.overlap_prefill = overlap
        run(min(args.closed_loop, 3.0))  # settle (requests of the previous setting drain through)
        tokens, steps, wall = run(args.closed_loop)
        rows.append(
            {
                "target": opts.target,
                "draft": args.draft,
                "k": args.k,
                "schedule": args.schedule,
                "acceptance": label,
                "batch": args.batch,
                "prompt": args.prompt,
                "max_tokens": args.max_tokens,
                "prefill_beside_verify": overlap,
                "output_tok_s": round(tokens / wall, 1),
                "steps_per_s": round(steps / wall, 1),
                "tokens_per_step": round(tokens / max(steps, 1), 2),
            }
        )
        print(json.dumps(rows[-1]))
    router.close()
    write_result(
        args.out,
        "closed_loop_engine",
        {
            **metadata(),
            "label": "engine alone (no gRPC), closed loop; prefill beside the verify call on, off, on",
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
