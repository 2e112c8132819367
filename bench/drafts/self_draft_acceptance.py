"""Acceptance rate of the self-speculative draft (target's first N layers + final norm + head) on
the embedded SmolLM2-135M-Instruct, greedy, fixed k. Real model, real acceptance (no simulation).

    python bench/drafts/self_draft_acceptance.py --layers 6,12,18,24 --k 4 --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))  # engine_throughput
from engine_throughput import git_revision

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.engine import Engine, EngineOptions
from verifypd.model.build import Models
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of Python.",
    "How do I boil an egg?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="6,9,12,15,18,21,24,27")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="self_draft_acceptance.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    target = load_model("smollm2", device, torch.float32, 2048)
    codec_tok = target.tokenizer
    prompts = [
        tuple(
            codec_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for p in PROMPTS
    ]
    rows = []
    for n in [int(x) for x in args.layers.split(",")]:
        models = Models(
            target,
            PagedLlama(target.shape, target.weights),
            PagedLlama(target.shape, target.weights, num_layers=n),
            f"self:{n}",
            device,
            torch.float32,
        )
        engine = Engine(
            EngineOptions(
                num_blocks=512, device=args.device, config=RuntimeConfig(k_initial=args.k, k_max=args.k, adaptive=False)
            ),
            models=models,
        )
        done = engine.generate(
            [RequestSpec(p, max_tokens=args.max_tokens, request_id=str(i)) for i, p in enumerate(prompts)]
        )
        drafted = sum(c.usage["draft_tokens"] for c in done.values())
        accepted = sum(c.usage["accepted_tokens"] for c in done.values())
        rows.append(
            {
                "draft": f"self:{n}",
                "k": args.k,
                "drafted": drafted,
                "accepted": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": " ".join(["python"] + sys.argv),
        "git_revision": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "device": args.device,
        "target": "smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized fp32)",
        "greedy": True,
        "prompts": PROMPTS,
        "max_tokens": args.max_tokens,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
