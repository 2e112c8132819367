"""Adaptive k that never costs, torch-free: the real Router and Scheduler over
lanes that cost simulated time (costed_lanes.py), with SIMULATED acceptance, against plain decoding
under the same cost tables; and the policy's pieces on their own."""

from __future__ import annotations

import pytest
from costed_lanes import (
    CostedLanes,
    h200_like_draft_s,
    h200_like_verify_s,
    ngram_like_draft_s,
    run_rounds,
    speedup_over_plain,
)
from engine_helpers import observe_plain

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec, RequestStats
from verifypd.router.block_manager import BlockManager
from verifypd.router.draft_length import (
    DRAFT_OFF_GAIN,
    DRAFT_ON_GAIN,
    PROBE_FIRST,
    PROBE_K,
    PROBE_MAX,
    ProbeSchedule,
    StepCostModel,
    choose_batch_k,
)
from verifypd.router.router import Router
from verifypd.router.scheduler import Scheduler
from verifypd.router.sequence import SeqStatus, Sequence
from verifypd.router.step_costs import PLAIN_SAMPLES

ROUNDS = [16, 128, 128]  # as bench/engine/engine_throughput.py: a short warm-up round, then measured rounds
ADAPTIVE = RuntimeConfig(k_min=0, k_max=8, k_initial=4, adaptive=True)


@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.parametrize("draft, pipeline", [("model", False), ("ngram", False), ("model", True)])
def test_low_acceptance_costs_nothing(batch, draft, pipeline):
    """(a) At acceptance 0.1 adaptive k runs at >= 0.98 x plain decoding; k is 0 in nearly every
    step, probes are few and each is a normal k = 1 draft call (no catch-up on skipped tokens).
    Also with pdv pipelining allowed, whose unmeasured costs are optimistic by design."""
    lane_args = {} if draft == "model" else {"pooled": False, "draft_s": ngram_like_draft_s}
    speedup, lanes, router = speedup_over_plain(0.1, batch, ROUNDS, pipeline=pipeline, **lane_args)
    assert speedup >= 0.98, speedup
    probes = router.scheduler.probes
    assert probes.drafting + probes.probes <= 0.05 * probes.decisions, vars(probes)
    assert probes.probes <= probes.decisions / PROBE_FIRST + 1
    if draft == "model":
        # A probe never catches the draft up on skipped tokens (its input is <= 2 tokens, the shape
        # of an ordinary drafting step); only drafting chosen on its merits may, in its first step
        # after k = 0 (lock-step: none at all here; pipelined: a few pipelining tries).
        # Probes that ran drafted PROBE_K. (Pipelined at 64, the opening steps' measured cost,
        # settled against the probe credit, leaves none for a periodic probe in runs this short.)
        assert any(c.k == PROBE_K for c in lanes.draft_calls) or (pipeline and probes.probes == 0)
        catch_ups = [c for c in lanes.draft_calls if c.input_len > 2]
        assert len(catch_ups) <= (probes.drafting if pipeline else 0), catch_ups


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_high_acceptance_still_drafts(batch):
    """(b) At acceptance 0.7 the policy drafts in most steps and gains."""
    speedup, lanes, router = speedup_over_plain(0.7, batch, ROUNDS)
    probes = router.scheduler.probes
    assert speedup >= 1.1, speedup
    assert probes.drafting >= 0.8 * probes.decisions, vars(probes)


def steep_verify_s(batch: int, k: int) -> float:
    """A compute-bound target: every scored token costs half a plain step."""
    return 9e-3 * (1 + k / 2)


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_negative_expected_gain_stops_drafting(draft):
    """(c) Acceptance 0.5 on a GPU where verify cost grows fast with k: drafting loses (E(0.5, 1) =
    1.5 tokens for >= 1.5 x the time), so after the first steps the batch stops drafting, whether
    the draft costs time (a model) or next to nothing (ngram: verify(k) still costs)."""
    lane_args = dict(verify_s=steep_verify_s)
    if draft == "ngram":
        lane_args.update(pooled=False, draft_s=ngram_like_draft_s)
    speedup, lanes, router = speedup_over_plain(0.5, 32, ROUNDS, **lane_args)
    probes = router.scheduler.probes
    assert speedup >= 0.97, speedup
    # What drafting there is: k_initial before acceptance is known, and one try of a k at each
    # batch bucket not yet measured drafting (the prior cost of a drafted token is 10 % of a step).
    assert probes.drafting <= 0.06 * probes.decisions, vars(probes)


def test_drafting_batch_stops_as_soon_as_gain_is_negative_and_starts_only_with_margin():
    """(c) The on/off rule with hysteresis: a drafting batch keeps drafting while the predicted
    gain is >= DRAFT_OFF_GAIN, stops below it (a 5 % loss stops it; before, a 10 % switch margin
    kept it drafting); a batch not drafting starts only at >= DRAFT_ON_GAIN."""
    config = RuntimeConfig(k_min=0, k_max=4, k_initial=4, adaptive=True)
    costs = StepCostModel()
    observe_plain(costs, 16, 10e-3)
    alphas = [0.5] * 16  # E(0.5, 1) = 1.5 tokens a step

    def with_k1_gain(gain: float) -> StepCostModel:
        c = StepCostModel()
        observe_plain(c, 16, 10e-3)
        for k in range(1, 5):  # k = 1 the best drafting k: the others cost much more
            c.observe_step(16, k, 10e-3 * 1.5 / gain * (1 if k == 1 else 2 * k))
        return c

    losing = with_k1_gain(0.95)
    assert choose_batch_k(config, alphas, losing, 16, 4, current=1) == 0
    assert choose_batch_k(config, alphas, losing, 16, 4, current=0) == 0
    middle = with_k1_gain((DRAFT_ON_GAIN + DRAFT_OFF_GAIN) / 2)
    assert choose_batch_k(config, alphas, middle, 16, 4, current=1) == 1  # drafting: keeps drafting
    assert choose_batch_k(config, alphas, middle, 16, 4, current=0) == 0  # not: does not start
    assert choose_batch_k(config, alphas, middle, 16, 4, current=None) == 0
    winning = with_k1_gain(DRAFT_ON_GAIN * 1.01)
    assert choose_batch_k(config, alphas, winning, 16, 4, current=0) == 1


def test_plain_decoding_is_measured_before_drafting_is_judged():
    """Unmeasured, k = 0 would be estimated from drafting steps with the prior cost of a drafted
    token, flattering drafting when the real draft costs more: plain steps are taken first, as many
    as PLAIN_SAMPLES (the first after a prefill also waits for its GPU work), and judged by median."""
    config = RuntimeConfig(k_min=0, k_max=4, k_initial=4, adaptive=True)
    costs = StepCostModel()
    costs.observe_step(16, 2, 12e-3)
    assert choose_batch_k(config, [0.3] * 16, costs, 16, 4, current=2) == 0
    costs.observe_step(16, 0, 30e-3)  # the first plain step, slowed by the batch's prefill: not yet the cost
    for _ in range(PLAIN_SAMPLES - 1):
        assert not costs.measured(16, 0)
        assert choose_batch_k(config, [0.3] * 16, costs, 16, 4, current=2) == 0  # still measuring
        costs.observe_step(16, 0, 6e-3)  # drafting doubles the step: E(0.3, 2) = 1.39 does not pay
    assert costs.measured(16, 0) and costs.step_s(16, 0) == pytest.approx(6e-3)
    assert choose_batch_k(config, [0.3] * 16, costs, 16, 4, current=2) == 0
    for _ in range(4):
        costs.observe_step(16, 0, 11e-3)  # median of seven: 11 ms, drafting now pays
    assert choose_batch_k(config, [0.3] * 16, costs, 16, 4, current=2) > 0


def test_one_slow_step_of_two_is_not_the_cost():
    """Of two samples the lower is the cost (one slow step, a GC pause say, moves nothing: the upper
    median of two made single 4-5 ms steps the cost of k = 4 at batch 16); of three the middle."""
    costs = StepCostModel()
    costs.observe_step(16, 4, 1.8e-3)
    costs.observe_step(16, 4, 5.2e-3)
    assert costs.step_s(16, 4) == pytest.approx(1.8e-3)
    costs.observe_step(16, 4, 2.0e-3)
    assert costs.step_s(16, 4) == pytest.approx(2.0e-3)


def test_measuring_plain_decoding_does_not_switch_a_drafting_batch_off():
    """The one plain step that measures k = 0 at a new batch size is not a decision to stop: after
    it, a batch that was drafting keeps drafting at a gain between DRAFT_OFF_GAIN and DRAFT_ON_GAIN."""
    s = Scheduler(BlockManager(400, 4, "target"), BlockManager(400, 4, "draft"), 512)
    s.running += [decoding("a", 0, lag=0), decoding("b", 1, lag=0)]
    for seq in s.running:
        seq.alpha_estimate = 0.5  # E(0.5, 1) = 1.5
    config = RuntimeConfig(k_min=0, k_max=4, k_initial=4, adaptive=True, schedule="pd")
    costs = StepCostModel()
    costs.observe_step(2, 1, 1.5 / 1.05 * 10e-3)  # k = 1: 5 % more goodput than a 10 ms plain step
    for k in range(2, 5):
        costs.observe_step(2, k, 30e-3)
    s.k.drafting["batch"] = 1  # the batch was drafting (at another batch size)
    assert [w.k for w in s.plan(config, costs).decode] == [0, 0]  # plain decoding measured first
    observe_plain(costs, 2, 10e-3)
    assert [w.k for w in s.plan(config, costs).decode] == [1, 1]


def test_unmeasured_k_costs_follow_the_measured_slope():
    costs = StepCostModel()
    costs.observe_step(8, 0, 6e-3)
    # One point: each drafted token adds the prior 10 % of a plain step, not 0 (an optimistic
    # lower bound made acceptance 0.1 try drafting at every unmeasured k).
    assert costs.step_s(8, 2) == pytest.approx(6e-3 * 1.2)
    costs.observe_step(8, 2, 9e-3)
    # Below the one measured drafting k: its cost above plain decoding split into k + 1 shares, one
    # the drafting step's overhead (not the line from plain decoding: 7.5 ms; router.cost_estimates).
    assert costs.step_s(8, 1) == pytest.approx(8e-3)
    assert costs.step_s(8, 4) == pytest.approx(12e-3)  # beyond: along the measured slope
    assert costs.step_s(16, 3) == pytest.approx(costs.default_verify_s + 3 * costs.default_draft_step_s)
    # Pipelined steps: perfect overlap (half a lock-step step of the group) until one is measured
    # at the group's bucket, then from what was measured there.
    assert costs.pipelined_step_s(8, 2) == pytest.approx(9e-3 / 2)
    costs.observe_pipelined(8, 1, 8e-3)
    assert costs.pipelined_step_s(8, 2) == pytest.approx(8e-3 + 0.1 * 8e-3 / 1.1)


def test_probe_schedule_backs_off_and_resets():
    probes = ProbeSchedule()
    steps, probed_at = 0, []
    while len(probed_at) < 6:
        due = probes.due
        probes.record(0, probed=due)
        if due:
            probed_at.append(steps)
        steps += 1
    gaps = [b - a for a, b in zip(probed_at, probed_at[1:], strict=False)]
    assert probed_at[0] == PROBE_FIRST and gaps == [64 + 1, 128 + 1, 256 + 1, 512 + 1, 1024 + 1]
    assert probes.interval == PROBE_MAX
    probes.record(3, probed=False)  # drafting chosen on its merits: the next probe comes early again
    assert probes.interval == PROBE_FIRST and probes.drafting == 1 and probes.probes == 6


def decoding(rid: str, order: int, lag: int) -> Sequence:
    """A decoding request whose draft KV lags its pending token by `lag` positions."""
    seq = Sequence(RequestSpec(tuple(range(3, 19)), max_tokens=64), rid, order, RequestStats())
    seq.output_ids += [5] * 4
    seq.status, seq.target_computed = SeqStatus.DECODING, seq.pending_pos
    seq.draft_computed = seq.pending_pos - lag
    seq.alpha_estimate = 0.05
    seq.opened = True  # past its first decode step (no opening probe)
    return seq


@pytest.mark.parametrize("pooled", [True, False])
def test_probes_draft_k1_only_where_no_catch_up_is_needed(pooled):
    """(d) A probe drafts PROBE_K = 1 (one graphed first step, a verify of query 2, both captured)
    and, with a model draft, only for requests whose draft input is <= 2 tokens: one that skipped
    drafting for many steps would first prefill every skipped token, eagerly (the 17.7 ms probe).
    A pool-less draft (ngram) has nothing to catch up: every request can be probed."""
    s = Scheduler(BlockManager(400, 4, "target"), BlockManager(400, 4, "draft") if pooled else None, 512)
    fresh, behind = decoding("fresh", 0, lag=0), decoding("behind", 1, lag=40)
    s.running += [fresh, behind]
    config = RuntimeConfig(k_min=0, k_max=4, k_initial=4, adaptive=True, schedule="pd")
    costs = StepCostModel()
    for k in range(5):
        costs.observe_step(2, k, 5e-3 * (1 + 0.3 * k))
    for _ in range(PROBE_FIRST):
        assert all(w.k == 0 and not w.probe for w in s.plan(config, costs).decode)
    plan = s.plan(config, costs)
    ks = {w.seq.request_id: (w.k, w.probe) for w in plan.decode}
    assert ks == ({"fresh": (1, True), "behind": (0, False)} if pooled else {"fresh": (1, True), "behind": (1, True)})
    assert s.probes.probes == 1 and s.k.last_k["batch"] == 0  # a probe is not the batch's k


def test_a_probe_of_part_of_the_batch_is_not_a_cost_sample():
    """A step where a probe drafted for some requests costs less than a k = 1 step of the whole
    batch: the router does not record it as one. A probe of the whole batch is a k = 1 step."""
    together = CostedLanes(0.1)  # all 16 prompts prefilled in one step: all fresh at once
    router, _, _ = run_rounds(together, RuntimeConfig(k_initial=4, prefill_token_budget=16 * 128), 16, ROUNDS)
    probe_calls = [c for c in together.draft_calls if c.k == PROBE_K]
    assert probe_calls and all(c.batch == 16 for c in probe_calls)
    assert router.costs.measured(16, 1)
    # Eight requests decoding for a while (k = 0, a probe due but none of them fresh), then two
    # arrive: the probe drafts for those two only, in a step that verifies all ten.
    lanes = CostedLanes(0.1)
    router = Router(lanes, lanes, lanes, decode=None, eos_token_ids=(), config=ADAPTIVE, clock=lanes.clock)
    prompt = tuple(range(3, 3 + 128))
    for i in range(8):
        router.add_request(RequestSpec(prompt, max_tokens=200, stop_at_eos=False, request_id=f"old{i}"))
    for _ in range(PROBE_FIRST + 20):
        router.step()
    assert router.scheduler.probes.due and not [c for c in lanes.draft_calls if c.k == PROBE_K]
    for i in range(2):
        router.add_request(RequestSpec(prompt, max_tokens=200, stop_at_eos=False, request_id=f"new{i}"))
    for _ in range(3):
        router.step()
    assert [(c.batch, c.k, c.input_len) for c in lanes.draft_calls if c.k == PROBE_K] == [(2, 1, 1)]
    assert router.scheduler.probes.probes == 1 and not router.costs.measured(10, 1)


def test_steps_without_a_proposal_count_against_drafting():
    """Prompt lookup proposes nothing without an n-gram match: a request asked for drafts that gets
    none gains nothing that step. Acceptance counts only proposed tokens; how often a request gets
    a proposal is its own estimate, and goodput weighs the gain by it (the verify padding too: a
    step in which nobody has a proposal costs a plain step)."""

    class ProposesNothing(CostedLanes):
        def draft(self, items):
            return [out.__class__(out.request_id, []) for out in super().draft(items)]

    lanes = ProposesNothing(1.0, pooled=False, draft_s=ngram_like_draft_s)
    router, _, _ = run_rounds(lanes, RuntimeConfig(k_initial=4, adaptive=False), 4, [8])
    tracker = router.costs.acceptance
    assert tracker.observations == 0 and tracker.proposal_rate < 0.1

    costs = StepCostModel()
    observe_plain(costs, 16, 10e-3)
    costs.observe_step(16, 4, 16e-3)
    config = RuntimeConfig(k_min=0, k_max=4, k_initial=4, adaptive=True)
    # Accepted whenever proposed (alpha 0.9), but proposing for one request in ten: the batch of 16
    # pays the k = 4 verify in 81 % of steps for about 1.6 requests' gain.
    assert choose_batch_k(config, [0.9] * 16, costs, 16, 4, current=4, rates=[0.1] * 16) == 0
    assert choose_batch_k(config, [0.9] * 16, costs, 16, 4, current=4) > 0  # (as if always proposing)
    assert choose_batch_k(config, [0.9] * 16, costs, 16, 4, current=4, rates=[0.9] * 16) > 0
    # Alone, a request pays the k = 4 verify only when it has a proposal: drafting pays at any rate.
    observe_plain(costs, 1, 5e-3)
    costs.observe_step(1, 4, 6.5e-3)
    assert choose_batch_k(config, [0.9], costs, 1, 4, current=4, rates=[0.1]) > 0


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_prompt_lookup_that_rarely_matches_costs_nothing(batch):
    """An ngram draft proposing for 30 % of asks, accepted at 0.3 when it does: adaptive k stays
    >= 0.98 x plain decoding; copy-heavy text (accepted at 0.9) still gains."""
    lane_args = dict(pooled=False, draft_s=ngram_like_draft_s, propose_rate=0.3)
    speedup, _, _ = speedup_over_plain(0.3, batch, ROUNDS, **lane_args)
    assert speedup >= 0.98, speedup
    speedup, _, _ = speedup_over_plain(0.9, batch, ROUNDS, **lane_args)
    assert speedup >= 1.1, speedup


def test_costed_lane_tables_describe_the_issue_measurement():
    """The simulated tables keep the H200 figures the issue quotes: a k = 1 draft call of 1.4 ms at
    batch 1 against 17.7 ms for one that first catches up on ~100 skipped tokens, eagerly."""
    assert h200_like_draft_s(1, 1, 2) == pytest.approx(1.4e-3)
    assert 12e-3 < h200_like_draft_s(1, 1, 100) < 20e-3
    assert h200_like_verify_s(64, 1) > h200_like_verify_s(64, 0)


def test_costs_below_the_measured_ks_stay_positive():
    """Extrapolating a steep measured slope down to k = 0 must not reach 0 s (goodput divides by
    it: the live control-loop test hit ZeroDivisionError when the operator lowered k_max)."""
    from verifypd.router.step_costs import StepCostModel

    costs = StepCostModel()
    for _ in range(3):
        costs.observe_step(8, 4, 0.010)
        costs.observe_step(8, 5, 0.030)  # 20 ms per drafted token: the line hits 0 s below k = 3.5
        costs.observe_step(16, 2, 0.0)  # a clock that read 0
    assert costs.step_s(8, 0) >= 0.005 and costs.step_s(8, 1) >= 0.005
    assert costs.goodput([0.5] * 8, 0, 8) > 0 and costs.goodput([0.5] * 8, 1, 8, rates=[0.0] * 8) > 0
    assert costs.goodput([0.5] * 16, 2, 16) > 0


@pytest.mark.parametrize("with_rates", [False, True])
def test_goodputs_for_all_k_equal_the_formula(with_rates):
    """StepCostModel.goodputs (every k in one pass over the requests, by power sums: the policy runs
    every step, and per-k sums cost ~0.5 ms of host time at batch 64) gives, for each k, the
    goodput of docs/engine.md: Σ 1 + p_i (E(a_i, k) - 1) over step(B, 0) + P(any) (step(B, k) - step(B, 0))."""
    import random

    from verifypd.router.step_costs import expected_tokens

    rng = random.Random(7)
    costs = StepCostModel()
    for k, s in ((0, 7e-3), (1, 7.6e-3), (3, 9.1e-3)):
        costs.observe_step(64, k, s)
    alphas = [0.0, 1.0, 0.999] + [rng.random() for _ in range(61)]
    rates = [rng.random() for _ in alphas] if with_rates else None
    got = costs.goodputs(alphas, 8, 64, rates)
    assert len(got) == 9
    p = rates or [1.0] * len(alphas)
    none = 1.0
    for r in p:
        none *= 1 - r
    for k in range(9):
        tokens = sum(1 + r * (expected_tokens(a, k) - 1) for a, r in zip(alphas, p, strict=False))
        cost = costs.step_s(64, 0) + (1 - none) * (costs.step_s(64, k) - costs.step_s(64, 0))
        assert got[k] == pytest.approx(tokens / cost, rel=1e-12), k
        assert costs.goodput(alphas, k, 64, rates) == got[k]


def test_policy_off_is_rechecked_rarely_not_every_step(monkeypatch):
    """A batch not drafting re-evaluates the draft-length policy at most every RECHECK_OFF_EVERY
    steps unless acceptance, the batch or the config changed (its evaluation was host time the GPU
    waited for, every step: alpha 0.1 ran at 0.93 x k = 0 at batch 64 on an H200). The decisions,
    and the speed-up, are those of the test above."""
    import verifypd.router.k_decision as k_decision_module

    calls = []
    real = k_decision_module.choose_batch_k

    def counted(config, *args, **kwargs):
        if config.adaptive:  # not the plain-decoding run it is compared with
            calls.append(kwargs.get("current"))
        return real(config, *args, **kwargs)

    monkeypatch.setattr(k_decision_module, "choose_batch_k", counted)
    speedup, lanes, router = speedup_over_plain(0.1, 16, ROUNDS)
    probes = router.scheduler.probes
    assert speedup >= 0.98
    assert probes.drafting <= 0.05 * probes.decisions
    # Every step with k = 0 and nothing new: one evaluation per RECHECK_OFF_EVERY steps, plus those
    # the batch changed for (requests finishing at different steps, new rounds).
    assert len(calls) <= probes.decisions / k_decision_module.RECHECK_OFF_EVERY + 60, (len(calls), probes.decisions)
    assert len(calls) < probes.decisions / 2


class PerFamilyAcceptance(CostedLanes):
    """SIMULATED acceptance by request: `alphas` maps a request-id prefix to its acceptance."""

    def __init__(self, alphas: dict[str, float], **kwargs):
        super().__init__(0.0, **kwargs)
        self.alphas = alphas

    def verify(self, items):
        out = []
        for item in items:
            self.alpha = next(a for prefix, a in self.alphas.items() if item.request_id.startswith(prefix))
            out += super().verify([item])
            self.now -= self.verify_s(1, len(item.draft_tokens))  # one verify call for the batch, below
        self.now += self.verify_s(len(items), max(len(i.draft_tokens) for i in items))
        return out


def family_seconds(
    config: RuntimeConfig, families: list[str], alphas: dict[str, float], per_family: int = 8, **lane_args
) -> dict[str, float]:
    """Families of requests run one after another, one request at a time (bench/drafts/draft_acceptance.py
    at batch 1): simulated seconds per family."""
    lanes = PerFamilyAcceptance(alphas, **lane_args)
    router = Router(lanes, lanes, lanes, decode=None, eos_token_ids=(), config=config, clock=lanes.clock, max_running=1)
    seconds = {}
    for family in families:
        t0 = lanes.now
        for i in range(per_family):
            router.add_request(
                RequestSpec(tuple(range(3, 3 + 128)), max_tokens=128, stop_at_eos=False, request_id=f"{family}-{i}")
            )
        while router.has_work():
            router.step()
        seconds[family] = lanes.now - t0
    return seconds


@pytest.mark.parametrize("lane_args", [{}, {"pooled": False, "draft_s": ngram_like_draft_s}], ids=["model", "ngram"])
def test_a_request_that_drafts_well_drafts_after_requests_that_did_not(lane_args):
    """Requests that draft well (SIMULATED acceptance 0.8) after a run of requests that draft badly
    (0.1), one at a time: the engine-wide acceptance the first ones left is low, and without an
    opening probe each new request started at k = 0 from it and was rarely probed (periodic probes,
    k = 1, backing off): the good family ran at plain speed. Each request's first step now drafts
    k_initial (KDecision._opening_probes), so the good family gains, and the bad one still costs
    nothing."""
    alphas = {"bad": 0.1, "good": 0.8}
    plain = family_seconds(RuntimeConfig(k_initial=0, adaptive=False), ["bad", "good"], alphas, **lane_args)
    adaptive = family_seconds(ADAPTIVE, ["bad", "good"], alphas, **lane_args)
    assert plain["bad"] / adaptive["bad"] >= 0.97, (plain, adaptive)
    assert plain["good"] / adaptive["good"] >= 1.3, (plain, adaptive)


def test_a_cheap_sample_at_a_large_k_does_not_make_it_cheaper_than_a_smaller_k():
    """Lock-step costs are monotone in k: one fast step at k = 6 (few rows proposed, a quiet host)
    is costed at least as a measured k = 4 step, so it cannot look like the best k by itself."""
    costs = StepCostModel()
    for _ in range(3):
        costs.observe_step(4, 0, 1.0e-3)
    costs.observe_step(4, 4, 2.0e-3)
    costs.observe_step(4, 6, 0.5e-3)
    assert costs.step_s(4, 6) >= costs.step_s(4, 4) == 2.0e-3
    assert costs.step_s(4, 5) >= 2.0e-3
    alphas = [0.5] * 4
    goodputs = costs.goodputs(alphas, 8, 4)
    assert max(range(1, 9), key=goodputs.__getitem__) != 6
