"""`split` topology on CPU: three lane processes, KV passed by handle (/dev/shm), copied over gRPC,
copied layer by layer into the owners' pools (peer) or written straight into them (direct).

One set of lane processes serves the whole module; each test wires a fresh gateway (router) to
them, so block allocation starts clean every time.
"""

from __future__ import annotations

import pytest
from services_helpers import (
    Client,
    engine_options,
    greedy_request,
    offline_outputs,
    random_prompts,
)

from verifypd.domain.requests import RequestSpec, SamplingParams
from verifypd.v1 import generate_pb2

pytestmark = pytest.mark.slow  # lane processes (tests/README.md)


@pytest.fixture(scope="module")
def lanes(tiny_models):
    from verifypd.lanes.processes import LaneProcesses

    procs = LaneProcesses(engine_options(*tiny_models))
    procs.start(timeout_s=120)
    yield procs
    procs.terminate()


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(6, seed=3, max_len=40)


@pytest.fixture(scope="module")
def expected(tiny_models, prompts):
    return offline_outputs(
        engine_options(*tiny_models), [RequestSpec(tuple(p), max_tokens=24, stop_at_eos=False) for p in prompts]
    )


def split_gateway(tiny_models, lanes, kv_transport):
    from verifypd.gateway.server import build_split

    return build_split(
        lanes.addrs, engine_options(*tiny_models), kv_transport=kv_transport, lane_secret=lanes.secret
    ).start()


def owner_bytes_received(gw) -> int:
    _, draft, verify = gw.lanes
    return sum(lane.describe_pb(refresh=True).kv_bytes_received for lane in (draft, verify))


def kv_bytes_per_token(gw) -> int:
    """Bytes one token's KV takes in the target plus the draft pool."""
    total = 0
    for lane in gw.lanes[1:]:
        for d in lane.describe_pb().pools:
            total += 2 * d.num_layers * d.num_kv_heads * d.head_dim * 4  # float32 on CPU
    return total


def run_all(gw, prompts) -> list[list[int]]:
    client = Client(gw.address)
    try:
        return [client.generate(**greedy_request(p))[0] for p in prompts]
    finally:
        client.close()


def test_handles_give_offline_output_and_no_kv_bytes_cross_grpc(tiny_models, lanes, prompts, expected):
    with split_gateway(tiny_models, lanes, "handle") as gw:
        assert set(gw.wiring.mode_by_pool.values()) == {"imported"}
        received_before = owner_bytes_received(gw)
        assert run_all(gw, prompts) == expected
        prefill = gw.lanes[0]
        assert prefill.kv_bytes_copied == 0
        assert owner_bytes_received(gw) == received_before
        # Every byte of every Prefill call (requests + replies) is less than the KV that the
        # prompts produced: the KV itself cannot have travelled with them.
        prompt_kv = sum(len(p) for p in prompts) * kv_bytes_per_token(gw)
        assert prefill.calls >= len(prompts) and prefill.wire_bytes < prompt_kv / 10


def test_copy_transport_gives_same_output(tiny_models, lanes, prompts, expected):
    with split_gateway(tiny_models, lanes, "copy") as gw:
        assert set(gw.wiring.mode_by_pool.values()) == {"copy"}
        received_before = owner_bytes_received(gw)
        assert run_all(gw, prompts) == expected
        copied = gw.lanes[0].kv_bytes_copied
        assert copied >= sum(len(p) for p in prompts) * kv_bytes_per_token(gw)
        assert owner_bytes_received(gw) - received_before == copied


def test_peer_transport_gives_same_output(tiny_models, lanes, prompts, expected):
    """The multi-GPU transport on the CPU: the prefill lane stages KV in its own memory and copies
    each layer's blocks into the owners' /dev/shm pools as the forward goes (peer_copy.py); the
    owners are other processes, as they are other GPUs there. Nothing crosses gRPC."""
    with split_gateway(tiny_models, lanes, "peer") as gw:
        assert set(gw.wiring.mode_by_pool.values()) == {"peer"}
        received_before = owner_bytes_received(gw)
        assert run_all(gw, prompts) == expected
        copied = gw.lanes[0].kv_bytes_copied
        assert copied >= sum(len(p) for p in prompts) * kv_bytes_per_token(gw)
        assert owner_bytes_received(gw) == received_before


def test_direct_transport_gives_same_output(tiny_models, lanes, prompts, expected):
    """The multi-GPU transport without staging, on the CPU: the prefill lane's pools are the owners'
    /dev/shm pools, as a GPU's are the owners' pools mapped from other GPUs (peer_copy.py), and its
    forward writes them directly. Nothing is staged, copied or sent over gRPC."""
    with split_gateway(tiny_models, lanes, "direct") as gw:
        assert set(gw.wiring.mode_by_pool.values()) == {"direct"}
        received_before = owner_bytes_received(gw)
        assert run_all(gw, prompts) == expected
        assert gw.lanes[0].kv_bytes_copied == 0
        assert owner_bytes_received(gw) == received_before


@pytest.mark.parametrize("top_k", [0, 7])
def test_sampling_through_split_equals_offline(tiny_models, lanes, top_k):
    """Seeded output is the same split and colocated, and equal to no draft at all (docs/engine.md,
    "Seeds"): only draft tokens cross the wire."""
    prompt = [4, 8, 15, 16, 23, 42]
    sampling = SamplingParams(temperature=0.8, top_p=0.9, top_k=top_k, seed=99)
    spec = RequestSpec(tuple(prompt), max_tokens=20, stop_at_eos=False, sampling=sampling)
    expected = offline_outputs(engine_options(*tiny_models), [spec])
    assert offline_outputs(engine_options(tiny_models[0], "none", k=0), [spec]) == expected
    with split_gateway(tiny_models, lanes, "auto") as gw:
        ids, msgs = Client(gw.address).generate(
            token_ids=generate_pb2.TokenIds(ids=prompt),
            max_tokens=20,
            stop_at_eos=False,
            sampling=generate_pb2.SamplingParams(temperature=0.8, top_p=0.9, top_k=top_k, seed=99),
        )
        assert [ids] == expected
        assert msgs[-1].usage.draft_tokens > 0
        assert gw.info.topology == "split"


def test_call_channel_and_unary_grpc_give_the_same_tokens(tiny_models, lanes, prompts, expected):
    """The router's fast path (call channel: compact columns, request intros, block-table deltas)
    and the unary gRPC path drive the same lanes to the same tokens; the channel is really used."""
    from verifypd.core.assembly import connect_lanes
    from verifypd.gateway.server import load_codec
    from verifypd.lanes.rpc.lane_wiring import wire_pools
    from verifypd.router.router import Router

    options = engine_options(*tiny_models)
    outputs = {}
    for channel in (True, False):
        clients = connect_lanes(lanes.addrs, secret=lanes.secret)
        for c in clients:
            c._use_channel = channel
        wire_pools(*clients, kv_transport="handle")
        router = Router(*clients, decode=load_codec(options.target).decode, eos_token_ids=(), config=options.config)
        ids = [router.add_request(RequestSpec(tuple(p), max_tokens=24, stop_at_eos=False)) for p in prompts]
        tokens = {i: [] for i in ids}
        while router.has_work():
            for out in router.step():
                tokens[out.request_id] += out.token_ids
        outputs[channel] = [tokens[i] for i in ids]
        assert all((c._client is not None) == channel for c in clients)
        if channel:  # finished requests were released: the mirrors hold nothing
            assert all(not c._mirror.keys and not c._mirror.tables for c in clients)
        for c in clients:
            c.close()
    assert outputs[True] == outputs[False] == expected


def test_pipelined_pdv_over_lane_processes_gives_offline_tokens(tiny_models, lanes, prompts, expected):
    """pdv with pipelining across the lane processes: one group's draft beside the other's verify,
    and prefill calls beside decode calls; greedy tokens stay those of offline decoding."""
    from verifypd.core.assembly import connect_lanes
    from verifypd.gateway.server import load_codec
    from verifypd.lanes.rpc.lane_wiring import wire_pools
    from verifypd.router.router import Router

    options = engine_options(*tiny_models)
    clients = connect_lanes(lanes.addrs, secret=lanes.secret)
    wire_pools(*clients, kv_transport="handle")
    router = Router(
        *clients,
        decode=load_codec(options.target).decode,
        eos_token_ids=(),
        config=options.config.updated(schedule="pdv", pipeline=True),
    )
    tokens, pending = {}, [RequestSpec(tuple(p), max_tokens=24, stop_at_eos=False) for p in prompts]
    order = []
    while pending or router.has_work():
        if pending:  # one request joins per step: prefill keeps meeting decode work
            spec = pending.pop(0)
            rid = router.add_request(spec)
            tokens[rid] = []
            order.append(rid)
        for out in router.step():
            tokens[out.request_id] += out.token_ids
    ctx = router.context
    assert ctx.prefill_thread is not None and ctx.draft_thread is not None  # both overlaps happened
    router.close()
    for c in clients:
        c.close()
    assert [tokens[r] for r in order] == expected


def test_pdv_switching_pipelined_and_lock_step_over_lane_processes(tiny_models, lanes, prompts, expected, monkeypatch):
    """Adaptive pdv chooses pipelined or lock-step step by step; across lane processes every switch
    (held drafts verified alone first) keeps the offline tokens."""
    import itertools

    from verifypd.core.assembly import connect_lanes
    from verifypd.gateway.server import load_codec
    from verifypd.lanes.rpc.lane_wiring import wire_pools
    from verifypd.router import k_decision as k_decision_module
    from verifypd.router.router import Router

    choices = itertools.cycle([True, True, False, True, False, False, True])
    monkeypatch.setattr(k_decision_module, "pipelining_pays", lambda *args: next(choices))
    options = engine_options(*tiny_models)
    clients = connect_lanes(lanes.addrs, secret=lanes.secret)
    wire_pools(*clients, kv_transport="handle")
    router = Router(
        *clients,
        decode=load_codec(options.target).decode,
        eos_token_ids=(),
        config=options.config.updated(schedule="pdv", pipeline=True, adaptive=True, k_min=0),
    )
    plans = []
    plan = router.scheduler.plan

    def recording_plan(config, costs):
        result = plan(config, costs)
        plans.append(result.pipelined)
        return result

    router.scheduler.plan = recording_plan
    ids = [router.add_request(RequestSpec(tuple(p), max_tokens=24, stop_at_eos=False)) for p in prompts]
    tokens = {i: [] for i in ids}
    while router.has_work():
        for out in router.step():
            tokens[out.request_id] += out.token_ids
    router.close()
    for c in clients:
        c.close()
    assert any(plans) and not all(plans)  # both kinds of step ran
    assert [tokens[i] for i in ids] == expected


def test_plain_decoding_chains_over_the_lane_rpc_under_concurrent_load(tiny_models, lanes, prompts):
    """No speculation (k = 0), clients in parallel, arriving and finishing at different times: the
    core chains plain steps over the verify lane's call channel (each sent before the reply of the
    one before, fed on the lane's device; arrivals joining from the host) and every stream is the
    offline engine's greedy output (with speculation or without: the same tokens)."""
    import threading

    from verifypd.gateway.server import build_split

    lengths = [10 + 7 * (i % 3) for i in range(len(prompts))]  # finishes spread: arrivals mid-chain
    specs = [RequestSpec(tuple(p), max_tokens=m, stop_at_eos=False) for p, m in zip(prompts, lengths)]
    want = offline_outputs(engine_options(*tiny_models), specs)
    assert offline_outputs(engine_options(*tiny_models, k=0), specs) == want
    options = engine_options(*tiny_models, k=0)
    with build_split(lanes.addrs, options, kv_transport="handle", lane_secret=lanes.secret).start() as gw:
        got: dict[int, list[int]] = {}

        def client(n: int) -> None:
            c = Client(gw.address)
            try:
                for i in range(n, len(prompts), 3):
                    got[i] = c.generate(**greedy_request(prompts[i], lengths[i]))[0]
            finally:
                c.close()

        threads = [threading.Thread(target=client, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got.get(i) for i in range(len(prompts))] == want
        steps, admitting, breaks = gw.core_loop.call(lambda r: (r.overlap.steps, r.overlap.admitting, r.overlap.breaks))
        assert steps >= 20 and admitting >= 1, (steps, admitting, breaks)
