"""The shift kernel of model.verdict_shift: a feature draft's catch-up fitted on the device to the verdict
of the verify call before it (one program per row; the rule and its torch reference are in
model.verdict_shift)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def shift_kernel(
    ids_ptr,
    pos_ptr,
    slots_ptr,
    feat_ptr,
    last_ptr,
    vrows_ptr,
    vks_ptr,
    verdict_ptr,
    stride_v,
    query,
    scratch_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    v = tl.load(vrows_ptr + row)
    if v >= 0:
        k = tl.load(vks_ptr + row)
        accepted = tl.load(verdict_ptr + v * stride_v).to(tl.int64)
        final = tl.load(verdict_ptr + v * stride_v + 1).to(tl.int64)
        shift = k - accepted
        cells = tl.arange(0, BLOCK)
        src = cells - shift
        has = (cells < query) & (src >= 0)
        base = row * query
        old_id = tl.load(ids_ptr + base + src, mask=has, other=0)
        old_pos = tl.load(pos_ptr + base + src, mask=has, other=0)
        old_slot = tl.load(slots_ptr + base + src, mask=has, other=-1)
        old_feat = tl.load(feat_ptr + base + src, mask=has, other=scratch_row)
        first_pos = tl.load(pos_ptr + base)
        i = src - (query - 1 - k)  # index of the cell's token among y_0 .. y_k
        device_part = has & (i >= 0)
        drafted = tl.load(verdict_ptr + v * stride_v + 2 + i, mask=device_part & (i < accepted), other=0)
        new_id = tl.where(device_part, tl.where(i < accepted, drafted.to(tl.int64), final), old_id)
        new_pos = tl.where(has, old_pos, first_pos)
        new_slot = tl.where(has, old_slot, -1)
        new_feat = tl.where(has, old_feat, scratch_row)
        tl.debug_barrier()  # every cell of the row is read before any is written (in place)
        ok = cells < query
        tl.store(ids_ptr + base + cells, new_id, mask=ok)
        tl.store(pos_ptr + base + cells, new_pos, mask=ok)
        tl.store(slots_ptr + base + cells, new_slot, mask=ok)
        tl.store(feat_ptr + base + cells, new_feat, mask=ok)
        tl.store(last_ptr + row, tl.load(last_ptr + row) - shift)
