"""Decode throughput of the verifypd engine vs transformers `generate`, same GPU, same run.

Target: a real model *shape* with random weights (bf16). Draft = the target itself ("self:<all
layers>", separate KV pool), so acceptance is ~1 by construction (measured and reported, not
assumed). Each batch runs B requests with a random prompt of --prompt-len tokens and exactly
--gen-len generated tokens (EOS ignored). tok/s = B * gen_len / wall time from the first step to
the last token (prefill included), after a warm-up run at the same batch.

    python bench/engine_throughput.py --shape llama-2-7b --batches 1,16,64 --out results.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "services"))

from verifypd.engine.draft_length import RuntimeConfig  # noqa: E402
from verifypd.engine.types import RequestSpec  # noqa: E402
from verifypd.local_engine import Engine, EngineOptions, load_models  # noqa: E402
from verifypd.model.loader import RANDOM_SHAPES  # noqa: E402


def git_revision() -> str:
    if os.environ.get("VERIFYPD_GIT_REV"):
        return os.environ["VERIFYPD_GIT_REV"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def random_prompts(batch: int, length: int, seed: int) -> list[tuple[int, ...]]:
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(100, 31000, (length,), generator=gen).tolist()) for _ in range(batch)]


def run_ours(engine: Engine, prompts, gen_len: int) -> dict:
    router = engine.router
    for i, p in enumerate(prompts):
        router.add_request(RequestSpec(p, max_tokens=gen_len, stop_at_eos=False, request_id=f"b{i}"))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    drafted = accepted = produced = steps = 0
    while router.has_work():
        steps += 1
        for out in router.step():
            produced += len(out.token_ids)
            if out.finished:
                drafted += out.stats.draft_tokens
                accepted += out.stats.accepted_tokens
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"tokens": produced, "seconds": seconds, "tok_per_s": produced / seconds, "steps": steps,
            "acceptance_rate": accepted / drafted if drafted else None}


def run_transformers(model, prompts, gen_len: int) -> dict:
    ids = torch.tensor(prompts, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                         do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tokens": produced, "seconds": seconds, "tok_per_s": produced / seconds}


def hf_random_model(shape_name: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = RANDOM_SHAPES[shape_name]
    config = LlamaConfig(vocab_size=32000, hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                         num_hidden_layers=d["num_layers"], num_attention_heads=d["num_heads"],
                         num_key_value_heads=d["num_kv_heads"], max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-2-7b", choices=sorted(RANDOM_SHAPES))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num-blocks", type=int, default=1400)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--out", default="engine_throughput.json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "git_revision": git_revision(),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
               "target_shape": args.shape, "weights": "random (bf16)", "prompt_len": args.prompt_len,
               "gen_len": args.gen_len, "draft": "target itself (self:all layers), acceptance ~1 by construction",
               "runs": []}
    if not args.skip_transformers:
        import transformers

        results["transformers"] = transformers.__version__
        model = hf_random_model(args.shape)
        for b in batches:
            prompts = random_prompts(b, args.prompt_len, seed=b)
            run_transformers(model, prompts, 8)  # warm-up
            r = run_transformers(model, prompts, args.gen_len)
            results["runs"].append({"system": "transformers.generate", "batch": b, **r})
            print(json.dumps(results["runs"][-1]), flush=True)
        del model
        torch.cuda.empty_cache()
    layers = RANDOM_SHAPES[args.shape]["num_layers"]
    options = EngineOptions(target=f"random:{args.shape}", draft=f"self:{layers}", device="cuda", dtype="bfloat16",
                            num_blocks=args.num_blocks, max_context=args.prompt_len + args.gen_len + 64)
    models = load_models(options)
    for k in (0, args.k):
        options.config = RuntimeConfig(k_min=0, k_max=max(k, 1), k_initial=k, adaptive=False)
        engine = Engine(options, models=models)
        for b in batches:
            prompts = random_prompts(b, args.prompt_len, seed=b)
            run_ours(engine, prompts, 8)  # warm-up
            r = run_ours(engine, prompts, args.gen_len)
            results["runs"].append({"system": f"verifypd k={k}", "batch": b, **r})
            print(json.dumps(results["runs"][-1]), flush=True)
        del engine
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
