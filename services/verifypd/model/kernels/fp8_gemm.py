"""Weight-only fp8 GEMM for few tokens (Triton): y = (x @ w8.T) * scale (+ bias), the fp8 weight
widened to x's dtype tile by tile in registers, the products on the tensor cores in x's dtype.

    x [M, K]       bfloat16 / float16, unit stride along K (M small: a decode or verify step)
    w [N, K]       float8_e4m3fn, contiguous
    scale [N]      float32: w[n, k] ~= w8[n, k] * scale[n]
    bias [N]       optional, x's dtype
    returns        y [M, N] in x's dtype; accumulated in float32, scaled once per output

Why not `torch._scaled_mm` at this size: it needs the activations in fp8 too (one more kernel per
projection), and its kernels tile M by 64-128, so a batch-1 step streams the weights through tiles
that are almost all padding. Here a program owns BLOCK_N output channels of every token in its
BLOCK_M rows and walks K once: the weight bytes are read exactly once, which is all a skinny GEMM
is bound by. The launch configuration is a pure function of (M, N) (`config`), so a CUDA graph
capture never tunes. K is a compile-time constant: a model has a handful of distinct K (hidden,
intermediate, heads * head_dim), and a known trip count lets the compiler pipeline the K loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the smallest M bucket that holds M.
CONFIGS: dict[int, tuple[int, int, int, int, int]] = {
    16: (16, 32, 256, 4, 4),
    32: (32, 32, 256, 4, 4),
    64: (64, 64, 128, 4, 4),
    128: (64, 128, 128, 8, 3),
}
MAX_TOKENS = max(CONFIGS)  # larger M is not what this kernel is for (model.fp8 picks the path)
MIN_PROGRAMS = 264  # about two programs per SM on an H100 / H200: narrower tiles below that


def config(m: int, n: int) -> tuple[int, int, int, int, int]:
    """The launch configuration for M tokens and N output channels (M <= MAX_TOKENS)."""
    if not 0 < m <= MAX_TOKENS:
        raise ValueError(f"the weight-only fp8 product takes 1..{MAX_TOKENS} tokens, got {m}")
    bucket = next(b for b in sorted(CONFIGS) if m <= b)
    block_m, block_n, block_k, warps, stages = CONFIGS[bucket]
    while block_n > 16 and triton.cdiv(n, block_n) * triton.cdiv(m, block_m) < MIN_PROGRAMS:
        block_n //= 2
    return block_m, block_n, block_k, warps, stages


@triton.jit
def _fp8_weight_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, stride_x, stride_y, K: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1]
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # [1, BLOCK_N]: w is [N, K] row-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype))
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def fp8_weight_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    launch: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * scale [N, 1]).T (+ bias) -> [M, N] in x's dtype.
    `launch` overrides `config` (the sweep in bench/engine/fp8_gemm.py)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.is_contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k, warps, stages = launch or config(m, n)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _fp8_weight_gemm_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, y, m, n, x.stride(0), y.stride(0),
        K=k, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
