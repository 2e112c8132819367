"""The lane work items of a step: KV handles of a request's blocks, and the prefill, draft and verify
items built from the plan's chunks and decode work, with their sampling controls and grammar masks.
Torch-free. They read the step context (router.step_context) and change nothing in it.
"""

from __future__ import annotations

from typing import Any

from verifypd.domain.grammar import GrammarError
from verifypd.domain.lanes import DraftItem, KvHandle, LaneError, PoolInfo, PrefillItem, VerifyItem
from verifypd.domain.sampling_controls import control_context
from verifypd.router.block_manager import lane_table
from verifypd.router.sequence import Sequence
from verifypd.router.step_context import StepContext
from verifypd.router.step_plan import DecodeWork, PrefillChunk


def kv_handle(pool: PoolInfo, blocks: list[int], seq_len: int, committed: int, freed: int = 0) -> KvHandle:
    """`freed`: leading entries of `blocks` released out of the window (lane_table)."""
    return KvHandle(pool.pool_id, pool.generation, lane_table(blocks, freed), seq_len, min(committed, seq_len))


def target_handle(ctx: StepContext, seq: Sequence, seq_len: int, committed: int) -> KvHandle:
    return kv_handle(ctx.target_pool, seq.target_blocks, seq_len, committed, seq.target_freed)


def draft_handle(ctx: StepContext, seq: Sequence, seq_len: int, committed: int) -> KvHandle | None:
    if ctx.draft_pool is None:
        return None
    return kv_handle(ctx.draft_pool, seq.draft_blocks, seq_len, committed, seq.draft_freed)


def token_masks(ctx: StepContext, seq: Sequence, drafts) -> Any:
    """A constrained request's masks for its next choice and one per draft (domain.grammar), or None.
    Reads the drafts' values on the host (an in-process draft's: one copy of its call's tokens)."""
    state = ctx.grammars.get(seq.request_id)
    if state is None:
        return None
    try:
        return state.step_masks(seq.output_ids, list(drafts))
    except GrammarError as exc:  # a committed token broke the grammar: the lane ignored its mask
        raise LaneError(f"request {seq.request_id}: {exc}") from None


def prefill_items(ctx: StepContext, chunks: list[PrefillChunk]) -> list[PrefillItem]:
    return [
        PrefillItem(
            request_id=c.seq.request_id,
            token_ids=c.seq.ids(c.start, c.end),
            start_pos=c.start,
            target_kv=target_handle(ctx, c.seq, c.start, c.seq.target_computed),
            draft_kv=draft_handle(ctx, c.seq, c.start, c.seq.draft_computed) if c.with_draft else None,
            sample_first=c.sample_first,
            sampling=c.seq.spec.sampling,
            controls=control_context(c.seq.spec, (), ctx.eos) if c.sample_first else None,
            token_mask=token_masks(ctx, c.seq, ()) if c.sample_first else None,
        )
        for c in chunks
    ]


def draft_items(ctx: StepContext, work: list[DecodeWork]) -> list[DraftItem]:
    items = []
    for w in work:
        seq, n = w.seq, w.seq.pending_pos
        items.append(
            DraftItem(
                request_id=seq.request_id,
                input_tokens=seq.ids(seq.draft_computed, n + 1),
                start_pos=seq.draft_computed,
                k=w.k,
                sampling=seq.spec.sampling,
                draft_kv=draft_handle(ctx, seq, seq.draft_computed, seq.draft_computed),
                target_kv=target_handle(ctx, seq, seq.target_computed, seq.target_computed)
                if ctx.feature_draft
                else None,
            )
        )
    return items


def verify_items(
    ctx: StepContext, work: list[DecodeWork], drafts: dict, typical: bool
) -> tuple[list[VerifyItem], bool]:
    items = []
    for w in work:
        seq, n = w.seq, w.seq.pending_pos
        if w.held:
            held = seq.held_draft
            assert held is not None and held.start_pos == n and len(held.tokens) == w.k, "held drafts out of step"
            tokens, probs = drafts[seq.request_id] if w.lookup else (held.tokens, held.probs)
            typical = typical and held.typical
        else:
            tokens, probs = drafts.get(seq.request_id, ((), None))
        items.append(
            VerifyItem(
                request_id=seq.request_id,
                pending_token=seq.ids(n, n + 1)[0],
                start_pos=n,
                draft_tokens=tokens,
                draft_probs=probs,
                sampling=seq.spec.sampling,
                target_kv=target_handle(ctx, seq, n, seq.target_computed),
                controls=control_context(seq.spec, seq.output_ids, ctx.eos),
                token_mask=token_masks(ctx, seq, tokens),
            )
        )
    return items, typical
