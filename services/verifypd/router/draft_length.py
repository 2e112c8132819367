"""The per-request draft-length (k) policy (its settings: domain.config.RuntimeConfig). Torch-free.

Expected tokens per verify step with acceptance rate a and k drafts (Leviathan et al. 2023):
    E(a, k) = (1 - a^(k+1)) / (1 - a)          (k + 1 when a == 1)
We pick k maximising goodput  E(a, k) / (k * t_draft + t_verify(k))  from step costs measured
online, and draft at all only when that beats plain decoding's  1 / t_verify(0)  by a margin
(DRAFT_ON_GAIN to start, DRAFT_OFF_GAIN to keep going), so k is 0 when drafting cannot pay for
itself: low acceptance, or a saturated GPU whose verify cost grows with the tokens scored. With k
at 0, rare cheap probes (ProbeSchedule, the scheduler picks whom) keep acceptance observed.
"""

from __future__ import annotations

from verifypd.domain.config import RuntimeConfig
from verifypd.router.step_costs import AcceptanceTracker, StepCostModel, batch_bucket, expected_tokens  # noqa: F401 (re-exported)


def request_alpha(successes: int, failures: int, prior: float | None, prior_weight: float = 4.0) -> float | None:
    """A request's acceptance: its own counts, shrunk toward the engine-wide estimate (None while
    the engine has no estimate yet: too few outcomes to judge, see AcceptanceTracker)."""
    if prior is None:
        return None
    return (successes + prior_weight * prior) / (successes + failures + prior_weight)


def request_rate(asked: int, proposed: int, prior: float, prior_weight: float = 4.0) -> float:
    """A request's proposal rate: its own counts, shrunk toward the engine-wide rate."""
    return (proposed + prior_weight * prior) / (asked + prior_weight)


def choose_k(
    config: RuntimeConfig,
    alpha: float | None,
    request_max_k: int | None,
    costs: StepCostModel,
    batch: int,
    remaining_tokens: int,
) -> int:
    """k for one request deciding alone (see choose_batch_k for a batch)."""
    return cap_k(config, choose_batch_k(config, [alpha], costs, batch, config.k_max), request_max_k, remaining_tokens)


def cap_k(config: RuntimeConfig, k: int, request_max_k: int | None, remaining_tokens: int) -> int:
    """Never more than the request allows or can still emit."""
    hi = config.k_max if request_max_k is None else min(config.k_max, request_max_k)
    hi = min(hi, max(remaining_tokens - 1, 0))
    return max(min(config.k_min, hi), min(k, hi))


# An opening probe (KDecision._opening_probes) may cost at most this many plain steps above a plain
# step, by the measured costs: at k = 8 an EAGLE head at 13 % acceptance spent ~3 plain steps on each
# new batch's opening at batch 16 (H100, embedded model), most of what it lost to plain decoding.
OPENING_MAX_EXTRA = 1.0


def opening_k(config: RuntimeConfig, costs: StepCostModel, batch: int, hi: int) -> int:
    """The k a request drafts in its opening probe: the largest k <= min(k_initial, hi) whose step at
    `batch` costs at most OPENING_MAX_EXTRA plain steps more than a plain step (StepCostModel.step_s:
    measured, or estimated from the ks measured; k = 1 if none does). Not the k of best goodput at
    the engine-wide acceptance: the probe is there to find requests that draft better than that
    estimate, and a longer probe tells a request's own acceptance sooner (a good request after bad
    ones opened at k = 1 stayed near the estimate and rarely drafted)."""
    k_open = max(min(config.k_initial, hi), 0)
    if k_open <= 1:
        return k_open
    plain = costs.step_s(batch, 0)
    fits = [k for k in range(2, k_open + 1) if costs.step_s(batch, k) / plain - 1.0 <= OPENING_MAX_EXTRA]
    return max(fits, default=1)


SWITCH_MARGIN = 1.1  # pdv: switching between pipelined and lock-step must promise 10 % more goodput
# Drafting on or off, with hysteresis: a batch not drafting starts only for a predicted 10 % more
# goodput than plain decoding (the first drafting step also catches the draft up on every token
# decoded meanwhile); a drafting batch stops as soon as the predicted gain falls under 2 %, so a
# batch whose expected gain is negative never keeps drafting. The 8 % band keeps it from flapping.
DRAFT_ON_GAIN, DRAFT_OFF_GAIN = 1.10, 1.02


def choose_batch_k(
    config: RuntimeConfig,
    alphas: list[float | None],
    costs: StepCostModel,
    batch: int,
    hi: int,
    current: int | None = None,
    pipelined: bool = False,
    rates: list[float] | None = None,
) -> int:
    """One k for the decoding batch: verify runs every request padded to max(k) + 1 tokens, so a
    shared k is what the GPU pays for. The drafting k maximises the batch's goodput
    Σ E(a_i, k) / step(batch, k); it is taken only if it beats plain decoding (k = 0) by
    DRAFT_ON_GAIN, or DRAFT_OFF_GAIN when `current` (the batch's k of the previous step) already
    drafts. Probes while k is 0 are the scheduler's (ProbeSchedule). `pipelined`: `alphas` are one
    pdv group's and `batch` counts both groups; costs are those of pipelined steps
    (`StepCostModel.pipelined_goodput`). `rates`: per request, how often its draft lane proposes
    anything when asked (None: always), see `StepCostModel.goodput`."""
    hi = max(min(hi, config.k_max), 0)
    lo = min(config.k_min, hi)
    known = [a for a in alphas if a is not None]
    if not config.adaptive or not known:
        return max(lo, min(config.k_initial, hi))
    if hi == 0:
        return 0
    if rates is not None:
        rates = [p for a, p in zip(alphas, rates, strict=False) if a is not None]
    if pipelined:
        goodput = [costs.pipelined_goodput(known, k, batch, rates) for k in range(hi + 1)]
    else:  # every k at once (host time: this runs every step, see StepCostModel.goodputs)
        goodput = costs.goodputs(known, hi, batch, rates)
    best = max(range(max(lo, 1), hi + 1), key=goodput.__getitem__)
    if lo > 0:  # k_min > 0: drafting is not the policy's choice
        return best
    if not costs.measured(batch, 0):
        # Plain decoding is what drafting is judged against: measure it once at this batch size
        # (estimated from drafting steps alone it would hang on the prior DRAFT_COST_PRIOR).
        return 0
    needed = DRAFT_OFF_GAIN if current else DRAFT_ON_GAIN
    return best if goodput[best] >= needed * goodput[0] else 0


# Probes: with k at 0 a batch drafts PROBE_K for some requests now and then, so acceptance keeps
# being observed (it may rise: a request starts copying its prompt). The first after PROBE_FIRST
# steps without drafting, then after twice as many each time (up to PROBE_MAX) while probes
# confirm k = 0. A probe is a normal k = 1 step for the requests it drafts for: only requests
# whose draft KV lags the pending token by at most PROBE_MAX_LAG are probed (draft input <= 2
# tokens, the shape of every drafting step, CUDA-graphed), never one whose draft would first have
# to catch up on the tokens decoded meanwhile: that draft call feeds 32 to 1,024 tokens per
# request, past the graphs' 9-token query, so it runs eagerly (before this rule every probe did:
# the likely cause of a median probe draft call of 17.7 ms against 1.4 ms for a k = 1 draft call
# at batch 1, H200). With a model draft the probed requests are those in their first decode step,
# right after prefill wrote their draft KV; a pool-less draft (ngram) has no KV to catch up.
PROBE_K = 1
PROBE_FIRST, PROBE_MAX = 32, 1024
PROBE_MAX_LAG = 1
TYPICAL_DRAFT_INPUT = PROBE_MAX_LAG + 1  # tokens a draft call takes in a step worth costing
# Probes (periodic and opening ones) are paid from a budget: each plain step while drafting is off
# earns PROBE_BUDGET plain steps' worth of time, and a probe spends what it is measured to cost
# above a plain step (StepCostModel: step(B, k) / step(B, 0) - 1, in plain steps). So at zero
# acceptance probes cost at most 1 % of plain decoding, however cheap the backoff makes them look:
# on the embedded model at 16 requests a probe step (~3.4 ms, the chain of plain steps broken)
# cost 3.5 plain steps, and two probes plus an opening one per 128-step batch took ~6 % (H100).
# Where probes are cheap (batch 1: a k = 1 step ~1.2 plain steps) the backoff decides, as before.
# The credit is capped, so a long plain run does not bank a burst of probes.
PROBE_BUDGET = 0.01
PROBE_CREDIT_MAX = 16.0  # plain steps' worth


class ProbeSchedule:
    """When the next probe is due (see PROBE_FIRST) and whether the budget affords it (see
    PROBE_BUDGET); also counts decisions for benchmarks."""

    def __init__(self) -> None:
        self.interval = PROBE_FIRST
        self.steps_off = 0  # k decisions of 0 since the last drafting or probing one
        self.credit = 0.0  # plain steps' worth of time probes may still spend (PROBE_BUDGET per plain step)
        self.spent = 0.0  # plain steps' worth spent on probes so far (tests, benchmarks)
        self.charged = 0.0  # estimates spent since the last `settle` (the probing step's)
        self.unsettled = False  # a probe was paid for since the last `settle`
        self.decisions = self.drafting = self.probes = 0
        self.k_counts: dict[int, int] = {}  # batch k decisions by k (benchmarks read it)

    @property
    def due(self) -> bool:
        return self.steps_off >= self.interval

    def affords(self, extra: float) -> bool:
        """Does the credit cover a probe costing `extra` plain steps above a plain step?"""
        return self.credit >= extra

    def spend(self, extra: float) -> None:
        self.charge(extra)
        self.charged += extra
        self.unsettled = True

    def charge(self, extra: float) -> None:
        """A probe's cost no step's wall time settles (the draft KV a prefill wrote for it)."""
        self.credit -= extra
        self.spent += extra

    def settle(self, measured: float) -> None:
        """After the step that ran the probes charged since the last settle: `measured`, that step's
        cost above a plain step (in plain steps, from its wall time), replaces what the estimate
        charged where it is more. The estimates price a probe as a measured or estimated k step;
        on the H200 an opening probe of a 12-layer self draft at 16 requests (the first decode step
        after the batch's prefill, eager, the plain chain broken) took ~7 plain steps against ~2-3
        charged, so at zero acceptance probes cost 2-3 % of plain decoding, not the budget's 1 %."""
        more = max(measured - self.charged, 0.0)
        self.credit -= more
        self.spent += more
        self.charged, self.unsettled = 0.0, False

    def record(self, k: int, probed: bool) -> None:
        self.decisions += 1
        self.k_counts[k] = self.k_counts.get(k, 0) + 1
        if probed:
            self.probes += 1
            self.interval = min(2 * self.interval, PROBE_MAX)
            self.steps_off = 0
        elif k > 0:
            self.drafting += 1
            self.interval = PROBE_FIRST  # speculation chosen on its own merits
            self.steps_off = 0
        else:
            self.steps_off += 1
            self.credit = min(self.credit + PROBE_BUDGET, PROBE_CREDIT_MAX)


def pipelining_pays(
    config: RuntimeConfig, alphas: list[float | None], costs: StepCostModel, batch: int, current: bool | None
) -> bool:
    """pdv: pipeline this step's `batch` decoding requests (two groups, draft of one beside the
    verify of the other) or run them lock-step? The better best-k goodput of the two, from measured
    step costs; an unmeasured pipelined cost is optimistic (see `pipelined_step_s`), so pipelining
    is tried before it is judged. Switching needs SWITCH_MARGIN (`current`: last step's choice)."""
    known = [a for a in alphas if a is not None]
    if not config.adaptive or not known or config.k_max < 1:
        return True
    ks = range(min(config.k_min, config.k_max), config.k_max + 1)
    lock_by_k = costs.goodputs(known, config.k_max, batch)
    lock = max(lock_by_k[k] for k in ks)
    pipe = max(costs.pipelined_goodput(known, k, batch) for k in ks if k > 0)
    if current is None:
        return pipe >= lock
    return pipe * SWITCH_MARGIN >= lock if current else pipe > SWITCH_MARGIN * lock
