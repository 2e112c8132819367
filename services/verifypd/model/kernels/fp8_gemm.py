"""The fp8 linear of a forward of few tokens (Triton): per-token activation quantization fused into
a split-K GEMV over the fp8 weight, the same product model.fp8 computes for any number of tokens.

    x [M, K]         bfloat16 / float16, unit stride along K; M <= MAX_TOKENS (a decode or verify step)
    w [N, K]         float8_e4m3fn, contiguous;  scale [N] float32: w[n, k] ~= w8[n, k] * scale[n]
    input_scale      None: token m scaled by s[m] = max(amax(|x[m]|), MIN_AMAX) / 448;
                     else that 0-d float32 scale for every token (a static checkpoint)
    bias [N]         optional, x's dtype
    returns          y[m, n] = sum_k e4m3(x[m, k] / s[m]) * w8[n, k] * s[m] * scale[n] (+ bias),
                     accumulated in float32, in x's dtype

Why not quantize_rows + `torch._scaled_mm` at this size: on an H200 `_scaled_mm` reads the weights
of a one-token product at 0.25-0.50 of the copy bandwidth (bench/engine/fp8_gemm.py), and that
bandwidth is all a skinny GEMM is bound by. Here the weight bytes are spread over a grid of about
WAVES programs per SM: BLOCK_N output channels times one of SPLITS slices of K each. A program
recomputes its tokens' amax over the whole row (M * K elements, from L2) instead of waiting on a
quantization kernel, quantizes its slice in registers and multiplies on the fp8 tensor cores. With
SPLITS > 1 each slice's float32 partial sums go to a workspace [SPLITS, M, N], which a second launch
adds up in a fixed order (so a result does not depend on timing) and scales.

The launch configuration is a pure function of (M, N, K) and the SM count (`plan`), so a CUDA graph
capture never tunes. K is a compile-time constant: a model has a handful of distinct K.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

MAX_TOKENS = 16  # larger M goes to quantize_rows + _scaled_mm (model.fp8)
BLOCK_M = 16  # tl.dot's least M: up to 16 tokens share every weight tile
BLOCK_N = 64
BLOCK_K = 256
WAVES = 4  # programs per SM the grid aims at (bytes in flight on every SM)
WARPS, STAGES = 4, 4
ROWS_MAX = 4  # up to this many tokens the CUDA-core kernel can run them (_fp8_gemv_rows_kernel)
CUDA_CORE_BLOCK_N = 16
CUDA_CORE_ELEMENTS = 4096  # ROWS * BLOCK_N * BLOCK_K products held per program (32 registers a lane)


@dataclass(frozen=True)
class Launch:
    block_n: int
    block_k: int
    splits: int  # slices of K, each its own program per column tile
    iters: int  # BLOCK_K steps per slice
    warps: int
    stages: int
    cuda_cores: bool  # the CUDA-core kernel (at most ROWS_MAX tokens), else tl.dot's


@cache
def sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if torch.cuda.is_available() else 132


def plan(
    m: int, n: int, k: int, sms: int, block_n: int | None = None, block_k: int | None = None, waves: int = WAVES,
    warps: int = WARPS, stages: int = STAGES, cuda_cores: bool | None = None,
) -> Launch:  # fmt: skip
    """How to cut the product of M tokens and an [N, K] weight for a GPU of `sms` SMs: up to
    ROWS_MAX tokens on the CUDA cores (tiles of CUDA_CORE_ELEMENTS products per program and step),
    more on the tensor cores; K split until the grid has about `waves` programs per SM (never into
    empty slices)."""
    cuda_cores = m <= ROWS_MAX if cuda_cores is None else cuda_cores
    if cuda_cores:
        block_n = block_n or CUDA_CORE_BLOCK_N
        block_k = block_k or CUDA_CORE_ELEMENTS // (triton.next_power_of_2(m) * block_n)
    block_n, block_k = block_n or BLOCK_N, block_k or BLOCK_K
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    splits = max(1, min(steps, round(waves * sms / tiles)))
    iters = triton.cdiv(steps, splits)
    return Launch(block_n, block_k, triton.cdiv(steps, iters), iters, warps, stages, cuda_cores)


@triton.jit
def _fp8_splitk_kernel(
    x_ptr, w_ptr, scale_ptr, input_scale_ptr, bias_ptr, out_ptr, M, N, stride_x,
    K: tl.constexpr, ITERS: tl.constexpr, SPLITS: tl.constexpr, FP8_LIMIT: tl.constexpr,
    FLOOR: tl.constexpr, STATIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # [BLOCK_M, 1]
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * K  # [1, BLOCK_N]: w is [N, K] row-major
    if STATIC:
        s = tl.zeros((BLOCK_M,), dtype=tl.float32) + tl.load(input_scale_ptr)
    else:  # each token's amax over its whole row (as model.kernels.fp8_quant computes it)
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        s = tl.maximum(amax, FLOOR) / FP8_LIMIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    start = split * (ITERS * BLOCK_K)
    for i in range(ITERS):
        k = start + i * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        # The token's fp8 value (rounded to nearest even, saturated at +-448), as quantize_rows stores it.
        q = tl.minimum(tl.maximum(x / s[:, None], -FP8_LIMIT), FP8_LIMIT).to(w_ptr.dtype.element_ty)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(q, w, acc)
    acc = acc * s[:, None]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS == 1:  # the epilogue here: one launch
        acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:  # partial sums of this slice: workspace [SPLITS, M, N] float32
        tl.store(out_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=ok)


@triton.jit
def _fp8_gemv_rows_kernel(
    x_ptr, w_ptr, scale_ptr, input_scale_ptr, bias_ptr, out_ptr, M, N, stride_x,
    K: tl.constexpr, ITERS: tl.constexpr, SPLITS: tl.constexpr, FP8_LIMIT: tl.constexpr,
    FLOOR: tl.constexpr, STATIC: tl.constexpr, HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # The CUDA-core twin of _fp8_splitk_kernel for up to ROWS (<= 4) tokens: the weight tile is read
    # along K (its contiguous axis), multiplied into float32 products kept per lane, and reduced over
    # K once at the end, so the loop is loads, conversions and FMAs only.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.arange(0, ROWS)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < N
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x  # [ROWS, 1]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    if STATIC:
        s = tl.zeros((ROWS,), dtype=tl.float32) + tl.load(input_scale_ptr)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None] & ((k0 + ks) < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        s = tl.maximum(amax, FLOOR) / FP8_LIMIT
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
    start = split * (ITERS * BLOCK_K)
    for i in range(ITERS):
        k = start + i * BLOCK_K + ks
        k_ok = k < K
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / s[:, None], -FP8_LIMIT), FP8_LIMIT).to(w_ptr.dtype.element_ty)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        acc += q.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    out = tl.sum(acc, axis=2) * s[:, None]  # [ROWS, BLOCK_N]
    ok = row_ok[:, None] & col_ok[None, :]
    if SPLITS == 1:
        out = out * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptr + (split * M + rows[:, None]) * N + cols[None, :], out, mask=ok)


@triton.jit
def _splitk_reduce_kernel(
    part_ptr, scale_ptr, bias_ptr, y_ptr, M, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat index into [M, N]
    ok = i < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLITS):  # in slice order: the same sum on every replay
        acc += tl.load(part_ptr + split * M * N + i, mask=ok, other=0.0)
    col = i % N
    acc = acc * tl.load(scale_ptr + col, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    limit: float,
    floor: float,
    bias: torch.Tensor | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """x [M, K] through the fp8 weight [N, K] (module doc) -> [M, N] in x's dtype. `limit`: the fp8
    maximum (448), `floor`: the smallest amax a dynamic scale is taken from (model.fp8 passes its
    constants). `launch` overrides `plan` (the sweep in bench/engine/fp8_gemm.py)."""
    m, k = x.shape
    n = weight.shape[0]
    if not 0 < m <= MAX_TOKENS:
        raise ValueError(f"the fused fp8 GEMV takes 1..{MAX_TOKENS} tokens, got {m}")
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.is_contiguous()
    go = launch or plan(m, n, k, sm_count(x.device.index or 0) if x.is_cuda else 132)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if go.splits == 1 else torch.empty(go.splits, m, n, dtype=torch.float32, device=x.device)
    unused = scale  # stands in for the pointers a launch does not read
    rows_kernel = go.cuda_cores
    assert m <= ROWS_MAX or not rows_kernel, "the CUDA-core kernel holds every token in each program"
    kernel = _fp8_gemv_rows_kernel if rows_kernel else _fp8_splitk_kernel
    kernel[(triton.cdiv(n, go.block_n), go.splits)](
        x, weight, scale, input_scale if input_scale is not None else unused, bias if bias is not None else unused,
        out, m, n, x.stride(0), k, go.iters, go.splits, limit, floor, input_scale is not None, bias is not None,
        triton.next_power_of_2(m) if rows_kernel else BLOCK_M, go.block_n, go.block_k,
        num_warps=go.warps, num_stages=go.stages,
    )  # fmt: skip
    if go.splits > 1:
        block = 1024
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            out, scale, bias if bias is not None else unused, y, m, n, SPLITS=go.splits, HAS_BIAS=bias is not None,
            BLOCK=block,
        )  # fmt: skip
    return y
