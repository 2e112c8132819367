"""RoPE on q and k, and the KV write into the paged pool, in one launch (Triton).

    qkv [T, (heads + 2 kv_heads) * D]   the fused projection's output (q heads, k heads, v heads)
    cos, sin [positions, D]             tables (HF rotate-half convention: both halves equal)
    positions, slots [T] int64          slot = block_id * block_size + offset, or -1: write nowhere
                                        (a CUDA graph's padding, draft steps past a request's k)
    k_cache, v_cache [slots, kv_heads, D]  one layer's view of the pool, flattened; in the model
                                        dtype, or float8_e4m3fn (model.kv_quant): then k / k_scale
                                        and v / v_scale are stored, saturated to +-448
    q_norm, k_norm [D]                  optional (Qwen3, Gemma 3): each q / k head is RMS-normed
                                        over D with its weight before the rotation
    returns q [T, heads, D] rotated
A program handles one (token, head): heads < `heads` are query heads, the rest key heads (whose
value head is copied beside them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kv_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slots_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    k_scale,
    v_scale,
    stride_t,
    stride_qt,
    stride_cs,
    stride_tab,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HALF)
    pos = tl.load(positions_ptr + token)
    cos = tl.load(cos_ptr + pos * stride_tab + d).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_tab + d).to(tl.float32)
    src = qkv_ptr + token * stride_t + head * 2 * HALF
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    if QK_NORM:  # as model.llama.rms_norm: statistics in float32, rounded to the dtype, times w
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        if head < HEADS:
            w1 = tl.load(q_norm_ptr + d)
            w2 = tl.load(q_norm_ptr + HALF + d)
        else:
            w1 = tl.load(k_norm_ptr + d)
            w2 = tl.load(k_norm_ptr + HALF + d)
        dtype = q_ptr.dtype.element_ty
        x1 = (w1 * (x1 * rstd).to(dtype)).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype)).to(tl.float32)
    out1 = (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty)
    out2 = (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty)
    if head < HEADS:
        dst = q_ptr + token * stride_qt + head * 2 * HALF
        tl.store(dst + d, out1)
        tl.store(dst + HALF + d, out2)
    else:
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            kv_head = head - HEADS
            dst = k_cache_ptr + slot * stride_cs + kv_head * 2 * HALF
            v_src = src + KV_HEADS * 2 * HALF
            vdst = v_cache_ptr + slot * stride_cs + kv_head * 2 * HALF
            v1 = tl.load(v_src + d)
            v2 = tl.load(v_src + HALF + d)
            if FP8_KV:  # from the values rounded to the model dtype, as the reference quantizes them
                cache_ty = k_cache_ptr.dtype.element_ty
                tl.store(dst + d, _saturate(out1.to(tl.float32) / k_scale).to(cache_ty))
                tl.store(dst + HALF + d, _saturate(out2.to(tl.float32) / k_scale).to(cache_ty))
                tl.store(vdst + d, _saturate(v1.to(tl.float32) / v_scale).to(cache_ty))
                tl.store(vdst + HALF + d, _saturate(v2.to(tl.float32) / v_scale).to(cache_ty))
            else:
                tl.store(dst + d, out1)
                tl.store(dst + HALF + d, out2)
                tl.store(vdst + d, v1)
                tl.store(vdst + HALF + d, v2)


@triton.jit
def _saturate(x):
    """Clamped to e4m3's range, explicitly: the stored value then does not depend on how a conversion
    treats overflow (the GPU's cvt saturates; torch's cast gives NaN past 480 in some versions)."""
    return tl.minimum(tl.maximum(x, -448.0), 448.0)


def rope_and_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """`k_scale` / `v_scale`: the fp8 cache's scales (unused for a cache in the model dtype)."""
    tokens = qkv.shape[0]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and cos.is_contiguous()
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens:
        _rope_kv_kernel[(tokens, heads + kv_heads)](
            qkv,
            cos,
            sin,
            positions,
            slots,
            q,
            k_cache,
            v_cache,
            q if q_norm is None else q_norm,  # unread without QK_NORM
            q if k_norm is None else k_norm,
            eps,
            k_scale,
            v_scale,
            qkv.stride(0),
            q.stride(0),
            k_cache.stride(0),
            cos.stride(0),
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=head_dim // 2,
            QK_NORM=q_norm is not None,
            FP8_KV=k_cache.dtype == torch.float8_e4m3fn,
            num_warps=1,
        )
    return q
