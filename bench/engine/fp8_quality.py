"""fp8 quality on the embedded SmolLM2-135M-Instruct (REAL weights: its GGUF through transformers, in
--dtype): the model with `--quantization fp8` against itself in --dtype, on held-out prompts.

Per prompt (bench/prompts/draft_acceptance.jsonl, the first --prompts, chat template applied):
  1. greedy decoding of --max-tokens tokens by the reference model and by the fp8 model
     -> `greedy_identical` (share of prompts whose outputs are equal) and `greedy_prefix_agreement`
        (mean share of tokens before the first difference);
  2. both models over the reference's sequence (teacher forcing), at each generated position
     -> `top1_agreement` (same argmax) and `mean_kl` = KL(reference || fp8) of the next-token
        distributions (float32, nats), averaged over positions.

    python bench/engine/fp8_quality.py --out bench/results/fp8_quality_h200.json        # GPU, bf16
    python bench/engine/fp8_quality.py --smoke --out /tmp/fp8_quality_cpu.json         # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_meta import metadata

from verifypd.model.layout import TokenRun, build_layout, to_device
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import load_model

PROMPTS = pathlib.Path(__file__).resolve().parents[1] / "prompts" / "draft_acceptance.jsonl"
BLOCK = 16


class Sequence:
    """One sequence's forward passes through a model and a private pool (of element type `kv_dtype`;
    None: the model's dtype)."""

    def __init__(self, model: PagedLlama, max_len: int, kv_dtype: torch.dtype | None = None):
        s, w = model.shape, model.weights
        self.model, self.device = model, w.embed.device
        self.blocks = tuple(range((max_len + BLOCK - 1) // BLOCK))
        shape = (2, s.num_layers, len(self.blocks), BLOCK, s.num_kv_heads, s.head_dim)
        self.pool = torch.zeros(shape, dtype=kv_dtype or w.embed.dtype, device=self.device)

    def forward(self, tokens: list[int], start: int) -> torch.Tensor:
        """Logits [len(tokens), V] (float32) of `tokens` at positions start.. (earlier ones cached)."""
        batch = to_device(build_layout([TokenRun(tokens, start, self.blocks)], BLOCK), self.device)
        index = torch.arange(len(tokens), device=self.device)
        return self.model.forward(self.pool, batch, index).float()

    def greedy(self, prompt: list[int], new: int) -> list[int]:
        out = [int(self.forward(prompt, 0)[-1].argmax())]
        while len(out) < new:
            out.append(int(self.forward([out[-1]], len(prompt) + len(out) - 1)[0].argmax()))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64, help="the first N prompts (the file holds 96)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--smoke", action="store_true", help="4 prompts, 8 tokens: checks the script")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.max_tokens = 4, 8
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ref = load_model("smollm2", device, dtype, 2048)
    fp8 = load_model("smollm2", device, dtype, 2048, quantization="fp8")
    models = PagedLlama(ref.shape, ref.weights), PagedLlama(fp8.shape, fp8.weights)
    tok = ref.tokenizer
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][: args.prompts]
    identical, prefix, top1, kl, positions = 0, 0.0, 0, 0.0, 0
    for row in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        max_len = len(ids) + args.max_tokens + 1
        outs = [Sequence(m, max_len).greedy(ids, args.max_tokens) for m in models]
        identical += outs[0] == outs[1]
        same = next((i for i, (a, b) in enumerate(zip(*outs, strict=True)) if a != b), args.max_tokens)
        prefix += same / args.max_tokens
        seq = ids + outs[0]
        # Logits predicting each generated token: rows len(ids) - 1 .. len(seq) - 2.
        ref_logits, fp8_logits = (Sequence(m, max_len).forward(seq[:-1], 0)[len(ids) - 1 :] for m in models)
        p_log, q_log = ref_logits.log_softmax(-1), fp8_logits.log_softmax(-1)
        kl += float((p_log.exp() * (p_log - q_log)).sum(-1).sum())
        top1 += int((ref_logits.argmax(-1) == fp8_logits.argmax(-1)).sum())
        positions += ref_logits.shape[0]
    result = dict(
        metadata(),
        benchmark="fp8_quality",
        model="smollm2 (embedded SmolLM2-135M-Instruct, real weights)",
        reference_dtype=args.dtype,
        fp8="--quantization fp8: projections fp8 per output channel, activations per token; "
        "embeddings, norms, lm_head in the reference dtype",
        prompts=len(rows),
        prompt_file=str(PROMPTS.relative_to(PROMPTS.parents[2])),
        max_tokens=args.max_tokens,
        greedy_identical=round(identical / len(rows), 4),
        greedy_prefix_agreement=round(prefix / len(rows), 4),
        top1_agreement=round(top1 / positions, 4),
        mean_kl=round(kl / positions, 6),
        positions=positions,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        json.dumps({k: result[k] for k in ("greedy_identical", "greedy_prefix_agreement", "top1_agreement", "mean_kl")})
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
