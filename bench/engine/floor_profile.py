"""Where a decode step's time goes against the weight-bytes floor, kernel by kernel (random weights).

One process, one GPU, a random-weight target shape in bf16 (or fp8 weights with `--quantization fp8`):

  1. the k = 0 decode step (ModelRunner.last_logits, CUDA graphs, context --context) at each batch:
     wall time per step, and its fraction of the bytes floor = (weight bytes + KV bytes read) /
     measured device copy bandwidth (bytes read + written per second, as engine_throughput.py counts);
  2. a torch.profiler trace of the same step run eagerly (same kernels, launched one by one), at batch
     1: each kernel class's GPU time per step (GEMM, attention, norm, RoPE/KV write, activation, the
     rest), kernels per step, and each GEMM class's own bytes floor (its weight bytes / bandwidth),
     so the gap between the graph step and the floor is split into "GEMMs slower than their bytes",
     "the other kernels" and "idle GPU inside the step".

    python bench/engine/floor_profile.py --shape llama-2-7b --out bench/results/floor_profile_h100.json
    python bench/engine/floor_profile.py --shape llama-2-7b --quantization fp8 --out /tmp/fp8.json
    python bench/engine/floor_profile.py --device cpu --shape tiny --out /tmp/floor_smoke.json   # plumbing only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # bench_meta
sys.path.insert(0, os.path.join(HERE, "..", "..", "services"))

from bench_meta import metadata  # noqa: E402

from verifypd.model.kv_pool import KvPool, PoolGeometry  # noqa: E402
from verifypd.model.layout import TokenRun  # noqa: E402
from verifypd.model.loader import RANDOM_SHAPES, random_model  # noqa: E402
from verifypd.model.runner import ModelRunner  # noqa: E402
from verifypd.model.tensor_parallel import SingleRank, shard_model  # noqa: E402

BLOCK = 16
TINY = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32
)
# Kernel-name fragments -> class (first match wins). GEMMs: cuBLAS / CUTLASS / nvjet / Triton matmuls.
CLASSES = (
    ("attention", ("paged_attention", "attn", "flash")),
    ("rope_kv", ("rope",)),
    ("norm", ("rms_norm", "norm")),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "sm80", "matmul", "scaled_mm", "splitk", "f8f8")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in CLASSES if any(k in low for k in keys)), "other")


def copy_bandwidth(device, numel: int = 256 * 1024 * 1024) -> float:
    """Device copy bandwidth (bytes read + written per second) over two float32 buffers of `numel`."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[2:])


def nbytes(t) -> int:
    """A tensor's bytes, or an fp8 weight's (its fp8 matrix plus its float32 scales)."""
    if t is None:
        return 0
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return nbytes(t.weight) + nbytes(t.scale)


def gemm_bytes(model) -> dict[str, int]:
    """Weight bytes per GEMM class for one step (fp8: the weights' bytes plus their scales)."""
    w = model.weights
    out = {"qkv": 0, "o": 0, "gate_up": 0, "down": 0, "lm_head": nbytes(w.lm_head)}
    for layer in w.layers[: model.num_layers]:
        for name in ("qkv", "o", "gate_up", "down"):
            out[name] += nbytes(getattr(layer, name))
    return out


def runs_for(batch: int, context: int) -> list[TokenRun]:
    per = -(-(context + 8) // BLOCK)
    return [TokenRun([7], context, tuple(range(i * per, (i + 1) * per))) for i in range(batch)]


def step_seconds(runner: ModelRunner, runs: list[TokenRun], reps: int, cuda: bool) -> float:
    for _ in range(3):
        runner.last_logits(runs)
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.last_logits(runs)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_profile(runner: ModelRunner, runs: list[TokenRun], steps: int) -> dict:
    """GPU time per step by kernel class, from an eager profile of `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        runner.last_logits(runs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            runner.last_logits(runs)
        torch.cuda.synchronize()
    by_class: dict[str, float] = {}
    count: dict[str, int] = {}
    top: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        cls = kernel_class(ev.name)
        by_class[cls] = by_class.get(cls, 0.0) + us
        count[cls] = count.get(cls, 0) + 1
        top[ev.name] = top.get(ev.name, 0.0) + us
    per_step = {c: round(v / steps / 1e3, 4) for c, v in sorted(by_class.items(), key=lambda kv: -kv[1])}
    return {
        "gpu_ms_per_step_by_class": per_step,
        "kernels_per_step_by_class": {c: n // steps for c, n in count.items()},
        "kernels_per_step": sum(count.values()) // steps,
        "gpu_busy_ms_per_step": round(sum(by_class.values()) / steps / 1e3, 4),
        "top_kernels_ms_per_step": {
            k[:120]: round(v / steps / 1e3, 4) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-2-7b", help="a loader.RANDOM_SHAPES name, or tiny")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none")
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    device = torch.device(args.device)
    if args.shape == "tiny":
        RANDOM_SHAPES["tiny"] = TINY
    batches = [int(b) for b in args.batches.split(",")] if cuda else [1, 2]
    dtype = torch.bfloat16 if cuda else torch.float32
    quant = None if args.quantization == "none" else args.quantization
    loaded = random_model(args.shape, device, dtype, 4096, quantization=quant)
    model = shard_model(loaded.shape, loaded.weights, SingleRank())
    s = model.shape
    per = -(-(args.context + 8) // BLOCK)
    pool = KvPool(
        "target", PoolGeometry(s.num_layers, per * max(batches), BLOCK, s.num_kv_heads, s.head_dim), dtype, device
    )
    result = dict(
        metadata(),
        bench="floor_profile",
        weights=f"random, {args.quantization if quant else 'bf16' if cuda else 'float32'}",
        shape=args.shape,
        context=args.context,
    )
    graphed = ModelRunner(model, pool, graphs=True if cuda else False)
    bw = copy_bandwidth(device) if cuda else None
    wbytes = gemm_bytes(model)
    kv_per_seq = (
        args.context * s.num_layers * 2 * s.num_kv_heads * s.head_dim * torch.tensor([], dtype=dtype).element_size()
    )
    result["copy_bandwidth_gb_s"] = round(bw / 1e9, 1) if bw else None
    result["weight_bytes_by_gemm"] = wbytes
    rows = []
    for b in batches:
        step = step_seconds(graphed, runs_for(b, args.context), 30 if cuda else 2, cuda)
        row = {"batch": b, "step_ms": round(step * 1e3, 4), "tok_per_s": round(b / step, 1)}
        if bw:
            floor = (sum(wbytes.values()) + b * kv_per_seq) / bw
            row.update(bytes_floor_ms=round(floor * 1e3, 4), fraction_of_floor=round(floor / step, 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["rows"] = rows
    if cuda:
        eager = ModelRunner(model, pool, graphs=False)
        prof = kernel_profile(eager, runs_for(1, args.context), 10)
        gemm_floor_ms = sum(wbytes.values()) / bw * 1e3
        gemm_ms = prof["gpu_ms_per_step_by_class"].get("gemm", 0.0)
        graph_step = rows[0]["step_ms"]
        prof["batch"] = 1
        prof["gemm_bytes_floor_ms"] = round(gemm_floor_ms, 4)
        prof["gemm_ms_over_floor"] = round(gemm_ms / gemm_floor_ms, 3)
        prof["graph_step_ms"] = graph_step
        prof["gap_split_ms"] = {
            "gemm_above_bytes_floor": round(gemm_ms - gemm_floor_ms, 4),
            "other_kernels": round(prof["gpu_busy_ms_per_step"] - gemm_ms, 4),
            "gpu_idle_in_graph_step": round(graph_step - prof["gpu_busy_ms_per_step"], 4),
        }
        result["profile_b1"] = prof
        print(json.dumps(prof, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
