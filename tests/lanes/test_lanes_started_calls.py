"""Started lane calls over the call channel (split serving): the router sends a step's
prefill call to the prefill lane while the verify lane still computes, as it launches an
in-process prefill beside an in-process verify (docs/services.md "Prefill beside decode across
lane processes"). In-process stub lanes here; the real lane processes in the last test."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from services_helpers import (
    engine_options,
    offline_outputs,
    random_prompts,
)
from test_lanes_call_channel import GREEDY, TARGET, handle, verify_item

from verifypd.domain.lanes import LaneError, PrefillItem
from verifypd.lanes.rpc import call_codec as cc
from verifypd.lanes.rpc.call_channel import CallClient, CallServer
from verifypd.lanes.rpc.lane_client import GrpcPrefillLane, GrpcVerifyLane
from verifypd.v1 import lanes_pb2

DELAY_S = 0.3
WAIT_S = 60  # a call waiting for another one: this long only when it never comes (a hang)


def slow_server(log: list, name: str, refuse_first: bool = False, hold=None):
    """A lane stub that takes DELAY_S per call (or until `hold()` returns) and logs (name, start, end);
    verify calls answer accepted 0 and token 100 + call number, prefill calls the first token
    200 + call number."""

    def handler(call, state):
        t0 = time.perf_counter()
        hold() if hold is not None else time.sleep(DELAY_S)
        state.calls += 1
        log.append((name, t0, time.perf_counter()))
        n = len(call.batch.keys_u32) // 4
        if refuse_first and state.calls == 1:
            return lanes_pb2.LaneReply(status_code=13, error="stub fault")
        if call.method == lanes_pb2.LANE_METHOD_PREFILL:
            return lanes_pb2.LaneReply(tokens_u32=cc.u32([200 + state.calls] * n))
        return lanes_pb2.LaneReply(count_u32=cc.u32([0] * n), tokens_u32=cc.u32([100 + state.calls] * n))

    return CallServer(handler, lambda: SimpleNamespace(calls=0), "127.0.0.1", 0, None)


def stub_client(cls, server):
    """A lane client whose work path talks to `server` (no gRPC channel needed)."""
    lane = cls.__new__(cls)
    lane.lane, lane.addr, lane._use_channel, lane.producer = cls.lane, f"127.0.0.1:{server.port}", True, None
    lane._call_lock, lane._lock, lane.calls, lane.wire_bytes = threading.Lock(), threading.Lock(), 0, 0
    lane._mirror, lane._pending = cc.ChannelMirror(), []
    lane.writes, lane.kv_bytes_copied, lane.kv_written_event = 0, 0, b""
    lane._client = CallClient("127.0.0.1", server.port, None, WAIT_S)
    lane._client.connect()
    lane._connected_client = lambda: lane._client
    return lane


def prefill_item(rid):
    return PrefillItem(rid, [5, 6, 7], 0, handle(TARGET, [1]), None, True, GREEDY)


@pytest.fixture
def two_lanes():
    log: list = []
    servers = [slow_server(log, "verify"), slow_server(log, "prefill")]
    yield log, stub_client(GrpcVerifyLane, servers[0]), stub_client(GrpcPrefillLane, servers[1])
    for s in servers:
        s.close()


def test_a_started_verify_and_prefill_compute_at_once():
    """Each lane holds its call until the other lane's call has arrived too (a barrier): the verify
    lane cannot answer before the prefill call is sent, so verify_start must return without its
    reply, and the two calls can only finish by computing at once (one after the other, the
    barrier would break after WAIT_S and the calls fail)."""
    log: list = []
    both = threading.Barrier(2, timeout=WAIT_S)
    servers = [slow_server(log, "verify", hold=both.wait), slow_server(log, "prefill", hold=both.wait)]
    try:
        verify, prefill = stub_client(GrpcVerifyLane, servers[0]), stub_client(GrpcPrefillLane, servers[1])
        assert verify.starts_async and prefill.starts_async
        started = verify.verify_start([verify_item("a", 1, [3])])
        assert not started.ready()  # returned before the lane answered (it cannot answer yet)
        beside = prefill.prefill_start([prefill_item("b")])
        assert [o.new_tokens for o in started.result()] == [[101]]
        assert [o.first_token for o in beside.result()] == [201]
        (_, v0, v1), (_, p0, p1) = sorted(log)[::-1]  # ("verify", ...) then ("prefill", ...)
        assert p0 < v1 and v0 < p1, "the two lanes' calls did not overlap"
        assert prefill.writes == 1 and verify.calls == 1 and prefill.calls == 1
    finally:
        for s in servers:
            s.close()


def test_a_call_nobody_waited_for_is_settled_before_the_next(two_lanes):
    """An error path may abandon a started call (the router raised before reading it): the next
    call on that lane reads the old reply first, so replies never answer the wrong call, and a
    prefill settled that way still counts as a KV write (owners must wait for it)."""
    _, verify, prefill = two_lanes
    verify.verify_start([verify_item("a", 1, [3])])  # abandoned
    assert [o.new_tokens for o in verify.verify([verify_item("a", 2, [3])])] == [[102]]
    prefill.prefill_start([prefill_item("b")])  # abandoned
    assert prefill.writes == 0
    assert [o.first_token for o in prefill.prefill([prefill_item("c")])] == [202]
    assert prefill.writes == 2


def test_a_started_call_that_fails_raises_lane_error_on_result():
    log: list = []
    server = slow_server(log, "verify", refuse_first=True)
    try:
        verify = stub_client(GrpcVerifyLane, server)
        started = verify.verify_start([verify_item("a", 1, [3])])
        with pytest.raises(LaneError, match="Verify failed: INTERNAL: stub fault"):
            started.result()
        with pytest.raises(LaneError):  # the same error again, not a read of the next reply
            started.result()
    finally:
        server.close()


@pytest.mark.slow
def test_router_sends_the_prefill_while_the_verify_lane_computes(tiny_models):
    """The real router over lane clients of three lane processes: a step with both decode and
    prefill work sends the prefill call before it reads the verify call's reply (before this, a
    lock-step step sent its prefill call only after decode, adding its whole round trip to the
    step), and the tokens stay the offline engine's."""
    from verifypd.core.assembly import connect_lanes
    from verifypd.domain.requests import RequestSpec
    from verifypd.lanes.processes import LaneProcesses
    from verifypd.lanes.rpc.lane_wiring import wire_pools
    from verifypd.router.router import Router

    options = engine_options(*tiny_models)
    prompts = random_prompts(6, seed=5, max_len=30)
    specs = [RequestSpec(tuple(p), max_tokens=12, stop_at_eos=False) for p in prompts]
    expected = offline_outputs(options, specs)
    procs = LaneProcesses(options)
    procs.start(timeout_s=120)
    try:
        clients = connect_lanes(procs.addrs, secret=procs.secret)
        prefill, _, verify = clients
        wire_pools(*clients, kv_transport="handle")
        beside = []  # per prefill call: was a verify call in flight when it was sent?
        plain_start = prefill.prefill_start

        def watched_start(items):
            beside.append(any(not p.done for p in verify._pending))
            return plain_start(items)

        prefill.prefill_start = watched_start
        router = Router(*clients, decode=None, eos_token_ids=(), config=options.config)
        ids = [router.add_request(specs[0])]
        tokens = {ids[0]: []}
        steps = 0
        while router.has_work():
            if steps == 2:  # the others arrive while the first decodes
                for spec in specs[1:]:
                    ids.append(router.add_request(spec))
                    tokens[ids[-1]] = []
            for out in router.step():
                tokens[out.request_id] += out.token_ids
            steps += 1
        assert [tokens[i] for i in ids] == expected
        assert any(beside), "no prefill call was sent while a verify call was in flight"
        for c in clients:
            c.close()
    finally:
        procs.terminate()


def test_a_draft_lane_that_proposes_nothing_is_not_called():
    """`--draft none` over lane processes: the draft lane's answer (no proposals) is known, so a
    k = 0 split server does not pay a draft round trip before every verify call."""
    from verifypd.domain.lanes import DraftItem
    from verifypd.lanes.rpc.lane_client import GrpcDraftLane

    lane = GrpcDraftLane.__new__(GrpcDraftLane)
    lane._info_pb = lanes_pb2.LaneInfo(lane="draft", draft_model="none")
    lane.calls, lane.handoff = 0, None

    def no_wire(*_):
        raise AssertionError("the draft lane was called")

    lane._start = lane._work = no_wire
    items = [DraftItem("a", [3], 4, None, 2, GREEDY), DraftItem("b", [5, 6], 7, None, 1, GREEDY)]
    outs = lane.draft(items)
    assert [(o.request_id, list(o.draft_tokens), o.draft_probs, o.resync_from) for o in outs] == [
        ("a", [], None, None),
        ("b", [], None, None),
    ]
    lane._info_pb = lanes_pb2.LaneInfo(lane="draft", draft_model="ngram")  # a draft that may propose: called
    with pytest.raises(AssertionError, match="was called"):
        lane.draft(items)
