"""Sampling controls, logprobs and n / best_of through the HTTP API with the official `openai` client:
every control gives the same tokens with speculation as with it disabled (greedy and seeded),
logprobs come in OpenAI's chat and legacy shapes and equal the unspeculated ones, n samples are
seeded `sample_seed(seed, i)`, best_of keeps the best by cumulative logprob, streams interleave
choices by index; bad values are a 400 naming the parameter and leave other requests as they were."""

from __future__ import annotations

import math

import httpx
import pytest
from http_helpers import MODEL, HttpGateway

from verifypd.domain.sampling_controls import sample_seed

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 9, 10]
CONTROLS = [
    {"repetition_penalty": 3.0},
    {"frequency_penalty": 1.2, "presence_penalty": 0.5},
    {"logit_bias": {"7": 4.0, "9": -100}},
    {"min_tokens": 4, "stop_token_ids": [63, 7]},  # each generated (unmasked) before 4 tokens
    {"presence_penalty": -1.5, "repetition_penalty": 0.8, "logit_bias": {"20": 2.5}},
]


@pytest.fixture(scope="module")
def server(chat_models):
    s = HttpGateway(chat_models, k=4)
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return server.openai()


def complete(client, speculate: bool, **params):
    extra = {k: params.pop(k) for k in list(params) if k in ("repetition_penalty", "min_tokens", "stop_token_ids")}
    extra["ignore_eos"] = True
    if not speculate:
        extra["speculation"] = {"disable": True}
    params.setdefault("max_tokens", 16)
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **params)


def ids_of(done, index: int = 0) -> list[int]:
    ids = done.model_extra["verifypd"]["token_ids"]
    return ids if index == 0 and ids and isinstance(ids[0], int) else ids[index]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("controls", CONTROLS, ids=[",".join(c) for c in CONTROLS])
def test_every_control_gives_the_unspeculated_tokens(client, controls, sampled):
    params = dict(controls, **({"temperature": 0.9, "seed": 17} if sampled else {}))
    plain = complete(client, False, **dict(params))
    spec = complete(client, True, **dict(params))
    assert ids_of(spec) == ids_of(plain)
    assert spec.usage.model_extra["verifypd"]["draft_tokens"] > 0  # drafts were verified
    base = complete(client, False, **({"temperature": 0.9, "seed": 17} if sampled else {}))
    assert ids_of(plain) != ids_of(base), "the control changed nothing: the test would not see it broken"


def test_control_effects(client):
    biased = ids_of(complete(client, True, logit_bias={"42": 100}))
    assert biased == [42] * 16
    banned = ids_of(complete(client, True, logit_bias={str(t): -100 for t in range(3, 60)}))
    assert all(t >= 60 or t < 3 for t in banned)
    plain = ids_of(complete(client, True, max_tokens=30))
    late = next(t for n, t in enumerate(plain) if n >= 3 and t not in plain[:3])  # first seen at n >= 3
    done = complete(client, True, min_tokens=3, stop_token_ids=[late], max_tokens=30)
    assert done.choices[0].finish_reason == "stop" and ids_of(done) == plain[: plain.index(late) + 1]
    early = plain[1]  # generated at index 1: masked until 3 tokens are out
    done = complete(client, True, min_tokens=3, stop_token_ids=[early], max_tokens=30)
    assert early not in ids_of(done)[:3] and ids_of(done)[:1] == plain[:1]
    assert done.choices[0].finish_reason == "length" or ids_of(done)[-1] == early


def test_completion_logprobs_equal_unspeculated_and_match_the_tokens(client):
    for sampled in ({}, {"temperature": 0.8, "seed": 5}):
        plain = complete(client, False, logprobs=3, **sampled)
        spec = complete(client, True, logprobs=3, **sampled)
        assert ids_of(spec) == ids_of(plain)
        lp, ref = spec.choices[0].logprobs, plain.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids_of(spec)) == len(lp.tokens) == len(lp.top_logprobs)
        assert lp.tokens == ref.tokens and lp.text_offset == ref.text_offset
        for a, b in zip(lp.token_logprobs, ref.token_logprobs, strict=True):
            assert a <= 0 and math.isclose(a, b, abs_tol=1e-5)  # float32, verify shapes differ
        for top, ref_top in zip(lp.top_logprobs, ref.top_logprobs, strict=True):
            assert list(top) == list(ref_top) and len(top) == 3
        if not sampled:  # greedy: the chosen token is the most likely one
            assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True))


def test_chat_logprobs_shape_streamed_and_not(client):
    msgs = [{"role": "user", "content": "w5 w6 w7"}]
    done = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}
    )
    content = done.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=6,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]


def test_n_samples_are_seeded_per_index_and_best_of_keeps_the_likeliest(client):
    done = complete(client, True, n=3, temperature=1.0, seed=11)
    assert [c.index for c in done.choices] == [0, 1, 2]
    for i in range(3):  # sample i is the request with seed sample_seed(11, i), n = 1
        alone = complete(client, False, temperature=1.0, seed=sample_seed(11, i))
        assert ids_of(done, i) == ids_of(alone)
    assert len({tuple(ids_of(done, i)) for i in range(3)}) > 1
    assert done.usage.completion_tokens == 3 * 16 and done.usage.prompt_tokens == len(PROMPT)
    best = complete(client, True, n=2, best_of=4, temperature=1.0, seed=11, logprobs=0)
    totals = []
    for i in range(4):
        alone = complete(client, False, temperature=1.0, seed=sample_seed(11, i), logprobs=0)
        totals.append((sum(alone.choices[0].logprobs.token_logprobs), ids_of(alone)))
    totals.sort(key=lambda t: -t[0])
    assert [ids_of(best, i) for i in range(2)] == [ids for _, ids in totals[:2]]


def test_n_streams_interleave_choices_by_index(client):
    chunks = list(complete(client, True, n=2, temperature=1.0, seed=3, stream=True))
    text = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            text[choice.index] += choice.text
    done = complete(client, True, n=2, temperature=1.0, seed=3)
    assert text == {0: done.choices[0].text, 1: done.choices[1].text}


def test_bad_values_are_a_400_and_leave_other_requests_alone(server, client):
    before = ids_of(complete(client, True, temperature=0.7, seed=2))
    for body, param in (
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
    ):
        r = httpx.post(
            server.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **body}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert ids_of(complete(client, True, temperature=0.7, seed=2)) == before
    assert server.blocks_in_use() == (0, 0)
