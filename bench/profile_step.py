"""Where a decode step's GPU time goes: torch.profiler over plain (k = 0) decode steps of the engine
on random-weight model shapes, top kernels by CUDA time, plus host time per lane call.

    python bench/profile_step.py --shape llama-2-7b --batch 64
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "services"))

from verifypd.engine.draft_length import RuntimeConfig  # noqa: E402
from verifypd.engine.types import RequestSpec  # noqa: E402
from verifypd.local_engine import Engine, EngineOptions  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-2-7b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    opts = EngineOptions(target=f"random:{args.shape}", draft="self:1", device="cuda", dtype="bfloat16",
                         num_blocks=args.batch * (args.context // 16 + 4) + 16, max_context=args.context + 64,
                         graph_buckets=(args.batch,), config=RuntimeConfig(k_min=0, k_max=1, k_initial=0, adaptive=False))
    engine = Engine(opts)
    router = engine.router
    for i in range(args.batch):
        router.add_request(RequestSpec(tuple(range(100, 100 + args.context)), max_tokens=10_000, stop_at_eos=False,
                                       request_id=str(i)))
    while any(s.status.name != "DECODING" for s in router.sequences()):
        router.step()
    for _ in range(5):
        router.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        router.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            router.step()
        torch.cuda.synchronize()
    print(f"# {args.shape} batch {args.batch} context {args.context}: {step_ms:.3f} ms per router step (unprofiled)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    import cProfile
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(args.steps):
        router.step()
    host.disable()
    print("# host time per function (cProfile, all steps):")
    pstats.Stats(host).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
