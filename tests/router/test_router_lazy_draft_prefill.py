"""Draft prefill only when drafting (docs/engine.md): while no request is expected to draft, prefill
writes no draft KV; when drafting starts, the draft's first call catches its KV up, and the result
is what a draft prefilled all along proposes (greedy, so proposals and acceptance are identical)."""

from __future__ import annotations

import random

import pytest
from engine_helpers import VOCAB, make_engine

from verifypd.domain.requests import RequestSpec
from verifypd.router.sequence import SeqStatus


def prompts(n: int = 6, seed: int = 3) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 30))) for _ in range(n)]


def count_draft_prefills(engine) -> list[int]:
    """Wraps the prefill lane's draft forward; returns the list of draft rows per call (filled in)."""
    calls: list[int] = []
    runner = engine.prefill_lane.draft
    forward = runner.forward

    def counted(runs, logits_for):
        calls.append(len(runs))
        return forward(runs, logits_for)

    runner.forward = counted
    return calls


def test_plain_decoding_prefills_no_draft_kv(tiny_models):
    """k fixed at 0: nobody will draft, so prefill runs no draft forward at all (the alpha 0.1 bench
    row paid a draft prefill for every prompt), and the draft KV stays at position 0."""
    engine = make_engine(*tiny_models, k=0)
    calls = count_draft_prefills(engine)
    router = engine.router
    for n, p in enumerate(prompts()):
        router.add_request(RequestSpec(p, max_tokens=12, stop_at_eos=False, request_id=str(n)))
    while any(s.status is not SeqStatus.DECODING for s in router.sequences()):
        router.step()
    assert all(s.draft_computed == 0 and s.draft_blocks for s in router.sequences())  # blocks still reserved
    while router.has_work():
        router.step()
    assert calls == []


def test_drafting_prefills_draft_kv(tiny_models):
    """k fixed at 3: every prompt's draft KV is written at prefill, as before."""
    engine = make_engine(*tiny_models, k=3)
    calls = count_draft_prefills(engine)
    engine.generate([RequestSpec(p, max_tokens=8, stop_at_eos=False) for p in prompts()])
    assert sum(calls) == len(prompts())


def run_then_draft(tiny_models, lazy: bool, start_after: int = 4):
    """Prefill and decode with k = 0, then switch to k = 3 (as Control.UpdateConfig would); returns
    per request (tokens, draft tokens, accepted tokens) and the draft calls' longest inputs."""
    engine = make_engine(*tiny_models, k=0)
    router = engine.router
    router.scheduler.lazy_draft_prefill = lazy
    inputs: list[int] = []
    draft = router.draft_lane.draft

    def recorded(items):
        inputs.append(max(len(i.input_tokens) for i in items))
        return draft(items)

    router.draft_lane.draft = recorded
    ids = [router.add_request(RequestSpec(p, max_tokens=20, stop_at_eos=False)) for p in prompts()]
    out = {i: [] for i in ids}
    stats = {}
    steps = 0
    while router.has_work():
        if steps == start_after:
            router.config = router.config.updated(k_initial=3)
        for o in router.step():
            out[o.request_id] += o.token_ids
            stats[o.request_id] = (o.stats.draft_tokens, o.stats.accepted_tokens)
        for s in router.sequences():  # the KV-position invariant
            assert s.draft_computed <= max(s.target_computed, 0) and s.target_computed <= s.num_tokens
        steps += 1
    return [(out[i], stats[i]) for i in ids], inputs


@pytest.mark.slow
def test_drafting_resumes_after_a_skipped_draft_prefill_as_if_prefilled(tiny_models):
    """Drafting starts after the prompts were prefilled without draft KV: the first draft call feeds
    each request's whole context (a catch-up), and every later proposal, hence every acceptance
    count, equals a run whose prefill wrote the draft KV; the tokens equal plain decoding."""
    lazy, lazy_inputs = run_then_draft(tiny_models, lazy=True)
    eager, eager_inputs = run_then_draft(tiny_models, lazy=False)
    plain = make_engine(*tiny_models, k=0).generate(
        [RequestSpec(p, max_tokens=20, stop_at_eos=False) for p in prompts()]
    )
    assert [t for t, _ in lazy] == [c.token_ids for c in plain.values()]
    assert lazy == eager
    drafted = sum(d for _, (d, _a) in lazy)
    accepted = sum(a for _, (_d, a) in lazy)
    assert 0 < accepted < drafted
    assert lazy_inputs[0] > max(len(p) for p in prompts())  # the catch-up covered the prompts
    assert eager_inputs[0] < lazy_inputs[0]


@pytest.mark.parametrize("max_k", [0, None])
def test_a_request_that_never_drafts_skips_its_draft_prefill(tiny_models, max_k):
    """A request with max_k = 0 plain-decodes whatever the server's k: no draft KV for it."""
    engine = make_engine(*tiny_models, k=3)
    calls = count_draft_prefills(engine)
    engine.generate([RequestSpec(p, max_tokens=6, stop_at_eos=False, max_k=max_k) for p in prompts(2)])
    assert sum(calls) == (0 if max_k == 0 else 2)
