"""Runtime configuration and the per-request draft-length (k) policy. Torch-free.

Expected tokens per verify step with acceptance rate a and k drafts (Leviathan et al. 2023):
    E(a, k) = (1 - a^(k+1)) / (1 - a)          (k + 1 when a == 1)
We pick k maximising goodput  E(a, k) / (k * t_draft + t_verify(k))  from step costs measured
online, so k shrinks to 0 (plain decoding) when drafting cannot pay for itself, e.g. when the GPU
is saturated and verify cost grows with the number of scored tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

from verifypd.engine.types import MAX_K, InvalidRequest


@dataclass(frozen=True)
class LanePriorities:
    """Higher runs first within a step (and gets the higher CUDA stream priority)."""

    draft: int = 2
    verify: int = 1
    prefill: int = 0


@dataclass(frozen=True)
class RuntimeConfig:
    k_min: int = 0
    k_max: int = 8
    k_initial: int = 4
    adaptive: bool = True
    priorities: LanePriorities = field(default_factory=LanePriorities)
    prefill_token_budget: int = 512
    revision: int = 0

    def validate(self) -> None:
        if not (0 <= self.k_min <= self.k_max <= MAX_K):
            raise InvalidRequest(f"need 0 <= k_min <= k_max <= {MAX_K}; got k_min={self.k_min} k_max={self.k_max}")
        if not (self.k_min <= self.k_initial <= self.k_max):
            raise InvalidRequest(f"need k_min <= k_initial <= k_max; got {self.k_min} <= {self.k_initial} <= {self.k_max}")
        if self.prefill_token_budget < 16:
            raise InvalidRequest(f"prefill_token_budget must be >= 16, got {self.prefill_token_budget}")

    def updated(self, **changes) -> "RuntimeConfig":
        new = replace(self, **changes, revision=self.revision + 1)
        new.validate()
        return new


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens produced per verify step: accepted drafts plus the one target token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class StepCostModel:
    """Online linear fits of lane step times, from the router's own measurements.

    draft:  seconds per draft step (one forward of the batch), an EMA;
    verify: seconds = fixed + per_token * scored_tokens, least squares over a sliding window.
    Until measured, defaults describe a memory-bound GPU (verifying k+1 tokens costs ~ one).
    """

    def __init__(self, window: int = 64):
        self.draft_step_s = 0.3e-3
        self._verify: deque[tuple[int, float]] = deque(maxlen=window)
        self.verify_fixed_s = 3e-3
        self.verify_per_token_s = 0.02e-3

    def observe_draft(self, steps: int, seconds: float) -> None:
        if steps > 0:
            self.draft_step_s = 0.8 * self.draft_step_s + 0.2 * (seconds / steps)

    def observe_verify(self, scored_tokens: int, seconds: float) -> None:
        self._verify.append((scored_tokens, seconds))
        xs = [x for x, _ in self._verify]
        if len(self._verify) < 8 or max(xs) == min(xs):
            return
        n = len(xs)
        mx, my = sum(xs) / n, sum(y for _, y in self._verify) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in self._verify) / sxx
        self.verify_per_token_s = max(slope, 0.0)
        self.verify_fixed_s = max(my - self.verify_per_token_s * mx, 1e-6)

    def goodput(self, alpha: float, k: int, batch: int) -> float:
        """Tokens per second for one request in a batch of `batch` requests all using k."""
        verify = self.verify_fixed_s + self.verify_per_token_s * batch * (k + 1)
        return expected_tokens(alpha, k) / (k * self.draft_step_s + verify)


def choose_k(config: RuntimeConfig, alpha: float | None, request_max_k: int | None,
             costs: StepCostModel, batch: int, remaining_tokens: int) -> int:
    """k for one request this step. Never drafts more than the request can still emit."""
    hi = config.k_max if request_max_k is None else min(config.k_max, request_max_k)
    hi = min(hi, max(remaining_tokens - 1, 0))
    lo = min(config.k_min, hi)
    if not config.adaptive or alpha is None:
        return max(lo, min(config.k_initial, hi))
    return max(range(lo, hi + 1), key=lambda k: costs.goodput(alpha, k, batch))


def update_alpha(previous: float | None, accepted: int, k: int, weight: float = 0.3) -> float | None:
    if k == 0:
        return previous
    observed = accepted / k
    return observed if previous is None else (1 - weight) * previous + weight * observed
