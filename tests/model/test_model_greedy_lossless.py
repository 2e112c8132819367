"""Greedy speculative decoding must reproduce greedy target-only decoding token for token."""

from __future__ import annotations

import random

import pytest
from engine_helpers import VOCAB, hf_greedy, make_engine

from verifypd.domain.requests import FinishReason, RequestSpec

pytestmark = pytest.mark.slow  # greedy decoding through the engine for every k (tests/README.md)


def random_prompts(n: int, seed: int, max_len: int = 20) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, max_len))) for _ in range(n)]


@pytest.fixture(scope="module")
def references(tiny_models):
    """Greedy target-only outputs from our engine with k = 0, checked against transformers."""
    prompts = random_prompts(12, seed=0)
    engine = make_engine(*tiny_models, k=0)
    done = engine.generate([RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts])
    return prompts, [c.token_ids for c in done.values()]


def test_plain_decoding_matches_transformers(tiny_models, hf_target, references):
    prompts, outputs = references
    for prompt, ours in list(zip(prompts, outputs, strict=False))[:4]:
        assert ours == hf_greedy(hf_target, list(prompt), 24)


@pytest.mark.parametrize("k", range(1, 9))
def test_speculative_equals_plain_for_every_k(tiny_models, references, k):
    prompts, expected = references
    engine = make_engine(*tiny_models, k=k)
    done = engine.generate([RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts])
    completions = list(done.values())
    assert [c.token_ids for c in completions] == expected
    drafted = sum(c.usage["draft_tokens"] for c in completions)
    accepted = sum(c.usage["accepted_tokens"] for c in completions)
    # The draft differs from the target: the run must have seen both accepts and rejects.
    assert 0 < accepted < drafted


def test_mixed_batch_with_per_request_k_and_joining_leaving(tiny_models, references):
    prompts, expected = references
    engine = make_engine(*tiny_models, k=3)
    router = engine.router
    tokens: dict[str, list[int]] = {}
    ids = {}
    pending = list(enumerate(prompts))
    cancelled = None
    step = 0
    while pending or router.has_work():
        # Requests join two at a time between steps, each with its own k (None = server k).
        for _ in range(2):
            if pending:
                n, prompt = pending.pop(0)
                max_k = [None, 0, 1, 5, 8][n % 5]
                ids[
                    router.add_request(
                        RequestSpec(prompt, max_tokens=24, stop_at_eos=False, max_k=max_k, request_id=f"r{n}")
                    )
                ] = n
        if step == 3:  # one extra request leaves mid-run (cancelled)
            cancelled = router.add_request(RequestSpec((5, 6, 7), max_tokens=24, stop_at_eos=False))
        if step == 5:
            out = router.abort(cancelled)
            assert out.finished and out.finish_reason is FinishReason.CANCELLED
        for out in router.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    for rid, n in ids.items():
        assert tokens[rid] == expected[n], f"request {rid} (k override {[None, 0, 1, 5, 8][n % 5]}) diverged"
    # Everything finished or cancelled: every block is back on the free lists.
    assert router.target_blocks.num_used == 0 and router.draft_blocks.num_used == 0


def test_self_speculative_draft_is_lossless(tiny_models, references):
    prompts, expected = references
    engine = make_engine(tiny_models[0], "self:1", k=4)
    done = engine.generate([RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts])
    assert [c.token_ids for c in done.values()] == expected


def test_adaptive_k_is_lossless(tiny_models, references):
    prompts, expected = references
    engine = make_engine(*tiny_models, k=4, adaptive=True)
    done = engine.generate([RequestSpec(p, max_tokens=24, stop_at_eos=False) for p in prompts])
    assert [c.token_ids for c in done.values()] == expected


def test_stop_conditions(tiny_models, references):
    prompts, expected = references
    engine = make_engine(*tiny_models, k=4)
    # max_tokens shorter than what a verify step can emit: output is cut exactly.
    done = engine.generate([RequestSpec(prompts[0], max_tokens=3, stop_at_eos=False)])
    (c,) = done.values()
    assert c.token_ids == expected[0][:3] and c.finish_reason == "length"
    # EOS: treat the 5th greedy token as end-of-sequence.
    engine.router.context.eos = frozenset({expected[1][4]})
    first = expected[1].index(expected[1][4])
    (c,) = engine.generate([RequestSpec(prompts[1], max_tokens=24)]).values()
    assert c.finish_reason == "eos" and c.token_ids == expected[1][: first + 1]
    # Stop string: the text of the greedy continuation contains "w{tok}" for its 3rd token.
    engine.router.context.eos = frozenset()
    word = f"w{expected[2][2]}"
    (c,) = engine.generate([RequestSpec(prompts[2], max_tokens=24, stop=(word,), stop_at_eos=False)]).values()
    assert c.finish_reason == "stop" and word not in c.text
    assert c.text.strip() == " ".join(f"w{t}" for t in expected[2][: expected[2].index(expected[2][2])])


@pytest.mark.parametrize("k", [1, 4])
def test_draft_equal_to_target_accepts_everything(tiny_models, k):
    """Draft = target (all layers, own pool): every draft must be accepted. This guards the draft
    lane itself (catch-up after full accepts, KV positions), which losslessness tests cannot see."""
    engine = make_engine(tiny_models[0], "self:3", k=k)
    done = engine.generate([RequestSpec(p, max_tokens=30, stop_at_eos=False) for p in random_prompts(4, seed=11)])
    for c in done.values():
        assert c.usage["draft_tokens"] > 0 and c.usage["accepted_tokens"] == c.usage["draft_tokens"]
        assert c.usage["verify_steps"] < 30 // (k + 1) + 2
