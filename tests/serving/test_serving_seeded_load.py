"""The issue-23 finding, end to end: the same seeded request sent 8 times at once, among other
traffic, to a gateway with adaptive k gives 8 identical outputs, equal to --draft none's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from services_helpers import (
    Client,
    engine_options,
    offline_outputs,
    random_prompts,
)

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.v1 import generate_pb2 as pb

PROMPT, SEED, TEMPERATURE, MAX_TOKENS = [9, 8, 7, 9, 8, 7], 2026, 0.9, 40


def test_seeded_request_under_concurrent_load_gives_one_output(tiny_models):
    from verifypd.gateway.server import build_colocated

    reference = offline_outputs(
        engine_options(tiny_models[0], "none", k=0),
        [
            RequestSpec(
                tuple(PROMPT),
                max_tokens=MAX_TOKENS,
                stop_at_eos=False,
                sampling=SamplingParams(temperature=TEMPERATURE, seed=SEED),
            )
        ],
    )[0]
    gw = build_colocated(engine_options(*tiny_models, adaptive=True, num_blocks=48)).start()
    client = Client(gw.address)
    seeded = dict(
        token_ids=pb.TokenIds(ids=PROMPT),
        max_tokens=MAX_TOKENS,
        stop_at_eos=False,
        sampling=pb.SamplingParams(temperature=TEMPERATURE, seed=SEED),
    )
    others = [
        dict(
            token_ids=pb.TokenIds(ids=p),
            max_tokens=10 + 5 * n,
            stop_at_eos=False,
            sampling=pb.SamplingParams(temperature=[0.0, 1.0][n % 2], seed=n),
        )
        for n, p in enumerate(random_prompts(8, seed=4))
    ]
    try:
        with ThreadPoolExecutor(16) as pool:
            calls = [pool.submit(client.generate, **fields) for pair in zip([seeded] * 8, others) for fields in pair]
            results = [c.result() for c in calls]
    finally:
        client.close()
        gw.stop()
    outputs = [ids for ids, _ in results[0::2]]
    drafted = sum(msgs[-1].usage.draft_tokens for _, msgs in results)
    assert drafted > 0  # speculation was on
    assert all(ids == reference for ids in outputs), [sum(a != b for a, b in zip(ids, reference)) for ids in outputs]
