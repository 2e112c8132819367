"""Does a seed name one output on the GPU? (CUDA graphs on, the serving path's kernels.)

Seeded sampled requests (temperature 0.8, top-p 0.95) on random TinyLlama-shape weights, served
with --draft none (the reference: plain seeded sampling), a self:22 model draft (k 4 fixed and
adaptive) and prompt lookup, each alone and inside a batch of 16 other requests. Counts requests
whose tokens differ from the reference and where they first diverge, per dtype, and the
acceptance rate. fp32 should show 0 mismatches; bf16 may show a few (random weights have many
near-tied logits, and a verify forward of k + 1 tokens rounds differently from a decode forward:
the floating-point caveat of docs/engine.md "Seeds", the same that bench/correctness/determinism.py measures
for greedy). Usage (GPU):

    python bench/correctness/seeded_output_gpu.py --out seeded_output_gpu.json
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
from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.engine import Engine, EngineOptions
from verifypd.model.build import load_models

SUBJECTS, CROWD, MAX_TOKENS = 8, 16, 64


def specs(tag: str, prompts, sampling_seed0: int, temperature: float = 0.8):
    return [
        RequestSpec(
            p,
            max_tokens=MAX_TOKENS,
            stop_at_eos=False,
            request_id=f"{tag}{i}",
            sampling=SamplingParams(temperature=temperature, top_p=0.95, seed=sampling_seed0 + i),
        )
        for i, p in enumerate(prompts)
    ]


def serve(options: EngineOptions, models, k: int, adaptive: bool, crowd: bool) -> tuple[dict, float | None]:
    options.config = RuntimeConfig(k_min=0, k_max=max(k, 1), k_initial=k, adaptive=adaptive)
    engine = Engine(options, models=models)
    subjects = specs("s", random_prompts(SUBJECTS, 32, seed=5), 1000)
    others = specs("c", random_prompts(CROWD, 48, seed=9), 7, temperature=1.0) if crowd else []
    done = engine.generate(others[: CROWD // 2] + subjects + others[CROWD // 2 :])
    drafted = sum(c.usage["draft_tokens"] for c in done.values())
    accepted = sum(c.usage["accepted_tokens"] for c in done.values())
    return {r: c.token_ids for r, c in done.items() if r.startswith("s")}, accepted / drafted if drafted else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="seeded_output_gpu.json")
    args = ap.parse_args()
    rows = []
    for dtype in ("float32", "bfloat16"):
        for draft in ("none", "self:22", "ngram"):
            options = EngineOptions(
                target="random:tinyllama-1.1b",
                draft=draft,
                device="cuda",
                dtype=dtype,
                num_blocks=1024,
                max_context=256,
            )
            models = load_models(options)
            if draft == "none":
                reference, _ = serve(options, models, 0, False, crowd=False)
                cases = [(0, False, True)]
            else:
                cases = [(4, False, False), (4, False, True), (4, True, True)]
            for k, adaptive, crowd in cases:
                out, rate = serve(options, models, k, adaptive, crowd)
                first = [
                    next((n for n, (a, b) in enumerate(zip(out[r], reference[r], strict=False)) if a != b), None)
                    for r in sorted(reference)
                ]
                rows.append(
                    {
                        "dtype": dtype,
                        "draft": draft,
                        "k": k,
                        "adaptive": adaptive,
                        "crowd": crowd,
                        "acceptance_rate": rate,
                        "mismatched_requests": sum(f is not None for f in first),
                        "first_divergence": first,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            del models
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"git_revision": git_revision(), "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
