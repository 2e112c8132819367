"""n samples over gRPC (GenerateRequest.n, gateway/samples.py): each message names its sample in
`choice_index`, sample i is the n = 1 request seeded `sample_seed(seed, i)`, samples 1.. start from
sample 0's prompt KV in the prefix cache (their usage.cached_tokens; HTTP's n the same), greedy samples
are equal, bad n is INVALID_ARGUMENT naming `n`, and a cancelled call frees every sample's KV."""

from __future__ import annotations

import grpc
import pytest
from http_helpers import MODEL, HttpGateway
from services_helpers import Client, SlowLane, wait_until

from verifypd.domain.sampling_controls import sample_seed
from verifypd.gateway.response_wire import ResponseEncoder
from verifypd.v1 import generate_pb2

PROMPT = [5, 6, 7, 5, 6, 7, 5, 6, 9, 10, 11, 12, 13, 14, 15]  # 3 full blocks of 4, and 3 tokens


@pytest.fixture(scope="module")
def server(tiny_models):
    s = HttpGateway(tiny_models, k=4)
    # A slow prefill, as a long prompt's on a GPU: samples submitted together would all be admitted
    # while sample 0's prompt is still being computed, and find nothing in the cache.
    s.slow_prefill = SlowLane(None)

    def wrap(router):
        s.slow_prefill.lane = router.prefill_lane
        router.prefill_lane = s.slow_prefill

    s.gw.core_loop.call(wrap)
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    server.slow.delay_s = 0.0
    server.slow_prefill.delay_s = 0.2
    c = Client(server.gw.address)
    yield c
    c.close()


def request(n: int, prompt=PROMPT, max_tokens: int = 12, **sampling) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prompt),
        max_tokens=max_tokens,
        stop_at_eos=False,
        sampling=generate_pb2.SamplingParams(**sampling),
        n=n,
    )


def by_choice(msgs) -> dict[int, list]:
    out: dict[int, list] = {}
    for m in msgs:
        out.setdefault(m.choice_index, []).append(m)
    return out


def test_samples_are_seeded_per_index_and_share_the_prompt_kv(client):
    prompt = [*PROMPT, 40]  # a prompt no other test sent: nothing of it is cached yet
    msgs = list(client.gen.Generate(request(3, prompt, temperature=1.0, seed=11), timeout=60))
    choices = by_choice(msgs)
    assert sorted(choices) == [0, 1, 2]
    assert {m.request_id for m in msgs} == {msgs[0].request_id}
    for i, ms in choices.items():
        assert ms[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
        assert all(m.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for m in ms[:-1])
        ids = [t for m in ms for t in m.token_ids]
        alone, _ = client.generate(**_fields(request(1, prompt, temperature=1.0, seed=sample_seed(11, i))))
        assert ids == alone, i
        usage = ms[-1].usage
        assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 12
        # sample 0 computed the prompt; 1.. found its full blocks in the cache, all but the one that
        # holds the last prompt position (its logits sample the first token: router.prefix_cache)
        assert usage.cached_tokens == (0 if i == 0 else 12), i
    assert len({tuple(t for m in ms for t in m.token_ids) for ms in choices.values()}) > 1


def _fields(req: generate_pb2.GenerateRequest) -> dict:
    return {f.name: v for f, v in req.ListFields()}


def test_greedy_samples_are_equal_and_n_zero_is_one(client):
    choices = by_choice(list(client.gen.Generate(request(2, seed=0), timeout=60)))
    assert [t for m in choices[0] for t in m.token_ids] == [t for m in choices[1] for t in m.token_ids]
    one = list(client.gen.Generate(request(0, seed=0), timeout=60))
    assert {m.choice_index for m in one} == {0}
    assert [t for m in one for t in m.token_ids] == [t for m in choices[0] for t in m.token_ids]


@pytest.mark.parametrize("n", [17, 10_000])
def test_bad_n_is_invalid_argument_naming_it(client, n):
    with pytest.raises(grpc.RpcError) as err:
        list(client.gen.Generate(request(n), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in [1, 16]" in err.value.details()


def test_cancel_frees_every_sample(server, client):
    server.slow.delay_s = 0.05
    call = client.gen.Generate(request(4, max_tokens=200, temperature=1.0, seed=5), timeout=60)
    seen = set()
    for m in call:
        seen.add(m.choice_index)
        if len(seen) == 4:
            break
    call.cancel()
    assert wait_until(lambda: server.blocks_in_use() == (0, 0), 20), server.blocks_in_use()


def test_http_n_samples_share_the_prompt_kv(server):
    server.slow_prefill.delay_s = 0.2
    client = server.openai()
    prompt = list(range(30, 46))  # shares no block with the other tests' prompts
    before = server.gw.core_loop.call(lambda r: r.prefix.hit_tokens)
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=4, n=3, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    assert len(done.choices) == 3
    # the summed usage counts the prompt once, cached_tokens of sample 0 (which computed it)
    assert done.usage.prompt_tokens == len(prompt)
    # the server's prefix cache served samples 1 and 2: 3 blocks each (as above)
    hits = server.gw.core_loop.call(lambda r: r.prefix.hit_tokens) - before
    assert hits == 2 * 12


def test_choice_index_on_the_wire_parses():
    raw = ResponseEncoder("r", 3).encode([1, 2], "ab", None, [4, 2, 0, 0, 0, 0], 0, 0.5)
    msg = generate_pb2.GenerateResponse.FromString(raw)
    assert msg.choice_index == 3 and msg.request_id == "r" and list(msg.token_ids) == [1, 2]
    plain = ResponseEncoder("r").encode([1], "", None, [0] * 6, 0, 0)
    assert generate_pb2.GenerateResponse.FromString(plain).choice_index == 0


def test_samples_wait_for_sample_zeros_first_token():
    """The order gateway.samples keeps, with a fake core client: samples 1.. are submitted only once
    sample 0 has an item (its prompt KV is then final and cached); sample 0's items stay readable."""
    import asyncio

    from verifypd.core.client import StreamBox
    from verifypd.domain.requests import RequestSpec, SamplingParams
    from verifypd.gateway.samples import submit_samples

    class Stream:
        def __init__(self, spec):
            self.spec, self.box = spec, StreamBox()

    class FakeClient:
        def __init__(self):
            self.log: list = []

        async def submit(self, spec, headers, api):
            stream = Stream(spec)
            self.log.append(("submit", spec.request_id, spec.sampling.seed))
            if spec.request_id.endswith("/0"):
                asyncio.get_running_loop().call_later(0.05, self.first_token, stream)
            return stream

        def first_token(self, stream):
            self.log.append(("token", stream.spec.request_id))
            stream.box.put("chunk")

        def cancel(self, stream):
            self.log.append(("cancel", stream.spec.request_id))

    async def run(share: bool):
        client = FakeClient()
        spec = RequestSpec((1, 2, 3), 4, SamplingParams(temperature=1.0, seed=9), request_id="r")
        streams = await submit_samples(client, spec, 3, None, "grpc", share)
        await asyncio.sleep(0.1)
        return client.log, [await asyncio.wait_for(streams[0].box.take(), 1)]

    log, first = asyncio.run(run(True))
    assert [e[:2] for e in log] == [("submit", "r/0"), ("token", "r/0"), ("submit", "r/1"), ("submit", "r/2")]
    assert [e[2] for e in log if e[0] == "submit"] == [sample_seed(9, i) for i in range(3)]
    assert first == [["chunk"]]
    log, _ = asyncio.run(run(False))  # no prefix cache: all at once
    assert [e[:2] for e in log][:3] == [("submit", "r/0"), ("submit", "r/1"), ("submit", "r/2")]
