"""The fit kernel of model.verify_fit: a verify call's layout fitted on the device to the verdict of the
call before it (one program per row; the rule and its torch reference are in model.verify_fit)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fit_kernel(
    ids_ptr,
    pos_ptr,
    slots_ptr,
    tables_ptr,
    vrows_ptr,
    vks_ptr,
    verdict_ptr,
    stride_v,
    stride_t,
    query,
    block_size,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    v = tl.load(vrows_ptr + row)
    if v >= 0:
        shift = tl.load(vks_ptr + row) - tl.load(verdict_ptr + v * stride_v).to(tl.int64)
        final = tl.load(verdict_ptr + v * stride_v + 1).to(tl.int64)
        cells = tl.arange(0, BLOCK)
        ok = cells < query
        base = row * query
        pos = tl.load(pos_ptr + base + cells, mask=ok, other=0) - shift
        slot = tl.load(slots_ptr + base + cells, mask=ok, other=-1)
        writes = ok & (slot >= 0)
        block = tl.load(tables_ptr + row * stride_t + pos // block_size, mask=writes, other=0)
        tl.store(pos_ptr + base + cells, pos, mask=ok)
        tl.store(slots_ptr + base + cells, tl.where(writes, block * block_size + pos % block_size, -1), mask=ok)
        tl.store(ids_ptr + base, final)
