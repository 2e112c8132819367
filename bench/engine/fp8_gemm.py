"""One projection of a decode / verify step at M tokens, bf16 against fp8, in the same run: bf16
`F.linear` (cuBLAS) and model.fp8.linear (per-token quantization, model.kernels.fp8_quant, then
`torch._scaled_mm` on the fp8 tensor cores). It explains the decode step's fp8 speedup
(fp8_throughput.py) projection by projection: the fp8 weights are half the bytes, and
`weight_gb_s` / `of_copy` say how much of that each GEMM turns into time.

RANDOM WEIGHTS with a real model's projection shapes (default Llama-2-7B: qkv, o, gate_up, down).
Each timing replays one CUDA graph of `--calls` products, each on its own copy of the weight (more
bytes than the L2 holds, as a step's layers are), timed with CUDA events. `weight_gb_s` is the
weight bytes read per second; `of_copy` that over the measured device-to-device copy bandwidth.

    python bench/engine/fp8_gemm.py --out bench/results/fp8_gemm_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "services"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_meta import metadata
from fp8_throughput import copy_bandwidth, timed_ms

from verifypd.model.fp8 import linear, quantize_weight
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-2-7b", help="a random: shape (model.loader.RANDOM_SHAPES)")
    ap.add_argument("--tokens", default="1,4,8,16,64,128")
    ap.add_argument("--calls", type=int, default=16, help="products per graph, each on its own weight copy")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for proj, (n, k) in projections(args.model).items():
        gen = torch.Generator(device=device).manual_seed(0)
        plain = [torch.randn(n, k, generator=gen, device=device).mul_(k**-0.5).bfloat16() for _ in range(args.calls)]
        fp8 = [quantize_weight(w) for w in plain]
        for m in tokens:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            row: dict = dict(projection=proj, n=n, k=k, tokens=m)
            for key, weights, nbytes in (("bf16", plain, 2 * n * k), ("fp8", fp8, n * k)):
                us = timed_ms(lambda x=x, weights=weights: [linear(x, w) for w in weights], device, args.iters)
                us = us / args.calls * 1e3
                row[f"{key}_us"] = round(us, 3)
                row[f"{key}_weight_gb_s"] = round(nbytes / us / 1e3, 1)
                row[f"{key}_of_copy"] = round(nbytes / us * 1e6 / bandwidth, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del plain, fp8
        torch.cuda.empty_cache()
    per_layer = {
        str(m): {key: round(sum(r[f"{key}_us"] for r in rows if r["tokens"] == m), 2) for key in ("bf16", "fp8")}
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
