"""The policy's cost model is honest per k (router.cost_estimates): an unmeasured k is never costed
cheaper than the measured ks allow, a bucket with only plain decoding measured borrows the relative
cost of drafting from a nearby one, and with those costs the policy does not draft where they and
the acceptance predict a loss. The figures are the embedded model's at 16 requests (H200): a plain
step ~0.98 ms, k = 1 ~1.55 plain steps, k = 8 ~2.5 ms; chat acceptance ~0.41. Torch-free."""

from __future__ import annotations

import pytest
from engine_helpers import observe_plain

from verifypd.domain.config import RuntimeConfig
from verifypd.router.draft_length import DRAFT_ON_GAIN, OPENING_MAX_EXTRA, choose_batch_k, opening_k
from verifypd.router.step_costs import StepCostModel, expected_tokens

CONFIG = RuntimeConfig(k_min=0, k_max=8, k_initial=8, adaptive=True)
PLAIN_S, K1_S, K8_S = 0.98e-3, 1.55 * 0.98e-3, 2.5e-3


def opened_at_8() -> StepCostModel:
    """Plain decoding and the k = 8 opening measured at 16 requests, nothing else."""
    costs = StepCostModel()
    observe_plain(costs, 16, PLAIN_S)
    costs.observe_step(16, 8, K8_S)
    return costs


def test_a_small_k_below_a_measured_one_is_not_costed_along_the_line_from_plain_decoding():
    """The line from plain decoding to k = 8 made k = 1 1.2 plain steps (it measured 1.55): with
    acceptance 0.41 the policy then drafted at k = 1 for ~0.9 x plain decoding's speed."""
    costs = opened_at_8()
    line = PLAIN_S + (K8_S - PLAIN_S) / 8
    assert costs.step_s(16, 1) > line * 1.1
    assert all(costs.step_s(16, k) <= costs.step_s(16, k + 1) <= K8_S for k in range(1, 8))
    assert choose_batch_k(CONFIG, [0.41] * 16, costs, 16, 8) == 0
    # Where drafting does pay (acceptance 0.9: E(0.9, 8) = 6.1 tokens for 2.6 plain steps) it still drafts.
    assert choose_batch_k(CONFIG, [0.9] * 16, costs, 16, 8) >= 4


@pytest.mark.parametrize("alpha", [0.2, 0.41, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9])
def test_no_k_is_chosen_that_the_measured_costs_say_loses(alpha):
    """Every k measured (k = 1 at 1.55 plain steps, then ~0.136 plain steps per drafted token): the
    policy drafts only at a k whose predicted goodput beats plain decoding's by DRAFT_ON_GAIN, and
    drafts whenever one does."""
    costs = StepCostModel()
    observe_plain(costs, 16, PLAIN_S)
    for k in range(1, 9):
        costs.observe_step(16, k, K1_S + (k - 1) * 0.136 * PLAIN_S)
    k = choose_batch_k(CONFIG, [alpha] * 16, costs, 16, 8)
    gain = [expected_tokens(alpha, kk) * PLAIN_S / costs.step_s(16, kk) for kk in range(9)]
    if k == 0:
        assert max(gain[1:]) < DRAFT_ON_GAIN, gain
    else:
        assert gain[k] == max(gain[1:]) >= DRAFT_ON_GAIN, (k, gain)
    # 0.5: E(0.5, 2) = 1.75 tokens for 1.82 plain steps at best; 0.6: E(0.6, 3) = 2.18 for 1.82 (1.19 x)
    assert (k == 0) == (alpha <= 0.5)


def test_a_bucket_with_only_plain_decoding_measured_borrows_a_nearby_buckets_drafting_cost():
    """The tail of a batch (4 requests left) had only plain steps measured: at the prior (10 % of a
    plain step per drafted token: k = 1 at 1.1 plain steps) the policy drafted there at acceptance
    0.41, where a drafting step cost 1.55 plain steps or more. Relative costs are borrowed from 16 (two doublings away),
    not from 64 (four away: another regime, memory-bound against compute-bound)."""
    costs = StepCostModel()
    observe_plain(costs, 16, PLAIN_S)
    costs.observe_step(16, 1, K1_S)
    costs.observe_step(16, 3, K1_S + 2 * 0.136 * PLAIN_S)
    observe_plain(costs, 4, 0.9e-3)
    assert costs.step_s(4, 1) == pytest.approx(0.9e-3 * 1.55)
    assert costs.step_s(4, 3) == pytest.approx(0.9e-3 * costs.step_s(16, 3) / PLAIN_S)
    assert choose_batch_k(CONFIG, [0.41] * 4, costs, 4, 8) == 0
    observe_plain(costs, 1, 0.9e-3)  # 16 is four doublings from 1: the prior
    assert costs.step_s(1, 2) == pytest.approx(0.9e-3 * 1.2)


def test_the_opening_k_follows_the_conservative_costs():
    """Opening at k = 8 measured 2.55 plain steps: new requests then open at the longest k whose
    conservative cost is within OPENING_MAX_EXTRA (the line from plain decoding allowed k = 5)."""
    costs = opened_at_8()
    k = opening_k(CONFIG, costs, 16, 8)
    assert 1 <= k < 5
    assert costs.step_s(16, k) / PLAIN_S - 1 <= OPENING_MAX_EXTRA < costs.step_s(16, k + 1) / PLAIN_S - 1


def test_a_decision_after_the_plain_median_moved_costs_few_python_calls():
    """Every k's cost after a plain step moved the median (as every plain step of a batch held at
    k = 0 may): estimated together in one pass (`lock_step_estimates`), not one k at a time (~130
    Python calls a decision, each a k = 0 step's host time on the GPU's critical path). The figures
    are the one-at-a-time rules' (the other tests here)."""
    import sys

    costs = opened_at_8()
    costs.observe_step(4, 0, 0.9e-3)  # (a bucket that borrows from 16's ratios)
    costs.observe_step(4, 0, 0.9e-3)
    costs.observe_step(4, 0, 0.9e-3)
    calls = [0]

    def profile(frame, event, arg):
        calls[0] += event == "call"

    for batch in (16, 4):
        costs.observe_step(batch, 0, 0.95e-3)  # the median moves: every estimate is recomputed
        calls[0] = 0
        sys.setprofile(profile)
        try:
            costs.goodputs([0.41] * batch, 8, batch)
        finally:
            sys.setprofile(None)
        assert calls[0] <= 25, (batch, calls[0])
