"""Scratch (issue 19v): the target's greedy answers on CPU, as the benches make them.

  eval   : the 96 prompts of bench/prompts/draft_acceptance.jsonl, chat template, 128 new tokens, temperature 0
           (what bench/eagle_acceptance.py's engine generates: RequestSpec(prompt, max_tokens=128), greedy, EOS stops)
  own    : a DIFFERENT prompt set, distill.data.own_prompts(..., requests) with a seed other than the
           committed head's (0), answered greedily with --gen-tokens (the distill data recipe), for vocabulary counts.
Writes JSON lines {"family", "prompt_ids", "answer_ids"}.
"""

import argparse
import json
import pathlib
import sys
import time

from verifypd.distill.data import encode, generate, own_prompts, read_prompts
from verifypd.distill.evaluate import prompt_families
from verifypd.engine.draft_length import RuntimeConfig
from verifypd.engine.types import RequestSpec
from verifypd.local_engine import Engine, EngineOptions, load_models

ap = argparse.ArgumentParser()
ap.add_argument("what", choices=("eval", "own"))
ap.add_argument("--out", required=True)
ap.add_argument("--count", type=int, default=400)
ap.add_argument("--seed", type=int, default=7)
ap.add_argument("--requests", default="seeds")
ap.add_argument("--gen-tokens", type=int, default=256)
args = ap.parse_args()
t0 = time.monotonic()
options = EngineOptions(
    target="smollm2",
    draft="none",
    device="cpu",
    max_context=640,
    max_running=64,
    config=RuntimeConfig(k_min=0, k_max=0, k_initial=0),
)
engine = Engine(options, models=load_models(options))
codec = engine.codec
rows = []
if args.what == "eval":
    path = "bench/prompts/draft_acceptance.jsonl"
    prompts, families = read_prompts(path), prompt_families(path)
    ids = [encode(codec, p) for p in prompts]
    done = engine.generate([RequestSpec(tuple(p), max_tokens=128, request_id=f"e{i}") for i, p in enumerate(ids)])
    rows = [
        {"family": f, "prompt_ids": p, "answer_ids": list(done[f"e{i}"].token_ids)}
        for i, (f, p) in enumerate(zip(families, ids))
    ]
else:
    prompts = own_prompts(engine, codec, args.count, args.seed, args.requests)
    prompts = [p[-256:] for p in prompts]
    answers = generate(engine, prompts, args.gen_tokens, 0.0, args.seed + 10**6)
    rows = [{"family": "own", "prompt_ids": p, "answer_ids": a} for p, a in zip(prompts, answers)]
pathlib.Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
n = sum(len(r["answer_ids"]) for r in rows)
print(f"{len(rows)} rows, {n} answer tokens, {time.monotonic() - t0:.0f} s", file=sys.stderr)
