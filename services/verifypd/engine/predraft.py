"""Drafts launched a step ahead: a lock-step speculative step's next draft call is made while this
step is committed. Torch-free.

A lock-step step runs: draft call, verify call, wait for the verdict, commit (append tokens, stream
them: detokenize, stop strings), then the next step plans and drafts. With in-process lanes the draft
call's GPU work only starts once the host has committed and planned, and the verify call waits for it;
the host's commit and planning run while the GPU idles. Session 29's host timings (H200, the embedded
model with its head, `bench/results/timing_s29/`): at 16 requests a step took ~2.8 ms, of which the
commit ~0.32 ms and the draft call's GPU time ~1 ms.

With a feature draft (`--draft eagle:` / `eagle+ngram:`), as soon as a verify call's tokens are appended
(`Router._commit_verify`), and before they are streamed, the next step's drafts are launched for the
requests that go on: k decided by the same policy and at the same point (`Scheduler.plan_predraft`:
the verdict just recorded, one decision per step), blocks reserved without preempting anyone (a request
that does not fit drafts nothing a step ahead). The drafts are held (`HeldDraft.predrafted`) and the
next `plan` verifies them as a pipelined group's: the GPU drafts while the host streams and plans. A
request that joins meanwhile (its prefill just finished) or got k = 0 decodes at k = 0 beside them
instead of waiting a step.

Why the tokens are the same: the draft call is the one the next step would make (same inputs: the
tokens just appended, the same target features, the same k unless the batch changes), and a dropped
held draft (the request finished on a stop string, was preempted or cancelled) needs no rollback: its
rows are re-fed from draft_computed, which only moves when drafts are verified (HeldDraft).
Streams keep it safe where a dropped request's blocks are reused: draft KV is written only by the draft
lane's stream (ordered) and by prefill, which waits for the decode lanes' streams (lanes.local).

Not for: pipelined pdv steps (their groups draft ahead already), baseline (one request a step), model
and prompt-lookup drafts (their draft KV positions follow other rules), lanes in other processes
(the draft call would block the commit it should hide behind).
"""
from __future__ import annotations

from verifypd.engine.draft_length import RuntimeConfig
from verifypd.engine.router_calls import take_drafts
from verifypd.engine.scheduler import DecodeWork
from verifypd.engine.sequence import HeldDraft, Sequence


class Predraft:
    def __init__(self, router):  # verifypd.engine.router.Router (which imports this module)
        self.router = router
        self.enabled = True  # off only to measure what it gains (bench/draft_acceptance.py --no-predraft)
        self.calls = 0       # steps that drafted a step ahead (tests, benchmarks)
        self.requests = 0    # requests drafted a step ahead, over all those steps

    def eligible(self, config: RuntimeConfig, items) -> bool:
        """May the step committing the verify call of `items` draft the next step now?"""
        router = self.router
        return (self.enabled and router.feature_draft and config.schedule != "baseline" and not config.pipelined
                and any(len(i.draft_tokens) for i in items)  # a drafting batch (one that stopped takes overlap)
                and not any(getattr(lane, "remote", False) for lane in (router.draft_lane, router.verify_lane)))

    def launch(self, config: RuntimeConfig, seqs: list[Sequence]) -> None:
        """Drafts the next step of `seqs` (requests whose tokens were just appended and that go on)."""
        router = self.router
        work = [DecodeWork(seq, k) for seq, k in router.scheduler.plan_predraft(config, router.costs, seqs)]
        if not work:
            return
        drafts: dict[str, tuple[object, object]] = {}
        if router.lookup is not None:  # the head mixed with prompt lookup: lookup's where it matches
            drafts = {rid: (tokens, None) for rid, tokens in router.lookup.take(work).items()}
        looked_up = set(drafts)
        drafting = [w for w in work if w.seq.request_id not in looked_up]
        typical = True
        if drafting:
            items = router._draft_items(drafting)
            results, seconds = router._call_draft(items)
            drafts.update(take_drafts(drafting, results))
            router.observer.on_lane_step("draft", seconds, len(items))
            typical = router._typical_draft(items)
        for w in work:
            rid = w.seq.request_id
            tokens, probs = drafts[rid]
            w.seq.held_draft = HeldDraft(w.seq.pending_pos, tokens, probs, typical, requested_k=w.k,
                                         predrafted=True, lookup=rid in looked_up)
        self.calls += 1
        self.requests += len(work)
