"""A decode step of few sequences over long contexts, with and without split-KV attention (the
GraphRunner's split variants, model.split_kv), in the same run: the step time through
`ModelRunner.last_logits` (CUDA graphs), each sequence at --contexts positions, at --batches.

RANDOM WEIGHTS with a real model's shape (default Llama-2-7B). "split" lets the runner pick its
split variant (split_min_context 0: whenever the grid leaves SMs idle); "plain" never splits. Each
timing is the median of --repeats runs of --iters steps (CUDA events), after a warm-up.

The split variants are captured at start-up beside the plain graphs: `warm_up` times a target's
start-up capture (kinds "all" and "accept", queries up to --warm-query) without and with them, for
each of --warm-models (random weights), and counts the graphs.

    python bench/engine/decode_splits.py --out bench/results/decode_splits_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_meta import metadata

from verifypd.model.graph_runner import attention_splits
from verifypd.model.kv_pool import KvPool, PoolGeometry
from verifypd.model.layout import TokenRun
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import random_model
from verifypd.model.runner import ModelRunner

BLOCK = 16


def step_ms(runner: ModelRunner, runs: list[TokenRun], iters: int, repeats: int) -> float:
    for _ in range(3):
        runner.last_logits(runs)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            runner.last_logits(runs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def warm_up(name: str, query: int, device: torch.device) -> dict:
    """Start-up capture of a target's verify graphs without and with the split variants."""
    loaded = random_model(name, device, torch.bfloat16, 2048)
    s = loaded.shape
    row: dict = dict(model=f"random:{name}")
    for label, min_context in (("plain", None), ("with_splits", 256)):
        pool = KvPool(
            "target", PoolGeometry(s.num_layers, 512, BLOCK, s.num_kv_heads, s.head_dim), torch.bfloat16, device
        )
        runner = ModelRunner(PagedLlama(s, loaded.weights), pool)
        assert runner.graphs is not None
        runner.graphs.split_min_context = min_context
        row[f"{label}_s"] = round(runner.graphs.warm_up(("all", "accept"), max_query=query), 2)
        row[f"{label}_graphs"] = len(runner.graphs.captured)
        del runner, pool
        torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", help="a random: shape (model.loader.RANDOM_SHAPES)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--contexts", default="64,256,1024,4096")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm-models", default="tinyllama-1.1b,llama-2-7b")
    ap.add_argument("--warm-query", type=int, default=8, help="k_max + 1 of the start-up capture")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    loaded = random_model(args.model, device, torch.bfloat16, max(contexts) + 64)
    s = loaded.shape
    per_seq = -(-(max(contexts) + 1) // BLOCK)
    geometry = PoolGeometry(s.num_layers, max(batches) * per_seq + 1, BLOCK, s.num_kv_heads, s.head_dim)
    pool = KvPool("target", geometry, torch.bfloat16, device)
    pool.tensor.normal_(0, 1)  # the attention reads real numbers
    model = PagedLlama(s, loaded.weights)
    runner = ModelRunner(model, pool)
    assert runner.graphs is not None
    rows = []
    for batch in batches:
        for context in contexts:
            runs = [TokenRun([7], context, tuple(range(b * per_seq, (b + 1) * per_seq))) for b in range(batch)]
            row: dict = dict(batch=batch, context=context)
            for name, min_context in (("plain", 1 << 30), ("split", 0)):
                runner.graphs.split_min_context = min_context
                row[f"{name}_ms"] = round(step_ms(runner, runs, args.iters, args.repeats), 4)
            row["splits"] = attention_splits(model, runner.graphs.rows_for(batch), 1, runner.graphs.sm_count)
            row["split_speedup"] = round(row["plain_ms"] / row["split_ms"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    del runner, model, pool, loaded
    torch.cuda.empty_cache()
    warm = [warm_up(name, args.warm_query, device) for name in args.warm_models.split(",") if name]
    result = dict(
        metadata(),
        benchmark="decode_splits",
        weights_note="RANDOM WEIGHTS (timing only)",
        model=f"random:{args.model}",
        dtype="bfloat16",
        rows=rows,
        warm_up=warm,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
