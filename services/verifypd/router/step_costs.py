"""What a decode step costs and how often drafts are accepted: the measurements the draft-length
policy (`verifypd.router.draft_length`) decides from. Torch-free.

Expected tokens per verify step with acceptance rate a and k drafts (Leviathan et al. 2023):
    E(a, k) = (1 - a^(k+1)) / (1 - a)          (k + 1 when a == 1)
"""

from __future__ import annotations

from collections import deque

from verifypd.domain.requests import MAX_K
from verifypd.router.cost_estimates import DRAFT_COST_PRIOR, lock_step_estimates, pipelined_estimate


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens produced per verify step: accepted drafts plus the one target token."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


MIN_STEP_S = 1e-6
# Plain decoding at a batch bucket is measured over this many steps before drafting is judged against
# it: the first plain step after a batch's prefill also waits for that prefill's GPU work, and one
# sample is its own median. At 16 requests (the embedded model, H200) that step read
# 1.58 ms against ~0.95 for the steps after it, and the policy drafted at 0.7 x plain decoding.
PLAIN_SAMPLES = 3


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
    An unmeasured k is estimated conservatively from the measured ones (`step_s`,
    router.cost_estimates); defaults describe a memory-bound GPU until anything is measured. Steps
    whose draft first caught up on many committed tokens (after steps without drafting), and probe
    steps that drafted for part of the batch, are not typical and are not recorded by the router.
    """

    def __init__(self, window: int = 9):
        self.window = window
        self._step: dict[tuple[int, int], float] = {}
        # step_s of the current medians by bucket, for k = 0..MAX_K (a decision asks for every k)
        self._estimates: dict[int, list[float]] = {}
        self._samples: dict[tuple[int, int], deque] = {}
        # pdv pipelined steps, by (padded group bucket, k): the wall time of one step in which one
        # group verifies its held drafts (k each) while the other group drafts.
        self._pipe: dict[tuple[int, int], float] = {}
        self._pipe_samples: dict[tuple[int, int], deque] = {}
        self.default_verify_s = 3e-3
        self.default_draft_step_s = DRAFT_COST_PRIOR * self.default_verify_s
        self.acceptance = AcceptanceTracker()  # engine-wide prior for requests not yet observed

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A lock-step step (draft + verify of `batch` requests). Median of the last few steps: one
        slow step (a lazy compile, a GC pause) moves nothing."""
        key = (batch_bucket(batch), k)
        before = self._step.get(key)
        self._record(self._samples, self._step, key, seconds)
        if self._step[key] != before:
            self._estimates.clear()

    def observe_pipelined(self, group: int, k: int, seconds: float) -> None:
        """A pipelined pdv step whose verify call held `group` requests with k held drafts each."""
        self._record(self._pipe_samples, self._pipe, (batch_bucket(group), k), seconds)

    def _record(self, samples_by_key: dict, medians: dict, key: tuple[int, int], seconds: float) -> None:
        samples = samples_by_key.setdefault(key, deque(maxlen=self.window))
        samples.append(max(seconds, MIN_STEP_S))  # a coarse clock can read 0: costs stay positive
        # The lower median: of two samples, one slow step (a GC pause, a step that also waited on
        # other work) must not be the cost. Taking the upper one, single 4-5 ms samples of a batch-16
        # step that costs ~1.8 ms made k = 4 and up look 2.5 x dearer than they are.
        medians[key] = sorted(samples)[(len(samples) - 1) // 2]

    def measured(self, batch: int, k: int) -> bool:
        """Whether a lock-step step of this k at this batch's bucket has been measured (plain
        decoding, k = 0, over PLAIN_SAMPLES steps)."""
        samples = self._samples.get((batch_bucket(batch), k))
        return samples is not None and len(samples) >= (PLAIN_SAMPLES if k == 0 else 1)

    def step_s(self, batch: int, k: int) -> float:
        """Measured, or estimated from the ks measured at this bucket, or from the relative costs of
        a nearby one (`cost_estimates.lock_step_estimates`); with nothing measured here, the defaults."""
        return self.step_costs(batch)[k]

    def step_costs(self, batch: int) -> list[float]:
        """`step_s` at this batch for every k in 0..MAX_K (computed together, kept until a median moves)."""
        bucket = batch_bucket(batch)
        cached = self._estimates.get(bucket)
        if cached is None:
            estimates = lock_step_estimates(self._step, bucket, MAX_K)
            if estimates is None:
                estimates = [self.default_verify_s + k * self.default_draft_step_s for k in range(MAX_K + 1)]
            cached = self._estimates[bucket] = estimates
        return cached

    def goodput(self, alphas: list[float], k: int, batch: int, rates: list[float] | None = None) -> float:
        """Tokens per second of a batch whose requests are asked for k drafts. `rates`: how often
        each request's draft lane proposes anything (None: always, a model draft). A request
        without a proposal plain-decodes, and a step in which no request has one costs a plain
        step, so with rates p_i: tokens Σ 1 + p_i (E(a_i, k) - 1) per step costing
        step(B, 0) + P(any proposal) (step(B, k) - step(B, 0))."""
        return self.goodputs(alphas, k, batch, rates)[k]

    def goodputs(self, alphas: list[float], hi: int, batch: int, rates: list[float] | None = None) -> list[float]:
        """`goodput` for every k in 0..hi at once: the draft-length policy asks for all of them every
        step, and summing E(a_i, k) per request and k took ~0.5 ms of host time per step at batch 64
        (the GPU idles meanwhile). With power sums it is one pass over the requests."""
        tokens = expected_token_sums(alphas, hi, rates)
        any_proposal = 1.0 if rates is None else _any_of(rates)
        costs = self.step_costs(batch)
        plain = costs[0]
        return [tokens[k] / (plain + any_proposal * (costs[k] - plain)) for k in range(hi + 1)]

    def pipelined_step_s(self, group: int, k: int) -> float:
        """Seconds of a pipelined step whose groups hold `group` requests drafting k. With no
        pipelined step measured at the group's bucket, it is estimated by perfect overlap, half of
        the lock-step cost of one group (a pipelined step costs at least max(draft, verify) >=
        (draft + verify) / 2): optimistic, so pipelining is tried, and the measurement then
        decides; once one k is measured there, other ks are estimated from it (`pipelined_estimate`), or at
        low acceptance every unmeasured k would be tried in turn."""
        estimate = pipelined_estimate(self._pipe, batch_bucket(group), k)
        return self.step_s(group, k) / 2 if estimate is None else estimate

    def pipelined_goodput(self, alphas: list[float], k: int, batch: int, rates: list[float] | None = None) -> float:
        """Tokens per second of requests whose drafts are pipelined, `batch` decoding in all (two
        groups of about batch / 2): in steady state each request is verified every other step, so it
        gains E(a, k) per two pipelined steps. k = 0 is no pipelining at all: the whole batch
        plain-decodes in every step, as in a lock-step step. Comparable with `goodput` over the
        same requests (the same alphas), which is how pdv decides whether to pipeline. `rates` as
        in `goodput` (here the step is costed as if some request always had a proposal)."""
        if k == 0:
            return self.goodput(alphas, 0, batch)
        group = -(-batch // 2)
        rates = rates or [1.0] * len(alphas)
        tokens = sum(1 + p * (expected_tokens(a, k) - 1) for a, p in zip(alphas, rates, strict=False))
        return tokens / (2 * self.pipelined_step_s(group, k))


def expected_token_sums(alphas: list[float], hi: int, rates: list[float] | None = None) -> list[float]:
    """[Σ_i 1 + p_i (E(a_i, k) - 1) for k in 0..hi] (p_i = rates[i], 1 without rates), by power
    sums: E(a, k) - 1 = a + a^2 + ... + a^k, so the k-th entry is B + Σ_{j<=k} Σ_i p_i a_i^j."""
    power_sums = [0.0] * (hi + 1)
    for i, a in enumerate(alphas):
        x = 1.0 if rates is None else rates[i]
        for j in range(1, hi + 1):
            x *= a
            power_sums[j] += x
    total, sums = float(len(alphas)), []
    for j in range(hi + 1):
        total += power_sums[j]
        sums.append(total)
    return sums


def _any_of(rates: list[float]) -> float:
    """P(at least one request has a proposal), proposals independent."""
    none = 1.0
    for p in rates:
        none *= 1.0 - p
    return 1.0 - none


class AcceptanceTracker:
    """Per-token acceptance estimate, engine-wide, from verify outcomes.

    Under the i.i.d. model behind E(a, k), a verify of k drafts that accepted m is m successes plus
    one failure when m < k, so a = successes / (successes + failures) is the maximum-likelihood
    estimate (accepted / drafted would be biased low: drafts after a rejection are never tried).
    Counts decay so the estimate follows a changing workload. A half success and a half failure
    (Jeffreys' prior) keep one early outcome from reading as 0 or 1, and no estimate is given
    before `min_observations` verify outcomes: until then the policy drafts k_initial, since
    switching speculation off on one unlucky rejection may leave it off for a whole request (a
    request not drafting is probed rarely, see draft_length.ProbeSchedule). An ask the draft lane
    answered with no proposal (prompt lookup without a match) counts as an outcome here: a lane that
    never proposes gives no verify outcome at all, and without an estimate the policy kept asking for
    k_initial drafts every step (a draft call and an unchained step each time, for nothing); with
    it, the prior acceptance and the measured proposal rate (goodput's `rates`) turn drafting off."""

    def __init__(self, decay: float = 0.99, min_observations: int = 8, prior: float = 0.5):
        self.decay, self.min_observations, self.prior = decay, min_observations, prior
        self.successes = 0.0
        self.failures = 0.0
        self.observations = 0
        self.unanswered = 0  # asks answered with no proposal (not decayed; see `alpha`)
        self.asked = 0.0  # verify steps of requests asked for drafts (decayed) ...
        self.proposed = 0.0  # ... and of those, steps with a proposal

    def observe(self, accepted: int, k: int) -> None:
        """A verify of k > 0 proposed drafts that accepted `accepted`."""
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1 if accepted < k else 0)
        self.observations += 1

    def observe_proposal(self, proposed: bool) -> None:
        """A request was asked for drafts; did the draft lane propose any?"""
        self.asked = self.decay * self.asked + 1
        self.proposed = self.decay * self.proposed + proposed
        self.unanswered += not proposed

    @property
    def proposal_rate(self) -> float:
        """Fraction of asks answered with a proposal, from a prior of one ask answered (1 until a
        lane is seen to propose nothing: a model draft always proposes)."""
        return (self.proposed + 1) / (self.asked + 1)

    @property
    def alpha(self) -> float | None:
        if self.observations + self.unanswered < self.min_observations:
            return None
        return (self.successes + self.prior) / (self.successes + self.failures + 2 * self.prior)
