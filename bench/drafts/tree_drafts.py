"""Draft trees against chains and plain decoding on the embedded SmolLM2-135M-Instruct with its shipped
EAGLE head (`eagle:smollm2`), batch 1, greedy, real acceptance (nothing simulated).

Rows, on the same prompts (a family of bench/prompts/draft_acceptance.jsonl, chat by default):
  * none     `--no-speculation` through the engine (router, CUDA graphs, overlapped plain steps)
  * chain    the head drafting chains through the engine: the served adaptive k, and a fixed --k
  * tree     spec_decode.tree_decode per --trees shape (its step's device half is one CUDA graph)
Each row: tok/s (wall, generation only), tokens per verify step (emitted tokens / target passes,
the bonus token included), and whether its tokens equal `none`'s.

SIMULATED rows (`--simulated-shape`, default llama-2-7b on a GPU): a `random:` target with a
random-weight head; a tree step's and a plain step's costs are measured (real compute; the step cost
is the difference of two runs of different lengths, so prefill drops out), and the speed-up is
computed for ASSUMED tokens per step (2.5 / 3.0 / 3.5): tau * t_plain / t_tree_step.

GPU (the lead's command; ~1-2 min on an H100, the GGUF at --target):

    python bench/drafts/tree_drafts.py --device cuda --target /path/to/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out bench/results/tree_drafts_h100.json

CPU smoke (the same code paths, a prompt, a few tokens): python bench/drafts/tree_drafts.py --device cpu --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # bench_meta
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
from bench_meta import metadata

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.draft_tree import parse_tree_shape
from verifypd.domain.drafts import parse_draft
from verifypd.domain.requests import RequestSpec
from verifypd.domain.tokenizer import TextCodec
from verifypd.engine import Engine, EngineOptions
from verifypd.model.build import Models, load_draft_model
from verifypd.model.eagle_draft import EagleModel
from verifypd.model.eagle_head import random_eagle_head
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import load_model
from verifypd.spec_decode.tree_decode import TreeDecoder

PROMPTS = pathlib.Path(__file__).resolve().parents[1] / "prompts" / "draft_acceptance.jsonl"
DEFAULT_TREES = "topk=4,budget=16,depth=5;topk=4,budget=32,depth=6;topk=8,budget=48,depth=6"


def load_prompts(family: str, count: int) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    picked = [r["prompt"] for r in rows if family in ("all", r["family"])]
    return picked[:count]


def models_for(target, draft: str, device, dtype) -> Models:
    """A fresh forward wrapper per system (a feature draft attaches its feature pool to it)."""
    head = load_draft_model(parse_draft(draft), target, device, dtype, 2048) if draft != "none" else None
    return Models(target, PagedLlama(target.shape, target.weights), head, draft, device, dtype)


def engine_row(target, draft: str, k: int | None, prompts, max_tokens: int, device, dtype) -> dict:
    if draft == "none":
        config = RuntimeConfig(k_min=0, k_max=0, k_initial=0, adaptive=False)
    elif k is not None:
        config = RuntimeConfig(k_min=0, k_max=k, k_initial=k, adaptive=False)
    else:
        config = RuntimeConfig()
    engine = Engine(
        EngineOptions(num_blocks=512, device=device.type, config=config, graph_buckets=(1,)),
        models=models_for(target, draft, device, dtype),
    )
    engine.generate([RequestSpec(prompts[0], max_tokens=16, stop_at_eos=False, request_id="warm")])
    outputs, tokens, steps, seconds = [], 0, 0, 0.0
    for i, p in enumerate(prompts):  # batch 1: one request at a time
        spec = RequestSpec(p, max_tokens=max_tokens, stop_at_eos=False, request_id=f"r{i}")
        t0 = time.perf_counter()
        done = engine.generate([spec])[spec.request_id]
        seconds += time.perf_counter() - t0
        outputs.append(done.token_ids)
        tokens += done.usage["completion_tokens"]
        steps += done.usage["verify_steps"]
    label = "none" if draft == "none" else f"chain {draft} " + ("adaptive k" if k is None else f"k={k}")
    return {
        "system": label,
        "tokens": tokens,
        "verify_steps": steps,
        # the first token comes from prefill, not a verify step
        "tokens_per_step": (tokens - len(prompts)) / steps if steps else None,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "outputs": outputs,
    }


def tree_row(target, draft: str, tree: str, prompts, max_tokens: int, device, dtype, graphs) -> dict:
    shape = parse_tree_shape(tree)
    context = max(len(p) for p in prompts) + max(max_tokens, 16)
    models = models_for(target, draft, device, dtype)
    decoder = TreeDecoder(models, shape, max_context=context, num_blocks=0, graphs=graphs)
    decoder.generate([list(prompts[0])], 16)  # graph capture and kernel compiles outside the timing
    outputs, tokens, steps, seconds = [], 0, 0, 0.0
    for p in prompts:
        [out], stats = decoder.generate([list(p)], max_tokens)
        outputs.append(out)
        tokens += len(out)
        steps += stats.steps
        seconds += stats.seconds
    return {
        "system": f"tree {draft} {tree}",
        "tokens": tokens,
        "verify_steps": steps,
        "tokens_per_step": (tokens - len(prompts)) / steps if steps else None,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "graphs": bool(decoder.tree_step.graphs),
        "graph_error": decoder.tree_step.graph_error,
        "graph_capture_s": decoder.tree_step.capture_seconds,
        "outputs": outputs,
    }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two outputs differ (one ending early counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def step_cost(run, short: int, long: int) -> float:
    """Seconds per step: (time(long) - time(short)) / (steps(long) - steps(short)); run(n) -> (s, steps)."""
    s1, n1 = run(short)
    s2, n2 = run(long)
    return (s2 - s1) / max(n2 - n1, 1)


def simulated_rows(target, trees: list[str], device, dtype, tokens: int, graphs) -> list[dict]:
    """SIMULATED speed-ups from measured step costs (module doc); the head is random (acceptance ~0)."""
    prompt = [3 + i % (target.shape.vocab_size - 3) for i in range(128)]
    engine = Engine(
        EngineOptions(
            num_blocks=256,
            device=device.type,
            config=RuntimeConfig(k_min=0, k_max=0, k_initial=0),
            graph_buckets=(1,),
        ),
        models=models_for(target, "none", device, dtype),
    )

    def plain(n: int) -> tuple[float, int]:
        spec = RequestSpec(tuple(prompt), max_tokens=n, stop_at_eos=False, request_id=f"p{n}")
        t0 = time.perf_counter()
        engine.generate([spec])
        return time.perf_counter() - t0, n

    plain(8)
    t_plain = step_cost(plain, tokens // 2, tokens)
    config, weights = random_eagle_head(target.shape, device=device, dtype=dtype)
    head = EagleModel(config, weights, target.weights.embed)
    rows = []
    for tree in trees:
        models = Models(target, PagedLlama(target.shape, target.weights), head, "eagle:random", device, dtype)
        decoder = TreeDecoder(
            models, parse_tree_shape(tree), max_context=len(prompt) + tokens + 16, num_blocks=0, graphs=graphs
        )

        def run(n: int, decoder: TreeDecoder = decoder) -> tuple[float, int]:
            _, stats = decoder.generate([prompt], n)
            return stats.seconds, stats.steps

        run(8)
        t_tree = step_cost(run, tokens // 2, tokens)
        rows.append(
            {
                "system": f"SIMULATED tree eagle:random {tree}",
                "target": target.name,
                "plain_step_ms": 1000 * t_plain,
                "tree_step_ms": 1000 * t_tree,
                "graph_capture_s": decoder.tree_step.capture_seconds,
                "graph_error": decoder.tree_step.graph_error,
                "simulated_speedup_at_tokens_per_step": {str(tau): tau * t_plain / t_tree for tau in (2.5, 3.0, 3.5)},
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2", help="the embedded model's spec, or a path to its GGUF")
    ap.add_argument("--draft", default="eagle:smollm2")
    ap.add_argument("--trees", default=DEFAULT_TREES, help="';'-separated --draft-tree shapes")
    ap.add_argument("--family", default="chat", help="a family of the prompts file, or all")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="the fixed-k chain row (besides the adaptive one)")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--smoke", action="store_true", help="one prompt, 12 tokens, one small tree (CPU check)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--no-graphs", action="store_true", help="tree steps eagerly (no CUDA graphs)")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float32"),
        help="model dtype (default bfloat16 on cuda, float32 on cpu); float32 tells a tree step's rounding "
        "(bf16 near-ties resolved otherwise) from a wrong token",
    )
    ap.add_argument(
        "--simulated-shape",
        default=None,
        help="a random: shape for the SIMULATED rows (default llama-2-7b on cuda; 'none': skip; "
        "'embedded': the --target model itself with a random head, as --smoke uses)",
    )
    ap.add_argument("--out", default="tree_drafts.json")
    args = ap.parse_args()
    if args.smoke:
        args.prompts, args.max_tokens, args.trees = 1, 12, "topk=2,budget=6,depth=3"
        args.simulated_shape = args.simulated_shape or "embedded"
    if args.simulated_shape is None:
        args.simulated_shape = "llama-2-7b" if args.device == "cuda" else "none"
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_model(args.target, device, dtype, 2048)
    codec = TextCodec(target.tokenizer)
    prompts = [
        tuple(codec.encode_chat([{"role": "user", "content": t}])) for t in load_prompts(args.family, args.prompts)
    ]
    graphs = False if args.no_graphs else None
    rows = [
        engine_row(target, "none", None, prompts, args.max_tokens, device, dtype),
        engine_row(target, args.draft, None, prompts, args.max_tokens, device, dtype),
        engine_row(target, args.draft, args.k, prompts, args.max_tokens, device, dtype),
    ]
    trees = [t for t in args.trees.split(";") if t]
    rows += [tree_row(target, args.draft, t, prompts, args.max_tokens, device, dtype, graphs) for t in trees]
    plain = rows[0]
    for r in rows:
        r["speedup_vs_none"] = r["tok_per_s"] / plain["tok_per_s"]
        r["same_tokens_as_none"] = sum(a == b for a, b in zip(r["outputs"], plain["outputs"], strict=True))
        # per prompt, the first output token that differs from plain decoding's (None: none differs)
        r["first_difference"] = [first_difference(a, b) for a, b in zip(r["outputs"], plain["outputs"], strict=True)]
    for r in rows:
        del r["outputs"]
        tps = "-" if r["tokens_per_step"] is None else f"{r['tokens_per_step']:.2f}"
        print(
            f"{r['system']:<48} {r['tok_per_s']:9.1f} tok/s  {r['speedup_vs_none']:5.2f}x  {tps} tok/step  "
            f"same as none {r['same_tokens_as_none']}/{len(prompts)}"
        )
    simulated = []
    if args.simulated_shape != "none":
        sim_target = target if args.simulated_shape == "embedded" else None
        if sim_target is None:
            sim_target = load_model(f"random:{args.simulated_shape}", device, dtype, 2048)
        sim_tokens = 12 if args.smoke else 64
        simulated = simulated_rows(sim_target, trees, device, dtype, sim_tokens, graphs)
        for r in simulated:
            print(r["system"], {k: round(v, 3) for k, v in r["simulated_speedup_at_tokens_per_step"].items()})
    result = {
        **metadata(),
        "what": "batch 1, greedy, real acceptance (nothing simulated); tokens_per_step counts the bonus token",
        "target": args.target,
        "draft": args.draft,
        "family": args.family,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "dtype": str(dtype),
        "targets": {"tokens_per_step": 3.0, "speedup_vs_none_batch1": 2.0},
        "rows": rows,
        "simulated_rows": simulated,
    }
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
