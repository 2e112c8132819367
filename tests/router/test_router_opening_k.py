"""The opening probe's k (draft_length.opening_k): the largest k <= min(k_initial, hi) whose step
costs at most OPENING_MAX_EXTRA plain steps more than a plain step, by the measured (or estimated)
step costs at the batch. Torch-free."""

from __future__ import annotations

from verifypd.domain.config import RuntimeConfig
from verifypd.router.draft_length import OPENING_MAX_EXTRA, opening_k
from verifypd.router.step_costs import StepCostModel

CONFIG = RuntimeConfig(k_min=0, k_max=8, k_initial=8, adaptive=True)


def costs_at(batch: int, plain_s: float, per_k_s: float, ks=range(9)) -> StepCostModel:
    """Lock-step costs measured at `batch`: plain_s + per_k_s * k for each k of `ks`."""
    costs = StepCostModel()
    for k in ks:
        for _ in range(3):
            costs.observe_step(batch, k, plain_s + per_k_s * k)
    return costs


def extra(costs: StepCostModel, batch: int, k: int) -> float:
    return costs.step_s(batch, k) / costs.step_s(batch, 0) - 1.0


def test_cheap_drafts_open_at_k_initial():
    """Batch 1 with a head whose drafted tokens cost 5 % of a plain step each: k = 8 is 1.4 plain steps."""
    costs = costs_at(1, 1e-3, 0.05e-3)
    assert opening_k(CONFIG, costs, 1, 8) == 8
    assert opening_k(CONFIG, costs, 1, 3) == 3  # never past what the request may take


def test_dear_drafts_open_at_the_longest_k_within_the_cap():
    """Batch 16 where each drafted token costs 30 % of a plain step: k = 3 is the longest opening
    within OPENING_MAX_EXTRA (k = 8 cost 3.4 plain steps)."""
    costs = costs_at(16, 1e-3, 0.3e-3)
    k = opening_k(CONFIG, costs, 16, 8)
    assert 1 < k < 8
    assert extra(costs, 16, k) <= OPENING_MAX_EXTRA < extra(costs, 16, k + 1)


def test_a_drafting_step_dearer_than_the_cap_at_any_k_opens_at_1():
    """The host-bound engine: any drafting step is unchained, 3.5 plain steps: the opening is k = 1."""
    costs = StepCostModel()
    for k in range(9):
        for _ in range(3):
            costs.observe_step(16, k, 1e-3 if k == 0 else 3.5e-3 + 0.1e-3 * k)
    assert opening_k(CONFIG, costs, 16, 8) == 1


def test_unmeasured_ks_are_costed_from_the_measured_ones():
    """Only plain steps and k = 1 measured (2 plain steps): larger ks are dearer still, so k = 1."""
    costs = costs_at(16, 1e-3, 1e-3, ks=(0, 1))
    assert opening_k(CONFIG, costs, 16, 8) == 1
    nothing_measured = StepCostModel()  # the defaults: each drafted token a tenth of a plain step
    assert opening_k(CONFIG, nothing_measured, 16, 8) == 8


def test_k_initial_0_opens_nothing():
    assert opening_k(RuntimeConfig(k_min=0, k_max=8, k_initial=0), costs_at(16, 1e-3, 0.05e-3), 16, 8) == 0
