"""Lock-step: a planned step whose decoding requests draft, then verify, in the same step. Torch-free.

The step the scheduler planned (`ctx.plan`): requests out of room are ended, the prefill chunks run
before decode (when priorities put prefill first), beside it or after it, and the decoding requests
draft (those with k > 0 and no held drafts; prompt lookup's proposals where mixed in) and are verified
in one verify call. The prefill's place:

  * pdv over lane processes (`config.pipelined`, a remote prefill lane): the prefill call (other
    requests, other blocks) goes out on the prefill worker thread beside the decode calls; its results
    are committed after decode's;
  * in-process lanes whose calls start asynchronously: the prefill call is started once the verify
    call is queued, so its host work hides under decode's GPU work (`BesidePrefill`);
  * otherwise after decode (before it if `priorities.prefill > priorities.verify`).

The verify call may hand on to the strategies that launch steps ahead: a plain step (every k = 0)
starts a chain of plain steps (overlapped.py); a step with drafts launches the next step's drafts
right after its verify call (draft_after.py) and, once committed, the next step (speculate_ahead.py).

pd and pdv without pipelining run every planned step here; pdv with pipelining runs here the steps
in which no group drafts ahead (pipelined.py runs the others); baseline's one-request steps run the
same way (baseline.py).
"""

from __future__ import annotations

from concurrent.futures import wait as wait_for_futures
from typing import NamedTuple

from verifypd.domain.lanes import LaneError
from verifypd.domain.requests import FinishReason, RequestOutput
from verifypd.router.lane_items import prefill_items, verify_items
from verifypd.router.prefill_calls import BesidePrefill, run_prefill, start_prefill, starts_async
from verifypd.router.proposals import proposals
from verifypd.router.sequence import held_after
from verifypd.router.step_context import CostSample, StepContext
from verifypd.router.step_plan import StepPlan
from verifypd.router.steps import StepResult
from verifypd.router.steps.overlapped import Overlapped
from verifypd.router.steps.speculate_ahead import SpeculateAhead


class Decoded(NamedTuple):
    """What a planned step's decode gave: what its cost describes (None: not a sample worth learning
    from), the verify call's seconds, and host seconds spent beside it that are not the step's cost."""

    sample: CostSample | None
    verify_s: float = 0.0
    beside_s: float = 0.0


class LockStep:
    def __init__(self, overlapped: Overlapped, ahead: SpeculateAhead):
        self.overlapped = overlapped  # a plain step starts a chain there
        self.ahead = ahead  # a speculative step launches the next step's drafts (and step) there

    def can_run(self, ctx: StepContext) -> bool:
        return ctx.plan is not None

    def step(self, ctx: StepContext) -> StepResult:
        config, plan = ctx.config, ctx.plan
        assert plan is not None, "a planned step without a plan"
        outputs = [ctx.finish(seq, FinishReason.LENGTH, [], "") for seq in plan.out_of_room]
        # pd and pdv: decode is high priority, prefill after it (unless priorities say otherwise).
        prefill_first = config.priorities.prefill > config.priorities.verify
        # Pipelined pdv over lane processes: the prefill call (other requests, other blocks) goes out
        # beside the decode calls instead of after them; its results are committed after decode's.
        pending = None
        if (
            plan.prefill
            and (plan.decode or plan.draft_ahead)
            and config.pipelined
            and getattr(ctx.prefill_lane, "remote", False)
        ):
            pending = ctx.submit_prefill(prefill_items(ctx, plan.prefill))
        beside = None  # in-process: the prefill call starts while the verify call runs on the GPU
        if (
            plan.prefill
            and plan.decode
            and not plan.draft_ahead
            and pending is None
            and not prefill_first
            and ctx.overlap_prefill
            and starts_async(ctx.verify_lane, ctx.prefill_lane)
        ):
            beside = BesidePrefill(plan.prefill)
        serial_prefill_s = 0.0  # prefill run before or after decode, not beside it
        try:
            if prefill_first and pending is None:
                t0 = ctx.clock()
                outputs += run_prefill(ctx, plan.prefill)
                serial_prefill_s += ctx.clock() - t0
            try:
                decoded = self.decode(ctx, plan, outputs, beside)
            except BaseException:
                if pending is not None:  # no call left in flight behind the error
                    wait_for_futures([pending])
                raise
            if pending is not None or not prefill_first:
                t0 = ctx.clock()
                outputs += run_prefill(ctx, plan.prefill, pending or (beside.started if beside else None))
                if pending is None:
                    serial_prefill_s += ctx.clock() - t0
        except BaseException as exc:
            # Tokens committed before the failing call are already in the sequences: hand their
            # chunks to the caller with the error, or the client's stream would skip them.
            if isinstance(exc, LaneError):
                exc.outputs = outputs
            raise
        sample = decoded.sample
        if sample is None:  # nothing to learn; the prefill's time still tells the probes (charge_probe_kv)
            return StepResult(outputs, excluded=(serial_prefill_s, decoded.beside_s))
        # Whole-step cost: planning, the lane calls, committing and the observer, without a prefill
        # that ran before or after decode. Host work per step is what a pipelined step (half the batch
        # verified) pays twice per token as often as a lock-step one. Nor the launch of a prefill beside
        # the verify call: 16 prompts' launch (~0.9 ms, H200) once made a plain step at 16 requests
        # cost 1.8 ms instead of ~1.0, and speculation that ran at 0.7 x plain decoding looked like a gain.
        cap_s = None
        if (
            sample[2] == 0
            and not sample[0]
            and (not plan.prefill or beside is not None)
            and config.overlap
            and self.overlapped.supported(ctx)
        ):
            cap_s = decoded.verify_s  # chained, its host work hides behind the GPU's
        return StepResult(outputs, sample, excluded=(serial_prefill_s, decoded.beside_s), cap_s=cap_s)

    def decode(
        self, ctx: StepContext, plan: StepPlan, outputs: list[RequestOutput], beside: BesidePrefill | None
    ) -> Decoded:
        """Draft `plan.decode` (those with k > 0 and no held drafts), then verify it; `beside`: its
        prefill is started once the verify call is queued, before its results (and with it a chain may
        start: the prefilled requests then join the next step)."""
        work = plan.decode
        if not work:
            return Decoded(None)
        drafts, typical = proposals(ctx, work)
        items, typical = verify_items(ctx, work, drafts, typical)
        results, verify_s, beside_s, launched, after_s = None, 0.0, 0.0, None, 0.0
        t0 = ctx.clock()
        after = self.ahead.draft_after.eligible(ctx, items)
        if beside is not None or after:
            started = ctx.verify_lane.verify_start(items)
            if after:  # the next step's drafts, fitted to this call's verdict on the device
                launched, after_s = self.ahead.launch_after(ctx, work, items, started)
        if beside is not None:
            t_beside = ctx.clock()
            beside.started = start_prefill(ctx, beside.chunks)
            if self.overlapped.eligible(ctx, work, False):
                self.overlapped.start(ctx, work, items, started, beside)
            beside_s = ctx.clock() - t_beside  # the prefill's launch: not the verify lane's time
            # Verify already done: the step waited on the prefill's launch; not its cost.
            typical = typical and not started.ready()
            results = started.result()
        elif after:
            results = started.result()
        elif self.overlapped.eligible(ctx, work, False):
            started = ctx.verify_lane.verify_start(items)
            t_follow = ctx.clock()
            self.overlapped.start(ctx, work, items, started)  # the next step, queued behind
            beside_s = ctx.clock() - t_follow  # its launch: not this verify call's time
            results = started.result()
        else:
            results = ctx.verify_lane.verify(items)
        verify_s = ctx.clock() - t0 - beside_s - after_s
        ctx.observer.on_lane_step("verify", verify_s, len(items))
        k_max = max(len(i.draft_tokens) for i in items)
        held = [w.seq.held_draft for w in work if w.held and not held_after(w.seq)]
        sample = (False, len(items), k_max) if not held and typical else None
        self.ahead.commit(ctx, work, items, results, outputs, launched)
        return Decoded(sample, verify_s, beside_s)
