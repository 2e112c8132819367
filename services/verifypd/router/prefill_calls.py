"""A step's prefill call: run and committed at once (`run_prefill`), or started beside a verify call
(`start_prefill`: a `StartedPrefill`, held in a `BesidePrefill`) and committed after it. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from verifypd.domain.requests import RequestOutput
from verifypd.router.lane_items import prefill_items
from verifypd.router.step_context import StepContext
from verifypd.router.step_plan import PrefillChunk


class BesidePrefill:
    """A regular step's prefill chunks, started beside its verify call (the lock-step strategy sets
    `started`, a StartedPrefill); a chain started there takes the prefilled requests along."""

    def __init__(self, chunks: list[PrefillChunk]):
        self.chunks: list[PrefillChunk] = chunks
        self.started: StartedPrefill | None = None


class StartedPrefill:
    """A prefill call started beside a verify call; `result()` is (outputs, launch + wait seconds),
    as a pipelined prefill's Future gives."""

    def __init__(self, started, launch_s: float, clock: Callable[[], float]):
        self._started, self._launch_s, self._clock = started, launch_s, clock

    @property
    def launch_s(self) -> float:
        """Seconds the host spent launching the call."""
        return self._launch_s

    @property
    def next_tokens(self):
        """The prefill's first tokens left on the device, where its lane leaves them (steps.overlapped)."""
        return getattr(self._started, "next_tokens", None)

    def result(self) -> tuple[list, float]:
        t0 = self._clock()
        results = self._started.result()
        return results, self._launch_s + self._clock() - t0


def starts_async(*lanes) -> bool:
    """Do all of `lanes` start calls that run on while the host goes on (in-process CUDA lanes)?"""
    return all(getattr(lane, "starts_async", False) for lane in lanes)


def start_prefill(ctx: StepContext, chunks: list[PrefillChunk]) -> StartedPrefill:
    t0 = ctx.clock()
    started = ctx.prefill_lane.prefill_start(prefill_items(ctx, chunks))
    return StartedPrefill(started, ctx.clock() - t0, ctx.clock)


def run_prefill(
    ctx: StepContext, chunks: list[PrefillChunk], pending: Future | StartedPrefill | None = None
) -> list[RequestOutput]:
    """Prefills `chunks` (or takes the results of their call already in flight) and commits them."""
    if not chunks:
        return []
    results, seconds = pending.result() if pending is not None else ctx.call_prefill(prefill_items(ctx, chunks))
    ctx.observer.on_lane_step("prefill", seconds, len(chunks))
    return ctx.commit_prefill(chunks, results)
