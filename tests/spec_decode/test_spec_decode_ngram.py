"""Prompt-lookup (n-gram) drafting: exact proposals, the lane's delta-fed history, and the engine
with it (pool-less: no draft blocks) giving exactly plain decoding's output."""

from __future__ import annotations

import random

import pytest
from engine_helpers import costed_clock, make_engine

from verifypd.domain.lanes import DraftItem, LaneInfo
from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.spec_decode.ngram import NgramDraftLane, TokenHistory, propose


@pytest.mark.parametrize(
    "context, k, n, expected",
    [
        # single match: the tokens after the earlier "1 2"
        ([1, 2, 3, 4, 1, 2], 3, (1, 3), [3, 4, 1]),
        # k caps the proposal; the copy may run on into the suffix itself
        ([1, 2, 3, 4, 1, 2], 1, (1, 3), [3]),
        # no earlier occurrence of the last token: nothing
        ([1, 2, 3], 2, (1, 3), []),
        ([], 2, (1, 3), []),
        ([7], 2, (1, 3), []),
        # several matches of "1 2": the most recent earlier one wins
        ([1, 2, 9, 1, 2, 7, 1, 2], 2, (1, 3), [7, 1]),
        # longest n first: "3 1 2" (n=3) beats the more recent 2-gram "1 2" -> 7
        ([3, 1, 2, 8, 1, 2, 7, 3, 1, 2], 1, (1, 3), [8]),
        # ... unless max_n stops at 2
        ([3, 1, 2, 8, 1, 2, 7, 3, 1, 2], 1, (1, 2), [7]),
        # min_n = 2: a lone 1-gram match does not count
        ([5, 6, 9, 6], 2, (2, 3), []),
        ([5, 6, 9, 6], 2, (1, 3), [9, 6]),
        # match at the end of the context: the overlapping copy extends the period
        ([4, 5, 5, 5], 4, (1, 3), [5, 5, 5, 5]),
        ([8, 1, 2, 1, 2], 5, (1, 2), [1, 2, 1, 2, 1]),
    ],
)
def test_proposals_for_hand_made_contexts(context, k, n, expected):
    assert propose(context, k, *n) == expected


def _scan(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force, token by token: the most recent earlier start of the longest suffix n-gram."""
    size = len(context)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for i in range(size - n - 1, -1, -1):
            if context[i : i + n] == context[size - n :]:
                out: list[int] = []
                for j in range(k):
                    pos = i + n + j
                    out.append(context[pos] if pos < size else out[pos - size])
                return out
    return []


@pytest.mark.parametrize("vocab", [4, 300, 1 << 31])
def test_history_with_rollbacks_equals_a_token_by_token_scan(vocab):
    """The history's byte search against a scan of the tokens themselves, as the router feeds it
    (extend, truncate). Ids like 1, 256, 65536 and 16777216 make byte matches that straddle two
    tokens (e.g. the bytes of [256, 0] contain those of 1 shifted by one byte): only aligned ones count."""
    rng = random.Random(vocab)
    straddlers = [0, 1, 256, 257, 65536, 16777216]
    for _ in range(300):
        min_n = rng.randint(1, 3)
        history = TokenHistory(min_n, rng.randint(min_n, 5))
        truth: list[int] = []
        for _ in range(rng.randint(1, 8)):
            pool = straddlers if rng.random() < 0.3 else None
            chunk = [rng.choice(pool) if pool else rng.randrange(vocab) for _ in range(rng.randrange(30))]
            history.extend(chunk)
            truth += chunk
            if truth and rng.random() < 0.3:
                keep = rng.randrange(len(truth) + 1)
                history.truncate(keep)
                del truth[keep:]
            k = rng.randint(1, 6)
            assert history.propose(k) == _scan(truth, k, history.min_n, history.max_n)


def _lane(min_n=1, max_n=3, capacity=1 << 20) -> NgramDraftLane:
    return NgramDraftLane(LaneInfo("draft", (), 96, 256), min_n, max_n, capacity)


def _item(rid: str, tokens: list[int], start: int, k: int = 4) -> DraftItem:
    return DraftItem(rid, tokens, start, None, k, SamplingParams())


def test_lane_history_fed_with_deltas_and_rollbacks_equals_stateless_lookup():
    """Random walk of the router's protocol: truncate to start_pos (rollback), append the delta."""
    rng = random.Random(0)
    lane = _lane()
    truth: list[int] = [rng.randrange(6) for _ in range(5)]
    start = 0
    for _ in range(400):
        k = rng.randrange(1, 6)
        (out,) = lane.draft([_item("r", truth[start:], start, k)])
        assert out.resync_from is None
        assert out.draft_tokens == propose(truth, k, 1, 3)
        m = rng.randrange(len(out.draft_tokens) + 1)  # accept a prefix, then one "target" token
        n = len(truth) - 1
        truth += out.draft_tokens[:m] + [rng.randrange(6)]
        start = min(n + len(out.draft_tokens), n + m + 1) if out.draft_tokens else n + 1
        if rng.random() < 0.2:  # the router may also lag (k = 0 steps): resend more
            start = rng.randrange(start + 1)


def test_missing_or_short_history_asks_for_a_resend():
    lane = _lane()
    (out,) = lane.draft([_item("new", [3], 10)])
    assert out.draft_tokens == [] and out.resync_from == 0
    lane.draft([_item("a", [1, 2, 3, 1, 2], 0)])  # holds [0, 5) + proposals
    (out,) = lane.draft([_item("a", [9], 40)])
    assert out.draft_tokens == [] and out.resync_from is not None and out.resync_from < 40
    lane.forget("a")
    assert lane.cached_requests == 0


def test_eviction_keeps_the_budget_and_evicted_requests_resync():
    lane = _lane(capacity=30)
    for rid in ("a", "b", "c"):
        lane.draft([_item(rid, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], 0)])
    assert lane.cached_requests < 3  # "a" (least recently used) went
    (out,) = lane.draft([_item("a", [3], 12)])
    assert out.resync_from == 0


def test_lane_rejects_bad_settings():
    with pytest.raises(ValueError, match="MIN <= MAX"):
        NgramDraftLane(LaneInfo("draft", (), 96, 256), 3, 2)
    with pytest.raises(ValueError, match="k >= 1"):
        _lane().draft([_item("r", [1, 2], 0, k=0)])


# Repetitive prompts, so lookup proposes; plus random ones, where it mostly cannot.
def _prompts() -> list[tuple[int, ...]]:
    rng = random.Random(7)
    rep = [tuple([rng.randrange(3, 96) for _ in range(5)] * 3) for _ in range(3)]
    rand = [tuple(rng.randrange(3, 96) for _ in range(rng.randrange(2, 30))) for _ in range(3)]
    return rep + rand


@pytest.fixture(scope="module")
def plain_outputs(tiny_models):
    engine = make_engine(tiny_models[0], "none", k=0)
    assert engine.draft_pool is None and engine.router.draft_blocks is None  # --no-speculation loads no draft
    done = engine.generate(
        [RequestSpec(p, max_tokens=28, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(_prompts())]
    )
    return [done[str(i)].token_ids for i in range(len(_prompts()))]


@pytest.mark.parametrize("draft, k, adaptive", [("ngram", 4, False), ("ngram:1-3", 3, False), ("ngram:1-4", 4, True)])
def test_greedy_with_ngram_equals_plain_decoding(tiny_models, plain_outputs, draft, k, adaptive):
    engine = make_engine(tiny_models[0], draft, k=k, adaptive=adaptive, num_blocks=48)
    assert engine.draft_pool is None and engine.router.draft_blocks is None
    assert engine.draft_lane.describe().pools == ()
    if adaptive:  # step costs from a virtual clock: what the policy drafts does not follow the machine's load
        costed_clock(engine.router)
    done = engine.generate(
        [RequestSpec(p, max_tokens=28, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(_prompts())]
    )
    assert [done[str(i)].token_ids for i in range(len(_prompts()))] == plain_outputs
    drafted = sum(c.usage["draft_tokens"] for c in done.values())
    accepted = sum(c.usage["accepted_tokens"] for c in done.values())
    # Fixed k meets rejections here; the adaptive policy drafts only where its costs say it pays (on
    # this virtual clock: 16 tokens, all accepted), so it must draft, not be rejected.
    assert 0 < accepted < drafted if not adaptive else 0 < accepted <= drafted
    assert engine.router.target_blocks.num_used == 0 and engine.draft_lane.cached_requests == len(done)


def test_lost_history_resyncs_and_output_is_unchanged(tiny_models, plain_outputs):
    """A draft lane that forgets everything mid-request (restart, eviction) costs proposals, not tokens."""
    engine = make_engine(tiny_models[0], "ngram:1-3", k=3)
    lane, router = engine.draft_lane, engine.router
    calls = []
    draft = lane.draft

    def forgetful(items):
        calls.append([(i.start_pos, len(i.input_tokens)) for i in items])
        if len(calls) % 4 == 0:
            lane._histories.clear()
        return draft(items)

    lane.draft = forgetful
    prompts = _prompts()[:3]
    for i, p in enumerate(prompts):
        router.add_request(RequestSpec(p, max_tokens=28, stop_at_eos=False, request_id=str(i)))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while router.has_work():
        for o in router.step():
            out[o.request_id] += o.token_ids
    assert [out[str(i)] for i in range(len(prompts))] == plain_outputs[:3]
    resent = [n for step in calls[1:] for start, n in step if start == 0]
    assert resent, "a cleared history should make the router resend a whole context"


def test_router_sends_deltas_after_the_first_call(tiny_models):
    engine = make_engine(tiny_models[0], "ngram:1-3", k=3)
    seen: dict[str, list[tuple[int, int]]] = {}
    draft = engine.draft_lane.draft

    def recording(items):
        for i in items:
            assert i.draft_kv is None
            seen.setdefault(i.request_id, []).append((i.start_pos, len(i.input_tokens)))
        return draft(items)

    engine.draft_lane.draft = recording
    prompts = _prompts()
    engine.generate(
        [RequestSpec(p, max_tokens=20, stop_at_eos=False, request_id=str(i)) for i, p in enumerate(prompts)]
    )
    for i, p in enumerate(prompts):
        calls = seen[str(i)]
        assert calls[0] == (0, len(p) + 1)  # the prompt and the first token, once
        assert all(1 <= n <= 2 for _, n in calls[1:]) and len(calls) > 3


@pytest.mark.slow
def test_sampling_with_ngram_draft_keeps_the_target_distribution(tiny_models, hf_target):
    """The chi-square test of test_model_sampling_lossless, with prompt lookup as the draft (q =
    one-hot of the proposal). The prompt holds every token once, so after any first token t1 >= 3
    lookup proposes the token that followed t1 in the prompt: the 2nd output token is an accepted
    proposal or a residual sample, and must still follow the target's marginal."""
    import numpy as np
    from engine_cases import _second_token_marginal, chi_square_pvalue, sample_second_tokens

    engine = make_engine(tiny_models[0], "ngram:1-2", k=2, num_blocks=8192, block_size=4, max_running=1024)
    engine.router.config = engine.router.config.updated(prefill_token_budget=1 << 16)  # few, big steps
    prompt = tuple(random.Random(3).sample(range(3, 96), 93))
    temperature, n = 1.5, 1000
    vocab = hf_target.config.vocab_size
    seconds = sample_second_tokens(engine, prompt, temperature, n, 3, 500, vocab)
    target_p = _second_token_marginal(hf_target, prompt, temperature)
    assert chi_square_pvalue(seconds, target_p) > 1e-3
    # Power: "always accept the proposal" would give this distribution instead; it must be rejected.
    p1 = _first_token_probs(hf_target, prompt, temperature)
    always = np.zeros(vocab)
    for t1 in range(vocab):
        proposal = propose(list(prompt) + [t1], 1, 1, 2)
        if proposal:
            always[proposal[0]] += p1[t1]
        else:  # no proposal: plain decoding either way
            always += p1[t1] * _next_probs(hf_target, list(prompt) + [t1], temperature)
    assert chi_square_pvalue(seconds, always) < 1e-3, "test has no power: proposals match the target"


def _first_token_probs(model, prompt, temperature):
    return _next_probs(model, list(prompt), temperature)


def _next_probs(model, ids, temperature):
    import torch

    with torch.no_grad():
        return torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / temperature, -1).numpy()
