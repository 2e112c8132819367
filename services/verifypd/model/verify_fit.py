"""A verify call fitted on the device to the verdict of the verify call before it (engine.spec_ahead):
launched before the host knows how many of that call's drafts were accepted.

The host lays each row out for the previous call's longest outcome, all of its k drafts accepted:
the pending token (a placeholder) at n + k + 1, then this call's drafts (on the device already: the
draft call made right after the previous verify call, engine.draft_after). With a drafts accepted the
row's real pending token is the verdict's `final` and it sits at n + a + 1, so every position of the
row moves back by k - a; slots follow the positions through the row's block table (its blocks were
reserved for the longest outcome); padding cells (slot -1) keep writing nowhere. A shift never makes
a position negative: the pending token's position only falls to n + 1.

    verdict [Rv, W] long     the previous call's rows: accepted a, final token, its drafts
    vrows [R] long           the verdict row of each row of this call; -1: not fitted (padding rows)
    vks [R] long             k of that verdict row (0 where vrows is -1)
    ids, positions, slots [R * Q] long, tables [R, width] long: this call's layout, rewritten in place

One Triton launch (a program per row) on CUDA; `fit_reference` is the same rule in torch (CPU, tests).
"""

from __future__ import annotations

import torch

from verifypd.model.sampler import small_tensor


def kernel_block(query: int) -> int:
    """BLOCK of a fit or shift launch over rows of `query` cells: one compiled Triton variant per value."""
    return 1 << (max(query, 2) - 1).bit_length()  # the next power of two, as triton.next_power_of_2


def kernel_variant(query: int) -> tuple[int, str]:
    """What of a query picks the compiled variant: its BLOCK, and the class Triton specializes an integer
    argument by (1, a multiple of 16, any other)."""
    return kernel_block(query), "1" if query == 1 else "16k" if query % 16 == 0 else "n"


def variant_queries(max_query: int) -> list[int]:
    """A query of each variant that calls of up to `max_query` cells take (each variant's largest)."""
    largest = {kernel_variant(q): q for q in range(1, max_query + 1)}
    return sorted(largest.values())


def fit_to_verdict(
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    vrows: torch.Tensor,
    vks: torch.Tensor,
    verdict: torch.Tensor,
    query: int,
    block_size: int,
) -> None:
    """Fits the layout (R = len(vrows) rows of `query` cells) to `verdict`, in place."""
    if not ids.is_cuda:
        fit_reference(ids, positions, slots, tables, vrows, vks, verdict, query, block_size)
        return
    from verifypd.model.kernels.fit import fit_kernel  # the Triton path only: CPU installs have no Triton

    fit_kernel[(vrows.shape[0],)](
        ids,
        positions,
        slots,
        tables,
        vrows,
        vks,
        verdict,
        verdict.stride(0),
        tables.stride(0),
        query,
        block_size,
        BLOCK=kernel_block(query),
        num_warps=1,
    )


def fit_reference(
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    vrows: torch.Tensor,
    vks: torch.Tensor,
    verdict: torch.Tensor,
    query: int,
    block_size: int,
) -> None:
    rows = vrows.shape[0]
    active = vrows >= 0
    v = verdict[vrows.clamp(min=0)].long()  # [R, W]
    shift = torch.where(active, vks - v[:, 0], torch.zeros_like(vks))
    pos = positions[: rows * query].view(rows, query)
    slot = slots[: rows * query].view(rows, query)
    new_pos = pos - shift[:, None]
    block = tables[:rows].gather(1, (new_pos // block_size).clamp(0, tables.shape[1] - 1))
    slot.copy_(torch.where(slot >= 0, block * block_size + new_pos % block_size, slot))
    pos.copy_(new_pos)
    first = ids[: rows * query].view(rows, query)[:, 0]
    first.copy_(torch.where(active, v[:, 1], first))


def fit_layout(
    fit: tuple,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    rows: int,
    query: int,
    block_size: int,
) -> None:
    """`fit` = (verdict, vrows, vks) as the verify lane passes it (host lists, one per real row); the
    layout holds `rows` >= len(vrows) rows (padding rows are not fitted)."""
    verdict, vrows, vks = fit
    pad = rows - len(vrows)
    both = small_tensor(list(vrows) + [-1] * pad + list(vks) + [0] * pad, ids.device)
    fit_to_verdict(ids, positions, slots, tables, both[:rows], both[rows:], verdict, query, block_size)
