"""The router's own host work per decode step: the real Router (planning, item building, commit,
detokenizing, the pdv worker thread) over lanes that do no model work, so every microsecond
measured is bookkeeping that a GPU step pays on top of its lane calls. Runs on the CPU.

    python bench/engine/router_host_overhead.py --batch 1,16,64,128 --out bench/results

The lanes answer at once: prefill returns a token, draft proposes k tokens, verify accepts each
draft with a seeded Bernoulli(alpha) (SIMULATED acceptance); text is decoded as for the GPU
sweeps' random-weight models (ids as text). What is not included: the lanes' own host work (tensor
preparation, graph replay launch) and gRPC streaming to clients.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench_meta

from bench_meta import metadata, write_result

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.lanes import DraftOutput, LaneInfo, PoolInfo, PrefillOutput, VerifyOutput
from verifypd.domain.requests import RequestSpec
from verifypd.domain.tokenizer import TextCodec
from verifypd.router.router import Router

VOCAB, BLOCK = 32_000, 16


class InstantLanes:
    """All three lanes in one object; no model work. Verify accepts draft i with probability alpha.
    `verify_s`: each verify call waits that long without holding the GIL, as a GPU sync does."""

    def __init__(self, num_blocks: int, alpha: float, seed: int = 0, verify_s: float = 0.0):
        self.alpha, self.rng, self.verify_s = alpha, random.Random(seed), verify_s
        self.pools = (PoolInfo("t", 1, "target", 1, num_blocks, BLOCK), PoolInfo("d", 1, "draft", 1, num_blocks, BLOCK))

    def describe(self) -> LaneInfo:
        return LaneInfo("all", self.pools, VOCAB, 1 << 16)

    def prefill(self, items):
        return [PrefillOutput(i.request_id, 7 if i.sample_first else None) for i in items]

    def draft(self, items):
        return [DraftOutput(i.request_id, [11] * i.k) for i in items]

    def verify(self, items):
        if self.verify_s:
            time.sleep(self.verify_s)
        out = []
        for i in items:
            k, m = len(i.draft_tokens), 0
            while m < k and self.rng.random() < self.alpha:
                m += 1
            out.append(VerifyOutput(i.request_id, m, [11] * m + [13]))
        return out


def measure(
    schedule: str, pipeline: bool, batch: int, k: int, alpha: float, steps: int, profile: cProfile.Profile | None = None
) -> dict:
    context = 256 + steps * (k + 1) + 64
    lanes = InstantLanes(batch * (context // BLOCK + 2) + 16, alpha)
    config = RuntimeConfig(k_min=k, k_max=k, k_initial=k, adaptive=False, schedule=schedule, pipeline=pipeline)
    # Random-weight models (the GPU sweeps) have no tokenizer: their text is the ids, space-separated.
    router = Router(
        lanes, lanes, lanes, decode=TextCodec(None).decode, eos_token_ids=(2,), config=config, max_running=batch
    )
    for i in range(batch):
        router.add_request(
            RequestSpec(tuple(range(3, 131)), max_tokens=context - 160, stop_at_eos=False, request_id=f"r{i}")
        )
    while any(s.status.name != "DECODING" for s in router.sequences()):
        router.step()
    for _ in range(10):  # warm: pdv groups formed, worker thread started
        router.step()
    tokens = 0
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.token_ids) for o in router.step())
    seconds = time.perf_counter() - t0
    if profile is not None:
        profile.disable()
    router.close()
    return {
        "schedule": schedule,
        "pipelined": pipeline and schedule == "pdv",
        "batch": batch,
        "k": k,
        "steps": steps,
        "tokens": tokens,
        "host_us_per_step": round(seconds / steps * 1e6, 1),
        "host_us_per_token": round(seconds / tokens * 1e6, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,16,64,128")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.7, help="SIMULATED per-token acceptance")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", action="store_true", help="print the top functions (cumulative) of each point")
    ap.add_argument("--out", default=None, help="directory for router_host_overhead_<host>.json")
    args = ap.parse_args()
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        for schedule, pipeline in (("pd", False), ("pdv", True)):
            prof = cProfile.Profile() if args.profile else None
            row = measure(schedule, pipeline, batch, args.k, args.alpha, args.steps, prof)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if prof is not None:
                pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    result = {**metadata(), "label": f"SIMULATED acceptance alpha={args.alpha}; lanes do no work", "rows": rows}
    write_result(args.out, "router_host_overhead", result)


if __name__ == "__main__":
    main()
