"""Pipelined verify calls (lanes/rpc/call_pipeline.py): a plain decoding step sent over the call
channel before the reply of the step before it, its pending tokens fed by reference to that step's
tokens on the verify lane's device.

In-process (fast): the feed's checks name their fields; the client sends call N + 1 before it reads
N's reply and a pipelined server launches N + 1 before it finishes N. Real lane processes (slow): the
router's chain over split lanes gives the offline engine's greedy tokens, with and without
speculation; a fed call reads exactly the rows it names; the verify lane killed mid-chain loses no
request and no token."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from services_helpers import engine_options, offline_outputs, random_prompts
from test_lanes_call_channel import GREEDY, TARGET, handle
from test_lanes_started_calls import stub_client

from verifypd.domain.lanes import HostTokens, KvHandle, LaneError, TokenFeed, VerifyItem
from verifypd.domain.requests import RequestSpec
from verifypd.lanes.rpc import call_codec as cc
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.lanes.rpc.call_channel import CallServer
from verifypd.lanes.rpc.call_pipeline import ChannelTokens, DeferredReply, FedTokens, feed_fields
from verifypd.lanes.rpc.lane_client import GrpcVerifyLane
from verifypd.v1 import lanes_pb2

WAIT_S = 60  # a call waiting for another one: this long only when it never comes (a hang)


def plain_item(rid, start, blocks=(1,), pending=7):
    return VerifyItem(rid, pending, start, (), handle(TARGET, blocks), GREEDY)


# -- the feed's checks -----------------------------------------------------------------------
def fed_batch(call: int, rows) -> lanes_pb2.PackedBatch:
    return lanes_pb2.PackedBatch(feed_call=call, feed_rows_u32=cc.u32(rows))


def test_the_lane_takes_only_the_previous_calls_tokens_and_names_the_field():
    fed = FedTokens()
    assert fed.feed(lanes_pb2.PackedBatch(), 2) is None  # pending tokens in pending_u32
    with pytest.raises(lv.LaneInvalid, match="batch.feed_call: 4 is not the previous") as exc:
        fed.feed(fed_batch(4, [0]), 1)  # nothing kept yet
    assert exc.value.code == lv.grpc.StatusCode.FAILED_PRECONDITION
    tokens = object()
    fed.keep(5, tokens, 3)
    with pytest.raises(lv.LaneInvalid, match="batch.feed_call: 4 is not the previous"):
        fed.feed(fed_batch(4, [0]), 1)  # an older call: its tokens are gone
    with pytest.raises(lv.LaneInvalid, match=r"batch.feed_rows_u32: 8 bytes, expected 12"):
        fed.feed(fed_batch(5, [0, 1]), 3)
    with pytest.raises(lv.LaneInvalid, match="batch.feed_rows_u32: row 3 is outside call 5's 3"):
        fed.feed(fed_batch(5, [2, 3]), 2)
    with pytest.raises(lv.LaneInvalid, match="batch.feed_rows_u32: given without batch.feed_call"):
        fed.feed(lanes_pb2.PackedBatch(feed_rows_u32=cc.u32([0])), 1)
    feed = fed.feed(fed_batch(5, [2, 0]), 2)
    assert feed is not None and feed.sources == (tokens,) and feed.rows == (2, 0)
    # rows NONE_U32: the item's pending token came in pending_u32 (a host token), after the call's rows
    batch = fed_batch(5, [cc.NONE_U32, 1, cc.NONE_U32])
    batch.pending_u32 = cc.u32([40, 0, 41])
    feed = fed.feed(batch, 3)
    assert feed is not None and feed.sources == (tokens, (40, 41)) and feed.rows == (3, 1, 4)
    assert isinstance(feed.sources[1], HostTokens)
    fed.keep(6, None, 2)  # a call that left no tokens (drafts, sampling controls): nothing feeds from it
    with pytest.raises(lv.LaneInvalid, match="batch.feed_call: 6 is not the previous"):
        fed.feed(fed_batch(6, [0]), 1)


def test_the_router_feeds_only_from_the_last_call_on_the_same_connection():
    client, other = object(), object()
    source = ChannelTokens(client, 9, 2)
    assert feed_fields(TokenFeed((source,), (1, 0)), client, 9, 2) == (9, cc.u32([1, 0]), None)
    # host tokens after the call's rows: their rows go as NONE_U32, their tokens as pending tokens
    mixed = TokenFeed((source, HostTokens((40, 41))), (3, 0, 2))
    assert feed_fields(mixed, client, 9, 3) == (9, cc.u32([cc.NONE_U32, 0, cc.NONE_U32]), [41, 0, 40])
    with pytest.raises(ValueError, match=r"one row in \[0, 4\)"):
        feed_fields(TokenFeed((source, HostTokens((40, 41))), (4,)), client, 9, 1)
    with pytest.raises(ValueError, match="names call 9, not the previous verify call on this connection"):
        feed_fields(TokenFeed((source,), (0,)), other, 9, 1)  # a reconnect since
    with pytest.raises(ValueError, match="names call 9"):
        feed_fields(TokenFeed((source,), (0,)), client, 10, 1)
    with pytest.raises(ValueError, match="one row in"):
        feed_fields(TokenFeed((source,), (2,)), client, 9, 1)
    with pytest.raises(ValueError, match="only by its own previous call"):
        feed_fields(TokenFeed((source, source), (0,)), client, 9, 1)


# -- pipelining over a stub lane ---------------------------------------------------------------
def pipelined_stub(log: list, arrived: threading.Condition):
    """A pipelined stub verify lane: each call is 'launched' at once (logged); its reply is finished
    on the reply thread, and only once the call after it has arrived (or after WAIT_S: then the
    reply says so). Replies give token 100 + the row's fed token (pending_u32 when not fed)."""

    def handler(call, state):
        n = len(call.batch.keys_u32) // 4
        with arrived:
            log.append(("launch", call.call_id, call.batch.feed_call))
            arrived.notify_all()
        rows = list(cc.from_u32(call.batch.feed_rows_u32)) if call.batch.feed_call else None
        pending = list(cc.from_u32(call.batch.pending_u32))
        tokens = [state.last[r] for r in rows] if rows is not None else pending
        state.last = [100 + t for t in tokens]
        last = list(state.last)

        def finish():
            with arrived:
                ok = arrived.wait_for(lambda: any(e[1] > call.call_id for e in log), timeout=WAIT_S)
                log.append(("reply", call.call_id, ok))
            return lanes_pb2.LaneReply(count_u32=cc.u32([0] * n), tokens_u32=cc.u32(last))

        return DeferredReply(finish)

    return CallServer(handler, lambda: SimpleNamespace(last=[]), "127.0.0.1", 0, None, pipelined=True)


def test_the_next_call_goes_out_and_is_launched_before_the_reply_of_the_one_before():
    """Call N's reply is held until call N + 1 has reached the lane: a client that waited for N's
    reply before sending N + 1, or a server that finished N before reading N + 1, would stall for
    WAIT_S and the log would say so. Fed rows pick the previous call's tokens (swapped here)."""
    log: list = []
    arrived = threading.Condition()
    server = pipelined_stub(log, arrived)
    try:
        lane = stub_client(GrpcVerifyLane, server)
        lane._info_pb = lanes_pb2.LaneInfo(lane="verify", feeds_tokens=True)
        assert lane.feeds_tokens
        first = lane.verify_start([plain_item("a", 3, pending=1), plain_item("b", 5, pending=2)])
        assert isinstance(first.next_tokens, ChannelTokens)
        second = lane.verify_start(
            [plain_item("a", 4, pending=0), plain_item("b", 6, pending=0)],
            feed=TokenFeed((first.next_tokens,), (1, 0)),
        )
        third = lane.verify_start(
            [plain_item("b", 7, pending=0)], feed=TokenFeed((second.next_tokens,), (0,))
        )  # settles the first (at most one call ahead), leaves the second in flight
        lane.verify_start([plain_item("b", 8, pending=0)], feed=TokenFeed((third.next_tokens,), (0,)))
        assert [o.new_tokens for o in first.result()] == [[101], [102]]
        assert [o.new_tokens for o in second.result()] == [[202], [201]]  # the rows, swapped
        assert [o.new_tokens for o in third.result()] == [[302]]
        replies = [e for e in log if e[0] == "reply"]
        assert replies[:3] == [("reply", 1, True), ("reply", 2, True), ("reply", 3, True)], log
        launched_2 = next(n for n, e in enumerate(log) if e[:2] == ("launch", 2))
        assert launched_2 < log.index(("reply", 1, True)), log  # N + 1 launched before N replied
        # A feed that names a call this connection did not make last is refused before it is sent
        with pytest.raises(LaneError, match="not the previous verify call"):
            lane.verify_start([plain_item("a", 9)], feed=TokenFeed((first.next_tokens,), (0,)))
    finally:
        server.close()


# -- real lane processes -----------------------------------------------------------------------
def run_router(router, specs, on_step=None) -> list[list[int]]:
    ids = [router.add_request(s) for s in specs]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while router.has_work():
        if on_step is not None:
            on_step(router)
        try:
            outputs = router.step()
        except LaneError as exc:
            outputs = getattr(exc, "outputs", [])
            for out in outputs:
                tokens[out.request_id] += out.token_ids
            raise
        for out in outputs:
            tokens[out.request_id] += out.token_ids
    return [tokens[i] for i in ids]


@pytest.fixture
def split_lanes(tiny_models):
    from verifypd.core.assembly import connect_lanes
    from verifypd.lanes.processes import LaneProcesses
    from verifypd.lanes.rpc.lane_wiring import wire_pools

    options = engine_options(*tiny_models, k=0)
    procs = LaneProcesses(options)
    procs.start(timeout_s=120)
    try:
        clients = connect_lanes(procs.addrs, secret=procs.secret)
        wire_pools(*clients, kv_transport="handle")
        yield options, procs, clients
    finally:
        procs.terminate()


@pytest.mark.slow
def test_split_chains_plain_steps_and_gives_the_offline_greedy_tokens(split_lanes, tiny_models):
    from verifypd.router.router import Router

    options, _, clients = split_lanes
    assert clients[2].feeds_tokens
    prompts = random_prompts(6, seed=5, max_len=30)
    specs = [RequestSpec(tuple(p), max_tokens=12 + n, stop_at_eos=False) for n, p in enumerate(prompts)]
    expected = offline_outputs(options, specs)  # colocated, no speculation (k = 0), chained
    assert expected == offline_outputs(engine_options(*tiny_models, k=4), specs)  # with speculation
    router = Router(*clients, decode=None, eos_token_ids=(), config=options.config)
    assert run_router(router, specs) == expected
    # chained (launched before the step before was committed) and fed on the verify lane's device;
    # requests finish at different steps (max_tokens), so rows of finished requests were dropped
    assert router.overlap.steps >= 8, router.overlap.breaks


@pytest.mark.slow
def test_arrivals_join_the_split_chain_without_breaking_it(split_lanes):
    """Requests arriving while a chain runs are prefilled beside a chained step (on the prefill lane,
    another process); their first tokens reach the host with that step's commit, after the next step
    was launched, so they join the step after it, their pending tokens sent from the host beside the
    others' fed ones. Tokens equal the offline engine's; nearly every step stays chained."""
    from verifypd.router.router import Router

    options, _, clients = split_lanes
    prompts = random_prompts(12, seed=5, max_len=30)
    specs = [RequestSpec(tuple(p), max_tokens=6 + 3 * (n % 4), stop_at_eos=False) for n, p in enumerate(prompts)]
    expected = offline_outputs(options, specs)
    router = Router(*clients, decode=None, eos_token_ids=(), config=options.config)
    ids: list[str] = []
    tokens: dict[str, list[int]] = {}
    todo, steps = list(specs), 0
    while todo or router.has_work():
        if todo and steps % 3 == 0:  # two arrivals every third step
            for spec in todo[:2]:
                ids.append(router.add_request(spec))
                tokens[ids[-1]] = []
            todo = todo[2:]
        for out in router.step():
            tokens[out.request_id] += out.token_ids
        steps += 1
    assert [tokens[i] for i in ids] == expected
    overlap = router.overlap
    assert overlap.admitting >= 3 and overlap.joined >= 8, (overlap.admitting, overlap.joined, overlap.breaks)
    assert overlap.steps >= steps - 4, (overlap.steps, steps, overlap.breaks)  # the chain did not break on arrivals


@pytest.mark.slow
def test_a_request_cancelled_mid_chain_keeps_the_others_streams(split_lanes):
    """A request cancelled while a chained step holding its row is in flight (and one more queued
    behind it on the lane): its row is dropped at commit, its blocks wait for that step, the lane
    drops its key with a later call; the others' tokens are the offline engine's, the chain goes on."""
    from verifypd.router.router import Router

    options, _, clients = split_lanes
    prompts = random_prompts(6, seed=21, max_len=25)
    specs = [RequestSpec(tuple(p), max_tokens=16 + 2 * n, stop_at_eos=False) for n, p in enumerate(prompts)]
    expected = offline_outputs(options, specs)
    router = Router(*clients, decode=None, eos_token_ids=(), config=options.config)
    ids = [router.add_request(s) for s in specs]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cancelled = None
    while router.has_work():
        if cancelled is None and router.overlap.inflight is not None and router.overlap.steps >= 3:
            cancelled = ids[2]
            out = router.abort(cancelled)
            assert out is not None and out.finished
        for out in router.step():
            tokens[out.request_id] += out.token_ids
    assert cancelled is not None
    for i, rid in enumerate(ids):
        if rid == cancelled:
            assert tokens[rid] == expected[i][: len(tokens[rid])] and len(tokens[rid]) < len(expected[i])
        else:
            assert tokens[rid] == expected[i], rid
    assert router.overlap.dropped >= 1 and router.overlap.steps >= 10, (router.overlap.dropped, router.overlap.breaks)
    assert router.context.target_blocks.num_used == 0  # every block back, the held ones included


@pytest.mark.slow
def test_a_fed_call_reads_the_rows_it_names(split_lanes):
    """Against the real verify lane: call B fed with rows (1, 0) of call A must give what call B'
    gives with A's tokens, swapped, sent as pending tokens (same positions, fresh blocks). A lane
    that ignored the rows or read the placeholders (pending 0) would differ."""
    _, _, (_, _, verify) = split_lanes
    pool = verify.describe().pools[0]

    def item(rid, pending, pos, block):
        return VerifyItem(rid, pending, pos, (), KvHandle(pool.pool_id, pool.generation, (block,), 0, 0), GREEDY)

    first = verify.verify_start([item("a", 11, 0, 1), item("b", 23, 0, 2)])
    a = [o.new_tokens[0] for o in first.result()]
    assert a[0] != a[1], "pick other pending tokens: swapping equal rows proves nothing"
    fed = verify.verify_start(
        [item("a", 0, 1, 1), item("b", 0, 1, 2)], feed=TokenFeed((first.next_tokens,), (1, 0))
    ).result()
    # the same with the tokens on the wire: the first position again in fresh blocks, then the next
    verify.verify([item("c", 11, 0, 3), item("d", 23, 0, 4)])
    wired = verify.verify([item("c", a[1], 1, 3), item("d", a[0], 1, 4)])
    assert [o.new_tokens for o in fed] == [o.new_tokens for o in wired]
    straight = verify.verify([item("c", a[0], 1, 3), item("d", a[1], 1, 4)])
    assert [o.new_tokens for o in straight] != [o.new_tokens for o in wired]  # the rows matter here


@pytest.mark.slow
def test_verify_lane_killed_mid_chain_loses_no_request_and_no_token(split_lanes):
    """SIGKILL the verify lane while a chained step is in flight (one more queued behind the one the
    router waits for); the step fails with LaneError, the supervisor's part (restart, re-wire) is
    done here, the router re-queues every request for recompute, and each request's tokens are the
    fault-free ones, none twice."""
    from verifypd.lanes.rpc.lane_wiring import wire_pools
    from verifypd.router.router import Router

    options, procs, clients = split_lanes
    prompts = random_prompts(5, seed=9, max_len=25)
    specs = [RequestSpec(tuple(p), max_tokens=20, stop_at_eos=False) for p in prompts]
    expected = offline_outputs(options, specs)
    router = Router(*clients, decode=None, eos_token_ids=(), config=options.config)
    ids = [router.add_request(s) for s in specs]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    killed, failures = False, 0
    while router.has_work():
        if not killed and router.overlap.inflight is not None and router.overlap.steps >= 4:
            os.kill(procs.pids()["verify"], signal.SIGKILL)
            killed = True
        try:
            outputs = router.step()
        except LaneError as exc:
            failures += 1
            assert failures <= 3, f"recovery keeps failing: {exc}"
            outputs = getattr(exc, "outputs", [])
            for out in outputs:
                tokens[out.request_id] += out.token_ids
            procs.procs["verify"].wait(30)
            procs.restart("verify")
            deadline = time.monotonic() + 120
            while not all(lane.healthy(1.0) for lane in clients):
                assert time.monotonic() < deadline, "the verify lane did not come back"
                time.sleep(0.2)
            for lane in clients:
                lane.describe_pb(refresh=True)
            wire_pools(*clients, kv_transport="handle")
            router.reset_kv()
            continue
        for out in outputs:
            tokens[out.request_id] += out.token_ids
    assert killed and failures >= 1
    assert [tokens[i] for i in ids] == expected
    assert router.overlap.steps >= 8  # chains ran again after the recovery
