"""The in-process engine: a colocated stack (verifypd.core.assembly.build_colocated) driven
from the caller's thread.

`Engine.generate` is the offline path (CLI `--offline`, tests, benches); the engine core of
`verifypd serve` builds the same stack and drives `router` from its loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from verifypd.core.assembly import build_colocated
from verifypd.domain.options import EngineOptions
from verifypd.domain.requests import RequestOutput, RequestSpec
from verifypd.model.build import Models
from verifypd.router.router import EngineObserver


class Engine:
    def __init__(
        self,
        options: EngineOptions | None = None,
        observer: EngineObserver | None = None,
        models: Models | None = None,
        *,
        simulated_acceptance: float | None = None,
        detokenize: bool = True,
    ):
        """`models`: already loaded (else loaded from `options`). `detokenize=False`: outputs carry
        no text (a front end detokenizes, as the gateway does). `simulated_acceptance` is for
        benchmarks only (see LocalVerifyLane); it overrides options.simulated_acceptance (set by
        `verifypd serve --simulated-acceptance`; no RPC sets it)."""
        self.options = options or EngineOptions()
        self.stack = build_colocated(
            self.options,
            observer=observer,
            models=models,
            simulated_acceptance=simulated_acceptance,
            detokenize=detokenize,
        )
        s = self.stack
        self.models, self.codec, self.router = s.models, s.codec, s.router
        self.target_pool, self.draft_pool = s.target_pool, s.draft_pool
        self.prefill_lane, self.draft_lane, self.verify_lane = s.prefill_lane, s.draft_lane, s.verify_lane
        self.startup_capture_seconds = s.startup_capture_seconds

    def generate(self, specs: list[RequestSpec]) -> dict[str, Completion]:
        """Runs requests to completion (offline); returns completions by request id."""
        ids = [self.router.add_request(s) for s in specs]
        done: dict[str, Completion] = {i: Completion(i) for i in ids}
        while self.router.has_work():
            for out in self.router.step():
                done[out.request_id].add(out)
        return done


@dataclass
class Completion:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    applied_k: list[int] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.token_ids
        self.text += out.text
        self.applied_k.append(out.applied_k)
        self.usage = out.stats.usage()
        self.ttft_s = out.stats.ttft
        if out.finished:
            if out.finish_reason is None:
                raise ValueError(f"request {out.request_id!r}: a finished output carries no finish_reason")
            self.finish_reason = out.finish_reason.value
            self.elapsed_s = (
                out.stats.token_times[-1] if out.stats.token_times else time.monotonic()
            ) - out.stats.arrival_time
