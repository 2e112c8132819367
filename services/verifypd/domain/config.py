"""The runtime configuration: what the operator and `Control.UpdateConfig` change while serving (draft-length
bounds, lane priorities, prefill budgets, the schedule). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from verifypd.domain.defaults import DEFAULT_K_INITIAL, DEFAULT_K_MAX, DEFAULT_K_MIN
from verifypd.domain.requests import MAX_K, InvalidRequest


@dataclass(frozen=True)
class LanePriorities:
    """Higher runs first within a step (and gets the higher CUDA stream priority)."""

    draft: int = 2
    verify: int = 1
    prefill: int = 0


SCHEDULES = ("baseline", "pd", "pdv")


@dataclass(frozen=True)
class RuntimeConfig:
    k_min: int = DEFAULT_K_MIN
    k_max: int = DEFAULT_K_MAX
    k_initial: int = DEFAULT_K_INITIAL
    adaptive: bool = True
    priorities: LanePriorities = field(default_factory=LanePriorities)
    prefill_token_budget: int = 512
    # Prompt tokens per step while no request is decoding (a burst of arrivals into an idle engine):
    # no one's next token waits on that prefill, so it takes max(this, prefill_token_budget); one
    # large prefill runs its GEMMs better than 16 chunks of 512 (docs/engine.md). 0: no raise.
    idle_prefill_token_budget: int = 8192
    # Router policy (docs/engine.md "Schedules"): "baseline" = one request per lane call, requests
    # interleaved round-robin; "pd" = prefill + lock-step draft/verify of the whole decoding batch;
    # "pdv" = three lanes, draft of one group overlapping verify of the other when `pipeline`.
    schedule: str = "pdv"
    pipeline: bool = False  # pdv only: overlap groups (CLI: on across lane processes); off = lock-step
    # Overlapped plain decoding (engine.overlap, docs/engine.md "Overlapped scheduling"): launch the
    # next k = 0 step before the current one's tokens reach the host. In-process lanes only (others
    # ignore it). On: 1.15-1.30 x the steps without it on an H200 (bench/results/engine_throughput_h200_overlap.json).
    overlap: bool = True
    # With `overlap`: a request admitted into a chained step is prefilled ahead of that step's verify
    # call and decodes in it (first token one step call sooner), where k is 0 whatever the batch
    # (plan_ahead.join_now); off: its prefill runs beside the step and it joins the next one. Off by
    # default until measured served on a GPU (docs/engine.md "Overlapped scheduling").
    admit_ahead: bool = False
    revision: int = 0

    def validate(self) -> None:
        if not (0 <= self.k_min <= self.k_max <= MAX_K):
            raise InvalidRequest(f"need 0 <= k_min <= k_max <= {MAX_K}; got k_min={self.k_min} k_max={self.k_max}")
        if not (self.k_min <= self.k_initial <= self.k_max):
            raise InvalidRequest(
                f"need k_min <= k_initial <= k_max; got {self.k_min} <= {self.k_initial} <= {self.k_max}"
            )
        if self.schedule not in SCHEDULES:
            raise InvalidRequest(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if self.prefill_token_budget < 16:
            raise InvalidRequest(f"prefill_token_budget must be >= 16, got {self.prefill_token_budget}")
        if self.idle_prefill_token_budget < 0:
            raise InvalidRequest(f"idle_prefill_token_budget must be >= 0, got {self.idle_prefill_token_budget}")

    @property
    def pipelined(self) -> bool:
        return self.schedule == "pdv" and self.pipeline

    def updated(self, **changes) -> RuntimeConfig:
        new = replace(self, **changes, revision=self.revision + 1)
        new.validate()
        return new
