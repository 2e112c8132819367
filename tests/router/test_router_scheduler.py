"""Scheduler policy, torch-free: chunked prefill budget, priorities, k fallback before preemption."""

from __future__ import annotations

from engine_helpers import observe_plain

from verifypd.domain.config import RuntimeConfig
from verifypd.domain.requests import RequestSpec, RequestStats
from verifypd.router.block_manager import BlockManager
from verifypd.router.draft_length import (
    AcceptanceTracker,
    StepCostModel,
    choose_batch_k,
    choose_k,
    expected_tokens,
    pipelining_pays,
    request_alpha,
)
from verifypd.router.scheduler import Scheduler
from verifypd.router.sequence import SeqStatus, Sequence


def seq(rid: str, prompt_len: int, order: int, priority: int = 0, max_tokens: int = 50) -> Sequence:
    spec = RequestSpec(tuple(range(3, 3 + prompt_len)), max_tokens=max_tokens, priority=priority)
    return Sequence(spec=spec, request_id=rid, arrival_order=order, stats=RequestStats())


def scheduler(blocks: int = 100, block_size: int = 4) -> Scheduler:
    return Scheduler(BlockManager(blocks, block_size, "target"), BlockManager(blocks, block_size, "draft"), 512)


def test_prefill_is_chunked_by_token_budget():
    s = scheduler()
    long = seq("long", 100, 0)
    s.add(long)
    config = RuntimeConfig(prefill_token_budget=32, idle_prefill_token_budget=0)
    spans = []
    while long.status is not SeqStatus.DECODING:
        plan = s.plan(config, StepCostModel())
        (chunk,) = plan.prefill
        spans.append((chunk.start, chunk.end, chunk.sample_first))
        long.target_computed = long.draft_computed = chunk.end  # what the router does
        if chunk.end == long.prefill_target:
            long.status = SeqStatus.DECODING
    assert spans == [(0, 32, False), (32, 64, False), (64, 96, False), (96, 100, True)]


def test_idle_engine_prefills_a_burst_in_one_step_then_chunks_beside_decoding():
    """Nothing decoding: the step's prefill takes up to idle_prefill_token_budget (one large prefill,
    nobody's next token waits on it); once requests decode, prefill_token_budget holds again."""
    s = scheduler(blocks=400)
    burst = [seq(f"b{i}", 100, i) for i in range(3)]
    for x in burst:
        s.add(x)
    config = RuntimeConfig(prefill_token_budget=32, idle_prefill_token_budget=256)
    plan = s.plan(config, StepCostModel())
    assert [(c.seq.request_id, c.start, c.end) for c in plan.prefill] == [("b0", 0, 100), ("b1", 0, 100), ("b2", 0, 56)]
    for c in plan.prefill:  # what the router does
        c.seq.target_computed = c.seq.draft_computed = c.end
        if c.end == c.seq.prefill_target:
            c.seq.status = SeqStatus.DECODING
            c.seq.output_ids.append(5)
    late = seq("late", 100, 9)
    s.add(late)
    plan = s.plan(config, StepCostModel())
    assert {w.seq.request_id for w in plan.decode} == {"b0", "b1"}
    assert sum(c.end - c.start for c in plan.prefill) == 32  # b2's next chunk, within the budget


def test_higher_priority_is_admitted_first():
    s = scheduler()
    s.add(seq("low", 8, 0, priority=-5))
    s.add(seq("normal", 8, 1))
    s.add(seq("high", 8, 2, priority=50))
    plan = s.plan(RuntimeConfig(prefill_token_budget=16, idle_prefill_token_budget=0), StepCostModel())
    assert [c.seq.request_id for c in plan.prefill] == ["high", "normal"]  # budget fits two


def test_blocks_run_out_k_drops_to_zero_then_lowest_priority_is_preempted():
    s = scheduler(blocks=5, block_size=4)  # 20 positions per pool
    a, b = seq("a", 7, 0, priority=10), seq("b", 7, 1)
    for x in (a, b):
        s.add(x)
    plan = s.plan(RuntimeConfig(prefill_token_budget=64), StepCostModel())
    for c in plan.prefill:
        c.seq.target_computed = c.seq.draft_computed = c.end
        c.seq.status = SeqStatus.DECODING
        c.seq.output_ids.append(5)  # first token from prefill: pending at position 7
    config = RuntimeConfig(k_initial=4, adaptive=False, schedule="pd")  # lock-step
    plan = s.plan(config, StepCostModel())
    # a (higher priority) is planned first and takes the last free block for k = 4 (12 positions);
    # b would need a 3rd block for k = 4, none is left: it falls back to k = 0 (fits in 2 blocks).
    assert [(w.seq.request_id, w.k) for w in plan.decode] == [("a", 4), ("b", 0)]
    assert not plan.preempted
    # Grow a so far that it needs b's blocks: b (lower priority) is preempted by recompute.
    a.output_ids += [5] * 8
    a.target_computed = a.draft_computed = a.pending_pos
    plan = s.plan(config, StepCostModel())
    assert [x.request_id for x in plan.preempted] == ["b"]
    assert b.status is SeqStatus.WAITING and b.target_blocks == [] and b.stats.preemptions == 1
    assert b.prefill_target == 7 and not b.samples_after_prefill  # recompute keeps the pending token


def test_choose_k_follows_goodput():
    costs = StepCostModel()
    config = RuntimeConfig(k_min=0, k_max=8, k_initial=3, adaptive=True)
    assert choose_k(config, None, None, costs, batch=1, remaining_tokens=100) == 3  # no estimate yet
    assert choose_k(config, 0.9, None, costs, batch=1, remaining_tokens=100) == 0  # plain step measured first
    observe_plain(costs, 1, costs.default_verify_s)
    high = choose_k(config, 0.9, None, costs, batch=1, remaining_tokens=100)
    low = choose_k(config, 0.05, None, costs, batch=1, remaining_tokens=100)
    assert high >= 4 and low == 0
    # Saturated GPU: measured verify cost grows with the tokens scored, so drafting stops paying.
    for k in range(0, 9):
        costs.observe_step(64, k, 5e-3 * (k + 1))
    assert choose_k(config, 0.7, None, costs, batch=64, remaining_tokens=100) == 0
    # The same measurements say nothing about batch 1, where verify is memory-bound.
    assert choose_k(config, 0.7, None, costs, batch=1, remaining_tokens=100) > 0
    # Request override and remaining tokens cap k.
    costs = StepCostModel()
    observe_plain(costs, 1, costs.default_verify_s)
    assert choose_k(config, 0.95, 2, costs, batch=1, remaining_tokens=100) == 2
    assert choose_k(config, 0.95, None, costs, batch=1, remaining_tokens=3) == 2
    assert expected_tokens(1.0, 4) == 5 and abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_batch_k_and_acceptance_estimates():
    config = RuntimeConfig(k_min=0, k_max=6, k_initial=4, adaptive=True)
    costs = StepCostModel()
    for k in range(0, 7):
        costs.observe_step(1, k, 5e-3 + 1e-3 * k)  # 5 ms verify whatever k, 1 ms per draft step
    observe_plain(costs, 1, 5e-3)
    assert choose_batch_k(config, [0.05], costs, 1, 6) == 0
    assert choose_batch_k(config, [0.8, 0.8], costs, 1, 6) >= 3
    # A verify of k = 4 accepting 2 is 2 successes and 1 failure: alpha 2/3, not 2/4 (plus the
    # prior's half success and half failure).
    tracker = AcceptanceTracker(decay=1.0, min_observations=2)
    tracker.observe(2, 4)
    assert tracker.alpha is None  # too few outcomes to judge: the policy drafts k_initial
    tracker.observe(4, 4)  # all accepted: no failure
    assert abs(tracker.alpha - 6.5 / 8) < 1e-12
    assert request_alpha(0, 0, None) is None and request_alpha(3, 1, None) is None
    assert request_alpha(0, 0, 0.6) == 0.6
    assert abs(request_alpha(3, 1, 0.5, prior_weight=4) - 5 / 8) < 1e-12


def test_pipelined_costs_are_their_own_and_optimistic_until_measured():
    costs = StepCostModel()
    for k in range(0, 5):
        costs.observe_step(4, k, 6e-3 + 2e-3 * k)  # lock-step at a group of 4: verify 6 ms + 2 ms per draft
        costs.observe_step(8, k, 7e-3 + 2.5e-3 * k)  # lock-step at the whole batch of 8
    observe_plain(costs, 8, 7e-3)
    observe_plain(costs, 4, 6e-3)
    # Unmeasured: perfect overlap, half the lock-step cost of one group.
    assert costs.pipelined_step_s(4, 3) == (6e-3 + 6e-3) / 2
    costs.observe_pipelined(4, 3, 11e-3)
    assert costs.pipelined_step_s(4, 3) == 11e-3 and costs.step_s(4, 3) == 12e-3  # the tables stay apart
    # Each request is verified every other pipelined step: E(a, k) per two steps.
    assert abs(costs.pipelined_goodput([0.7] * 4, 3, 8) - 4 * expected_tokens(0.7, 3) / 22e-3) < 1e-9
    # k = 0 is no pipelining: the whole batch plain-decodes every step, as lock-step.
    assert costs.pipelined_goodput([0.7] * 4, 0, 8) == costs.goodput([0.7] * 4, 0, 8)


def test_pdv_pipelines_only_where_it_measures_faster():
    config = RuntimeConfig(k_min=0, k_max=4, k_initial=3, adaptive=True, schedule="pdv", pipeline=True)
    costs = StepCostModel()
    for k in range(0, 5):
        costs.observe_step(4, k, 6e-3 + 2e-3 * k)
        costs.observe_step(8, k, 7e-3 + 2.5e-3 * k)
    observe_plain(costs, 8, 7e-3)
    observe_plain(costs, 4, 6e-3)
    alphas = [0.7] * 8
    assert pipelining_pays(config, alphas, costs, 8, None)  # unmeasured: optimistic, tried first
    for k in range(1, 5):
        costs.observe_pipelined(4, k, 12e-3 + 2e-3 * k)  # overlap measured to lose to lock-step
    assert not pipelining_pays(config, alphas, costs, 8, None)
    assert not pipelining_pays(config, alphas, costs, 8, True)
    for k in range(1, 5):
        for _ in range(costs.window):  # a full window: the median is the new cost
            costs.observe_pipelined(4, k, 6e-3)  # draft hidden and the group's verify cheaper than lock-step's
    assert pipelining_pays(config, alphas, costs, 8, False)
    # Near break-even the last choice holds (10 % margin either way).
    lock = max(costs.goodput(alphas, k, 8) for k in range(5))
    pipe = max(costs.pipelined_goodput(alphas, k, 8) for k in range(1, 5))
    for k in range(1, 5):
        near = costs.pipelined_step_s(4, k) * pipe / (1.05 * lock)  # pipelined 5 % ahead of lock-step
        for _ in range(costs.window):
            costs.observe_pipelined(4, k, near)
    assert pipelining_pays(config, alphas, costs, 8, True) and not pipelining_pays(config, alphas, costs, 8, False)
    # Fixed k, or nothing known about acceptance: pipelining as configured.
    assert pipelining_pays(
        RuntimeConfig(adaptive=False, schedule="pdv", pipeline=True), alphas, StepCostModel(), 8, False
    )
    assert pipelining_pays(config, [None] * 8, costs, 8, False)

    # The scheduler asks it each step: with overlap measured slow, a pdv step of 8 runs lock-step.
    s = scheduler(blocks=400)
    seqs = [seq(f"r{i}", 8, i) for i in range(8)]
    for x in seqs:
        x.status, x.target_computed, x.draft_computed, x.alpha_estimate = SeqStatus.DECODING, 8, 8, 0.7
        x.output_ids.append(5)
        s.running.append(x)
    slow = StepCostModel()
    for k in range(0, 5):
        slow.observe_step(8, k, 7e-3 + 2.5e-3 * k)
        slow.observe_pipelined(4, k, 30e-3)
    observe_plain(slow, 8, 7e-3)
    assert not s.plan(config, slow).pipelined
    fast = StepCostModel()
    for k in range(0, 5):
        fast.observe_step(8, k, 7e-3 + 2.5e-3 * k)
        fast.observe_pipelined(4, k, 7e-3)
    observe_plain(fast, 8, 7e-3)
    s.k.pipelining = None
    plan = s.plan(config, fast)
    assert plan.pipelined and plan.draft_ahead


def test_sequence_ids_slices_like_all_ids():
    seq = Sequence(RequestSpec((5, 6, 7), max_tokens=10), "r", 0, RequestStats(prompt_tokens=3))
    seq.output_ids += [8, 9]
    full = seq.all_ids
    assert full == [5, 6, 7, 8, 9]
    for start in range(6):
        for end in range(start, 6):
            assert seq.ids(start, end) == full[start:end], (start, end)
