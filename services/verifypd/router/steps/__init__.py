"""Step strategies: how one `Router.step()` runs. Torch-free.

Every strategy has the same small interface (`StepStrategy`): `can_run(ctx)` says whether this step
is its to run, `step(ctx)` runs it and returns its outputs and what its cost describes. Each gets
the step context (verifypd.router.step_context.StepContext) and nothing of the Router.

lock_step.py        a planned step, prefill placed before, beside or after decode; decode lock-step:
                    draft, then verify of the same requests (pd; pdv without pipelining)
pipelined.py        pdv pipelined: one group's draft call beside the other group's verify call
baseline.py         one request per step, round-robin (the schedule to compare with)
overlapped.py       plain decoding chained: the next k = 0 step launched while the one before runs
speculate_ahead.py  a speculative step launched before the step before it is streamed, its verify
                    call fitted on the device to the verdict before it
draft_after.py      the next step's drafts launched right after a verify call (speculate-ahead's first half)

Router.step picks one per step: a step launched ahead (overlapped, speculate-ahead) is committed by the
strategy that launched it; otherwise the scheduler plans the step and baseline, pipelined or lock-step
runs the plan (docs/engine.md "Step strategies").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from verifypd.domain.requests import RequestOutput
from verifypd.router.step_context import CostSample, StepContext


@dataclass
class StepResult:
    """What a step gave: its outputs, and what its cost describes (None: not worth learning from,
    see StepCostModel). The Router records the step's wall time less `excluded` (seconds that are
    not the step's cost, e.g. a prefill run before or after decode), at most `cap_s`."""

    outputs: list[RequestOutput]
    sample: CostSample | None = None
    excluded: tuple[float, ...] = ()
    cap_s: float | None = None


class StepStrategy(Protocol):
    def can_run(self, ctx: StepContext) -> bool:
        """Is this step this strategy's to run (a call of it in flight; or, with `ctx.plan` set, the plan's kind)?"""
        ...

    def step(self, ctx: StepContext) -> StepResult:
        """Runs one step."""
        ...
