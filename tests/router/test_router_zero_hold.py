"""The k = 0 hold (router.zero_hold) for drafts the policy had no cheap way to hold before: prompt
lookup (pool-less: any request can be probed, so it was never held; now held until a periodic probe
may run) and a draft configured off (k_max 0: no decision at all). A held step that the last
decision stands for takes no decision. Output stays plain decoding's."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import costed_clock, count_calls, make_engine
from test_router_overlap import prompts

from verifypd.domain.requests import RequestSpec
from verifypd.router.draft_length import PROBE_CREDIT_MAX, PROBE_FIRST
from verifypd.router.k_decision import RECHECK_OFF_EVERY


def _start(engine, batch: int, max_tokens: int, tag: str):
    router = engine.router
    router.config = dataclasses.replace(router.config, overlap=True)
    for i, p in enumerate(prompts(batch, 71)):
        router.add_request(RequestSpec(p, max_tokens=max_tokens, stop_at_eos=False, request_id=f"{tag}{i}"))
    return router


def test_prompt_lookup_is_held_and_still_probes_when_due(tiny_models):
    """Prompt lookup at SIMULATED acceptance 0: between periodic probes its k = 0 steps are held (no
    per-request probe check), and the probes still run on their schedule (ProbeSchedule: due, and
    covered by the probe budget), each ending the hold for its step."""
    engine = make_engine(tiny_models[0], "ngram", k=2, adaptive=True, num_blocks=512, simulated_acceptance=0.0)
    costed_clock(engine.router, per_draft_s=1e-4, draft_s=1e-4)  # probes cheap on this clock: the budget covers them
    router = _start(engine, 6, 230, "n")
    for _ in range(PROBE_FIRST // 2):
        router.step()
    scheduler = router.scheduler
    # Credit enough for the probes: this is about the hold stopping none; what a probe's step took
    # (the plain chain broken: ~1 plain step here) is charged in full (ProbeSchedule.settle).
    scheduler.probes.credit = PROBE_CREDIT_MAX
    probes_before, held_before, steps = scheduler.probes.probes, scheduler.held_steps, 200
    counts = count_calls(router, steps, frozenset({"_cheap_probe"}))
    probes = scheduler.probes
    assert probes.probes - probes_before >= 2, vars(probes)  # the hold stopped no probe
    held = scheduler.held_steps - held_before
    assert held >= steps * 3 // 4, (held, vars(probes))
    # checked only in the steps the hold ended for (a probe may run), not in every step
    assert counts.get("_cheap_probe", 0) <= 6 * (steps - held), (counts, held)
    while router.has_work():
        router.step()


def test_prompt_lookup_hold_keeps_plain_output(tiny_models):
    """Held prompt lookup (SIMULATED acceptance 0 makes it rejected) gives plain decoding's tokens."""
    specs = [RequestSpec(p, max_tokens=120, stop_at_eos=False, request_id=f"o{i}") for i, p in enumerate(prompts(5, 3))]
    plain = make_engine(tiny_models[0], "none", k=0, num_blocks=512)
    lookup = make_engine(tiny_models[0], "ngram", k=2, adaptive=True, num_blocks=512)
    want = plain.generate(specs)
    got = lookup.generate(specs)
    assert {r: c.token_ids for r, c in got.items()} == {r: c.token_ids for r, c in want.items()}
    assert lookup.router.scheduler.held_steps > 0


@pytest.mark.parametrize("draft", ["ngram", "self:1"])
def test_k_max_0_takes_no_k_decision(tiny_models, draft):
    """With drafting configured off (k_max 0), a step asks the policy nothing (its k is 0 whatever
    the acceptance, as with `--draft none`): each step took a whole k decision before."""
    engine = make_engine(tiny_models[0], draft, k=0, k_max=0, adaptive=True, num_blocks=512)
    router = _start(engine, 6, 60, "z")
    for _ in range(4):
        router.step()
    counts = count_calls(router, 30, frozenset({"choose_batch_k", "_off_signature", "measured"}))
    assert not counts, counts


def test_a_held_step_takes_no_decision_between_rechecks(tiny_models):
    """Held (a model draft at SIMULATED acceptance 0, its draft KV lagging), with no request joining
    or leaving: only the periodic recheck decides again; every other step just records k 0 (no
    measured-cost lookup, no alphas: `KDecision.batch_k` took both in every step before). Its plain verdicts
    read the engine-wide acceptance estimate once a step, not once a request (they change none)."""
    engine = make_engine(tiny_models[0], "self:1", k=2, adaptive=True, num_blocks=512, simulated_acceptance=0.0)
    router = _start(engine, 8, 140, "s")
    for _ in range(PROBE_FIRST + 10):
        router.step()
    scheduler = router.scheduler
    held_before, steps = scheduler.held_steps, 64
    counts = count_calls(router, steps, frozenset({"measured", "_alphas", "choose_batch_k", "alpha"}))
    assert scheduler.held_steps - held_before >= steps - 2, scheduler.held_steps
    rechecks = steps // RECHECK_OFF_EVERY + 1
    assert counts.get("choose_batch_k", 0) <= rechecks, counts
    assert counts.get("_alphas", 0) <= rechecks and counts.get("measured", 0) <= 3 * rechecks, counts
    assert counts.get("alpha", 0) <= steps + 4 * rechecks, counts
