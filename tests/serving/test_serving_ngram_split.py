"""`split` topology with the pool-less prompt-lookup draft lane: no draft model, no draft pool, no
draft KV; output equals the co-located engine's, and only token deltas cross the wire to the draft lane."""

from __future__ import annotations

import pytest
from services_helpers import (
    Client,
    engine_options,
    greedy_request,
    offline_outputs,
    split_gateway,
    started_lanes,
)

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.v1 import generate_pb2

pytestmark = pytest.mark.slow  # lane processes (tests/README.md)

DRAFT = "ngram:1-3"
# Repeated segments, so prompt lookup proposes (and the tiny random models, which loop, accept).
PROMPTS = [
    [5, 9, 11, 30, 5, 9, 11, 30, 5, 9],
    [40, 41, 42, 43, 44, 40, 41, 42],
    [7, 7, 7, 7, 7, 7],
    [12, 60, 33, 12, 60, 33, 12, 60, 33, 12, 60, 33, 90],
]


@pytest.fixture(scope="module")
def lanes(tiny_models):
    yield from started_lanes(engine_options(tiny_models[0], DRAFT))


def gateway(tiny_models, lanes, kv_transport):
    return split_gateway(lanes, engine_options(tiny_models[0], DRAFT), kv_transport)


@pytest.mark.parametrize("kv_transport", ["handle", "copy"])
def test_poolless_ngram_lane_split_equals_colocated(tiny_models, lanes, kv_transport):
    specs = [RequestSpec(tuple(p), max_tokens=24, stop_at_eos=False) for p in PROMPTS]
    expected = offline_outputs(engine_options(tiny_models[0], DRAFT), specs)
    with gateway(tiny_models, lanes, kv_transport) as gw:
        prefill, draft, verify = gw.lanes
        assert draft.describe().pools == ()  # the draft lane owns no pool ...
        # ... reads no KV the prefill lane writes, so never waits for its writes (on a GPU host a
        # CPU draft lane refused the CUDA event, found with `serve --topology split --draft none`)
        assert draft.producer is None and verify.producer is prefill
        assert set(gw.wiring.mode_by_pool) == {verify_pool_id(gw)}  # ... and prefill wires only the target's
        assert gw.router.draft_blocks is None
        sent: dict[str, list[int]] = {}  # request id -> input_tokens length of each Draft call
        call = draft.draft

        def recording(items):
            for i in items:
                sent.setdefault(i.request_id, []).append(len(i.input_tokens))
            return call(items)

        draft.draft = recording
        client = Client(gw.address)
        got, usage = [], []
        for p in PROMPTS:
            ids, msgs = client.generate(**greedy_request(p))
            got.append(ids)
            usage.append(msgs[-1].usage)
        client.close()
        assert got == expected
        drafted = sum(u.draft_tokens for u in usage)
        assert drafted > 0 and 0 < sum(u.accepted_tokens for u in usage) <= drafted
        # Deltas, not contexts: each request's first Draft call carries its whole context (the
        # prompt + first token), every later one only the 1-2 tokens the lane has not seen.
        assert sorted(lens[0] for lens in sent.values()) == sorted(len(p) + 1 for p in PROMPTS)
        assert all(1 <= n <= 2 for lens in sent.values() for n in lens[1:]) and sum(map(len, sent.values())) > 8


def verify_pool_id(gw) -> str:
    (pool,) = gw.lanes[2].describe().pools
    return pool.pool_id


def test_sampling_with_ngram_split_equals_colocated(tiny_models, lanes):
    prompt = PROMPTS[0]
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    expected = offline_outputs(
        engine_options(tiny_models[0], DRAFT),
        [RequestSpec(tuple(prompt), max_tokens=20, stop_at_eos=False, sampling=sampling)],
    )
    with gateway(tiny_models, lanes, "auto") as gw:
        ids, msgs = Client(gw.address).generate(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            max_tokens=20,
            stop_at_eos=False,
            sampling=generate_pb2.SamplingParams(temperature=0.8, top_p=0.9, seed=5),
        )
        assert [ids] == expected
        assert msgs[-1].usage.draft_tokens > 0
