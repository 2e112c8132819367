"""A speculative step launched before the tokens of the step before it are streamed. Torch-free.

With drafts made right after each verify call (engine.draft_after) a batch-16 speculative step of
the embedded model still left the GPU idle about 0.9 ms of ~2.2 (H200, torch.profiler trace, session
32): after verify call N's verdict reached the host, the host committed N (positions, tokens,
detokenizing and stop strings for every request: ~0.6 ms), planned N + 1 and launched its verify
call (a CUDA graph launch of the 30-layer target takes ~0.3 ms of host time before the GPU starts
it), while the GPU had only N + 1's drafts (~0.3 ms) to run.

So when step N's verdict is committed, its requests hold drafts made after it, and nothing else is
going on (no request waiting or prefilling, no chain of plain steps, not pipelined), the router
plans step N + 1 and launches its verify call and the drafts after it *before* streaming N's tokens:
  * requests that end in step N (EOS, max_tokens, the context) and those that could end on a stop
    string are streamed first: plan must not see them again (Router._commit_verify);
  * the plan is made as the next `Router.step()` would make it, and only taken when it is a decode
    step of requests that hold drafts or decode at k = 0 beside them (a block check before planning
    keeps it from preempting; a plan that is something else anyway is kept for the next step);
  * the next `Router.step()` finds N + 1 in flight (`advance`): it waits for its verdict, commits it
    (which may launch N + 2) and streams it.
The tokens are the ones the regular order gives: the same plan, the same drafts, the same verify call,
launched earlier. A request cancelled while its step is in flight has its row dropped at commit; its
blocks are reused only by work queued after that step's (the lanes' streams order it: prefill waits
for the decode streams).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verifypd.engine.draft_after import Launched, held_after
from verifypd.engine.draft_length import RuntimeConfig
from verifypd.engine.scheduler import DecodeWork, StepPlan
from verifypd.engine.sequence import SeqStatus
from verifypd.engine.types import RequestOutput
from verifypd.lanes.interface import VerifyItem


@dataclass
class InFlightStep:
    """A speculative step's verify call launched ahead, with the drafts launched after it."""

    work: list[DecodeWork]
    items: list[VerifyItem]
    started: Any
    launched: Launched | None
    typical: bool


class SpecAhead:
    def __init__(self, router):  # verifypd.engine.router.Router (which imports this module)
        self.router = router
        self.enabled = True  # off only to measure what it gains (bench/draft_acceptance.py --compare-ahead)
        self.inflight: InFlightStep | None = None
        self.next_plan: StepPlan | None = None  # a plan made here that was not a step to launch ahead
        self.steps = 0   # steps launched ahead (tests, benchmarks)
        self.kept = 0    # plans made here and kept for the next step instead (not a step to launch ahead)

    def eligible(self, config: RuntimeConfig) -> bool:
        router, sched = self.router, self.router.scheduler
        running = sched.running
        return (self.enabled and self.inflight is None and self.next_plan is None and router.overlap.inflight is None
                and not config.pipelined and config.schedule != "baseline" and not sched.num_waiting
                and any(held_after(s) for s in running) and all(s.status is SeqStatus.DECODING for s in running)
                and sched.fits_ahead(running))

    def launch(self, config: RuntimeConfig) -> None:
        """Called by Router._commit_verify once a step's verdict is committed, its drafts made after it
        held and its ending requests streamed: plans and launches the next step if it can go ahead."""
        if not self.eligible(config):
            return
        router = self.router
        plan = router.scheduler.plan(config, router.costs)
        work = plan.decode
        if (plan.prefill or plan.preempted or plan.out_of_room or plan.draft_ahead or not work
                or any(w.k > 0 and not w.held for w in work)):
            self.next_plan = plan
            self.kept += 1
            return
        drafts, typical = router._proposals(work)   # prompt lookup's in place of held drafts, if mixed
        items, typical = router._verify_items(work, drafts, typical)
        started = router.verify_lane.verify_start(items)
        launched = router._launch_after(work, items, started)[0] if router.draft_after.eligible(config, items) else None
        self.inflight = InFlightStep(work, items, started, launched, typical)
        self.steps += 1

    def take_plan(self) -> StepPlan | None:
        """The plan `launch` made and did not launch, if its requests are all still there."""
        plan, self.next_plan = self.next_plan, None
        if plan is None:
            return None
        live = self.router._seqs
        seqs = [w.seq for w in plan.decode + plan.draft_ahead] + [c.seq for c in plan.prefill]
        return plan if all(live.get(s.request_id) is s for s in seqs) else None  # else plan again (cancelled)

    def advance(self) -> tuple[list[RequestOutput], tuple[bool, int, int] | None]:
        """A `Router.step()` with a step in flight: waits for its verdict and commits it (which may
        launch the next one), then streams. Returns (outputs, cost sample or None)."""
        router, step = self.router, self.inflight
        self.inflight = None
        t0 = router._clock()
        results = step.started.result()
        router.observer.on_lane_step("verify", router._clock() - t0, len(step.items))
        live = [(w, item, res) for w, item, res in zip(step.work, step.items, results)
                if w.seq.status is SeqStatus.DECODING]   # cancelled meanwhile: the row is dropped
        outputs: list[RequestOutput] = []
        if live:
            work, items, res = (list(x) for x in zip(*live))
            router._commit_verify(work, items, res, outputs, step.launched)
        sample = (False, len(step.items), max(len(i.draft_tokens) for i in step.items)) if step.typical else None
        return outputs, sample

    def drop(self) -> None:
        """Lane restart (Router.reset_kv): waits out the step in flight, if any, and forgets it."""
        step, self.inflight, self.next_plan = self.inflight, None, None
        if step is not None:
            try:
                step.started.result()
            except Exception:  # the lanes are being reset (or failed): its results are of no use
                pass
