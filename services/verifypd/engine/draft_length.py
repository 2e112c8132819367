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


SCHEDULES = ("baseline", "pd", "pdv")


@dataclass(frozen=True)
class RuntimeConfig:
    k_min: int = 0
    k_max: int = 8
    k_initial: int = 4
    adaptive: bool = True
    priorities: LanePriorities = field(default_factory=LanePriorities)
    prefill_token_budget: int = 512
    # Router policy (docs/engine.md "Schedules"): "baseline" = one request per lane call, requests
    # interleaved round-robin; "pd" = prefill + lock-step draft/verify of the whole decoding batch;
    # "pdv" = three lanes, draft of one group overlapping verify of the other when `pipeline`.
    schedule: str = "pdv"
    pipeline: bool = False  # pdv only: overlap groups (CLI: on across lane processes); off = lock-step
    revision: int = 0

    def validate(self) -> None:
        if not (0 <= self.k_min <= self.k_max <= MAX_K):
            raise InvalidRequest(f"need 0 <= k_min <= k_max <= {MAX_K}; got k_min={self.k_min} k_max={self.k_max}")
        if not (self.k_min <= self.k_initial <= self.k_max):
            raise InvalidRequest(f"need k_min <= k_initial <= k_max; got {self.k_min} <= {self.k_initial} <= {self.k_max}")
        if self.schedule not in SCHEDULES:
            raise InvalidRequest(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if self.prefill_token_budget < 16:
            raise InvalidRequest(f"prefill_token_budget must be >= 16, got {self.prefill_token_budget}")

    @property
    def pipelined(self) -> bool:
        return self.schedule == "pdv" and self.pipeline

    def updated(self, **changes) -> "RuntimeConfig":
        new = replace(self, **changes, revision=self.revision + 1)
        new.validate()
        return new


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens produced per verify step: accepted drafts plus the one target token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def batch_bucket(batch: int) -> int:
    """Costs are tracked per padded batch size (powers of two, as the CUDA graphs are)."""
    return 1 << max(0, batch - 1).bit_length()


class StepCostModel:
    """Decode step costs measured online by the router: seconds of one whole speculative step
    (planning, the draft call, the verify call, committing the tokens; a prefill run before or
    after decode excluded) per (padded batch bucket, k); k = 0 is a plain verify step.

    Draft and verify are measured together because an in-process draft call returns before its GPU
    work is done (the tokens stay on the device for the verify call), so only their sum is real.
    The host work around the calls is included because it is paid per step: a pipelined step
    verifies half the batch, so it pays that work twice as often per token as a lock-step step.
    An unmeasured cost is estimated by the measured one of the largest smaller k at that bucket
    (cost does not fall as k grows, so this is a lower bound): optimism makes the policy try an
    unmeasured k once, and the measurement then corrects it. Defaults describe a memory-bound GPU
    until anything is measured. Steps whose draft first caught up on many committed tokens (after
    steps without drafting) are not typical and are not recorded by the router.
    """

    def __init__(self, window: int = 9):
        self.window = window
        self._step: dict[tuple[int, int], float] = {}
        self._samples: dict[tuple[int, int], deque] = {}
        # pdv pipelined steps, by (padded group bucket, k): the wall time of one step in which one
        # group verifies its held drafts (k each) while the other group drafts.
        self._pipe: dict[tuple[int, int], float] = {}
        self._pipe_samples: dict[tuple[int, int], deque] = {}
        self.default_verify_s = 3e-3
        self.default_draft_step_s = 0.3e-3
        self.acceptance = AcceptanceTracker()  # engine-wide prior for requests not yet observed

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A lock-step step (draft + verify of `batch` requests). Median of the last few steps: one
        slow step (a lazy compile, a GC pause) moves nothing."""
        self._record(self._samples, self._step, (batch_bucket(batch), k), seconds)

    def observe_pipelined(self, group: int, k: int, seconds: float) -> None:
        """A pipelined pdv step whose verify call held `group` requests with k held drafts each."""
        self._record(self._pipe_samples, self._pipe, (batch_bucket(group), k), seconds)

    def _record(self, samples_by_key: dict, medians: dict, key: tuple[int, int], seconds: float) -> None:
        samples = samples_by_key.setdefault(key, deque(maxlen=self.window))
        samples.append(seconds)
        medians[key] = sorted(samples)[len(samples) // 2]

    def step_s(self, batch: int, k: int) -> float:
        b = batch_bucket(batch)
        exact = self._step.get((b, k))
        if exact is not None:
            return exact
        below = [(kk, v) for (bb, kk), v in self._step.items() if bb == b and kk < k]
        return max(below)[1] if below else self.default_verify_s + k * self.default_draft_step_s

    def goodput(self, alphas: list[float], k: int, batch: int) -> float:
        """Tokens per second of a batch whose requests all draft k (verify scores k + 1 each)."""
        return sum(expected_tokens(a, k) for a in alphas) / self.step_s(batch, k)

    def pipelined_step_s(self, group: int, k: int) -> float:
        """Seconds of a pipelined step whose groups hold `group` requests drafting k. Unmeasured, it
        is estimated by perfect overlap, half of the lock-step cost of one group (a pipelined step
        costs at least max(draft, verify) >= (draft + verify) / 2): optimistic, so pipelining is
        tried, and the measurement then decides."""
        exact = self._pipe.get((batch_bucket(group), k))
        return exact if exact is not None else self.step_s(group, k) / 2

    def pipelined_goodput(self, alphas: list[float], k: int, batch: int) -> float:
        """Tokens per second of requests whose drafts are pipelined, `batch` decoding in all (two
        groups of about batch / 2): in steady state each request is verified every other step, so it
        gains E(a, k) per two pipelined steps. k = 0 is no pipelining at all: the whole batch
        plain-decodes in every step, as in a lock-step step. Comparable with `goodput` over the
        same requests (the same alphas), which is how pdv decides whether to pipeline."""
        if k == 0:
            return self.goodput(alphas, 0, batch)
        group = -(-batch // 2)
        return sum(expected_tokens(a, k) for a in alphas) / (2 * self.pipelined_step_s(group, k))


class AcceptanceTracker:
    """Per-token acceptance estimate, engine-wide, from verify outcomes.

    Under the i.i.d. model behind E(a, k), a verify of k drafts that accepted m is m successes plus
    one failure when m < k, so a = successes / (successes + failures) is the maximum-likelihood
    estimate (accepted / drafted would be biased low: drafts after a rejection are never tried).
    Counts decay so the estimate follows a changing workload."""

    def __init__(self, decay: float = 0.99):
        self.decay = decay
        self.successes = 0.0
        self.failures = 0.0

    def observe(self, accepted: int, k: int) -> None:
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1 if accepted < k else 0)

    @property
    def alpha(self) -> float | None:
        total = self.successes + self.failures
        return None if total <= 0 else self.successes / total


def request_alpha(successes: int, failures: int, prior: float | None, prior_weight: float = 4.0) -> float | None:
    """A request's acceptance: its own counts, shrunk toward the engine-wide estimate."""
    if prior is None:
        total = successes + failures
        return None if total == 0 else successes / total
    return (successes + prior_weight * prior) / (successes + failures + prior_weight)


def choose_k(config: RuntimeConfig, alpha: float | None, request_max_k: int | None,
             costs: StepCostModel, batch: int, remaining_tokens: int) -> int:
    """k for one request deciding alone (see choose_batch_k for a batch)."""
    return cap_k(config, choose_batch_k(config, [alpha], costs, batch, config.k_max), request_max_k,
                 remaining_tokens)


def cap_k(config: RuntimeConfig, k: int, request_max_k: int | None, remaining_tokens: int) -> int:
    """Never more than the request allows or can still emit."""
    hi = config.k_max if request_max_k is None else min(config.k_max, request_max_k)
    hi = min(hi, max(remaining_tokens - 1, 0))
    return max(min(config.k_min, hi), min(k, hi))


SWITCH_MARGIN = 1.1  # turning speculation on or off must promise 10% more goodput (see choose_batch_k)


def choose_batch_k(config: RuntimeConfig, alphas: list[float | None], costs: StepCostModel, batch: int,
                   hi: int, probe: bool = False, current: int | None = None, pipelined: bool = False) -> int:
    """One k for the decoding batch: verify runs every request padded to max(k) + 1 tokens, so a
    shared k is what the GPU pays for. Maximises the batch's goodput; `probe` turns a 0 into 1 so
    acceptance keeps being observed while speculation is off (the caller probes now and then).
    `pipelined`: `alphas` are one pdv group's and `batch` counts both groups; costs are those of
    pipelined steps (`StepCostModel.pipelined_goodput`)."""
    hi = max(min(hi, config.k_max), 0)
    lo = min(config.k_min, hi)
    known = [a for a in alphas if a is not None]
    if not config.adaptive or not known:
        return max(lo, min(config.k_initial, hi))
    goodput = costs.pipelined_goodput if pipelined else costs.goodput
    best = max(range(lo, hi + 1), key=lambda k: goodput(known, k, batch))
    # Hysteresis between drafting and not: each return to drafting first catches the draft up on
    # every token decoded meanwhile, so near break-even flipping back and forth costs more than
    # either choice. `current` is the batch's k of the previous step.
    if current is not None and lo <= current <= hi and (best == 0) != (current == 0):
        if goodput(known, best, batch) < SWITCH_MARGIN * goodput(known, current, batch):
            best = current
    return 1 if probe and best == 0 and hi >= 1 else best


def pipelining_pays(config: RuntimeConfig, alphas: list[float | None], costs: StepCostModel, batch: int,
                    current: bool | None) -> bool:
    """pdv: pipeline this step's `batch` decoding requests (two groups, draft of one beside the
    verify of the other) or run them lock-step? The better best-k goodput of the two, from measured
    step costs; an unmeasured pipelined cost is optimistic (see `pipelined_step_s`), so pipelining
    is tried before it is judged. Switching needs SWITCH_MARGIN (`current`: last step's choice)."""
    known = [a for a in alphas if a is not None]
    if not config.adaptive or not known or config.k_max < 1:
        return True
    ks = range(min(config.k_min, config.k_max), config.k_max + 1)
    lock = max(costs.goodput(known, k, batch) for k in ks)
    pipe = max(costs.pipelined_goodput(known, k, batch) for k in ks if k > 0)
    if current is None:
        return pipe >= lock
    return pipe * SWITCH_MARGIN >= lock if current else pipe > SWITCH_MARGIN * lock
