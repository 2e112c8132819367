"""Prefix caching in the `split` topology (lane processes on the CPU, the pool-less prompt-lookup
draft): the router allocates every block, so with KV passed by handle the prefill lane attends over
the very pool the verify lane writes, and a cached prompt's prefill computes only the uncached suffix.
Greedy and seeded tokens equal the uncached offline engine's; usage reports the cached tokens. With
copied KV (staging pools that never see the verify lane's writes) caching stays off. `verifypd serve
--topology split` with n > 1: the gateway (another process) learns from the core that it caches, so
samples 1.. start from sample 0's prompt KV."""

from __future__ import annotations

import random

import pytest
from services_helpers import (
    Client,
    Server,
    engine_options,
    free_port,
    greedy_request,
    offline_outputs,
    serve_cmd,
    split_gateway,
    started_lanes,
)

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.v1 import generate_pb2

pytestmark = pytest.mark.slow  # lane processes (tests/README.md)

DRAFT = "ngram:1-3"


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    base = [rng.randrange(3, 90) for _ in range(30)]
    # extends, diverges after 30, diverges inside a block (17), repeats the first
    return [base + [11, 12], base + [13], base[:17] + [40, 41, 42], base + [11, 12]]


@pytest.fixture(scope="module")
def lanes(tiny_models):
    yield from started_lanes(engine_options(tiny_models[0], DRAFT))


def gateway(tiny_models, lanes, kv_transport):
    return split_gateway(lanes, engine_options(tiny_models[0], DRAFT), kv_transport)


def run(gw, seed: int | None) -> tuple[list[list[int]], list[int]]:
    """The four prompts, then a second turn of the first: its prompt and answer and two new tokens
    (the answer's blocks were written by the verify lane: the KV a copying prefill lane never sees)."""
    client = Client(gw.address)
    try:
        tokens, cached = [], []
        for p in [*prompts(), None]:
            p = p if p is not None else second_turn(tokens[0])
            fields = greedy_request(p, max_tokens=12)
            if seed is not None:
                fields["sampling"] = generate_pb2.SamplingParams(temperature=0.9, seed=seed)
            ids, msgs = client.generate(**fields)
            tokens.append(ids)
            cached.append(msgs[-1].usage.cached_tokens)
        return tokens, cached
    finally:
        client.close()


def second_turn(answer: list[int]) -> list[int]:
    return [*prompts()[0], *answer, 50, 51]


def expected(tiny_models, seed: int | None) -> list[list[int]]:
    sampling = SamplingParams() if seed is None else SamplingParams(temperature=0.9, seed=seed)
    options = engine_options(tiny_models[0], DRAFT, prefix_cache=False)

    def outputs(ps):
        return offline_outputs(options, [RequestSpec(tuple(p), 12, sampling, stop_at_eos=False) for p in ps])

    first = outputs(prompts())
    return [*first, *outputs([second_turn(first[0])])]


@pytest.mark.parametrize("seed", [None, 7], ids=["greedy", "seeded"])
def test_handle_transport_caches_and_equals_uncached(tiny_models, lanes, seed):
    with gateway(tiny_models, lanes, "handle") as gw:
        assert set(gw.wiring.mode_by_pool.values()) == {"imported"}
        assert gw.router.prefix is not None
        assert gw.share_prefix  # the core's ready message says it caches (as `serve`'s gateway hears it)
        tokens, cached = run(gw, seed)
        assert tokens == expected(tiny_models, seed)
        # 30 shared tokens = 7 full blocks of 4; 17 shared: 4 blocks; the repeat: all but the last
        # block; the second turn: past the first's 32 prompt tokens, into its answer's blocks
        assert cached[:4] == [0, 28, 16, 28] and 32 < cached[4] <= 44
        used, hits = gw.core_loop.call(lambda r: (r.target_blocks.num_used, r.prefix.hit_tokens))
        assert used == 0 and hits == sum(cached)


def test_copy_transport_keeps_caching_off(tiny_models, lanes):
    with gateway(tiny_models, lanes, "copy") as gw:
        tokens, cached = run(gw, None)
        assert tokens == expected(tiny_models, None)
        assert cached == [0, 0, 0, 0, 0]
        assert gw.router.prefix is None and not gw.share_prefix


def test_serve_split_samples_share_sample_zeros_prompt_kv(tiny_models):
    """The real command line: the gateway process cannot see the lanes' wiring; the core's ready
    message says it caches, so samples 1.. are submitted after sample 0's first token. The prompt is
    prefilled 16 tokens a step: samples submitted at once would be admitted while sample 0's prompt is
    still being computed, and compute the rest of it themselves."""
    port = free_port()
    extra = ("--draft", DRAFT, "--prefill-token-budget", "16")
    server = Server(serve_cmd(tiny_models, port, *extra, topology="split"), echo=False).wait_ready()
    try:
        client = Client(f"127.0.0.1:{port}")
        rng = random.Random(9)
        prompt = [rng.randrange(3, 90) for _ in range(64)]  # 16 blocks of 4: 4 prefill steps
        request = generate_pb2.GenerateRequest(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            max_tokens=6,
            stop_at_eos=False,
            sampling=generate_pb2.SamplingParams(temperature=1.0, seed=3),
            n=3,
        )
        msgs = list(client.gen.Generate(request, timeout=120))
        client.close()
    finally:
        server.stop()
    cached = {m.choice_index: m.usage.cached_tokens for m in msgs if m.finish_reason}
    # sample 0 computed the prompt; 1.. found all its blocks but the one that samples the first token
    assert cached == {0: 0, 1: 60, 2: 60}, "".join(server.lines[-20:])
