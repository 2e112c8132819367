"""Moving an accepted tree path's KV into the sequence's contiguous positions (model.tree_kv)."""

from __future__ import annotations

import torch

from verifypd.model.tree_kv import accepted_moves, move_kv, move_rows, slots_at


def test_accepted_path_lands_in_contiguous_positions():
    block_size, layers = 4, 2
    pool = torch.randn(2, layers, 8, block_size, 1, 3)
    tables = torch.tensor([[5, 2, 7, 0], [1, 3, 6, 4]])
    base = torch.tensor([3, 6])  # the roots' positions
    # row 0 accepted nodes 2 then 5 (depths 1, 2); row 1 accepted node 1 only (already in place)
    path = torch.tensor([[0, 2, 5, 0], [0, 1, 0, 0]])
    accepted = torch.tensor([2, 1])
    before = pool.clone()
    flat = before.view(2, layers, -1, 1, 3)
    src, dst = accepted_moves(tables, base, path, accepted, block_size)
    move_kv(pool, src, dst)
    after = pool.view(2, layers, -1, 1, 3)
    at = lambda row, index: int(slots_at(tables[row : row + 1], torch.tensor([[index]]), block_size))  # noqa: E731
    assert torch.equal(after[:, :, at(0, 4)], flat[:, :, at(0, 3 + 2)])  # depth 1 <- node 2
    assert torch.equal(after[:, :, at(0, 5)], flat[:, :, at(0, 3 + 5)])  # depth 2 <- node 5 (read before written)
    assert torch.equal(after[:, :, at(1, 7)], flat[:, :, at(1, 7)])
    touched = {at(0, 4), at(0, 5)}
    others = [s for s in range(flat.shape[2]) if s not in touched]
    assert torch.equal(after[:, :, others], flat[:, :, others])
    rows = torch.arange(float(flat.shape[2]))[:, None]
    move_rows(rows, src, dst)
    assert rows[at(0, 5), 0] == at(0, 8)
