"""The call channel (lanes.proto LaneCall/LaneReply): codec round trips, block-table deltas,
validation naming fields, the connection's auth and error handling. In-process, no model."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest

from verifypd.domain.lanes import DraftItem, KvHandle, LaneError, PrefillItem, VerifyItem, VerifyOutput
from verifypd.domain.requests import SamplingParams
from verifypd.lanes.rpc import call_codec as cc
from verifypd.lanes.rpc import call_decode as cd
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.lanes.rpc.call_channel import CallClient, CallServer, ChannelClosed
from verifypd.v1 import lanes_pb2

TARGET, DRAFT = ("target-00000000000a", 3), ("draft-00000000000b", 5)
LIMITS = lv.LaneLimits(100, 256, {"target": lv.PoolLimits(*TARGET, 64, 4), "draft": lv.PoolLimits(*DRAFT, 64, 4)})
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=0.75, top_k=5, seed=11)  # float32-exact
VERIFY, DRAFT_M, PREFILL = lanes_pb2.LANE_METHOD_VERIFY, lanes_pb2.LANE_METHOD_DRAFT, lanes_pb2.LANE_METHOD_PREFILL


def handle(pool, blocks):
    return KvHandle(pool[0], pool[1], tuple(blocks), 0, 0)


def verify_item(rid, start, blocks, drafts=(1, 2), sampling=GREEDY):
    drafts = drafts if isinstance(drafts, cc.HandoffTokens) else list(drafts)
    return VerifyItem(rid, 7, start, drafts, handle(TARGET, blocks), sampling)


def round_trip(mirror, state, method, items, encode):
    call = lanes_pb2.LaneCall(method=method, batch=encode(mirror, items))
    call = lanes_pb2.LaneCall.FromString(call.SerializeToString())
    return cd.decode(call.method, call.batch, state, LIMITS), call


def test_verify_round_trip_and_deltas_carry_only_what_changed():
    mirror, state = cc.ChannelMirror(), cd.ChannelState()
    items = [verify_item("a", 5, [3, 4]), verify_item("b", 9, [8, 9, 10], drafts=(), sampling=SAMPLED)]
    got, call = round_trip(mirror, state, VERIFY, items, lambda m, i: cc.encode_verify(m, i, None))
    assert [
        (g.request_id, g.pending_token, g.start_pos, list(g.draft_tokens), g.target_kv.block_ids, g.sampling)
        for g in got
    ] == [("a", 7, 5, [1, 2], (3, 4), GREEDY), ("b", 7, 9, [], (8, 9, 10), SAMPLED)]
    assert len(call.batch.intros) == 2
    # Next step: request a grew by one block, b unchanged: no intros, one block id on the wire.
    items = [verify_item("a", 8, [3, 4, 20]), verify_item("b", 10, [8, 9, 10], drafts=(), sampling=SAMPLED)]
    got, call = round_trip(mirror, state, VERIFY, items, lambda m, i: cc.encode_verify(m, i, None))
    assert not call.batch.intros and list(cc.from_u32(call.batch.target_blocks.added_u32)) == [20]
    assert [g.target_kv.block_ids for g in got] == [(3, 4, 20), (8, 9, 10)]
    # A rebuilt table (preemption, recompute) keeps only the common prefix.
    got, call = round_trip(
        mirror, state, VERIFY, [verify_item("a", 2, [3, 30])], lambda m, i: cc.encode_verify(m, i, None)
    )
    assert list(cc.from_u32(call.batch.target_blocks.keep_u32)) == [1]
    assert got[0].target_kv.block_ids == (3, 30)


def test_prefill_and_draft_round_trip_with_both_pools():
    mirror, state = cc.ChannelMirror(), cd.ChannelState()
    pre = [
        PrefillItem("a", [5, 6, 7], 0, handle(TARGET, [1]), handle(DRAFT, [2]), True, GREEDY),
        PrefillItem("b", [9] * 6, 4, handle(TARGET, [3, 4, 5]), handle(DRAFT, [6, 7, 8]), False, SAMPLED),
    ]
    got, _ = round_trip(mirror, state, PREFILL, pre, cc.encode_prefill)
    assert [(g.token_ids, g.start_pos, g.target_kv.block_ids, g.draft_kv.block_ids, g.sample_first) for g in got] == [
        ([5, 6, 7], 0, (1,), (2,), True),
        ([9] * 6, 4, (3, 4, 5), (6, 7, 8), False),
    ]
    dr = [DraftItem("a", [8], 3, handle(DRAFT, [2, 11]), 4, GREEDY)]
    got, call = round_trip(mirror, state, DRAFT_M, dr, cc.encode_draft)
    assert (got[0].input_tokens, got[0].k, got[0].draft_kv.block_ids) == ([8], 4, (2, 11))
    assert not call.batch.intros  # a was introduced by the prefill call on this channel
    mirror.release(["a"])
    _, call = round_trip(
        mirror, state, DRAFT_M, [DraftItem("b", [1], 10, handle(DRAFT, [6, 7, 8]), 1, SAMPLED)], cc.encode_draft
    )
    state.release(call.batch.released)  # as the lane does after the call
    assert list(call.batch.released) == [0] and set(state.requests) == {1}


def bad(method, batch, state=None, **kw):
    with pytest.raises(lv.LaneInvalid) as exc:
        cd.decode(method, batch, state or cd.ChannelState(), LIMITS, **kw)
    return exc.value


def fresh_verify(**changes):
    mirror = cc.ChannelMirror()
    batch = cc.encode_verify(mirror, [verify_item("a", 5, [3, 4])], None)
    for name, value in changes.items():
        setattr(batch, name, value)
    return batch


def test_bad_calls_name_the_field():
    assert "batch.tokens_u32: token id 100" in str(bad(VERIFY, fresh_verify(tokens_u32=cc.u32([1, 100]))))
    assert "batch.pending_u32" in str(bad(VERIFY, fresh_verify(pending_u32=cc.u32([555]))))
    assert "batch.start_pos_u32" in str(bad(VERIFY, fresh_verify(start_pos_u32=b"\x00")))
    e = bad(VERIFY, fresh_verify(start_pos_u32=cc.u32([7])))  # 7 + 3 positions > 2 blocks of 4
    assert "cannot hold 10 positions" in str(e)
    batch = fresh_verify()
    batch.target_blocks.generation = 4
    e = bad(VERIFY, batch)
    assert e.code.name == "FAILED_PRECONDITION" and "a handle from before a lane restart" in str(e)
    batch = fresh_verify()
    del batch.intros[:]
    assert "key 0 is not held" in str(bad(VERIFY, batch))
    batch = fresh_verify(token_count_u32=cc.u32([17]), tokens_u32=cc.u32([1] * 17))
    assert "at most 16 drafts" in str(bad(VERIFY, batch))
    draft = cc.encode_draft(cc.ChannelMirror(), [DraftItem("a", [8], 3, handle(DRAFT, [2]), 1, GREEDY)])
    draft.k_u32 = cc.u32([0])
    assert "batch.k_u32[0]: must be in [1, 16]" in str(bad(DRAFT_M, draft))
    draft.k_u32 = cc.u32([1])
    draft.handoff_slot = 1
    assert "no handoff buffer" in str(bad(DRAFT_M, draft))
    draft.handoff_slot = 3
    assert "must be 0, 1 or 2" in str(bad(DRAFT_M, draft))


def test_keep_beyond_the_held_table_is_refused():
    state = cd.ChannelState()
    mirror = cc.ChannelMirror()
    cd.decode(VERIFY, cc.encode_verify(mirror, [verify_item("a", 1, [3])], None), state, LIMITS)
    batch = cc.encode_verify(mirror, [verify_item("a", 1, [3])], None)
    batch.target_blocks.keep_u32 = cc.u32([2])
    batch.target_blocks.added_count_u32 = cc.u32([0])
    assert "keep_u32[0]: 2 kept, the channel holds 1" in str(bad(VERIFY, batch, state))


def test_handoff_drafts_are_rows_of_one_slot():
    mirror = cc.ChannelMirror()
    items = [verify_item("a", 2, [3, 4], drafts=cc.HandoffTokens(2, 0, 3)), verify_item("b", 1, [9], drafts=(4,))]
    batch = cc.encode_verify(mirror, items, None)
    assert batch.handoff_slot == 2 and list(cc.from_u32(batch.tokens_u32)) == [4]
    got = cd.decode(VERIFY, batch, cd.ChannelState(), LIMITS, handoff=(8, 16))
    assert isinstance(got[0].draft_tokens, cc.HandoffTokens) and (
        got[0].draft_tokens.row,
        len(got[0].draft_tokens),
    ) == (0, 3)
    assert list(got[1].draft_tokens) == [4]
    assert "no draft handoff buffer" in str(bad(VERIFY, batch))
    assert "drafts <= 2" in str(bad(VERIFY, cc.encode_verify(cc.ChannelMirror(), items, None), handoff=(1, 2)))
    mixed = [
        verify_item("a", 5, [3, 4], drafts=cc.HandoffTokens(1, 0, 3)),
        verify_item("b", 1, [9], drafts=cc.HandoffTokens(2, 1, 3)),
    ]
    with pytest.raises(ValueError, match="one handoff slot"):
        cc.encode_verify(cc.ChannelMirror(), mixed, None)
    with pytest.raises(TypeError):
        list(cc.HandoffTokens(1, 0, 2))


def test_reply_shapes_are_checked_on_the_router_side():
    items = [verify_item("a", 5, [3]), verify_item("b", 5, [3])]
    good = cd.verify_reply([VerifyOutput("a", 1, [1, 2]), VerifyOutput("b", 0, [3])])
    assert [o.new_tokens for o in cc.decode_verify(items, good)] == [[1, 2], [3]]
    with pytest.raises(ValueError):
        cc.decode_verify(items, lanes_pb2.LaneReply(count_u32=cc.u32([1]), tokens_u32=cc.u32([1, 2])))
    with pytest.raises(ValueError):
        cc.decode_verify(items, lanes_pb2.LaneReply(count_u32=cc.u32([1, 0]), tokens_u32=cc.u32([1, 2])))


# -- the connection ----------------------------------------------------------------------------
def echo_server(secret):
    """Answers VERIFY calls by echoing item counts; an item count of 3 is refused (INVALID_ARGUMENT)."""

    def handler(call, state):
        n = len(call.batch.keys_u32) // 4
        if n == 3:
            return lanes_pb2.LaneReply(status_code=3, error="batch: three is refused")
        state.calls += 1
        return lanes_pb2.LaneReply(count_u32=cc.u32([state.calls] * n))

    return CallServer(handler, lambda: SimpleNamespace(calls=0), "127.0.0.1", 0, secret)


def call_with(client, n):
    batch = lanes_pb2.PackedBatch(keys_u32=cc.u32(range(n)))
    return client.call(lanes_pb2.LaneCall(method=VERIFY, batch=batch))


def test_connection_state_lives_and_dies_with_the_connection():
    server = echo_server("s3cret")
    try:
        client = CallClient("127.0.0.1", server.port, "s3cret", 5.0)
        assert list(cc.from_u32(call_with(client, 2).count_u32)) == [1, 1]
        assert list(cc.from_u32(call_with(client, 1).count_u32)) == [2]  # same connection, same state
        reply = call_with(client, 3)
        assert reply.status_code == 3 and "three" in reply.error and not client.connected
        assert list(cc.from_u32(call_with(client, 1).count_u32)) == [1]  # reconnected: fresh state
        assert client.bytes > 0
    finally:
        server.close()


def test_wrong_secret_is_refused():
    server = echo_server("s3cret")
    try:
        with pytest.raises((ChannelClosed, OSError)):
            call_with(CallClient("127.0.0.1", server.port, "guess", 5.0), 1)
        with pytest.raises((ChannelClosed, OSError)):
            call_with(CallClient("127.0.0.1", server.port, None, 5.0), 1)
    finally:
        server.close()


def test_garbage_frames_drop_only_that_connection():
    server = echo_server(None)
    try:
        raw = socket.create_connection(("127.0.0.1", server.port))
        raw.recv(16)
        raw.sendall(bytes(32) + b"\x05\x00\x00\x00" + b"\xff" * 5)  # proof, then a frame that is no LaneCall
        assert raw.recv(16) == b""  # closed by the lane
        client = CallClient("127.0.0.1", server.port, None, 5.0)
        assert list(cc.from_u32(call_with(client, 1).count_u32)) == [1]
    finally:
        server.close()


def test_lane_client_turns_channel_errors_into_lane_errors():
    from verifypd.lanes.rpc.lane_client import GrpcVerifyLane

    lane = GrpcVerifyLane.__new__(GrpcVerifyLane)  # only the work path: no gRPC channel needed
    lane.lane, lane.addr, lane._use_channel, lane.producer = "verify", "127.0.0.1:1", True, None
    lane._call_lock, lane._lock, lane.calls, lane.wire_bytes = threading.Lock(), threading.Lock(), 0, 0
    lane._mirror, lane._pending = cc.ChannelMirror(), []
    server = echo_server(None)
    try:
        lane._client = CallClient("127.0.0.1", server.port, None, 5.0)
        lane._client.connect()
        lane._connected_client = lambda: lane._client
        items = [verify_item(f"r{i}", 1, [3]) for i in range(3)]  # three items: refused by the stub
        with pytest.raises(LaneError, match="Verify failed: INVALID_ARGUMENT: batch: three is refused"):
            lane.verify(items)
        server.close()
        lane._client.connect = lambda: (_ for _ in ()).throw(ConnectionRefusedError("refused"))
        with pytest.raises(LaneError, match="UNAVAILABLE"):
            lane.verify(items[:1])
    finally:
        server.close()
