"""A feature draft's catch-up fitted on the device to the verdict of the verify call before it
(engine.draft_after): the draft call is launched before the host knows how many drafts were accepted.

The host lays each row out for the longest outcome, every one of the verify call's k drafts accepted:
its fed tokens x_s .. x_n (known), then the verify call's k + 1 tokens y_0 .. y_k (placeholders), right-
aligned in Q cells as model.eagle_chain's CallInputs are, with `last` = n + k + 1. With a drafts
accepted the row's real input is x_s .. x_n, y_0 .. y_a (y_i = draft i + 1 for i < a, y_a = the
target's own token: the verdict's `final`), so every cell moves k - a places to the right: cells that
fall off the right end are dropped, cells that come in on the left are padding (slot -1, the features'
scratch row, token 0, the row's first position: they write nowhere), and `last` becomes n + a + 1. The
device part's tokens are written from the verdict as they move.

    verdict [Rv, W] int   the verify call's rows: accepted a, final token, its K = W - 2 drafts
    vrows [R] long        the verdict row of each draft row; -1: not fitted (padding rows)
    vks [R] long          k of that verify row (its device part is k + 1 cells); 0 where vrows is -1
    ids, positions, slots, feature_rows [R * Q] long, last [R] long: CallInputs, rewritten in place

One Triton launch (a program per row) on CUDA; `shift_reference` is the same rule in torch (CPU, tests).
"""

from __future__ import annotations

from typing import Protocol

import torch

from verifypd.model.verify_fit import kernel_block


class ShiftInputs(Protocol):
    """What the shift reads and rewrites of a call's inputs (model.eagle_chain.CallInputs)."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    feature_rows: torch.Tensor
    last: torch.Tensor
    vrows: torch.Tensor
    vks: torch.Tensor
    query: int


def shift_to_verdict(inp: ShiftInputs, verdict: torch.Tensor, scratch_row: int, use_triton: bool) -> None:
    """Fits the catch-up inputs `inp` (eagle_chain.CallInputs, with vrows / vks filled) to `verdict`."""
    rows = inp.last.shape[0]
    if not use_triton:
        shift_reference(inp, verdict, scratch_row)
        return
    from verifypd.model.kernels.shift import shift_kernel  # the Triton path only: CPU installs have no Triton

    shift_kernel[(rows,)](
        inp.ids,
        inp.positions,
        inp.slots,
        inp.feature_rows,
        inp.last,
        inp.vrows,
        inp.vks,
        verdict,
        verdict.stride(0),
        inp.query,
        scratch_row,
        BLOCK=kernel_block(inp.query),
        num_warps=1,
    )


def shift_reference(inp: ShiftInputs, verdict: torch.Tensor, scratch_row: int) -> None:
    rows, query = inp.last.shape[0], inp.query
    active = inp.vrows >= 0
    rows_v = verdict[inp.vrows.clamp(min=0)].long()  # [R, W]
    accepted, final = rows_v[:, 0], rows_v[:, 1]
    shift = torch.where(active, inp.vks - accepted, torch.zeros_like(accepted))
    cells = torch.arange(query, device=inp.last.device)[None, :]
    src = cells - shift[:, None]
    has = src >= 0
    src_c = src.clamp(min=0)
    view = lambda t: t.view(rows, query)  # noqa: E731
    old_id, old_pos = view(inp.ids).gather(1, src_c), view(inp.positions).gather(1, src_c)
    old_slot, old_feat = view(inp.slots).gather(1, src_c), view(inp.feature_rows).gather(1, src_c)
    i = src - (query - 1 - inp.vks[:, None])
    device_part = has & (i >= 0) & active[:, None]
    drafted = (
        rows_v[:, 2:].gather(1, i.clamp(0, max(rows_v.shape[1] - 3, 0))) if rows_v.shape[1] > 2 else torch.zeros_like(i)
    )
    y = torch.where(i < accepted[:, None], drafted, final[:, None])
    view(inp.ids).copy_(torch.where(device_part, y, torch.where(has, old_id, torch.zeros_like(old_id))))
    view(inp.positions).copy_(torch.where(has, old_pos, view(inp.positions)[:, :1].expand_as(old_pos)))
    view(inp.slots).copy_(torch.where(has, old_slot, torch.full_like(old_slot, -1)))
    view(inp.feature_rows).copy_(torch.where(has, old_feat, torch.full_like(old_feat, scratch_row)))
    inp.last.sub_(shift)
