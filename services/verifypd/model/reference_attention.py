"""The torch reference attention backend of the paged forward (model.llama: the CPU default, and the
oracle of the Triton kernels in tests): new K/V scattered into the pool by slot, each context gathered
through its block table and attended with `scaled_dot_product_attention` on a padded batch.

    q [T, heads, D];  k_cache, v_cache [blocks, block_size, kv_heads, D] (one layer's pool)
    padded q [B, heads, Q, D];  gathered keys / values [B, kv_heads, C, D]
    mask [B, 1, Q, C] additive (0 or -inf), C = the block tables' width in tokens
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from verifypd.model import kv_quant


class AttentionBatch(Protocol):
    """What the reference path reads of a batch (model.llama.BatchLayout, which imports this module)."""

    positions: torch.Tensor  # [T] long
    block_tables: torch.Tensor  # [B, W]
    query_start: torch.Tensor  # [B + 1] int32
    max_query: int

    @property
    def tree(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None: ...


def reference_attention(q, k_cache, v_cache, batch: AttentionBatch, mask, scale: float, softcap: float | None):
    """[T, heads * D]: the new tokens' attention over their contexts (their own K/V already stored)."""
    heads, head_dim = q.shape[1], q.shape[2]
    seq_of, idx_in_run = token_coordinates(batch)
    tables = batch.block_tables.long()
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)  # [B, kvh, C, D]
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    if kv_quant.is_fp8(k_cache):
        keys = kv_quant.dequantize(keys, q.dtype, kv_quant.K_SCALE)
        values = kv_quant.dequantize(values, q.dtype, kv_quant.V_SCALE)
    # Slots past a sequence's last position may hold garbage, NaN included: zero them, since
    # an additive -inf mask does not stop NaN (0 * NaN is NaN in the weighted sum).
    visible = mask.isfinite().any(2)  # [B, 1, C]
    keys = torch.where(visible[..., None], keys, 0)
    values = torch.where(visible[..., None], values, 0)
    qp = q.new_zeros(tables.shape[0], batch.max_query, heads, head_dim)
    qp[seq_of, idx_in_run] = q
    if softcap:  # scaled_dot_product_attention has no soft-capping: spelled out
        out = softcapped_attention(qp.transpose(1, 2), keys, values, mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, heads, Q, D]
    return out.transpose(1, 2)[seq_of, idx_in_run].reshape(-1, heads * head_dim)


def attention_mask(batch: AttentionBatch, block_size: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, Q, C]: query at position p sees keys at positions <= p, and with a
    `window`, only those > p - window; in tree mode, the prefix and its tree bits' slots."""
    num_seqs, max_blocks = batch.block_tables.shape
    ctx = max_blocks * block_size
    seq_of, idx_in_run = token_coordinates(batch)
    qpos = torch.full((num_seqs, batch.max_query), -1, dtype=torch.long, device=batch.positions.device)
    qpos[seq_of, idx_in_run] = batch.positions
    kpos = torch.arange(ctx, device=qpos.device)
    if batch.tree is not None:
        if window:
            raise ValueError("tree attention takes no sliding window")
        allowed = tree_allowed(batch, kpos, seq_of, idx_in_run)
    else:
        allowed = kpos[None, None, :] <= qpos[:, :, None]
    if window:
        allowed &= kpos[None, None, :] > qpos[:, :, None] - window
    allowed[..., 0] |= qpos < 0  # padded query rows attend one key so softmax stays finite
    mask = torch.zeros(allowed.shape, dtype=dtype, device=qpos.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


def tree_allowed(batch: AttentionBatch, kpos: torch.Tensor, seq_of: torch.Tensor, idx_in_run: torch.Tensor):
    """[B, Q, C] bool: which key slots each query of a tree batch sees (the kernel's tree rule)."""
    assert batch.tree is not None
    base, length, bits = batch.tree
    base, length = base.long()[seq_of][:, None], length.long()[seq_of][:, None]
    rel = kpos[None, :] - base
    in_tree = (rel >= 0) & (rel < length)
    bit = (bits.long()[:, None] >> rel.clamp(0, 63)) & 1
    seen = (kpos[None, :] < base) | (in_tree & (bit != 0))
    allowed = torch.zeros(
        batch.block_tables.shape[0], batch.max_query, kpos.numel(), dtype=torch.bool, device=kpos.device
    )
    allowed[seq_of, idx_in_run] = seen
    return allowed


def softcapped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """q [B, heads, Q, D], k/v [B, kv_heads, C, D], mask [B, 1, Q, C] -> [B, heads, Q, D]: softmax over
    cap * tanh(q.k * scale / cap) + mask, in float32 (transformers' eager Gemma 2 attention)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap + mask
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def store_kv_reference(k, v, k_cache, v_cache, slots) -> None:
    """Plain torch twin of `store_kv`: k/v [T, kvh, D] into the flat cache (quantized when it is
    fp8, model.kv_quant); negative slots skipped."""
    keep = slots >= 0
    if not bool(keep.all()):
        k, v, slots = k[keep], v[keep], slots[keep]
    if kv_quant.is_fp8(k_cache):
        k, v = kv_quant.quantize(k, kv_quant.K_SCALE), kv_quant.quantize(v, kv_quant.V_SCALE)
    k_cache[slots] = k
    v_cache[slots] = v


def token_coordinates(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each token [T], index of the token within its sequence's run [T])."""
    starts = batch.query_start.long()
    lens = starts[1:] - starts[:-1]
    seq_of = torch.repeat_interleave(torch.arange(lens.numel(), device=starts.device), lens)
    return seq_of, torch.arange(seq_of.numel(), device=starts.device) - starts[seq_of]
