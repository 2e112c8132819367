"""A speculative step launched before the tokens of the step before it are streamed. Torch-free.

With drafts made right after each verify call (steps.draft_after) a batch-16 speculative step of
the embedded model still left the GPU idle about 0.9 ms of ~2.2 (H200, torch.profiler trace, session
32): after verify call N's verdict reached the host, the host committed N (positions, tokens,
detokenizing and stop strings for every request: ~0.6 ms), planned N + 1 and launched its verify
call (a CUDA graph launch of the 30-layer target takes ~0.3 ms of host time before the GPU starts
it), while the GPU had only N + 1's drafts (~0.3 ms) to run.

So when step N's verdict is committed, its requests hold drafts made after it, and nothing else is
going on (no request waiting or prefilling, no chain of plain steps, not pipelined), the router
plans step N + 1 and launches its verify call and the drafts after it *before* streaming N's tokens:
  * requests that end in step N (EOS, max_tokens, the context) and those that could end on a stop
    string are streamed first: plan must not see them again (`SpeculateAhead.commit`);
  * the plan is made as the next `Router.step()` would make it, and only taken when it is a decode
    step of requests that hold drafts or decode at k = 0 beside them (a block check before planning
    keeps it from preempting; a plan that is something else anyway is kept for the next step);
  * the next `Router.step()` finds N + 1 in flight (`step`): it waits for its verdict, commits it
    (which may launch N + 2) and streams it.
The tokens are the ones the regular order gives: the same plan, the same drafts, the same verify call,
launched earlier. A request cancelled while its step is in flight has its row dropped at commit; its
blocks are reused only by work queued after that step's (the lanes' streams order it: prefill waits
for the decode streams).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from verifypd.domain.lanes import VerdictFit, VerifyItem, fits_verdict, plain_item
from verifypd.domain.requests import RequestOutput
from verifypd.router.lane_items import target_handle, verify_items
from verifypd.router.proposals import proposals
from verifypd.router.sequence import SeqStatus, held_after
from verifypd.router.step_context import StepContext
from verifypd.router.step_plan import DecodeWork, StepPlan
from verifypd.router.steps import StepResult
from verifypd.router.steps.draft_after import DraftAfter, Fitted, Launched
from verifypd.router.steps.overlapped import Overlapped


@dataclass
class InFlightStep:
    """A speculative step's verify call launched ahead, with the drafts launched after it."""

    work: list[DecodeWork]
    items: list[VerifyItem]
    started: Any
    launched: Launched | None
    typical: bool


class SpeculateAhead:
    """Speculative steps launched ahead: their drafts right after the verify call before them
    (`draft_after`), their verify call before that call's tokens are streamed (`launch`) or even
    before its verdict reaches the host (`fit_next`); the next `step` commits the step in flight."""

    def __init__(self, draft_after: DraftAfter, overlapped: Overlapped):
        self.draft_after = draft_after
        self.overlapped = overlapped  # no step goes ahead while a chain of plain steps is in flight
        self.enabled = True  # off only to measure what it gains (bench/draft_acceptance.py --compare-ahead)
        self.inflight: InFlightStep | None = None
        self.next_plan: StepPlan | None = None  # a plan made here that was not a step to launch ahead
        self.fit = True  # verify calls fitted to the verdict before them (off only to measure it: #no-fit)
        self.pending: Fitted | None = None  # launched by fit_next, not yet taken by `launch`
        self.steps = 0  # steps launched ahead (tests, benchmarks)
        self.kept = 0  # plans made here and kept for the next step instead (not a step to launch ahead)
        self.fitted = 0  # of the steps launched ahead, those launched before the verdict before them

    def can_run(self, ctx: StepContext) -> bool:
        """A step launched ahead is in flight: this step commits it."""
        return self.inflight is not None

    def eligible(self, ctx: StepContext) -> bool:
        config, sched = ctx.config, ctx.scheduler
        running = sched.running
        return (
            self.enabled
            and self.inflight is None
            and self.next_plan is None
            and self.overlapped.inflight is None
            and not config.pipelined
            and config.schedule != "baseline"
            and not sched.num_waiting
            and any(held_after(s) for s in running)
            and all(s.status is SeqStatus.DECODING for s in running)
            and sched.blocks.fits_ahead(running)
        )

    def launch(self, ctx: StepContext, launched: Launched | None = None) -> None:
        """Called by `commit` once a step's verdict is committed, its drafts made after it (`launched`)
        held and its ending requests streamed: takes their verify call if it was launched already
        (`fit_next`), else plans and launches the next step if it can go ahead."""
        if launched is not None and launched.verify is not None:
            self._take(ctx, launched.verify)
            return
        if not self.eligible(ctx):
            return
        config = ctx.config
        plan = ctx.scheduler.plan(config, ctx.costs)
        work = plan.decode
        if (
            plan.prefill
            or plan.preempted
            or plan.out_of_room
            or plan.draft_ahead
            or not work
            or any(w.k > 0 and not w.held for w in work)
        ):
            self.next_plan = plan
            self.kept += 1
            return
        drafts, typical = proposals(ctx, work)  # prompt lookup's in place of held drafts, if mixed
        items, typical = verify_items(ctx, work, drafts, typical)
        started = ctx.verify_lane.verify_start(items)
        launched = self.launch_after(ctx, work, items, started)[0] if self.draft_after.eligible(ctx, items) else None
        self.inflight = InFlightStep(work, items, started, launched, typical)
        self.steps += 1

    def launch_after(self, ctx: StepContext, work: list[DecodeWork], items: list[VerifyItem], started):
        """Right after the verify call of `items` (`started`): the next step's drafts (`draft_after`),
        and their verify call, fitted (`fit_next`). Returns (Launched or None, host seconds spent)."""
        t0 = ctx.clock()
        launched = self.draft_after.launch(ctx, work, items, started)
        seconds = ctx.clock() - t0
        if launched is not None:
            ctx.observer.on_lane_step("draft", seconds, len(launched.work))
            self.fit_next(ctx, launched, work, items, started)  # their verify call, fitted
        return launched, seconds

    def _chains(self, ctx: StepContext) -> bool:
        """Nothing but the decoding batch: no arrival, prefill or chain of plain steps to plan for."""
        config, sched = ctx.config, ctx.scheduler
        return (
            self.enabled
            and self.overlapped.inflight is None
            and not config.pipelined
            and config.schedule != "baseline"
            and not sched.num_waiting
            and all(s.status is SeqStatus.DECODING for s in sched.running)
        )

    def fit_next(
        self, ctx: StepContext, launched: Launched, work: list[DecodeWork], items: list[VerifyItem], started
    ) -> None:
        """Right after the drafts `launched` made after verify call `items` (`started`), before its
        verdict reaches the host: their verify call, each row laid out for the longest outcome of its
        row of `items` and fitted to the verdict on the device (model.verify_fit), so the GPU has the
        next verify call queued while the host commits this one. Requests without drafts decode at
        k = 0 in it, as they would join the next step. Only where that call is the one the next step
        would make: greedy, every running request in `items`, nothing waiting, target blocks for the
        longest outcome free without preemption, and no prompt lookup to consult (its proposals need
        the verdict's tokens on the host: only while lookup is quiet, PromptLookup.may_skip)."""
        lane = ctx.verify_lane
        if not (
            self.fit
            and self._chains(ctx)
            and launched.work
            and fits_verdict(lane)
            and getattr(started, "verdict", None) is not None
            and all(i.sampling.greedy and plain_item(i) for i in items)
            and {id(s) for s in ctx.scheduler.running} <= {id(w.seq) for w in work}
            # A request that may reach max_tokens in `items` would likely waste its row (a whole verify
            # call at batch 1: ~3 % of the embedded model's time there, one per request, H200)
            and all(
                w.seq.remaining_tokens > len(i.draft_tokens) + 1
                for w, i in zip(work, items, strict=False)
                if w.seq.status is SeqStatus.DECODING
            )
            and (ctx.lookup is None or ctx.lookup.may_skip())  # last: a yes counts as a skipped step
        ):
            return
        drafted = {w.seq.request_id: w.k for w in launched.work}
        rows = []  # (row of `items`, request, its next start if all its drafts are accepted, next k)
        for r, (w, item) in enumerate(zip(work, items, strict=False)):
            if w.seq.status is not SeqStatus.DECODING:
                continue  # ended since `items` was launched (fitted itself): its row is dropped
            start = item.start_pos + len(item.draft_tokens) + 1
            rows.append((r, w.seq, start, drafted.get(w.seq.request_id, 0)))
        if not rows or not ctx.scheduler.blocks.reserve_target([(seq, start + k + 1) for _, seq, start, k in rows]):
            return
        next_work, next_items = [], []
        for _, seq, start, k in rows:
            tokens, probs = launched.drafts[seq.request_id] if k else ((), None)
            next_work.append(DecodeWork(seq, k, held=k > 0))
            next_items.append(
                VerifyItem(
                    seq.request_id,
                    0,
                    start,
                    tokens,
                    target_handle(ctx, seq, start, seq.target_computed),
                    seq.spec.sampling,
                    probs,
                )
            )
        fit = VerdictFit(started, tuple(r for r, *_ in rows), tuple(len(items[r].draft_tokens) for r, *_ in rows))
        launched.verify = self.pending = Fitted(
            next_work, next_items, lane.verify_start(next_items, fit=fit), launched.typical
        )

    def _take(self, ctx: StepContext, fitted: Fitted) -> None:
        """The step's verdict is committed: its items get their real positions and pending tokens (the
        device fitted them alike), and the call becomes the step in flight; the drafts after it (and
        their verify call, fitted again) are launched if the chain goes on."""
        self.pending = None
        for n, (w, item) in enumerate(zip(fitted.work, fitted.items, strict=False)):
            seq = w.seq
            if seq.status is not SeqStatus.DECODING:
                continue  # ended (or was cancelled) in the step before: its row is dropped at commit
            start, held = seq.pending_pos, seq.held_draft
            assert start <= item.start_pos and (
                not w.held or held is not None and held.predrafted and held.start_pos == start
            ), "a fitted verify call out of step"
            fitted.items[n] = replace(
                item,
                pending_token=seq.ids(start, start + 1)[0],
                start_pos=start,
                target_kv=target_handle(ctx, seq, start, seq.target_computed),
            )
        launched = None
        if self._chains(ctx) and self.draft_after.eligible(ctx, fitted.items):
            launched = self.launch_after(ctx, fitted.work, fitted.items, fitted.started)[0]
        self.inflight = InFlightStep(fitted.work, fitted.items, fitted.started, launched, fitted.typical)
        self.steps += 1
        self.fitted += 1

    def take_plan(self, ctx: StepContext) -> StepPlan | None:
        """The plan `launch` made and did not launch, if its requests are all still there."""
        plan, self.next_plan = self.next_plan, None
        if plan is None:
            return None
        live = ctx.sequences
        seqs = [w.seq for w in plan.decode + plan.draft_ahead] + [c.seq for c in plan.prefill]
        return plan if all(live.get(s.request_id) is s for s in seqs) else None  # else plan again (cancelled)

    def commit(
        self,
        ctx: StepContext,
        work: list[DecodeWork],
        items: list[VerifyItem],
        results,
        outputs: list[RequestOutput],
        launched: Launched | None,
    ) -> None:
        """Commits a verify call: positions, verdicts, tokens; holds the drafts launched after it
        (`launched`); streams the requests it ends (or may end, on a stop string), then may launch the
        next step (`launch`), then streams the others."""
        verified = ctx.commit_verdicts(work, items, results)
        later = verified
        if launched is not None:
            self.draft_after.hold(launched)
            later = []
            for v in verified:
                if v.finish is not None or v.seq.spec.stop:
                    ctx.stream_verified([v], outputs)
                else:
                    later.append(v)
            self.launch(ctx, launched)
        ctx.stream_verified(later, outputs)

    def step(self, ctx: StepContext) -> StepResult:
        """A `Router.step()` with a step in flight: waits for its verdict and commits it (which may
        launch the next one), then streams."""
        step = self.inflight
        assert step is not None, "no speculative step in flight"
        self.inflight = None
        t0 = ctx.clock()
        results = step.started.result()
        ctx.observer.on_lane_step("verify", ctx.clock() - t0, len(step.items))
        live = [
            (w, item, res)
            for w, item, res in zip(step.work, step.items, results, strict=False)
            if w.seq.status is SeqStatus.DECODING
        ]  # cancelled meanwhile: the row is dropped
        outputs: list[RequestOutput] = []
        if live:
            work, items, res = (list(x) for x in zip(*live, strict=False))
            self.commit(ctx, work, items, res, outputs, step.launched)
        sample = (False, len(step.items), max(len(i.draft_tokens) for i in step.items)) if step.typical else None
        return StepResult(outputs, sample)

    def drop(self) -> None:
        """Lane restart (Router.reset_kv): waits out the calls in flight, if any, and forgets them."""
        calls = [c for c in (self.inflight, self.pending) if c is not None]
        self.inflight, self.next_plan, self.pending = None, None, None
        for call in calls:
            try:
                call.started.result()
            except Exception:  # the lanes are being reset (or failed): its results are of no use
                pass
