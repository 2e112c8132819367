"""Speculation that never costs, torch-free: with drafting off, plain steps call no draft lane, probes
stay within their budget (draft_length.PROBE_BUDGET) and back off, and drafting comes back when
acceptance does. The real Router and Scheduler over lanes that cost simulated time (costed_lanes.py),
with SIMULATED acceptance."""

from __future__ import annotations

import pytest
from costed_lanes import CostedLanes, h200_like_draft_s, h200_like_verify_s, ngram_like_draft_s

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec
from verifypd.router.draft_length import PROBE_BUDGET, PROBE_CREDIT_MAX, ProbeSchedule
from verifypd.router.router import Router

ADAPTIVE = RuntimeConfig(k_min=0, k_max=8, k_initial=4, adaptive=True)


def host_bound_verify_s(batch: int, k: int) -> float:
    """A step of the embedded model at 16 requests on an H100 (bench/results/policy_trace_h100.json):
    a chained plain step ~1 ms; any step with drafts is unchained, its host work exposed: ~3.5 ms."""
    return 1e-3 if k == 0 else 3.5e-3 + 0.1e-3 * k


class Counting(CostedLanes):
    """Costed lanes that log, per verify call, whether a draft call came before it in the same step."""

    def __post_init__(self):
        super().__post_init__()
        self.steps: list[int] = []  # per verify call: draft calls since the previous verify call
        self._drafts = 0

    def draft(self, items):
        self._drafts += 1
        return super().draft(items)

    def verify(self, items):
        self.steps.append(self._drafts)
        self._drafts = 0
        return super().verify(items)


def run(lanes: CostedLanes, config: RuntimeConfig, batch: int, rounds: int, gen_len: int = 128) -> list[float]:
    """`rounds` rounds of `batch` requests on one router; simulated seconds of each."""
    router = Router(lanes, lanes, lanes, decode=None, eos_token_ids=(), config=config, clock=lanes.clock)
    seconds = []
    for r in range(rounds):
        for i in range(batch):
            router.add_request(
                RequestSpec(tuple(range(3, 3 + 64)), max_tokens=gen_len, stop_at_eos=False, request_id=f"r{r}-{i}")
            )
        t0 = lanes.now
        while router.has_work():
            router.step()
        seconds.append(lanes.now - t0)
    lanes.router = router  # type: ignore[attr-defined]
    return seconds


@pytest.mark.parametrize("pooled", [False, True], ids=["ngram", "model"])
def test_zero_acceptance_probes_cost_at_most_the_budget(pooled):
    """At zero acceptance, on a host-bound engine where any drafting step costs 3.5 plain steps, the
    probes (opening and periodic) of eight 128-token rounds at batch 16 cost at most PROBE_BUDGET of
    plain decoding after the first round (where the policy learns), and steps between probes call no
    draft lane. Without the budget (backoff alone) they cost ~3 %: an opening probe per round and
    periodic ones at 32, 96, 224, ... steps."""
    draft_s = ngram_like_draft_s if not pooled else (lambda b, k, n: 0.0)
    lanes = Counting(0.0, verify_s=host_bound_verify_s, draft_s=draft_s, pooled=pooled)
    adaptive = run(lanes, ADAPTIVE, 16, 8)
    plain = run(CostedLanes(0.0, verify_s=host_bound_verify_s, pooled=pooled), RuntimeConfig(k_initial=0), 16, 8)
    later = sum(adaptive[1:]) / sum(plain[1:])
    plain_steps = sum(plain[1:]) / 1e-3
    # The budget's bound: what probes may spend in the later rounds' plain steps, plus the capped credit.
    assert later <= 1 + PROBE_BUDGET + PROBE_CREDIT_MAX / plain_steps, later
    assert later <= 1.012, later
    steps_after_first_round = lanes.steps[len(lanes.steps) // 8 :]
    drafted = [n for n in steps_after_first_round if n]
    assert len(drafted) <= 4, drafted  # each probe spends 2.5+ plain steps of a 1 % credit
    assert all(n <= 1 for n in steps_after_first_round)
    schedule = lanes.router.scheduler.probes  # type: ignore[attr-defined]
    assert schedule.spent <= PROBE_BUDGET * schedule.decisions + 1e-9


def test_a_lane_that_never_proposes_turns_drafting_off():
    """Prompt lookup on text it cannot predict proposes nothing: no verify outcome ever reaches the
    acceptance estimate. Before, the policy then had no estimate and drafted k_initial every step
    forever (a draft call and an unchained step each time, on the embedded model 0 of 474 plain steps
    chained); asks answered with nothing now count, and drafting turns off."""
    lanes = Counting(0.0, verify_s=host_bound_verify_s, draft_s=ngram_like_draft_s, pooled=False, propose_rate=0.0)
    run(lanes, ADAPTIVE, 16, 3)
    later = lanes.steps[len(lanes.steps) // 3 :]
    assert sum(bool(n) for n in later) <= 4, sum(bool(n) for n in later)  # probes only (before: every step)
    assert lanes.router.costs.acceptance.alpha is not None  # type: ignore[attr-defined]


def test_drafting_resumes_when_acceptance_returns():
    """Three rounds at zero acceptance switch drafting off; then the requests become predictable
    (SIMULATED acceptance 0.9): the budget still affords probes, and the next rounds draft and gain."""
    lanes = CostedLanes(0.0, verify_s=h200_like_verify_s, draft_s=h200_like_draft_s)
    router = Router(lanes, lanes, lanes, decode=None, eos_token_ids=(), config=ADAPTIVE, clock=lanes.clock)

    def round_(r: int) -> float:
        for i in range(16):
            router.add_request(
                RequestSpec(tuple(range(3, 3 + 64)), max_tokens=128, stop_at_eos=False, request_id=f"r{r}-{i}")
            )
        t0 = lanes.now
        while router.has_work():
            router.step()
        return lanes.now - t0

    off = [round_(r) for r in range(3)]
    assert router.scheduler.probes.k_counts.get(0, 0) > 200  # drafting was off
    lanes.alpha = 0.9
    drafting_before = router.scheduler.probes.drafting
    on = [round_(r) for r in range(3, 6)]
    assert router.scheduler.probes.drafting > drafting_before + 50  # back on, on its merits
    assert on[-1] < 0.8 * off[-1], (off, on)


def test_credit_accrues_per_plain_step_and_is_capped():
    probes = ProbeSchedule()
    for _ in range(100):
        probes.record(0, probed=False)
    assert probes.credit == pytest.approx(100 * PROBE_BUDGET)
    assert probes.affords(1.0) and not probes.affords(1.01)
    probes.spend(0.6)
    assert probes.credit == pytest.approx(0.4) and probes.spent == pytest.approx(0.6)
    for _ in range(100_000):
        probes.record(0, probed=False)
    assert probes.credit == PROBE_CREDIT_MAX


class ColdAfterPrefill(CostedLanes):
    """A model draft whose first draft call after a prefill costs COLD_S more (on the H200 the first
    decode step after a batch's prefill ran eagerly with the chain broken): a cost the step-cost
    model's estimates, taken from typical steps, never see."""

    COLD_S = 8e-3

    def __post_init__(self):
        super().__post_init__()
        self.cold = False

    def prefill(self, items):
        self.cold = True
        return super().prefill(items)

    def draft(self, items):
        if self.cold:
            self.now += self.COLD_S
            self.cold = False
        return super().draft(items)


def test_a_probe_is_charged_what_its_step_took():
    """Opening probes whose step costs COLD_S (8 plain steps) more than the step-cost model
    estimates are charged at least that (ProbeSchedule.settle, from the step's wall time): so
    the budget, not the estimate, bounds what probes take. Charged by the estimate alone, `spent`
    was 4.4 plain steps for two probing draft calls."""
    lanes = ColdAfterPrefill(0.0, verify_s=host_bound_verify_s, draft_s=lambda b, k, n: 0.0)
    run(lanes, ADAPTIVE, 16, 1)  # the first round drafts k_initial and learns acceptance 0
    first = len(lanes.draft_calls)
    schedule = lanes.router.scheduler.probes  # type: ignore[attr-defined]
    spent_before = schedule.spent
    run_more(lanes, 11)
    probing_calls = len(lanes.draft_calls) - first
    assert probing_calls >= 1
    assert schedule.spent - spent_before >= probing_calls * ColdAfterPrefill.COLD_S / 1e-3, schedule.spent


def run_more(lanes: CostedLanes, rounds: int) -> None:
    """More rounds of 16 requests on the router `run` left on `lanes`."""
    router = lanes.router  # type: ignore[attr-defined]
    for r in range(rounds):
        for i in range(16):
            router.add_request(
                RequestSpec(tuple(range(3, 3 + 64)), max_tokens=128, stop_at_eos=False, request_id=f"m{r}-{i}")
            )
        while router.has_work():
            router.step()


def test_settle_charges_the_measured_excess_once():
    probes = ProbeSchedule()
    probes.credit = 10.0
    probes.spend(2.0)
    probes.settle(7.0)  # the probing step took 7 plain steps more than a plain one: 5 more than charged
    assert probes.credit == pytest.approx(3.0) and probes.spent == pytest.approx(7.0)
    probes.spend(2.0)
    probes.settle(1.0)  # cheaper than charged: the estimate stands
    assert probes.credit == pytest.approx(1.0) and probes.spent == pytest.approx(9.0)


def test_due_probe_writes_draft_kv_only_when_the_budget_affords_it():
    """A prefill writes draft KV for a due probe only if the budget can pay for the opening probe
    that KV is for; else it is work for a probe that will not run (every new batch paid it)."""
    lanes = CostedLanes(0.0, verify_s=host_bound_verify_s)
    run(lanes, ADAPTIVE, 16, 2)  # acceptance 0 learnt: drafting off
    router = lanes.router  # type: ignore[attr-defined]
    scheduler, probes = router.scheduler, router.scheduler.probes
    probes.steps_off = probes.interval  # a probe is due
    probes.credit = 0.0
    assert not scheduler.drafts_soon(ADAPTIVE, router.costs)
    probes.credit = PROBE_CREDIT_MAX
    assert scheduler.drafts_soon(ADAPTIVE, router.costs)


class DraftKvPrefill(CostedLanes):
    """A model draft whose KV costs a prefill DRAFT_SHARE of the target's: a prefill item carrying a
    draft KV handle costs that much more (the lane writes both). Per item, as in-process lanes take
    it, so the scheduler may leave draft KV out (lazy draft prefill)."""

    DRAFT_SHARE = 1.0
    per_item_draft_kv = True

    def prefill(self, items):
        self.now += 1e-3 * self.DRAFT_SHARE * sum(i.draft_kv is not None for i in items)
        return super().prefill(items)


def test_draft_kv_written_for_probes_is_charged_to_them():
    """At zero acceptance a due probe makes each new batch's prefill write draft KV for the opening
    probe; that KV (here as dear as the target's prefill: 16 plain steps a batch) is the probes'
    expense, so the budget bounds it too. Uncharged, every batch paid it: ~+11 % over plain."""
    lanes = DraftKvPrefill(0.0, verify_s=host_bound_verify_s, draft_s=lambda b, k, n: 0.0)
    adaptive = run(lanes, ADAPTIVE, 16, 12)
    plain = run(DraftKvPrefill(0.0, verify_s=host_bound_verify_s), RuntimeConfig(k_initial=0), 16, 12)
    later = sum(adaptive[2:]) / sum(plain[2:])
    plain_steps = sum(plain[2:]) / 1e-3
    assert later <= 1 + PROBE_BUDGET + PROBE_CREDIT_MAX / plain_steps, later


def test_a_batch_the_policy_drafts_gets_draft_kv_at_prefill():
    """Acceptance 0.9 learnt, and the last batch ended at k = 0 (chat batches end with one or two
    requests, where drafting may not pay): the next batch's prefill still writes draft KV, because
    the policy drafts such a batch at that acceptance, so no drafting step catches a draft up on a
    whole 64-token prompt (ordinary draft inputs: accepted + 1 <= 9)."""
    lanes = DraftKvPrefill(0.9, verify_s=h200_like_verify_s, draft_s=h200_like_draft_s)
    run(lanes, ADAPTIVE, 16, 1)
    router = lanes.router  # type: ignore[attr-defined]
    assert router.scheduler.lazy_draft_prefill
    router.scheduler.k.drafting["batch"] = 0  # the previous batch's last decision (see the docstring)
    assert router.scheduler.drafts_soon(ADAPTIVE, router.costs)
    first = len(lanes.draft_calls)
    run_more(lanes, 1)
    later = lanes.draft_calls[first:]
    assert later, "the policy drafts at acceptance 0.9"
    catch_ups = [c for c in later if c.input_len > ADAPTIVE.k_max + 1]
    assert not catch_ups, catch_ups
