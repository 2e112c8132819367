"""A step's draft proposals: the requests that draft now, prompt lookup's proposals where it is mixed
in (spec_decode.lookup_mix), the draft call, and whether the step is a typical cost sample. Torch-free.
"""

from __future__ import annotations

from typing import Any

from verifypd.domain.lanes import DraftItem
from verifypd.router.commits import take_drafts
from verifypd.router.draft_length import TYPICAL_DRAFT_INPUT
from verifypd.router.lane_items import draft_items
from verifypd.router.sequence import held_after
from verifypd.router.step_context import StepContext
from verifypd.router.step_plan import DecodeWork


def typical_draft(ctx: StepContext, items: list[DraftItem]) -> bool:
    """A draft call worth costing: no long catch-up on tokens decoded without drafting (an eager
    draft prefill); a pool-less lane (prompt lookup) catches up by appending host tokens. A
    feature draft is re-fed every accepted token of the last step: up to k_max + 1 is typical."""
    limit = ctx.config.k_max + 1 if ctx.feature_draft else TYPICAL_DRAFT_INPUT
    return ctx.draft_pool is None or max(len(i.input_tokens) for i in items) <= limit


def proposals(ctx: StepContext, work: list[DecodeWork]) -> tuple[dict[str, tuple[Any, Any]], bool]:
    """This step's proposals of `work`'s requests that draft now (k > 0, no held drafts, or held
    ones made after the last verify call that prompt lookup replaces), by request id; and whether
    the step is a typical cost sample (no long draft catch-up, no probe of part of the batch)."""
    drafting = [w for w in work if w.k > 0 and not w.held]
    drafts: dict[str, tuple[Any, Any]] = {}
    typical = True
    looking = drafting + [w for w in work if w.held and held_after(w.seq)]  # (steps.draft_after)
    if ctx.lookup is not None and looking:
        # Steps mixing lookup's proposals with the head's (or lookup's alone, no draft call) are
        # cost samples too: the policy's k then weighs what this mix costs as it runs.
        drafts = {rid: (tokens, None) for rid, tokens in ctx.lookup.take(looking).items()}
        for w in looking:
            w.lookup = w.seq.request_id in drafts
        drafting = [w for w in drafting if not w.lookup]
    if drafting:
        items = draft_items(ctx, drafting)
        results, draft_s = ctx.call_draft(items)
        drafts.update(take_drafts(drafting, results))
        ctx.observer.on_lane_step("draft", draft_s, len(items))
        typical = typical_draft(ctx, items)
        # A probe drafting for part of the batch costs less than a k = 1 step of all of it.
        typical = typical and sum(w.probe for w in work) in (0, len(work))
    return drafts, typical
