"""Writes the new tokens' K and V into the paged pool in one launch (Triton), skipping tokens whose
slot is negative: the padding of a CUDA graph's fixed-size batch and draft steps past a request's
k write nowhere, so no scratch block is needed.

    k, v     [T, kv_heads, D]
    k_cache  [num_blocks * block_size, kv_heads, D]   (one layer's view of the pool, flattened)
    slots    [T] int64: block_id * block_size + offset, or -1
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_vt, stride_cs,
                     ROW: tl.constexpr, ROW_POW2: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        cols = tl.arange(0, ROW_POW2)
        ok = cols < ROW
        k = tl.load(k_ptr + token * stride_kt + cols, mask=ok)
        v = tl.load(v_ptr + token * stride_vt + cols, mask=ok)
        tl.store(k_cache_ptr + slot * stride_cs + cols, k, mask=ok)
        tl.store(v_cache_ptr + slot * stride_cs + cols, v, mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k/v rows must be contiguous over (kv_heads, D); the cache over (kv_heads, D) per slot."""
    num_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
    assert k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2]
    assert k_cache.stride(0) == row and k_cache.is_contiguous()
    if num_tokens:
        _store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), k_cache.stride(0),
                                        ROW=row, ROW_POW2=triton.next_power_of_2(row), num_warps=4)
