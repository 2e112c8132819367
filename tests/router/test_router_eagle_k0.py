"""An EAGLE draft while the adaptive policy has turned drafting off (k = 0): its plain steps chain
like `--no-speculation`'s (steps.overlapped: the next step launched before the current one's tokens
reach the host), and call no draft lane. A step that cannot chain costs a whole host round trip on
the GPU; the head's catch-up waits for the next drafting step (its features are written by every
target forward). SIMULATED acceptance 0, so that the policy turns drafting off whatever the head."""

from __future__ import annotations

import dataclasses

import pytest
from engine_cases import write_head
from engine_helpers import costed_clock, count_calls, make_engine
from test_router_overlap import drive, prompts

from verifypd.domain.requests import RequestSpec
from verifypd.router.draft_length import PROBE_FIRST
from verifypd.router.k_decision import RECHECK_OFF_EVERY


@pytest.fixture(scope="module")
def head(tiny_models, tmp_path_factory):
    return write_head(tiny_models, tmp_path_factory.mktemp("eagle_k0") / "head")


def _specs() -> list[RequestSpec]:
    return [RequestSpec(p, max_tokens=90, stop_at_eos=False, request_id=f"e{i}") for i, p in enumerate(prompts(6, 71))]


def _count_draft_calls(engine) -> list[int]:
    """Wraps the draft lane's calls (in their own step, and launched after a verify call); a counter."""
    calls = [0]
    lane = engine.router.draft_lane
    for name in ("draft", "draft_after"):
        call = getattr(lane, name, None)
        if call is None:
            continue

        def counted(*args, _call=call, **kwargs):
            calls[0] += 1
            return _call(*args, **kwargs)

        setattr(lane, name, counted)
    return calls


def test_eagle_k0_steps_chain_like_plain_decoding(tiny_models, head):
    plain = make_engine(tiny_models[0], "none", k=0, num_blocks=512)
    costed_clock(plain.router)
    plain_out, _, plain_router = drive(plain, _specs(), overlap=True)

    eagle = make_engine(tiny_models[0], head, k=2, adaptive=True, num_blocks=512, simulated_acceptance=0.0)
    costed_clock(eagle.router)
    draft_calls = _count_draft_calls(eagle)
    out, _, router = drive(eagle, _specs(), overlap=True)

    assert {r: o[0] for r, o in out.items()} == {r: o[0] for r, o in plain_out.items()}
    probes = router.scheduler.probes
    off = probes.decisions - probes.drafting - probes.probes
    assert off > 60, (off, probes.k_counts)
    # The plain engine chains every step but the first of the batch; the head's engine chains every
    # k = 0 step but those next to a drafting or probing step and the PLAIN_SAMPLES steps' end.
    assert plain_router.overlap.steps >= 85, plain_router.overlap.steps
    assert router.overlap.steps >= off - 6, (router.overlap.steps, off, router.overlap.breaks)
    # Drafting calls come only from the steps that draft (the opening, probes), none from k = 0 steps.
    assert draft_calls[0] <= probes.drafting + probes.probes + 2, (draft_calls[0], probes.k_counts)


# The draft-length policy's per-request and per-k work: none of it belongs in a step the policy
# holds at k = 0 with no request it could probe (Scheduler._hold), bar the periodic recheck.
POLICY_CALLS = frozenset({"_cheap_probe", "_probe_extra", "_opening_probes", "opening_k", "choose_batch_k", "step_s"})


@pytest.mark.parametrize("batch, mixed", [(4, False), (12, False), (12, True)])
def test_held_k0_steps_do_no_per_request_policy_work(tiny_models, head, batch, mixed):
    """Once the batch is held at k = 0 (SIMULATED acceptance 0; past PROBE_FIRST steps, so a
    periodic probe is due, but every request's draft lags: none can take one), a step does none of
    the policy's per-request probe checks or cost estimates: only the decision recheck every
    RECHECK_OFF_EVERY steps. (Without the hold each step checked every request and costed a probe.)
    `mixed`: the head mixed with prompt lookup (eagle+ngram), held the same way."""
    draft = head.replace("eagle:", "eagle+ngram:", 1) if mixed else head
    eagle = make_engine(tiny_models[0], draft, k=2, adaptive=True, num_blocks=512, simulated_acceptance=0.0)
    router = eagle.router
    router.config = dataclasses.replace(router.config, overlap=True)
    for i, p in enumerate(prompts(batch, 71)):
        router.add_request(RequestSpec(p, max_tokens=120, stop_at_eos=False, request_id=f"h{i}"))
    for _ in range(PROBE_FIRST + 10):
        router.step()
    scheduler = router.scheduler
    assert scheduler.probes.due and scheduler.probes.k_counts.get(0, 0) > PROBE_FIRST, vars(scheduler.probes)
    held_before, steps = scheduler.held_steps, 48
    counts = count_calls(router, steps, POLICY_CALLS)
    assert scheduler.held_steps - held_before >= steps - 2, scheduler.held_steps
    assert not any(counts.get(name) for name in ("_cheap_probe", "_probe_extra", "_opening_probes")), counts
    rechecks = steps // RECHECK_OFF_EVERY + 1
    assert counts.get("choose_batch_k", 0) <= rechecks, counts
    assert counts.get("step_s", 0) <= rechecks * (2 * (router.config.k_max + 1) + 2), counts


def test_a_held_batch_that_drafts_again_grows_its_draft_blocks_then(tiny_models, head):
    """Held at k = 0, plain steps grow no draft-pool blocks (nothing drafts); when drafting resumes
    (here the operator sets k_min 2), the drafting step reserves the head's blocks for its whole
    catch-up, every request drafts, and every block returns at the end."""
    eagle = make_engine(tiny_models[0], head, k=2, adaptive=True, num_blocks=512, simulated_acceptance=0.0)
    router = eagle.router
    router.config = dataclasses.replace(router.config, overlap=True)
    for i, p in enumerate(prompts(6, 71)):
        router.add_request(RequestSpec(p, max_tokens=150, stop_at_eos=False, request_id=f"g{i}"))
    for _ in range(PROBE_FIRST + 10):
        router.step()
    scheduler = router.scheduler
    assert scheduler.held_steps > PROBE_FIRST // 2, scheduler.held_steps
    block = router.draft_blocks.block_size
    lagging = [s for s in scheduler.running if len(s.draft_blocks) * block < s.pending_pos - block]
    assert len(lagging) == 6, [(len(s.draft_blocks), s.pending_pos) for s in scheduler.running]
    drafted = {s.request_id: s.stats.draft_tokens for s in lagging}
    router.config = router.config.updated(k_min=2)
    for _ in range(3):
        router.step()
    assert all(s.stats.draft_tokens > drafted[s.request_id] for s in lagging), drafted
    assert all(len(s.draft_blocks) * block >= s.pending_pos for s in scheduler.running)
    while router.has_work():
        router.step()
    assert router.draft_blocks.num_free == router.draft_blocks.num_blocks
    assert router.target_blocks.num_free == router.target_blocks.num_blocks


@pytest.mark.parametrize("draft, warm", [("head", True), ("mix", True), ("self:1", True), ("head", False)])
def test_the_hold_lasts_while_requests_leave(tiny_models, head, draft, warm):
    """Requests finishing one by one (as chat requests end at EOS) keep the batch held: the others
    still cannot be probed, so a step after a request left does no per-request probe checks (each
    departure ended the hold before: a full check of every request, and the draft pool's blocks
    grown, in that step). The k decision is still re-taken at the smaller batch. `mix`: the head
    with prompt lookup (eagle+ngram), held the same way. `self:1`: a
    model draft (the target's first layer; its draft KV lags as the head's does). Not `warm`: plain
    decoding is unmeasured at the smaller batch sizes, and the hold lasts through the plain steps
    that measure it (it ended at each before)."""
    name = {"head": head, "mix": head.replace("eagle:", "eagle+ngram:", 1)}.get(draft, draft)
    engine = make_engine(tiny_models[0], name, k=2, adaptive=True, num_blocks=512, simulated_acceptance=0.0)
    router = engine.router
    router.config = dataclasses.replace(router.config, overlap=True)
    window = 30

    def batch(tag: str) -> list[RequestSpec]:  # the first finishes after the opening, the rest 3 steps apart
        return [
            RequestSpec(p, max_tokens=PROBE_FIRST + 16 + 3 * i, stop_at_eos=False, request_id=f"{tag}{i}")
            for i, p in enumerate(prompts(12, 71))
        ]

    if warm:
        engine.generate(batch("warm"))  # plain decoding measured at every batch size it shrinks through
    for spec in batch("l"):
        router.add_request(spec)
    for _ in range(PROBE_FIRST + 12):
        router.step()
    scheduler = router.scheduler
    assert scheduler.held_steps > 0 and len(scheduler.running) == 12, (scheduler.held_steps, len(scheduler.running))
    held_before = scheduler.held_steps
    counts = count_calls(router, window, POLICY_CALLS)
    left = 12 - len(scheduler.running)
    assert left >= 7 and scheduler.running, left
    assert not any(counts.get(n) for n in ("_cheap_probe", "_probe_extra", "_opening_probes")), counts
    assert scheduler.held_steps - held_before >= window - 2, (scheduler.held_steps - held_before, left)
    # one decision per departure (the batch changed) and the periodic recheck, no more (not warm:
    # and one in each step that measures plain decoding at a new batch size)
    if warm:
        assert counts.get("choose_batch_k", 0) <= left + window // RECHECK_OFF_EVERY + 1, counts


@pytest.mark.parametrize("draft", ["head", "self:1"])
def test_k_max_0_chained_steps_grow_no_draft_blocks(tiny_models, head, draft):
    """With drafting configured off (k_max 0) and a draft attached, chained plain steps grow no
    draft-pool blocks (each step grew every request's before: ~11 % more Python calls a step than
    `--no-speculation` at 16 requests, bench/drafts/k0_step_cost.py), and output stays plain."""
    name = head if draft == "head" else draft
    engine = make_engine(tiny_models[0], name, k=0, k_max=0, num_blocks=512)
    router = engine.router
    router.config = dataclasses.replace(router.config, overlap=True)
    for spec in _specs():
        router.add_request(spec)
    for _ in range(4):
        router.step()
    scheduler = router.scheduler
    before = {s.request_id: len(s.draft_blocks) for s in scheduler.running}
    chained = router.overlap.steps
    for _ in range(40):
        router.step()
    assert router.overlap.steps - chained >= 38, router.overlap.steps - chained
    assert {s.request_id: len(s.draft_blocks) for s in scheduler.running} == before
    while router.has_work():
        router.step()
    assert router.draft_blocks.num_free == router.draft_blocks.num_blocks
