"""One projection of a decode / verify step, M tokens, three ways, in the same run: bf16 `F.linear`
(cuBLAS), the fp8 quantized product (per-token activation quantization + `torch._scaled_mm`), and the
weight-only fp8 kernel (model.kernels.fp8_gemm) with its launch table and with each candidate
launch configuration (the sweep that sets the table and model.fp8.WEIGHT_ONLY_TOKENS).

RANDOM WEIGHTS with a real model's projection shapes (default Llama-2-7B: qkv, o, gate_up, down).
Each timing replays one CUDA graph of `--calls` products, each on its own copy of the weight (more
bytes than the L2 holds, as a step's layers are), timed with CUDA events. `weight_gb_s` is the
weight bytes read per second; `of_copy` that over the measured device-to-device copy bandwidth.

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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_meta import metadata
from fp8_throughput import copy_bandwidth, timed_ms

from verifypd.model.fp8 import quantize_weight, quantized_product
from verifypd.model.kernels.fp8_gemm import CONFIGS, config, fp8_weight_gemm
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


def candidates(m: int) -> list[tuple[int, int, int, int, int]]:
    """Launch configurations worth trying at M tokens: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)."""
    block_ms = [16] if m <= 16 else ([32] if m <= 32 else [32, 64] if m <= 64 else [64])
    block_ns = [16, 32, 64] if m <= 16 else [32, 64] if m <= 64 else [64, 128]
    block_ks = [256, 512] if m <= 16 else [128, 256] if m <= 64 else [64, 128]
    shapes = [(4, 4), (8, 3)]
    return [(bm, bn, bk, w, st) for bm, bn, bk, (w, st) in itertools.product(block_ms, block_ns, block_ks, shapes)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", help="a random: shape (model.loader.RANDOM_SHAPES)")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,96,128")
    ap.add_argument("--sweep-tokens", default="1,16,32,64,128", help="M values that also try every candidate")
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
                fp8_quantized_us=time_it(lambda w, x=x: quantized_product(x, w), fp8),
                fp8_weight_only_us=time_it(lambda w, x=x: fp8_weight_gemm(x, w.weight, w.scale), fp8),
                table_config=config(m, n),
            )
            for key, nbytes in (("bf16", 2 * n * k), ("fp8_weight_only", n * k)):
                row[f"{key}_weight_gb_s"] = nbytes / row[f"{key}_us"] / 1e3
                row[f"{key}_of_copy"] = nbytes / row[f"{key}_us"] * 1e6 / bandwidth
            if m in sweep:
                timings = {}
                for launch in candidates(m):
                    timings[str(launch)] = time_it(
                        lambda w, x=x, launch=launch: fp8_weight_gemm(x, w.weight, w.scale, launch=launch), fp8
                    )
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
            key: round(sum(r[f"{key}_us"] for r in at), 2) for key in ("bf16", "fp8_quantized", "fp8_weight_only")
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
