"""The fp8 linear of a forward of few tokens in one launch (Triton): per-token activation
quantization fused into a GEMV over the fp8 weight, the same product model.fp8 computes for any
number of tokens:

    x [M, K]         bfloat16 / float16, unit stride along K; M <= MAX_TOKENS (a decode or verify step)
    w [N, K]         float8_e4m3fn, contiguous;  scale [N] float32: w[n, k] ~= w8[n, k] * scale[n]
    input_scale      None: token m scaled by s[m] = max(amax(|x[m]|), MIN_AMAX) / 448;
                     else that 0-d float32 scale for every token (a static checkpoint)
    bias [N]         optional, x's dtype
    returns          y[m, n] = sum_k e4m3(x[m, k] / s[m]) * w8[n, k] * s[m] * scale[n] (+ bias),
                     accumulated in float32, in x's dtype

Why not quantize_rows + `torch._scaled_mm` at this size: that is a second kernel per projection
(~130 launches on a 32-layer decode step), and `_scaled_mm`'s kernels tile M by 64-128, so a
batch-1 step streams the weights through tiles that are almost all padding. Here a program owns
BLOCK_N output channels of every token and walks K once: the weight bytes are read once, which is
all a skinny GEMM is bound by, and the products run on the fp8 tensor cores as `_scaled_mm`'s
do. Each program recomputes the tokens' amax from x (M * K elements,
from L2) instead of waiting on another kernel. The launch configuration is a pure function of M
(`config`), so a CUDA graph capture never tunes. K is a compile-time constant: a model has a
handful of distinct K, and a known trip count lets the compiler unroll and pipeline the K loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the smallest bucket of tokens that holds M.
CONFIGS: dict[int, tuple[int, int, int, int, int]] = {
    16: (16, 64, 256, 4, 4),
}
MAX_TOKENS = max(CONFIGS)  # larger M goes to quantize_rows + _scaled_mm (model.fp8)


def config(m: int) -> tuple[int, int, int, int, int]:
    """The launch configuration for M tokens (M <= MAX_TOKENS)."""
    if not 0 < m <= MAX_TOKENS:
        raise ValueError(f"the fused fp8 GEMV takes 1..{MAX_TOKENS} tokens, got {m}")
    return CONFIGS[next(b for b in sorted(CONFIGS) if m <= b)]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, input_scale_ptr, bias_ptr, y_ptr, M, N, stride_x, stride_y,
    K: tl.constexpr, FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, STATIC: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # One program: BLOCK_N output channels of BLOCK_M tokens. The tokens are quantized tile by tile
    # in registers and multiplied with the weight tile on the fp8 tensor cores (fp32 accumulator).
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1]
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # [1, BLOCK_N]: w is [N, K] row-major
    if STATIC:
        s = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(input_scale_ptr)
    else:  # each token's amax (as model.kernels.fp8_quant computes it), read again by every program
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        s = tl.maximum(amax, FLOOR) / FP8_LIMIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        # The token's fp8 value (rounded to nearest even, saturated at +-448), as quantize_rows stores it.
        q = tl.minimum(tl.maximum(x / s[:, None], -FP8_LIMIT), FP8_LIMIT).to(w_ptr.dtype.element_ty)
        w = tl.load(w_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(q, w, acc)
    acc = acc * s[:, None] * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    limit: float,
    floor: float,
    bias: torch.Tensor | None = None,
    launch: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] through the fp8 weight [N, K] (module doc) -> [M, N] in x's dtype. `limit`: the fp8
    maximum (448), `floor`: the smallest amax a dynamic scale is taken from (model.fp8 passes its
    constants). `launch` overrides `config` (the sweep in bench/engine/fp8_gemm.py)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.is_contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k, warps, stages = launch or config(m)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x, weight, scale, input_scale if input_scale is not None else scale, bias if bias is not None else scale,
        y, m, n, x.stride(0), y.stride(0), K=k, FP8_LIMIT=limit, FLOOR=floor, STATIC=input_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
