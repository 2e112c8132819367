"""Pipelined pdv: one group's draft call beside the other group's verify call. Torch-free.

(docs/engine.md "Schedules"; `RuntimeConfig.pipeline` with the pdv schedule.) The scheduler splits the
decoding requests in two groups (Scheduler._plan_pipelined): each pipelined step, one group drafts
(`plan.draft_ahead`; its drafts are held until the next step verifies them) while the other verifies
the drafts it made the step before (`plan.decode`, with the requests that plain-decode at k = 0).
The draft call runs on the context's draft worker thread while this thread makes the verify call;
both are waited for before anything is committed, so an error in one leaves no call in flight.

The rest of the step is a lock-step step's (prefill before, beside or after decode: lock_step.py).
A step of a pdv schedule that is not pipelined (pipelining does not pay at this batch, or no group
drafts ahead) is a lock-step step.
"""

from __future__ import annotations

import os

from verifypd.domain.lanes import DraftOutput
from verifypd.domain.requests import RequestOutput
from verifypd.router.commits import take_drafts
from verifypd.router.lane_items import draft_items, verify_items
from verifypd.router.prefill_calls import BesidePrefill
from verifypd.router.proposals import proposals, typical_draft
from verifypd.router.sequence import HeldDraft, held_after
from verifypd.router.step_context import StepContext
from verifypd.router.step_plan import StepPlan
from verifypd.router.steps.lock_step import Decoded, LockStep

# Diagnostics only: VERIFYPD_SERIAL_PIPELINE=1 keeps pdv's groups and held drafts but makes the
# draft call after the verify call instead of beside it (tells a concurrency fault from the rest).
SERIAL_PIPELINE = os.environ.get("VERIFYPD_SERIAL_PIPELINE") == "1"


class Pipelined(LockStep):
    def can_run(self, ctx: StepContext) -> bool:
        return ctx.plan is not None and bool(ctx.plan.draft_ahead)

    def decode(
        self, ctx: StepContext, plan: StepPlan, outputs: list[RequestOutput], beside: BesidePrefill | None
    ) -> Decoded:
        """Draft `plan.draft_ahead` on the worker thread while verifying `plan.decode` (held drafts or
        k = 0) here; the drafts are held until the next step verifies them. (No prefill beside: that
        needs a verify call of the whole decoding batch.)"""
        work, ahead = plan.decode, plan.draft_ahead
        drafts, typical = proposals(ctx, work)
        ahead_items = draft_items(ctx, ahead)
        ahead_typical = typical_draft(ctx, ahead_items)
        future = ctx.submit_draft(ahead_items) if work and not SERIAL_PIPELINE else None
        items, typical = verify_items(ctx, work, drafts, typical)
        results, verify_error, verify_s = None, None, 0.0
        if items:
            t0 = ctx.clock()
            try:
                results = ctx.verify_lane.verify(items)
            except BaseException as exc:  # first let the concurrent draft call finish
                verify_error = exc
            verify_s = ctx.clock() - t0
        ahead_results: list[DraftOutput] = []  # (set unless draft_error is)
        draft_error: BaseException | None = None
        try:
            ahead_results, ahead_s = future.result() if future is not None else ctx.call_draft(ahead_items)
        except BaseException as exc:
            draft_error = exc
        if verify_error is not None:
            raise verify_error
        sample = None
        if items:
            ctx.observer.on_lane_step("verify", verify_s, len(items))
            k_max = max(len(i.draft_tokens) for i in items)
            held = [w.seq.held_draft for w in work if w.held and not held_after(w.seq)]
            if held and typical and ahead_typical and len(held) == len(items):
                # This group's verify call and the other group's draft call ran side by side; the
                # step's wall time is what pipelining costs (docs/engine.md "Schedules").
                sample = (True, len(items), k_max)
            ctx.commit_verify(work, items, results, outputs)
        if draft_error is not None:
            raise draft_error
        ctx.observer.on_lane_step("draft", ahead_s, len(ahead_items))
        held_drafts = take_drafts(ahead, ahead_results)
        for w in ahead:
            tokens, probs = held_drafts[w.seq.request_id]
            # Held even when empty (a pool-less lane proposed nothing): the request then plain-decodes
            # in its next step, as a lock-step step verifies it with k = 0 right after the draft.
            w.seq.held_draft = HeldDraft(w.seq.pending_pos, tokens, probs, ahead_typical, requested_k=w.k)
        return Decoded(sample, verify_s)
