"""One projection of a decode / verify step at M tokens, bf16 against fp8, in the same run: bf16
`F.linear` (cuBLAS); `fp8` = model.fp8.linear (at M <= 16 the fused split-K GEMV,
model.kernels.fp8_gemm; above, quantize_rows + `torch._scaled_mm`); and at M <= 16 `scaled_mm`, the
other path, for comparison. `--sweep-tokens` also times the GEMV under other launch plans (the
sweep behind its defaults). It explains the decode step's fp8 speedup (fp8_throughput.py)
projection by projection: the fp8 weights are half the bytes, and `weight_gb_s` / `of_copy` say
how much of that each GEMM turns into time.

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
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_meta import metadata
from fp8_throughput import copy_bandwidth, timed_ms

from verifypd.model.fp8 import FP8_MAX, MIN_AMAX, Fp8Weight, linear, quantize_weight
from verifypd.model.kernels.fp8_gemm import MAX_TOKENS, ROWS_MAX, fp8_gemv, plan, sm_count
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


def scaled_mm(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """model.fp8.linear's path above 16 tokens: quantize_rows, then `_scaled_mm`."""
    q, s = quantize_rows(x, None, FP8_MAX, MIN_AMAX)
    return torch._scaled_mm(q, w.weight.t(), scale_a=s, scale_b=w.scale.view(1, -1), out_dtype=torch.bfloat16)


def gemv_all(x: torch.Tensor, weights: list[Fp8Weight], go) -> list[torch.Tensor]:
    return [fp8_gemv(x, w.weight, w.scale, None, FP8_MAX, MIN_AMAX, launch=go) for w in weights]


def sweep_plans(m: int, n: int, k: int, sms: int) -> dict[str, object]:
    """Launch plans worth trying at M tokens for an [N, K] product: kernel, tile sizes, programs per SM."""
    plans = {}
    for bn, bk, waves in itertools.product([8, 16, 32], [64, 128, 256, 512], [2, 4]):
        if m <= ROWS_MAX and triton.next_power_of_2(m) * bn * bk <= 16384:
            go = plan(m, n, k, sms, block_n=bn, block_k=bk, waves=waves, cuda_cores=True)
            plans[f"cuda-cores bn{bn} bk{bk} waves{waves} splits{go.splits}"] = go
    for bn, bk, waves in itertools.product([32, 64, 128], [128, 256], [2, 4]):
        go = plan(m, n, k, sms, block_n=bn, block_k=bk, waves=waves, cuda_cores=False)
        plans[f"tensor-cores bn{bn} bk{bk} waves{waves} splits{go.splits}"] = go
    return plans


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", help="a random: shape (model.loader.RANDOM_SHAPES)")
    ap.add_argument("--tokens", default="1,4,8,16,64,128")
    ap.add_argument("--sweep-tokens", default="1", help="M values that also try other launch plans")
    ap.add_argument("--calls", type=int, default=16, help="products per graph, each on its own weight copy")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    tokens = [int(t) for t in args.tokens.split(",")]
    sweep = {int(t) for t in args.sweep_tokens.split(",")}
    sms = sm_count(0)
    rows = []
    for proj, (n, k) in projections(args.model).items():
        gen = torch.Generator(device=device).manual_seed(0)
        plain = [torch.randn(n, k, generator=gen, device=device).mul_(k**-0.5).bfloat16() for _ in range(args.calls)]
        fp8 = [quantize_weight(w) for w in plain]
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row: dict = dict(projection=proj, n=n, k=k, tokens=m)
            paths = [("bf16", linear, plain, 2 * n * k), ("fp8", linear, fp8, n * k)]
            if m <= MAX_TOKENS:
                paths.append(("scaled_mm", scaled_mm, fp8, n * k))
            for key, fn, weights, nbytes in paths:
                us = timed_ms(lambda x=x, fn=fn, weights=weights: [fn(x, w) for w in weights], device, args.iters)
                us = us / args.calls * 1e3
                row[f"{key}_us"] = round(us, 3)
                row[f"{key}_weight_gb_s"] = round(nbytes / us / 1e3, 1)
                row[f"{key}_of_copy"] = round(nbytes / us * 1e6 / bandwidth, 3)
            if m <= MAX_TOKENS and m in sweep:
                timings = {}
                for name, go in sweep_plans(m, n, k, sms).items():
                    try:
                        ms = timed_ms(lambda x=x, ws=fp8, go=go: gemv_all(x, ws, go), device, args.iters)
                        timings[name] = round(ms / args.calls * 1e3, 3)
                    except triton.runtime.errors.OutOfResources:  # tiles past the SM's shared memory
                        continue
                row["sweep_us"] = dict(sorted(timings.items(), key=lambda kv: kv[1])[:6])
            rows.append(row)
            print(json.dumps(row), flush=True)
        del plain, fp8
        torch.cuda.empty_cache()
    per_layer = {
        str(m): {
            key: round(sum(r[f"{key}_us"] for r in rows if r["tokens"] == m), 2)
            for key in ("bf16", "fp8", "scaled_mm")
            if m <= MAX_TOKENS or key != "scaled_mm"
        }
        for m in tokens
    }
    result = dict(
        metadata(),
        benchmark="fp8_gemm",
        weights_note="RANDOM WEIGHTS (timing only)",
        model=f"random:{args.model}",
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        rows=rows,
        us_per_layer_by_tokens=per_layer,
    )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(per_layer), "->", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
