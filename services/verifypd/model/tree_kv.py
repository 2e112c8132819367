"""Per-position state of draft trees: where a tree's nodes sit in a pool, and moving the accepted
path's entries into the sequence's contiguous positions after a verify (spec_decode.tree).

A tree of N nodes for a sequence whose pending token sits at position n uses the cache indices
n .. n + N - 1 (node j at n + j; node 0, the root, is the pending token itself, so its slot is already
its final one). After acceptance the path's node j_d (depth d) belongs at n + d; j_d >= d, and every
slot moved to (n + 1 .. n + a) is read before it is written (a gather, then a scatter), so one
indexed copy per pool does it, KV of every layer at once.
"""

from __future__ import annotations

import torch


def slots_at(tables: torch.Tensor, index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slots [B, M] of cache indices index [B, M] through block tables [B, W]."""
    block = tables.long().gather(1, index // block_size)
    return block * block_size + index % block_size


def move_kv(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """pool [2, layers, blocks, block_size, kv_heads, D]; src/dst [M] slots: K/V of every layer at
    src copied to dst (all read first)."""
    flat = pool.view(pool.shape[0], pool.shape[1], -1, *pool.shape[4:])
    flat[:, :, dst] = flat[:, :, src]


def move_rows(tensor: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """A slot-addressed tensor [slots, ...] (a FeaturePool's): rows src copied to dst."""
    tensor[dst] = tensor[src]


def accepted_moves(
    tables: torch.Tensor, base: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) slots [B * D] for the accepted path: depth d's node to cache index base + d. base [B]:
    the root's cache index; path [B, D + 1] accepted node indices (path[:, 0] = 0, valid to
    accepted + 1). Fixed shape (CUDA-graph safe): past a row's accepted depth src = dst (a no-op copy)."""
    depth = torch.arange(1, path.shape[1], device=path.device)[None, :].expand(path.shape[0], -1)
    node = torch.where(depth <= accepted[:, None], path[:, 1:], depth)
    src = slots_at(tables, base[:, None] + node, block_size).reshape(-1)
    dst = slots_at(tables, base[:, None] + depth, block_size).reshape(-1)
    return src, dst
