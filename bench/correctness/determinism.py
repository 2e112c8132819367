"""Is the engine run-to-run deterministic on the GPU? Same 16 greedy requests, same engine, 3 runs.

Counts requests whose tokens differ from run 1, for bf16 and fp32, k = 0 and k = 4 (draft = target,
random TinyLlama-shape weights, which have many near-tied logits so any numeric wobble shows).
With --deterministic, torch.use_deterministic_algorithms(True) is on (CUBLAS_WORKSPACE_CONFIG set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))  # engine_throughput
from engine_throughput import git_revision, random_prompts

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.engine import Engine, EngineOptions
from verifypd.model.build import load_models


def run(engine, prompts, tag):
    done = engine.generate(
        [RequestSpec(p, max_tokens=64, stop_at_eos=False, request_id=f"{tag}-{i}") for i, p in enumerate(prompts)]
    )
    return [done[f"{tag}-{i}"].token_ids for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--out", default="determinism.json")
    args = ap.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    prompts = random_prompts(16, 64, seed=5)
    rows = []
    for dtype in ("bfloat16", "float32"):
        options = EngineOptions(
            target="random:tinyllama-1.1b", draft="self:22", device="cuda", dtype=dtype, num_blocks=512, max_context=256
        )
        models = load_models(options)
        for k in (0, 4):
            options.config = RuntimeConfig(k_min=0, k_max=max(k, 1), k_initial=k, adaptive=False)
            engine = Engine(options, models=models)
            outs = [run(engine, prompts, f"r{r}") for r in range(3)]
            fresh = Engine(options, models=models)
            outs.append(run(fresh, prompts, "fresh"))
            mism = [sum(a != b for a, b in zip(outs[0], o, strict=False)) for o in outs[1:]]
            rows.append(
                {
                    "dtype": dtype,
                    "k": k,
                    "mismatched_requests_vs_run1": mism,
                    "note": "runs 2,3 same engine; run 4 fresh engine, same weights",
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            del engine, fresh
        del models
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(
            {
                "git_revision": git_revision(),
                "device": torch.cuda.get_device_name(),
                "deterministic_algorithms": args.deterministic,
                "rows": rows,
            },
            f,
            indent=2,
        )


if __name__ == "__main__":
    main()
