"""Decode-step time of the target forward, bf16 weights vs fp8 weights (`--quantization fp8`), in the
same run, per batch size, beside the memory floor of each step.

RANDOM WEIGHTS with a real model's shape (default Llama-2-7B): the timing does not depend on the
values. Each row is one decode step of B sequences, each with --context tokens of KV already in the
paged pool (the paged-attention kernel reads them), through `PagedLlama.forward` with logits for
every sequence; on CUDA the step is captured in one CUDA graph and replayed (as the serving runner
does), timed with CUDA events over --iters replays after warm-up. The two models are built one after
the other from the same seed (the fp8 one quantizes each layer as it is made) so one GPU holds one.

The floor of a step is the bytes it must read once from GPU memory, over the measured copy bandwidth
(a device-to-device copy of 2 GiB: read + write bytes / time):
    weights  every projection + lm_head (+ the batch's embedding rows), in their stored dtype
    kv       B * context tokens of K and V (bf16)
so `floor_ms = (weights + kv) / bandwidth`; `speedup` is bf16 ms / fp8 ms at each batch.

    python bench/engine/fp8_throughput.py --out bench/results/fp8_throughput_h200.json
    python bench/engine/fp8_throughput.py --smoke --out /tmp/fp8_throughput_cpu.json   # CPU check
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_meta import metadata

from verifypd.model.fp8 import Fp8Weight
from verifypd.model.layout import TokenRun, build_layout, to_device
from verifypd.model.llama import PagedLlama
from verifypd.model.loader import RANDOM_SHAPES, random_model

SMOKE_SHAPE = dict(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=4, vocab_size=1024)


def weight_bytes(model: PagedLlama, batch: int) -> int:
    """Bytes a decode step reads of the weights: every projection, lm_head, the batch's embedding rows."""
    w = model.weights

    def size(t) -> int:
        if t is None:
            return 0
        if isinstance(t, Fp8Weight):
            return t.nbytes()
        return t.numel() * t.element_size()

    total = size(w.lm_head) + batch * w.embed.shape[1] * w.embed.element_size()
    for lw in w.layers[: model.num_layers]:
        total += sum(size(getattr(lw, f)) for f in ("qkv", "o", "gate_up", "down"))
    return total


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(1 << 30, dtype=torch.int16, device=device)  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    del src, dst
    return 2 * 2 * (1 << 30) / seconds


def timed_ms(step, device: torch.device, iters: int) -> float:
    """Milliseconds per call of step(): replayed from one CUDA graph on a GPU (captured after a warm-up
    on a side stream), called in a loop on the CPU."""
    if device.type != "cuda":
        step()
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - t0) * 1e3 / iters
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / iters


def step_ms(model: PagedLlama, batch: int, context: int, block_size: int, iters: int) -> float:
    """Milliseconds of one decode step of `batch` sequences at `context` tokens each."""
    s = model.shape
    device, dtype = model.weights.embed.device, model.weights.embed.dtype
    per_seq = (context + 1 + block_size - 1) // block_size
    blocks = batch * per_seq + 1
    pool = torch.zeros(2, s.num_layers, blocks, block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device)
    pool.normal_(0, 1)  # filled so the attention reads real numbers
    runs = [TokenRun([7 + b % 100], context, tuple(range(b * per_seq, (b + 1) * per_seq))) for b in range(batch)]
    layout = to_device(build_layout(runs, block_size), device)
    index = torch.arange(batch, device=device)
    out = torch.empty(batch, s.vocab_size, dtype=dtype, device=device)

    def step():
        model.forward(pool, layout, index, out)

    return timed_ms(step, device, iters)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", help="a random: shape (model.loader.RANDOM_SHAPES)")
    ap.add_argument("--batches", default="1,64,128")
    ap.add_argument("--context", type=int, default=256, help="KV tokens per sequence before the step")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, batches 1,4, context 32: checks the script")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    name = args.model
    if args.smoke:
        RANDOM_SHAPES["fp8-smoke"] = SMOKE_SHAPE
        name, batches, args.context, args.iters = "fp8-smoke", [1, 4], 32, 3
    bandwidth = copy_bandwidth(device)
    rows = []
    for quantization in (None, "fp8"):
        loaded = random_model(name, device, torch.bfloat16, args.context + 64, quantization=quantization)
        model = PagedLlama(loaded.shape, loaded.weights)
        s = loaded.shape
        for batch in batches:
            ms = step_ms(model, batch, args.context, args.block_size, args.iters)
            weights = weight_bytes(model, batch)
            kv = batch * args.context * 2 * s.num_layers * s.num_kv_heads * s.head_dim * 2
            rows.append(
                dict(
                    weights="fp8" if quantization else "bf16",
                    batch=batch,
                    step_ms=round(ms, 4),
                    tokens_per_s=round(batch / ms * 1e3, 1),
                    weight_bytes=weights,
                    kv_bytes=kv,
                    floor_ms=round((weights + kv) / bandwidth * 1e3, 4) if bandwidth == bandwidth else None,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
        del model, loaded
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    by = {(r["weights"], r["batch"]): r for r in rows}
    speedups = {str(b): round(by[("bf16", b)]["step_ms"] / by[("fp8", b)]["step_ms"], 3) for b in batches}
    result = dict(
        metadata(),
        benchmark="fp8_throughput",
        weights_note="RANDOM WEIGHTS (timing only)",
        model=f"random:{name}",
        model_dtype="bfloat16",
        context=args.context,
        block_size=args.block_size,
        iters=args.iters,
        cuda_graphs=device.type == "cuda",
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1) if bandwidth == bandwidth else None,
        rows=rows,
        speedup_fp8_over_bf16=speedups,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("speedup fp8 / bf16 per batch:", speedups, "->", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
