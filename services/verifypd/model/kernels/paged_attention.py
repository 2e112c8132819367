"""Paged attention in Triton: reads K/V in place through the block table (no gathered copy).

One kernel serves decode (1 query per sequence), verify (k+1 queries, causal inside the run) and
prefill / chunked prefill (a run of new tokens after a cached prefix). GQA and MHA alike: a
program owns one (sequence, kv head, tile of query rows) and its rows are (token, head-in-group)
pairs, so the K/V it loads are shared by all query heads of the group.

Shapes (T = new tokens of the batch, B = sequences, D = head_dim):
    q            [T, heads, D]                     already rotated (RoPE)
    k_cache      [num_blocks, block_size, kv_heads, D]   (one layer's view of the pool), in q's dtype or
                                                   float8_e4m3fn (model.kv_quant: k ~= k_cache * k_scale)
    block_tables [B, W] int32                      W >= blocks any sequence uses
    positions    [T] int64                         absolute position of each new token, non-decreasing
                                                   within a sequence's run
    query_start  [B + 1] int32                     tokens of sequence b are q[query_start[b]:query_start[b+1]]
    out          [T, heads, D]

A query at position p attends keys at positions 0..p of its sequence; with a `window` (sliding-window
layers) only keys at positions > p - window, and the tile's loop starts at the first key any of its
rows sees. `softcap` > 0 (Gemma 2) caps the scaled scores: cap * tanh(score / cap), before the mask.
The keys' slots were written before the call (the new tokens' K/V go into the pool first). Slots
outside what a tile needs are never loaded, and loads are masked to `other=0`, so garbage (even
NaN) in unwritten, rolled-back or out-of-window slots cannot reach the output.

Tree mode (draft trees, spec_decode.tree): `tree_base` [B], `tree_len` [B] (<= 64) and `tree_bits` [T]
int64. Sequence b's tree nodes sit in the key slots [tree_base[b], tree_base[b] + tree_len[b]) (all
written before the call); a query sees every key before tree_base (the committed prefix) and the tree
slot tree_base + j iff bit j of its tree_bits is set (its ancestors and itself). `positions` then only
place RoPE (depth-based, so siblings share one) and are not read here; no window, no position order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


# The block-table row stride varies with the batch's widest table: don't compile a variant per value.
@triton.jit(do_not_specialize=["stride_bt", "stride_ps"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    positions_ptr,
    query_start_ptr,
    tree_base_ptr,
    tree_len_ptr,
    tree_bits_ptr,
    part_ptr,
    part_ml_ptr,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_ps,
    scale_log2,
    v_scale,
    window,
    softcap,
    split_min_keys,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    TREE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    if tile * BLOCK_M < q_len * GROUP:
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        token = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = token < q_len
        pos = tl.load(positions_ptr + q_begin + token, mask=row_ok, other=-1)
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(
            q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        # Keys this tile needs: 0 .. the position of its last token (positions never decrease
        # within a run, so that token's position is the tile's maximum).
        last_token = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
        if TREE:  # the prefix, then the tree's slots; each row's bits pick the tree keys it sees
            tree_base = tl.load(tree_base_ptr + seq).to(tl.int64)
            kv_len = tree_base + tl.load(tree_len_ptr + seq)
            bits = tl.load(tree_bits_ptr + q_begin + token, mask=row_ok, other=0).to(tl.int64)
        else:
            kv_len = tl.load(positions_ptr + q_begin + last_token) + 1
        first_key = 0
        if SLIDING:  # the tile's first token has its smallest position, so the earliest key it sees
            first_pos = tl.load(positions_ptr + q_begin + (tile * BLOCK_M) // GROUP)
            first_seen = first_pos - window + 1
            first_key = tl.maximum(first_seen, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        table = block_tables_ptr + seq * stride_bt
        key_end = kv_len
        if SPLITS > 1:  # this program's share of the tile's keys: a run of whole BLOCK_N tiles
            per = tl.cdiv(tl.cdiv(kv_len - first_key, SPLITS), BLOCK_N) * BLOCK_N
            # A sequence shorter than split_min_keys keeps all its keys in part 0, walked as the
            # unsplit kernel walks them; the combine then reproduces the unsplit output bit for bit
            # (one weight exp2(0) = 1, the idle parts' weights 0). So whether a sequence's attention
            # is split depends on its own length only, not on which graph its batch replayed.
            per = tl.where(kv_len < split_min_keys, kv_len - first_key + BLOCK_N, per)
            first_key = first_key + split * per
            key_end = kv_len - tl.maximum(kv_len - first_key - per, 0)  # min(kv_len, first_key + per)
        for start in range(first_key, key_end, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            k_ok = kpos < key_end
            if SLIDING:  # keys before the window are not even loaded: their blocks may be reused
                k_ok = k_ok & (kpos >= first_seen)
            page = tl.load(table + kpos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            slot = page * stride_kb + (kpos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
            # An fp8 cache is widened to q's dtype (exact); its k_scale is folded into scale_log2.
            k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=k_ok[:, None], other=0.0).to(q.dtype)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale_log2  # scores in log2 units (the softmax runs on exp2)
            if SOFTCAP:  # softcap is in log2 units too: cap * tanh(x / cap), with
                # tanh(y) = 1 - 2 / (exp2(2y log2 e) + 1), finite at both tails (overflow gives 1)
                s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap)) + 1.0))
            if TREE:
                rel = kpos.to(tl.int64) - tree_base
                in_tree = (rel >= 0) & k_ok  # (a shift by >= 64 is undefined: never taken)
                bit = (bits[:, None] >> tl.where(in_tree, rel, 0)[None, :]) & 1
                seen = (kpos[None, :] < tree_base) | (in_tree[None, :] & (bit != 0))
            else:
                seen = kpos[None, :] <= pos[:, None]
            if SLIDING:
                seen = seen & (kpos[None, :] > pos[:, None] - window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=k_ok[:, None], other=0.0).to(q.dtype)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
            m_i = m_new
        if SPLITS > 1:  # unnormalized partials [SPLITS, T, heads, D] and (max, sum) [SPLITS, T, heads, 2]
            row = split * stride_ps + (q_begin + token) * (GROUP * NUM_KV_HEADS) + head
            tl.store(part_ptr + row[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + row * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_ok)
        else:
            out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # v_scale: an fp8 cache's (else 1)
            tl.store(
                out_ptr + (q_begin + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None],
            )


@triton.jit
def _combine_splits_kernel(
    part_ptr,
    part_ml_ptr,
    out_ptr,
    stride_ps,
    stride_ot,
    stride_oh,
    v_scale,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """One (token, head) row: the softmax-weighted sum of its SPLITS partials (log2 units)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    row = token * NUM_HEADS + head
    parts = tl.arange(0, SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(part_ml_ptr + (parts * stride_ps + row) * 2)
    l_part = tl.load(part_ml_ptr + (parts * stride_ps + row) * 2 + 1)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # no key seen by any split: out 0
    w = tl.exp2(m - m_safe)  # splits that saw nothing (m = -inf) weigh 0
    total = tl.sum(w * l_part, axis=0)
    acc = tl.load(part_ptr + (parts * stride_ps + row)[:, None] * HEAD_DIM + dims[None, :])
    out = tl.sum(acc * w[:, None], axis=0) * (v_scale / tl.where(total > 0, total, 1.0))
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


def tile_rows(max_query: int, group: int) -> int:
    """Query rows per program: the smallest power of two >= the rows of one sequence, 16..64."""
    return min(64, max(16, triton.next_power_of_2(max_query * group)))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    query_start: torch.Tensor,
    max_query: int,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tree: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    splits: int = 1,
    split_min_keys: int = 0,
) -> torch.Tensor:
    """See the module doc for shapes. `max_query` bounds the tokens of any one sequence (it sets
    the grid; it may exceed the real maximum, e.g. a CUDA graph's padded size). `window` 0 and
    `softcap` 0 are off (and compiled out). `k_scale` / `v_scale`: an fp8 cache's scales.
    `tree`: (tree_base, tree_len, tree_bits), tree mode. `splits` (a power of two): each program's
    keys are cut into that many parts, run by programs of their own, whose partial softmax sums a
    second kernel combines (split-KV, "flash decoding"): for few sequences over long contexts. The
    parts are cut on the device from each tile's key count, so a CUDA graph may replay it at any
    context; a context shorter than `splits` key tiles leaves parts idle. A sequence with fewer than
    `split_min_keys` keys is not cut (all in part 0): its output equals the unsplit kernel's exactly."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert head_dim == triton.next_power_of_2(head_dim), "head_dim must be a power of two"
    if out is None:
        out = torch.empty_like(q)
    num_seqs = query_start.numel() - 1
    if tree is not None and window:
        raise ValueError("tree attention takes no sliding window")
    tree_base, tree_len, tree_bits = tree if tree is not None else (query_start, query_start, positions)
    if splits < 1 or splits != triton.next_power_of_2(splits):
        raise ValueError(f"splits must be a power of two >= 1, got {splits}")
    block_m = tile_rows(max_query, group)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query * group, block_m) * splits)
    stride_ps = num_tokens * num_heads
    # [splits, T, heads, D] partial sums and [splits, T, heads, 2] (max, sum); unused when splits == 1
    part = torch.empty(
        (splits, num_tokens, num_heads, head_dim) if splits > 1 else (1,), dtype=torch.float32, device=q.device
    )
    part_ml = torch.empty(
        (splits, num_tokens, num_heads, 2) if splits > 1 else (1,), dtype=torch.float32, device=q.device
    )
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        positions,
        query_start,
        tree_base,
        tree_len,
        tree_bits,
        part,
        part_ml,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        stride_ps,
        scale * k_scale * math.log2(math.e),
        v_scale,
        window,
        softcap * math.log2(math.e),
        split_min_keys,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        IEEE=q.dtype == torch.float32,
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        TREE=tree is not None,
        NUM_KV_HEADS=num_kv_heads,
        SPLITS=splits,
        # head_dim 256 (Gemma): the [BLOCK_M, D] float32 accumulator alone is 128 registers a thread
        # at 4 warps; 8 warps halve that. (Not yet timed on a GPU against 4 warps / smaller BLOCK_M.)
        num_warps=4 if head_dim <= 128 else 8,
        num_stages=2,
    )
    if splits > 1:
        _combine_splits_kernel[(num_tokens, num_heads)](
            part,
            part_ml,
            out,
            stride_ps,
            out.stride(0),
            out.stride(1),
            v_scale,
            HEAD_DIM=head_dim,
            NUM_HEADS=num_heads,
            SPLITS=splits,
        )
    return out
