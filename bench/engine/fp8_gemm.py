"""One projection of a decode / verify step, M tokens, three ways, in the same run: bf16 `F.linear`
(cuBLAS), the fp8 product as quantize_rows + `torch._scaled_mm`, and the fused quantize + GEMV
kernel (model.kernels.fp8_gemm, M <= its MAX_TOKENS) with its launch table and with each candidate
launch configuration (the sweep that sets the table).

RANDOM WEIGHTS with a real model's projection shapes (default Llama-2-7B: qkv, o, gate_up, down).
Each timing replays one CUDA graph of `--calls` products, each on its own copy of the weight (more
bytes than the L2 holds, as a step's layers are), timed with CUDA events. `weight_gb_s` is the
weight bytes read per second; `of_copy` that over the measured device-to-device copy bandwidth.
`fp8_gemv_us` is what model.fp8.linear runs at M <= 16; `fp8_scaled_mm_us` what it runs above.

    python bench/engine/fp8_gemm.py --out bench/results/fp8_gemm_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_meta import metadata
from fp8_throughput import copy_bandwidth, timed_ms

from verifypd.model.fp8 import FP8_MAX, MIN_AMAX, Fp8Weight, quantize_weight
from verifypd.model.kernels.fp8_gemm import CONFIGS, MAX_TOKENS, config, fp8_gemv
from verifypd.model.kernels.fp8_quant import quantize_rows
from verifypd.model.loader import RANDOM_SHAPES


def projections(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each dense projection of a random: shape."""
    s = RANDOM_SHAPES[name]
    hidden, inter = s["hidden_size"], s["intermediate_size"]
    head_dim = s.get("head_dim", hidden // s["num_heads"])
    return {
        "qkv": ((s["num_heads"] + 2 * s["num_kv_heads"]) * head_dim, hidden),
        "o": (hidden, s["num_heads"] * head_dim),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


def scaled_mm_product(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """model.fp8.linear's path above 8 tokens: quantize_rows, then `_scaled_mm`."""
    q, s = quantize_rows(x, None, FP8_MAX, MIN_AMAX)
    return torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16)


def gemv(x: torch.Tensor, w: Fp8Weight, launch=None) -> torch.Tensor:
    return fp8_gemv(x, w.weight, w.scale, None, FP8_MAX, MIN_AMAX, launch=launch)


def candidates(m: int) -> list[tuple[int, int, int, int, int]]:
    """Launch configurations worth trying at M tokens: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    shapes = itertools.product([32, 64, 128], [128, 256, 512], [(4, 4), (8, 3)])
    return [(16, bn, bk, w, st) for bn, bk, (w, st) in shapes]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", help="a random: shape (model.loader.RANDOM_SHAPES)")
    ap.add_argument("--tokens", default="1,4,8,16,64,128")
    ap.add_argument("--sweep-tokens", default="1,16", help="M values that also try every candidate")
    ap.add_argument("--calls", type=int, default=16, help="products per graph, each on its own weight copy")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    tokens = [int(t) for t in args.tokens.split(",")]
    sweep = {int(t) for t in args.sweep_tokens.split(",")}
    rows, best = [], {}
    for proj, (n, k) in projections(args.model).items():
        gen = torch.Generator(device=device).manual_seed(0)
        plain = [torch.randn(n, k, generator=gen, device=device).mul_(k**-0.5).bfloat16() for _ in range(args.calls)]
        fp8 = [quantize_weight(w) for w in plain]
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

            def time_it(fn, weights):
                return timed_ms(lambda: [fn(w) for w in weights], device, args.iters) / args.calls * 1e3  # us

            row = dict(
                projection=proj,
                n=n,
                k=k,
                tokens=m,
                bf16_us=time_it(lambda w, x=x: F.linear(x, w), plain),
                fp8_scaled_mm_us=time_it(lambda w, x=x: scaled_mm_product(x, w), fp8),
                table_config=config(m) if m <= MAX_TOKENS else None,
            )
            if m <= MAX_TOKENS:
                row["fp8_gemv_us"] = time_it(lambda w, x=x: gemv(x, w), fp8)
            for key, nbytes in (("bf16", 2 * n * k), ("fp8_gemv", n * k), ("fp8_scaled_mm", n * k)):
                if f"{key}_us" not in row:
                    continue
                row[f"{key}_weight_gb_s"] = nbytes / row[f"{key}_us"] / 1e3
                row[f"{key}_of_copy"] = nbytes / row[f"{key}_us"] * 1e6 / bandwidth
            if m in sweep:
                timings = {}
                for launch in candidates(m):
                    try:
                        timings[str(launch)] = time_it(lambda w, x=x, launch=launch: gemv(x, w, launch), fp8)
                    except triton.runtime.errors.OutOfResources:  # tiles past the SM's shared memory
                        continue
                row["sweep_us"] = dict(sorted(timings.items(), key=lambda kv: kv[1])[:5])
                best[f"{proj} m={m}"] = min(timings.items(), key=lambda kv: kv[1])
            rows.append({key: round(v, 3) if isinstance(v, float) else v for key, v in row.items()})
            print(json.dumps(rows[-1]), flush=True)
        del plain, fp8
        torch.cuda.empty_cache()
    totals = {}
    for m in tokens:
        at = [r for r in rows if r["tokens"] == m]
        totals[str(m)] = {
            key: round(sum(r[f"{key}_us"] for r in at), 2)
            for key in ("bf16", "fp8_scaled_mm", "fp8_gemv")
            if all(f"{key}_us" in r for r in at)
        }
    result = dict(
        metadata(),
        benchmark="fp8_gemm",
        weights_note="RANDOM WEIGHTS (timing only)",
        model=f"random:{args.model}",
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        table=CONFIGS,
        rows=rows,
        us_per_layer_by_tokens=totals,
        best_launch=best,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(totals), "->", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
