"""An EAGLE-3 head in the layout its authors publish, at the 8B shape, served through `--draft eagle:DIR`.

The target is a random-weight Llama-3.1-8B shape (loader.RANDOM_SHAPES["llama-3.1-8b"]: hidden 4096, 32
layers, 32 heads, 8 kv heads, intermediate 14336, vocab 128256, rope theta 500000 with llama3 scaling).
The head has random weights in the published layout of the official EAGLE-3 releases (as
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): `pytorch_model.bin` in float16 holding fc.weight, midlayer.* (the one
decoder layer, q/k/v and gate/up split, hidden_norm beside input_layernorm), norm.weight,
lm_head.weight over a 32000-token draft vocabulary, d2t (draft id -> target id offset) and t2d (a bool
mask over the target vocabulary); `config.json` with architectures ["LlamaForCausalLMEagle3"],
draft_vocab_size, and none of our own keys (no target_hidden_size, no eagle_config: the loader's
defaults pick the aux layers). It is loaded the way `verifypd serve --draft eagle:DIR` loads one.

Measured: the head's load time (load_eagle_head alone) and each engine's start-up, then greedy output of
a few prompts with the head (k = 4) against `--no-speculation` (k = 0, no draft): lossless means equal
tokens (exit status 1 otherwise); tok/s of both. Random weights: the head's acceptance is ~0 (tokens per
step recorded, not a quality figure). float32 by default (see --dtype); the engines run one after the
other (one 8B model in memory at a time).

    python bench/drafts/eagle3_bin_head.py --device cuda --out bench/results/eagle3_bin_head_h100.json
    python bench/drafts/eagle3_bin_head.py --device cpu --smoke --out /tmp/eagle3_bin_head_smoke.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # bench_meta

import torch

SHAPE = "llama-3.1-8b"
SMOKE_SHAPE = "tiny-llama-3.1"  # the same features at a CPU size (registered by main in --smoke)
PUBLISHED_DRAFT_VOCAB = 32000


def published_config(config, torch_dtype: str = "float16") -> dict:
    """config.json as the official EAGLE-3 Llama 3.1 8B head publishes its keys (no verifypd-only keys)."""
    raw = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
        "transformers_version": "4.28.1",
        "use_cache": True,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
    }
    if config.rope_scaling:
        raw["rope_scaling"] = dict(config.rope_scaling)
    return raw


def write_published_head(path: pathlib.Path, target_shape, draft_vocab: int, seed: int = 0) -> dict:
    """A random head for `target_shape` in the published layout under `path`; returns its state dict.
    The draft vocabulary is a random sorted subset of the target's (published heads keep the most
    frequent tokens), so d2t offsets are not all zero."""
    from verifypd.model.eagle_head import head_state_dict, random_eagle_head

    config, weights = random_eagle_head(target_shape, seed=seed, draft_vocab=draft_vocab, std=0.02)
    gen = torch.Generator().manual_seed(seed + 1)
    weights.draft_to_target = torch.randperm(target_shape.vocab_size, generator=gen)[:draft_vocab].sort().values
    state = {k: v.half() if v.is_floating_point() else v for k, v in head_state_dict(config, weights).items()}
    path.mkdir(parents=True, exist_ok=True)
    torch.save(state, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(published_config(config), indent=2) + "\n")
    return state


def register_smoke_shape() -> None:
    from verifypd.model.loader import RANDOM_SHAPES

    small = dict(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=32
    )
    RANDOM_SHAPES[SMOKE_SHAPE] = {**RANDOM_SHAPES[SHAPE], **small}


def run_engine(target: str, draft: str, k: int, args, prompts: list[list[int]]) -> dict:
    from verifypd.domain.config import RuntimeConfig
    from verifypd.domain.requests import RequestSpec
    from verifypd.engine import Engine, EngineOptions

    config = RuntimeConfig(k_min=0, k_max=max(k, 1), k_initial=k, adaptive=False)
    t0 = time.perf_counter()
    engine = Engine(
        EngineOptions(
            target=target,
            draft=draft,
            device=args.device,
            dtype=args.dtype,
            num_blocks=args.num_blocks,
            max_context=args.max_context,
            config=config,
            prefix_cache=False,
            cuda_graphs=args.device != "cpu",
            graph_buckets=(1, 2, 4, 8),  # batches up to --prompts: fewer graphs, a shorter start-up
        )
    )
    start_s = time.perf_counter() - t0

    def specs(tag: str):
        return [
            RequestSpec(tuple(p), max_tokens=args.max_tokens, stop_at_eos=False, request_id=f"{tag}{i}")
            for i, p in enumerate(prompts)
        ]

    engine.generate(specs("warm"))  # first calls (graphs of other shapes, allocator)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = engine.generate(specs("run"))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = [done[f"run{i}"].token_ids for i in range(len(prompts))]
    chunks = sum(len(done[f"run{i}"].applied_k) for i in range(len(prompts)))  # one per step a request took part in
    engine.router.close()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "draft": draft,
        "k": k,
        "startup_s": round(start_s, 3),
        "generate_s": round(seconds, 4),
        "tok_per_s": round(sum(map(len, tokens)) / seconds, 2),
        "tokens_per_step": round(sum(map(len, tokens)) / chunks, 3),
        "tokens": tokens,
    }


def main() -> None:
    from bench_meta import metadata

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    # float32 by default: random weights give near-tied logits, and bf16 GEMMs of different row
    # counts (a k + 1 verify against a 1-token decode) may round a near tie either way; in float32
    # the equality check tests the speculation, not the rounding. --dtype bfloat16 for bf16 tok/s.
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--smoke", action="store_true", help=f"a tiny shape with the same features ({SMOKE_SHAPE})")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=256)  # 4 prompts x 128 positions need ~40
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if min(args.prompts, args.prompt_len, args.max_tokens, args.k) < 1:
        ap.error("--prompts, --prompt-len, --max-tokens and --k must be >= 1")
    shape_name = SHAPE
    draft_vocab = PUBLISHED_DRAFT_VOCAB
    if args.smoke:
        register_smoke_shape()
        shape_name, draft_vocab = SMOKE_SHAPE, 1000
        args.max_tokens, args.prompt_len = min(args.max_tokens, 16), min(args.prompt_len, 24)
        args.prompts, args.max_context = min(args.prompts, 2), min(args.max_context, 256)
    from verifypd.model.eagle_head import load_eagle_head
    from verifypd.model.loader import random_model, random_shape

    shape, _ = random_shape(shape_name, args.max_context)
    gen = torch.Generator().manual_seed(7)
    prompts = [
        torch.randint(3, shape.vocab_size, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)
    ]
    target = f"random:{shape_name}"
    with tempfile.TemporaryDirectory() as tmp:
        head_dir = pathlib.Path(tmp) / "EAGLE3-LLaMA3.1-Instruct-8B-random"
        state = write_published_head(head_dir, shape, draft_vocab)
        names = sorted(state)
        device, dtype = torch.device(args.device), getattr(torch, args.dtype)
        loaded = random_model(shape_name, device, dtype, args.max_context)  # the target's embeddings / lm_head
        t0 = time.perf_counter()
        config, _ = load_eagle_head(str(head_dir), loaded.shape, loaded.weights.lm_head, device, dtype)
        if device.type == "cuda":
            torch.cuda.synchronize()
        head_load_s = time.perf_counter() - t0
        del loaded
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        bin_mb = (head_dir / "pytorch_model.bin").stat().st_size / 2**20
        plain = run_engine(target, "none", 0, args, prompts)
        eagle = run_engine(target, f"eagle:{head_dir}", args.k, args, prompts)
    mismatch = [
        next((j for j, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), None if x == y else min(len(x), len(y)))
        for x, y in zip(plain["tokens"], eagle["tokens"], strict=True)
    ]
    result = {
        "metadata": metadata(),
        "target": target,
        "head": {
            "layout": "pytorch_model.bin (float16) + config.json, the published EAGLE-3 names",
            "tensor_names": names,
            "bin_mib": round(bin_mb, 1),
            "draft_vocab_size": config.draft_vocab_size,
            "aux_layer_ids": list(config.aux_layer_ids),
            "load_s": round(head_load_s, 3),
        },
        "weights": "random (target and head): acceptance ~0, not a quality figure",
        "dtype": args.dtype,
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "no_speculation": {k: v for k, v in plain.items() if k != "tokens"},
        "eagle": {k: v for k, v in eagle.items() if k != "tokens"},
        "lossless": all(m is None for m in mismatch),
        "first_mismatch_per_prompt": mismatch,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("head", "no_speculation", "eagle", "lossless")}, indent=2))
    if not result["lossless"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
