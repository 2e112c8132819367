"""Drafts launched a step ahead (engine.predraft): a lock-step step with a feature draft makes the next
step's drafts while it streams its tokens. Same tokens as plain decoding (greedy and seeded), also with
requests joining, finishing at different lengths, cancelled or preempted while their drafts are held;
the head is fed every position once, in order; the next plan verifies the held drafts."""
from __future__ import annotations

import random

import pytest

from engine_helpers import make_engine
from test_engine_eagle import write_head
from test_engine_lookup_mix import repeating_prompts
from verifypd.engine.types import RequestSpec, SamplingParams


@pytest.fixture(scope="module")
def head(tiny_models, tmp_path_factory):
    return write_head(tiny_models, tmp_path_factory.mktemp("predraft") / "head")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 90) for _ in range(rng.randrange(4, 12))] for _ in range(n)]


def _specs(prompts, **kw) -> list[RequestSpec]:
    # different lengths: requests finish (and leave their drafts made ahead unused) at different steps
    return [RequestSpec(p, max_tokens=10 + 3 * i, stop_at_eos=False, request_id=f"r{i}", **kw)
            for i, p in enumerate(prompts)]


def _feeds(engine) -> dict[str, list]:
    """Wraps the draft lane: (start_pos, tokens fed) of every item, by request."""
    fed: dict[str, list] = {}
    draft = engine.draft_lane.draft

    def recording(items):
        for i in items:
            fed.setdefault(i.request_id, []).append((i.start_pos, len(i.input_tokens)))
        return draft(items)
    engine.draft_lane.draft = recording
    return fed


@pytest.mark.parametrize("k, adaptive, max_running", [(1, False, 8), (4, False, 8), (3, False, 3), (3, True, 8)])
def test_greedy_with_drafts_made_ahead_equals_plain(tiny_models, head, k, adaptive, max_running):
    prompts = _prompts(6, seed=k)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    engine = make_engine(tiny_models[0], head, k=k, adaptive=adaptive, max_running=max_running)
    fed = _feeds(engine)
    done = engine.generate(_specs(prompts))
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    predraft = engine.router.predraft
    assert predraft.calls > 0 and predraft.requests >= predraft.calls
    # The head is fed each request's positions once, in order, without a gap (a draft made ahead
    # starts where the verify before it left draft_computed).
    for calls in fed.values():
        for (start, n), (nxt, _) in zip(calls, calls[1:]):
            assert nxt == start + n, (start, n, nxt)


def test_held_drafts_are_verified_by_the_next_step(tiny_models, head):
    """Every draft call but the first of a fixed-k batch is made a step ahead: the step after it
    verifies them (no draft call of its own)."""
    prompts = _prompts(4, seed=5)
    specs = [RequestSpec(p, max_tokens=16, stop_at_eos=False) for p in prompts]  # all finish together
    engine = make_engine(tiny_models[0], head, k=3)
    calls = []
    draft = engine.draft_lane.draft
    engine.draft_lane.draft = lambda items: calls.append(len(items)) or draft(items)
    engine.generate(specs)
    assert engine.router.predraft.calls == len(calls) - 1, (engine.router.predraft.calls, len(calls))


def test_seeded_output_with_drafts_made_ahead_equals_plain(tiny_models, head):
    prompts = _prompts(5, seed=11)
    specs = lambda: _specs(prompts, sampling=SamplingParams(temperature=0.7, seed=7))  # noqa: E731
    plain = make_engine(tiny_models[0], "none", k=0).generate(specs())
    engine = make_engine(tiny_models[0], head, k=4)
    done = engine.generate(specs())
    assert {r: c.token_ids for r, c in done.items()} == {r: c.token_ids for r, c in plain.items()}
    assert engine.router.predraft.calls > 0


def test_off_gives_the_same_tokens_and_no_step_ahead(tiny_models, head):
    prompts = _prompts(5, seed=2)
    on = make_engine(tiny_models[0], head, k=3)
    off = make_engine(tiny_models[0], head, k=3)
    off.router.predraft.enabled = False
    a, b = on.generate(_specs(prompts)), off.generate(_specs(prompts))
    assert {r: c.token_ids for r, c in a.items()} == {r: c.token_ids for r, c in b.items()}
    assert on.router.predraft.calls > 0 and off.router.predraft.calls == 0


def test_cancel_and_preemption_with_held_drafts(tiny_models, head):
    """A request cancelled while it holds drafts made ahead, and a pool small enough to preempt: the
    others' tokens are plain decoding's."""
    prompts = _prompts(6, seed=4)
    plain = make_engine(tiny_models[0], "none", k=0).generate(_specs(prompts))
    engine = make_engine(tiny_models[0], head, k=4, num_blocks=40)
    router = engine.router
    ids = [router.add_request(s) for s in _specs(prompts)]
    tokens = {i: [] for i in ids}
    cancelled = None
    while router.has_work():
        for out in router.step():
            tokens[out.request_id] += out.token_ids
        held = [s for s in router.sequences() if s.held_draft is not None and s.held_draft.predrafted]
        if cancelled is None and held:
            cancelled = held[-1].request_id
            assert router.abort(cancelled) is not None
    assert cancelled is not None
    for rid in ids:
        if rid != cancelled:
            assert tokens[rid] == plain[rid].token_ids, rid
    assert not router.scheduler.running and router.target_blocks.num_free == router.target_blocks.num_blocks


@pytest.mark.parametrize("k", [2, 4])
def test_head_mixed_with_lookup_drafted_ahead(tiny_models, head, k):
    mixed = "eagle+ngram:" + head.removeprefix("eagle:")
    prompts = repeating_prompts(5, seed=k)
    specs = lambda: [RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts]  # noqa: E731
    plain = make_engine(tiny_models[0], "none", k=0).generate(specs())
    engine = make_engine(tiny_models[0], mixed, k=k)
    fed = _feeds(engine)
    done = engine.generate(specs())
    assert [c.token_ids for c in done.values()] == [c.token_ids for c in plain.values()]
    assert engine.router.predraft.calls > 0 and engine.router.lookup.proposed > 0
    for calls in fed.values():  # a step lookup drafted (held ahead) leaves the head's rows alone
        for (start, n), (nxt, _) in zip(calls, calls[1:]):
            assert nxt == start + n, (start, n, nxt)
