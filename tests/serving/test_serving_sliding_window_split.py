"""Sliding-window KV through the serving processes. Split topology: the lane processes announce their
pools' window (the lane RPC's PoolDescriptor.window), so the router frees the blocks behind it there
too; a long generation of a tiny Mistral (every layer slides) over both KV transports holds few blocks,
is exactly transformers' greedy output, and ServerInfo says "freed". `verifypd serve`: the engine-core
process hands the fields to the gateway (its ready message), GetServerInfo answers them."""

from __future__ import annotations

import random

import pytest
import torch
from family_checkpoints import WINDOW, hf_greedy_through_eos, write_family
from services_helpers import BLOCK_SIZE, Client, Server, engine_options, free_port, greedy_request, serve_cmd

from verifypd.v1 import generate_pb2

pytestmark = pytest.mark.slow  # lane processes (tests/README.md)

DRAFT, K, NEW_TOKENS = "self:1", 3, 40


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from verifypd.lanes.processes import LaneProcesses

    path = str(write_family(tmp_path_factory.mktemp("mistral_split"), "mistral", seed=5))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 100) for _ in range(n)] for n in (11, 7)]
    expected = [hf_greedy_through_eos(hf, p, NEW_TOKENS) for p in prompts]
    procs = LaneProcesses(engine_options(path, DRAFT, k=K))
    procs.start(timeout_s=120)
    yield path, procs, prompts, expected
    procs.terminate()


@pytest.mark.parametrize("kv_transport", ["handle", "copy"])
def test_split_lanes_free_behind_the_window(setup, kv_transport):
    from verifypd.gateway.server import build_split

    path, procs, prompts, expected = setup
    options = engine_options(path, DRAFT, k=K)
    with build_split(procs.addrs, options, kv_transport=kv_transport, lane_secret=procs.secret).start() as gw:
        ctx = gw.router.context
        assert (ctx.target_pool.window, ctx.draft_pool.window) == (WINDOW, WINDOW)
        assert (gw.info.sliding_window, gw.info.sliding_window_kv) == (WINDOW, "freed")
        held: list[int] = []
        release = ctx.release_out_of_window

        def recording(seq):
            release(seq)
            held.append(ctx.target_blocks.num_used)

        ctx.release_out_of_window = recording
        client = Client(gw.address)
        got = [client.generate(**greedy_request(p, max_tokens=NEW_TOKENS))[0] for p in prompts]
        info = client.gen.GetServerInfo(generate_pb2.ServerInfoRequest(), timeout=10)
        client.close()
    assert got == expected
    assert (info.sliding_window, info.sliding_window_kv) == (WINDOW, "freed")
    whole = -(-(len(prompts[0]) + NEW_TOKENS) // BLOCK_SIZE)
    assert held and max(held) <= -(-(WINDOW + K + 1) // BLOCK_SIZE) + 1 < whole


def test_serve_answers_the_fields_from_the_core_process(setup):
    path, _, prompts, expected = setup
    port = free_port()
    server = Server(serve_cmd((path, "self:1"), port)).wait_ready()
    try:
        client = Client(f"127.0.0.1:{port}")
        info = client.gen.GetServerInfo(generate_pb2.ServerInfoRequest(), timeout=10)
        got = client.generate(**greedy_request(prompts[0], max_tokens=NEW_TOKENS))[0]
        client.close()
    finally:
        server.stop()
    assert (info.sliding_window, info.sliding_window_kv) == (WINDOW, "freed")
    assert got == expected[0]
