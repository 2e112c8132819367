"""Drafts launched right after a verify call, before its verdict reaches the host. Torch-free.

A lock-step speculative step ran: draft call, verify call, wait for the verdict, commit (append,
stream), plan, and only then the next draft call; the GPU idled through the host's commit and
planning, and the host idled through the draft's GPU work. Host timings (H200, the
embedded model with its head, 16 requests): a step ~2.8 ms, of which the draft call's host work
0.53 ms, the verify call's launch 0.46, the wait 0.96 and the commit 0.32. Launching the next
drafts once the verdict is on the host (a "predraft" tried and reverted) hid only the streaming.

With a feature draft (`--draft eagle:` / `eagle+ngram:`) and in-process lanes, the router now
launches step N + 1's draft call right after verify call N, on the verify call's stream: each
request's input is laid out for N's longest outcome (every draft accepted: its k + 1 verified
tokens as placeholders) and fitted on the device to N's verdict (model.verdict_shift: the accepted
count moves the row, the verified tokens are read from the verdict). Then the host waits for N's
verdict and commits it while the GPU drafts N + 1; the drafts are held (`HeldDraft.predrafted`) and
the next plan verifies them; requests without any (joined meanwhile, or k = 0) decode beside them
at k = 0. So a step's host work is: launch verify, launch the next drafts, wait, commit, plan.

Why the tokens are the same: the call is the one the next step would make (the same tokens once
fitted, the same target features, which verify N wrote at the verified positions; a feature draft's
catch-up re-feeds every verified token, as StepContext.commit_verdicts's rule says), with k decided by
the same policy a step earlier (`plan_ahead.plan_after`, from the acceptance known before N's
verdict). Held drafts that are dropped (the request finished, was preempted or cancelled) need no
rollback: the head's rows past the verified positions are rewritten by its next catch-up.
With prompt lookup mixed in (`eagle+ngram:`) the next step takes lookup's proposal instead where the
request's context repeats (router.proposals); the head's rows stay valid either way.

Not for: pipelined pdv, baseline, model and lookup-only drafts, lanes in other processes (the lane
RPC carries no verdict), verify calls that carry no drafts (a plain step has no verdict to fit to;
the first speculative step after plain decoding drafts in its own step), drafts longer than the
head's graphs fit as placeholders (k > MAX_VERIFIED_K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verifypd.domain.lanes import DraftItem, VerifyItem, drafts_after_verdict
from verifypd.router.commits import Proposal, take_drafts
from verifypd.router.lane_items import draft_handle, target_handle
from verifypd.router.plan_ahead import plan_after
from verifypd.router.sequence import HeldDraft, SeqStatus
from verifypd.router.step_context import StepContext
from verifypd.router.step_plan import DecodeWork

MAX_VERIFIED_K = 8  # placeholders of a verify call with up to this k fit the head's catch-up graphs (9)


@dataclass
class Launched:
    """Drafts launched after a verify call, held once its verdict is committed."""

    work: list[DecodeWork]
    drafts: dict[str, Proposal]
    typical: bool
    # The verify call of these drafts, launched right after them and fitted to the verdict on the
    # device (SpeculateAhead.fit_next), or None: the next step plans and launches it once committed.
    verify: Fitted | None = None


@dataclass
class Fitted:
    """A verify call launched right after the drafts made after the verify call before it, laid out
    for that call's longest outcome and fitted to its verdict on the device (`SpeculateAhead.fit_next`)."""

    work: list[DecodeWork]
    items: list[VerifyItem]
    started: Any
    typical: bool


class DraftAfter:
    """Launches the next step's drafts right after a verify call and holds them once its verdict is
    committed (the speculate-ahead strategy and the lock-step one call it)."""

    def __init__(self):
        self.enabled = True  # off only to measure what it gains (bench/draft_acceptance.py --compare-draft-after)
        self.calls = 0  # draft calls launched after a verify call (tests, benchmarks)
        self.requests = 0  # requests drafted so, over all those calls
        self.held = 0  # of those, drafts the next step verified (the rest were dropped)

    def eligible(self, ctx: StepContext, items: list[VerifyItem]) -> bool:
        """May the step whose verify call is `items` launch the next step's drafts right after it?"""
        config = ctx.config
        return (
            self.enabled
            # structured output: a step's masks need its drafts' values on the host (lane_items.token_masks)
            and all(i.token_mask is None for i in items)
            and ctx.feature_draft
            and config.schedule != "baseline"
            and not config.pipelined
            and drafts_after_verdict(ctx.draft_lane)
            and hasattr(ctx.verify_lane, "verify_start")
            and any(len(i.draft_tokens) for i in items)
            and max(len(i.draft_tokens) for i in items) <= MAX_VERIFIED_K
        )

    def launch(self, ctx: StepContext, work: list[DecodeWork], items: list[VerifyItem], started) -> Launched | None:
        """Right after launching `items` (`started`): the next step's drafts of `work`'s requests."""
        if getattr(started, "verdict", None) is None:
            return None
        config = ctx.config
        rows = {w.seq.request_id: n for n, w in enumerate(work)}
        # (a verify call launched before the verdict before it, steps.speculate_ahead, may hold rows of
        # requests that ended since: they draft no more)
        plan = plan_after(
            ctx.scheduler,
            config,
            ctx.costs,
            [
                (w.seq, len(i.draft_tokens))
                for w, i in zip(work, items, strict=False)
                if w.seq.status is SeqStatus.DECODING
            ],
        )
        if not plan:
            return None
        after = [DecodeWork(seq, k) for seq, k in plan]
        draft_items, verify_rows, verify_ks = [], [], []
        for w in after:
            row = rows[w.seq.request_id]
            draft_items.append(self._item(ctx, work[row], items[row], w.k))
            verify_rows.append(row)
            verify_ks.append(len(items[row].draft_tokens))
        lane = ctx.draft_lane
        if not drafts_after_verdict(lane):  # (`eligible` let the step launch this)
            raise TypeError(f"{type(lane).__name__} does not draft after a verdict (drafts_after_verdict)")
        results = lane.draft_after(draft_items, started, verify_rows, verify_ks)
        self.calls += 1
        self.requests += len(after)
        typical = max(len(i.input_tokens) for i in draft_items) <= config.k_max + 1
        return Launched(after, take_drafts(after, results), typical)

    @staticmethod
    def _item(ctx: StepContext, w: DecodeWork, item: VerifyItem, k: int) -> DraftItem:
        """The draft item of `w`'s next step, for the longest outcome of its verify call `item`."""
        seq, n = w.seq, item.start_pos
        k_now = len(item.draft_tokens)
        # Where the head's valid rows end: a head call this step fed through x_n (its rows past it are
        # the chain's, speculative); lookup's proposal or k = 0 left draft_computed where it was.
        start = n + 1 if k_now > 0 and not w.lookup else seq.draft_computed
        return DraftItem(
            request_id=seq.request_id,
            input_tokens=seq.ids(start, n + 1) + [0] * (k_now + 1),
            start_pos=start,
            k=k,
            sampling=seq.spec.sampling,
            draft_kv=draft_handle(ctx, seq, start, start),
            target_kv=target_handle(ctx, seq, n, n),
        )

    def hold(self, launched: Launched | None) -> None:
        """After the verify call's verdict is committed: its requests that go on hold their drafts."""
        if launched is None:
            return
        for w in launched.work:
            seq = w.seq
            if seq.status is not SeqStatus.DECODING:
                continue  # finished (or cancelled) meanwhile: the drafts are dropped
            tokens, probs = launched.drafts[seq.request_id]
            seq.held_draft = HeldDraft(
                seq.pending_pos, tokens, probs, launched.typical, requested_k=w.k, predrafted=True
            )
            seq.draft_computed = seq.pending_pos + 1  # the head was fed through the new pending token
            self.held += 1
