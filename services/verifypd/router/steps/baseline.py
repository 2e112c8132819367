"""Baseline: one request per step, round-robin, each lane call of one item. Torch-free.

(docs/engine.md "Schedules"; `RuntimeConfig.schedule == "baseline"`: the schedule the others are
measured against.) The scheduler's plan holds one request (Scheduler._plan_single): its next prefill
chunk, or its draft + verify. That runs as a lock-step step; what needs a batch never happens here
(a prefill beside decode, drafts launched after the verify call, a step launched ahead).
"""

from __future__ import annotations

from verifypd.router.step_context import StepContext
from verifypd.router.steps.lock_step import LockStep


class Baseline(LockStep):
    def can_run(self, ctx: StepContext) -> bool:
        return ctx.plan is not None and ctx.config.schedule == "baseline"
