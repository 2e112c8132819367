"""A step-by-step trace of the draft-length policy on the embedded model: per step, the batch, the
k decided, the goodputs the policy predicted for every k (from its measured costs and acceptance),
the cost sample recorded, and the wall time and tokens the step really took; also each lane call of
the step (`lanes`: lane, ms, batch; a step that launches the next one ahead holds several) and the
longest input of each draft call (`draft_input_max`: tokens a draft catches up on, > k_max + 1 after
a k = 0 hold: such a step is no cost sample). `--repeats N` traces N runs of the family on one
engine, the policy's state carried from each into the next (as draft_acceptance's repeats).
Diagnostic, not a speed figure: the trace's own bookkeeping adds host time to each step.

    python bench/drafts/policy_trace.py --device cuda --target PATH.gguf --draft eagle:smollm2 \\
        --family chat --batch 16 --max-tokens 128 --out policy_trace.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
from draft_acceptance import load_prompts, make_engine
from engine_throughput import git_revision

import verifypd.router.k_decision as k_decision_module
from verifypd.domain.heap import freeze_startup_heap, thaw_heap
from verifypd.domain.requests import RequestSpec
from verifypd.domain.tokenizer import TextCodec
from verifypd.model.loader import load_model
from verifypd.router.step_context import StepContext


def traced_run(engine, specs: list[RequestSpec]) -> list[dict]:
    steps: list[dict] = []
    current: dict = {}
    original_choose = k_decision_module.choose_batch_k
    original_record = StepContext.record_cost
    original_call_draft = StepContext.call_draft
    observer = engine.router.context.observer
    original_lane_step = observer.on_lane_step

    def choose(config, alphas, costs, batch, hi, **kw):
        k = original_choose(config, alphas, costs, batch, hi, **kw)
        rates = kw.get("rates")
        known = [a for a in alphas if a is not None]
        if known and hi > 0:
            current["predicted"] = [round(g, 1) for g in costs.goodputs(known, hi, batch, rates)]
        current.update(
            batch=batch,
            hi=hi,
            k=k,
            alpha_mean=round(sum(known) / len(known), 3) if known else None,
            alpha_max=round(max(known), 3) if known else None,
            rate_mean=round(sum(rates) / len(rates), 3) if rates else None,
            step_ms={kk: round(costs.step_s(batch, kk) * 1e3, 3) for kk in (0, 1, 2, 4, 8) if kk <= max(hi, 0)},
        )
        return k

    def record(self, sample, seconds):
        current["sample"] = [bool(sample[0]), sample[1], sample[2], round(seconds * 1e3, 3)]
        return original_record(self, sample, seconds)

    def call_draft(self, items):
        current.setdefault("draft_input_max", []).append(max((len(i.input_tokens) for i in items), default=0))
        return original_call_draft(self, items)

    def lane_step(lane, seconds, batch):
        current.setdefault("lanes", []).append([lane, round(seconds * 1e3, 3), batch])
        return original_lane_step(lane, seconds, batch)

    k_decision_module.choose_batch_k = choose
    StepContext.record_cost = record  # type: ignore[method-assign]
    StepContext.call_draft = call_draft  # type: ignore[method-assign]
    observer.on_lane_step = lane_step
    try:
        for s in specs:
            engine.router.add_request(s)
        while engine.router.has_work():
            current.clear()
            t0 = time.perf_counter()
            outs = engine.router.step()
            wall = time.perf_counter() - t0
            steps.append({**current, "wall_ms": round(wall * 1e3, 3), "tokens": sum(len(o.token_ids) for o in outs)})
    finally:
        k_decision_module.choose_batch_k = original_choose
        StepContext.record_cost = original_record  # type: ignore[method-assign]
        StepContext.call_draft = original_call_draft  # type: ignore[method-assign]
        observer.on_lane_step = original_lane_step
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--drafts", default="eagle:smollm2")
    ap.add_argument("--families", default="chat")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--repeats", type=int, default=1, help="traced runs per family on one engine (state carried)")
    ap.add_argument("--out", default="policy_trace.json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(args.target, device, dtype, 2048)
    codec = TextCodec(target.tokenizer)
    rows = load_prompts(args.batch)
    prompts = {
        f: [tuple(codec.encode_chat([{"role": "user", "content": r["prompt"]}])) for r in rs] for f, rs in rows.items()
    }
    runs = []
    for draft in ["none"] + args.drafts.split(","):
        engine = make_engine(target, draft, None, device, dtype)
        for family, ids in prompts.items():  # warm as draft_acceptance --warm-batches does
            engine.generate([RequestSpec(p, max_tokens=32, request_id=f"w-{family}-{i}") for i, p in enumerate(ids)])
        freeze_startup_heap()  # as serve's engine core does once started (domain/heap.py)
        for family, repeat in [(f, r) for f in args.families.split(",") for r in range(args.repeats)]:
            specs = [
                RequestSpec(p, max_tokens=args.max_tokens, request_id=f"{family}-{repeat}-{i}")
                for i, p in enumerate(prompts[family])
            ]
            t0 = time.perf_counter()
            steps = traced_run(engine, specs)
            seconds = time.perf_counter() - t0
            tokens = sum(s["tokens"] for s in steps)
            runs.append(
                {
                    "draft": draft,
                    "family": family,
                    "repeat": repeat,
                    "seconds": seconds,
                    "tokens": tokens,
                    "tok_per_s": tokens / seconds,
                    "steps": steps,
                }
            )
            print(draft, family, repeat, f"{tokens / seconds:.0f} tok/s", len(steps), "steps", flush=True)
        del engine
        thaw_heap()  # this engine's objects are collectable again
    result = {
        "command": " ".join(["python"] + sys.argv),
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "note": "diagnostic trace; each step's bookkeeping adds host time",
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
