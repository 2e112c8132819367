"""fp8 KV cache (`--kv-cache-dtype fp8`): quality on a real model, decode speed and pool capacity on a 7B shape.

(a) Quality, REAL weights: the model at --target (default: the embedded SmolLM2-135M-Instruct GGUF) in
    --dtype, once with its KV pool in --dtype and once in float8_e4m3fn (static scale 1.0, saturating:
    model.kv_quant), same weights. Per prompt (bench/prompts/draft_acceptance.jsonl, the first --prompts,
    chat template applied):
      1. greedy decoding of --max-tokens tokens with each KV dtype -> `greedy_identical` (share of
         prompts with equal outputs) and `greedy_prefix_agreement` (mean share of tokens before the
         first difference);
      2. both over the dtype-KV sequence (teacher forcing: one prefill of prompt + output) ->
         `top1_agreement` (same argmax) and `mean_kl` = KL(dtype KV || fp8 KV) of the next-token
         distributions (float32, nats), averaged over the generated positions;
      3. `kv_absmax`: the largest |K| and |V| the dtype-KV runs stored, and the share of stored values
         past e4m3's 448 (those saturate with scale 1.0).
(b) Speed and capacity, RANDOM WEIGHTS with the Llama-2-7B shape (timing does not depend on values):
      * `tokens_per_s` of one decode step of B sequences (--batches, default 64 and 128), each with
        --context tokens of KV already in the paged pool, through `PagedLlama.forward` captured in one
        CUDA graph and replayed --iters times (as the serving runner does), KV in bf16 vs fp8;
      * `pool`: the target pool model.build.make_pools really allocates after the weights (free memory x
        --gpu-memory-fraction, sized by the KV element size) -> blocks, tokens, and
        `max_requests_at_2048` = requests of 2,048 tokens of context the pool admits at once.

    python bench/engine/fp8_kv.py --out bench/results/fp8_kv_h100.json                  # GPU, < 4 min
    python bench/engine/fp8_kv.py --device cpu --smoke --out /tmp/fp8_kv_cpu.json      # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fp8_quality, fp8_throughput
from bench_meta import metadata
from fp8_quality import Sequence
from fp8_throughput import timed_ms

from verifypd.domain.options import EngineOptions
from verifypd.model.build import Models, make_pools
from verifypd.model.fp8 import FP8, FP8_MAX
from verifypd.model.kv_quant import kv_cache_dtype
from verifypd.model.layout import TokenRun, build_layout, to_device
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import RANDOM_SHAPES, load_model, random_model

PROMPTS = pathlib.Path(__file__).resolve().parents[1] / "prompts" / "draft_acceptance.jsonl"
BLOCK = 16
CAPACITY_CONTEXT = 2048
SMOKE_SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=4, vocab_size=1024)


def quality(args, device: torch.device, dtype: torch.dtype) -> dict:
    loaded = load_model(args.target, device, dtype, 2048)
    model, tok = PagedLlama(loaded.shape, loaded.weights), loaded.tokenizer
    fp8 = kv_cache_dtype("fp8", dtype, device)
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()][: args.prompts]
    identical, prefix, top1, kl, positions = 0, 0.0, 0, 0.0, 0
    s = loaded.shape
    per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim  # K and V elements a token stores
    absmax, stored, saturated = [0.0, 0.0], 0, 0
    for row in rows:
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        max_len = len(ids) + args.max_tokens + 1
        ref_seq = Sequence(model, max_len, dtype)
        ref_out = ref_seq.greedy(ids, args.max_tokens)
        written = ref_seq.pool.abs().float()  # unwritten slots are 0
        absmax = [max(absmax[i], float(written[i].max())) for i in (0, 1)]
        stored += (len(ids) + args.max_tokens - 1) * per_token  # the last output token is never fed
        saturated += int((written > FP8_MAX).sum())
        fp8_out = Sequence(model, max_len, fp8).greedy(ids, args.max_tokens)
        identical += ref_out == fp8_out
        same = next((i for i, (a, b) in enumerate(zip(ref_out, fp8_out, strict=True)) if a != b), args.max_tokens)
        prefix += same / args.max_tokens
        seq = ids + ref_out
        # Logits predicting each generated token: rows len(ids) - 1 .. len(seq) - 2.
        ref_logits, fp8_logits = (
            Sequence(model, max_len, kv).forward(seq[:-1], 0)[len(ids) - 1 :] for kv in (dtype, fp8)
        )
        p_log, q_log = ref_logits.log_softmax(-1), fp8_logits.log_softmax(-1)
        kl += float((p_log.exp() * (p_log - q_log)).sum(-1).sum())
        top1 += int((ref_logits.argmax(-1) == fp8_logits.argmax(-1)).sum())
        positions += ref_logits.shape[0]
    del model, loaded
    return dict(
        model=f"{args.target} (REAL weights)",
        model_dtype=str(dtype).removeprefix("torch."),
        attention="triton" if device.type == "cuda" else "reference",
        prompts=len(rows),
        prompt_file=str(PROMPTS.relative_to(PROMPTS.parents[2])),
        max_tokens=args.max_tokens,
        greedy_identical=round(identical / len(rows), 4),
        greedy_prefix_agreement=round(prefix / len(rows), 4),
        top1_agreement=round(top1 / positions, 4),
        mean_kl=round(kl / positions, 6),
        positions=positions,
        kv_absmax={"k": round(absmax[0], 3), "v": round(absmax[1], 3)},
        kv_saturated_share=saturated / max(stored, 1),
        layers_heads_dim=[s.num_layers, s.num_kv_heads, s.head_dim],
    )


def step_ms(model: PagedLlama, kv_dtype: torch.dtype, batch: int, context: int, iters: int) -> float:
    """Milliseconds of one decode step of `batch` sequences at `context` tokens each (KV in `kv_dtype`)."""
    s = model.shape
    device = model.weights.embed.device
    per_seq = (context + 1 + BLOCK - 1) // BLOCK
    blocks = batch * per_seq + 1
    pool = torch.empty(2, s.num_layers, blocks, BLOCK, s.num_kv_heads, s.head_dim, dtype=kv_dtype, device=device)
    for kv in range(2):  # real numbers for the attention to read, a layer at a time (no bf16 copy of it all)
        for layer in range(s.num_layers):
            pool[kv, layer].copy_(torch.randn(pool.shape[2:], device=device))
    runs = [TokenRun([7 + b % 100], context, tuple(range(b * per_seq, (b + 1) * per_seq))) for b in range(batch)]
    layout = to_device(build_layout(runs, BLOCK), device)
    index = torch.arange(batch, device=device)
    out = torch.empty(batch, s.vocab_size, dtype=model.weights.embed.dtype, device=device)

    def step():
        model.forward(pool, layout, index, out)

    return timed_ms(step, device, iters)


def pool_capacity(loaded, model: PagedLlama, device: torch.device, kv_dtype: torch.dtype, fraction: float) -> dict:
    """The target pool make_pools allocates after the weights, and the 2,048-token requests it admits."""
    models = Models(loaded, model, None, "none", device, torch.bfloat16, kv_dtype=kv_dtype)
    pool, _ = make_pools(models, EngineOptions(block_size=BLOCK, gpu_memory_fraction=fraction))
    g = pool.geometry
    row = dict(
        blocks=g.num_blocks,
        tokens=g.num_blocks * BLOCK,
        pool_gib=round(g.num_blocks * g.bytes_per_block(kv_dtype) / 2**30, 2),
        max_requests_at_2048=g.num_blocks // -(-CAPACITY_CONTEXT // BLOCK),
        summary=pool.summary(),
    )
    pool.close()
    del pool
    return row


def speed(args, device: torch.device) -> dict:
    name, batches = args.model, [int(b) for b in args.batches.split(",")]
    if args.smoke:
        RANDOM_SHAPES["fp8-kv-smoke"] = SMOKE_SHAPE
        name, batches = "fp8-kv-smoke", [2, 4]
    loaded = random_model(name, device, torch.bfloat16, max(args.context, CAPACITY_CONTEXT) + 64)
    model = PagedLlama(loaded.shape, loaded.weights)
    rows, capacity = [], {}
    for kv_name in ("auto", "fp8"):
        kv_dtype = kv_cache_dtype(kv_name, torch.bfloat16, device)
        label = "bf16" if kv_name == "auto" else "fp8"
        # CPU: make_pools takes 1 GiB worth of blocks (no free-memory reading there).
        capacity[label] = pool_capacity(loaded, model, device, kv_dtype, args.gpu_memory_fraction)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for batch in batches:
            ms = step_ms(model, kv_dtype, batch, args.context, args.iters)
            rows.append(dict(kv=label, batch=batch, step_ms=round(ms, 4), tokens_per_s=round(batch / ms * 1e3, 1)))
            print(json.dumps(rows[-1]), flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    by = {(r["kv"], r["batch"]): r for r in rows}
    return dict(
        weights_note="RANDOM WEIGHTS (timing and capacity only)",
        model=f"random:{name}",
        model_dtype="bfloat16",
        context=args.context,
        block_size=BLOCK,
        iters=args.iters,
        cuda_graphs=device.type == "cuda",
        rows=rows,
        speedup_fp8_over_bf16={
            str(b): round(by[("bf16", b)]["step_ms"] / by[("fp8", b)]["step_ms"], 3) for b in batches
        },
        gpu_memory_fraction=args.gpu_memory_fraction,
        pool=capacity,
        capacity_ratio_fp8_over_bf16=round(capacity["fp8"]["blocks"] / max(capacity["bf16"]["blocks"], 1), 3),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2", help="the quality model: a GGUF path, a model dir, or smollm2")
    ap.add_argument("--prompts", type=int, default=64, help="the first N prompts (the file holds 96)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument(
        "--model", default="llama-2-7b", help="the speed model: a random: shape (model.loader.RANDOM_SHAPES)"
    )
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--context", type=int, default=512, help="KV tokens per sequence before the timed step")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.85, help="of free memory, as `serve`'s default")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="2 prompts x 4 tokens, a tiny speed shape: checks the script")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.max_tokens, args.context, args.iters = 2, 4, 64, 2
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" or args.dtype != "bfloat16" else torch.float32
    t0 = time.perf_counter()
    result = dict(metadata(), benchmark="fp8_kv", kv_fp8=f"{FP8}, static per-tensor scale 1.0, saturating")
    result["quality"] = quality(args, device, dtype)
    print(json.dumps(result["quality"]), flush=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["speed"] = speed(args, device)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    q, sp = result["quality"], result["speed"]
    print(
        f"greedy identical {q['greedy_identical']:.2%}, KL {q['mean_kl']:.2e}; tok/s x{sp['speedup_fp8_over_bf16']}; "
        f"pool x{sp['capacity_ratio_fp8_over_bf16']} -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
