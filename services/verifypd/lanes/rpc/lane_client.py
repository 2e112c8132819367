"""The lane protocols over gRPC: `Router(GrpcPrefillLane(a), GrpcDraftLane(b), GrpcVerifyLane(c))`
cannot tell these from the in-process lanes. Torch-free (the gateway process of `split` never
touches tensors).

Work calls go over the lane's call channel (call_channel.py: one persistent connection, compact
columns, request state and block tables sent as deltas) when the lane announces one, else over
unary gRPC. Every failure of a lane call (process gone, deadline, error status) becomes
`LaneError`; the gateway then ends in-flight requests with UNAVAILABLE. `wire_bytes` counts the
serialized bytes of every lane call (request + reply), so a test can prove that with handles no
KV crossed the wire. With `spans` set (core/tracing.py, when traces are on) each work call gets a
span whose context travels with it (lane_spans.py).
"""

from __future__ import annotations

import logging
import threading

from verifypd.domain.lanes import (
    DraftItem,
    DraftOutput,
    Finished,
    LaneError,
    PrefillItem,
    PrefillOutput,
    StartedCall,
    TokenFeed,
    VerifyItem,
    VerifyOutput,
    plain_item,
)
from verifypd.lanes.rpc import call_codec as cc
from verifypd.lanes.rpc import lane_convert as lc
from verifypd.lanes.rpc.call_channel import CallClient, ChannelClosed
from verifypd.lanes.rpc.call_pipeline import MAX_IN_FLIGHT, ChannelTokens, feed_fields
from verifypd.lanes.rpc.lane_connection import LaneConnection
from verifypd.lanes.rpc.lane_spans import LaneCallSpans, end_call_span
from verifypd.lanes.rpc.started_call import StartedLaneCall
from verifypd.v1 import lanes_pb2, lanes_pb2_grpc

log = logging.getLogger("verifypd.lane_client")


class _GrpcLane(LaneConnection):
    remote = True  # another process: the router may overlap calls to different lanes

    _method: lanes_pb2.LaneMethod = lanes_pb2.LANE_METHOD_UNSPECIFIED  # this lane's work call
    spans: LaneCallSpans | None = None  # work-call spans (lane_spans.py), set when traces are on

    def __init__(
        self, addr: str, timeout_s: float = 60.0, secret: str | None = None, call_channel: bool = True, tls=None
    ):
        """`tls`: a verifypd.net.lane_tls.LaneTls (gRPC and the call channel over mutual TLS), or None."""
        super().__init__(addr, timeout_s, secret, tls)
        self._use_channel = call_channel  # False: work calls over unary gRPC (tools, comparisons)
        self._client: CallClient | None = None
        self._mirror = cc.ChannelMirror()
        self._call_lock = threading.Lock()  # one call at a time on the connection
        self._pending = []
        # Owners: the prefill lane whose KV writes this lane must wait for (wire_pools sets it),
        # and how many of its writes this lane has been told about.
        self.producer: GrpcPrefillLane | None = None
        self._writes_seen = 0

    # -- work calls --------------------------------------------------------------------------
    @property
    def starts_async(self) -> bool:
        """Work calls over the call channel can be started: the router sends a step's prefill call
        while the verify lane computes (lanes/interface.py, "prefill beside decode")."""
        return self._use_channel

    def _work(self, items, encode, decode, unary):
        """One work call: over the call channel when the lane has one, else `unary(traceparent)`."""
        return self._start(items, encode, decode, unary).result()

    def _start(self, items, encode, decode, unary, ahead: bool = False) -> StartedCall:
        """Writes one work call and returns without its reply (`.result()` reads and decodes it).
        Calls started and never waited for are settled (their replies read, their decodes run)
        before the next call on this connection, so the stream of replies stays in step; `ahead`
        (a verify call fed by the one before it, call_pipeline.py): one of them may stay in flight."""
        if not items:
            return Finished([])
        with self._call_lock:
            self._settle(MAX_IN_FLIGHT - 1 if ahead else 0)
            client = self._connected_client()
            traced = self.spans.start(self.lane, items) if self.spans is not None else None
            span, traceparent = traced if traced is not None else (None, None)
            if client is None:
                error = None
                try:
                    return Finished(unary(traceparent))
                except LaneError as exc:
                    error = str(exc)
                    raise
                finally:
                    end_call_span(span, error)
            name = lanes_pb2.LaneMethod.Name(self._method).removeprefix("LANE_METHOD_").capitalize()
            try:
                batch = encode(self._mirror, items)
                producer = self.producer
                if producer is not None and producer.kv_written_event and producer.writes != self._writes_seen:
                    self._writes_seen = producer.writes  # read before the handle goes out: never misses one
                    batch.wait_event = producer.kv_written_event
                call = lanes_pb2.LaneCall(method=self._method, batch=batch, traceparent=traceparent or "")
                call_id = client.send(call)
            except (OSError, ChannelClosed) as exc:
                end_call_span(span, str(exc))
                raise LaneError(f"{self.lane} lane at {self.addr}: {name} failed: UNAVAILABLE: {exc}") from None
            self.last_sent = (client, call_id)
            started = StartedLaneCall(self, client, call_id, items, decode, name, span)
            self._pending.append(started)
            return started

    _pending: list[StartedLaneCall]  # started calls whose replies are not read yet, in call order
    last_sent: tuple[CallClient, int] | None = None  # the connection and id of the last call written

    def _settle(self, keep: int = 0) -> None:
        """Under _call_lock: reads the replies of started calls nobody waited for yet (an error
        path, or the call before a pipelined one) until at most `keep` are in flight."""
        while len(self._pending) > keep:
            self._pending.pop(0).complete()

    _client_bytes = 0

    def finish_started(self, call: StartedLaneCall) -> None:
        """Reads a started call's reply (and those of the calls before it: replies come in call
        order) under the connection's lock; they are no longer pending."""
        with self._call_lock:
            if call in self._pending:
                self._settle(len(self._pending) - self._pending.index(call) - 1)
            call.complete()

    def first_pending(self, call: StartedLaneCall) -> bool:
        """Is `call` the oldest started call whose reply is unread (the next reply is its)?"""
        return bool(self._pending) and self._pending[0] is call

    def count_channel_call(self, client: CallClient) -> None:
        """Counts a call-channel call: its connection's bytes since the last call counted, and one call."""
        sent_and_received = client.bytes
        self.count(sent_and_received - self._client_bytes)
        self._client_bytes = sent_and_received

    def on_call_channel(self) -> bool:
        """The lane's work calls go over its (reachable) call channel."""
        return self._use_channel and self._client is not None and self._client.connected

    def _connected_client(self) -> CallClient | None:
        """The call channel's connection (a new one, with a fresh mirror, after any failure);
        None when the lane announces no call channel."""
        if not self._use_channel:
            return None
        if self._client is not None and self._client.connected:
            return self._client
        port = self.describe_pb(refresh=True).call_port  # a restarted lane may listen elsewhere
        if not port:
            return None
        self._client_bytes = 0  # the old connection's bytes stay counted
        self._client = CallClient(self.addr.rsplit(":", 1)[0], port, self.secret, self.timeout_s, self.tls)
        self._mirror = cc.ChannelMirror()
        try:
            self._client.connect()
        except OSError as exc:
            raise LaneError(
                f"{self.lane} lane at {self.addr}: call channel on port {port} unreachable: {exc}"
            ) from None
        return self._client

    def probe_channel(self) -> None:
        """At wiring: connects the call channel, or turns it off for this client (with a warning)."""
        with self._call_lock:
            try:
                self._connected_client()
            except LaneError as exc:
                log.warning("%s; work calls to this lane go over gRPC", exc)
                self._use_channel = False

    def release(self, request_ids) -> None:
        """The router is done with these requests: the lane drops its copy with the next call."""
        with self._call_lock:
            self._mirror.release(request_ids)

    def close(self) -> None:
        with self._call_lock:
            if self._client is not None:
                self._client.close()
        super().close()


class GrpcPrefillLane(_GrpcLane):
    lane = "prefill"
    stub_class = lanes_pb2_grpc.PrefillLaneStub

    def __init__(
        self, addr: str, timeout_s: float = 60.0, secret: str | None = None, call_channel: bool = True, tls=None
    ):
        super().__init__(addr, timeout_s, secret, call_channel, tls)
        self.kv_bytes_copied = 0  # KV bytes the lane streamed to owners (copy transport)
        self.kv_written_event = b""  # ImportPoolsReply.kv_written_event (CUDA IPC, call channel only)
        self.writes = 0  # prefill calls completed: owners wait on the event when this moved

    _method = lanes_pb2.LANE_METHOD_PREFILL

    def prefill(self, items: list[PrefillItem]) -> list[PrefillOutput]:
        return self.prefill_start(items).result()

    def prefill_start(self, items: list[PrefillItem]) -> StartedCall:
        def decode(items, reply):
            self.kv_bytes_copied += reply.kv_bytes_copied
            self.writes += 1  # also for a call settled on an error path: owners then wait
            return cc.decode_prefill(items, reply)

        def unary(traceparent):
            result = self.rpc("Prefill", lc.prefill_batch_to_pb(items), traceparent=traceparent)
            self.kv_bytes_copied += result.kv_bytes_copied
            return lc.prefill_outputs_from_pb(result)

        return self._start(items, cc.encode_prefill, decode, unary)


class GrpcDraftLane(_GrpcLane):
    lane = "draft"
    stub_class = lanes_pb2_grpc.DraftLaneStub

    _method = lanes_pb2.LANE_METHOD_DRAFT

    def __init__(
        self, addr: str, timeout_s: float = 60.0, secret: str | None = None, call_channel: bool = True, tls=None
    ):
        super().__init__(addr, timeout_s, secret, call_channel, tls)
        self.handoff: tuple[int, int] | None = None  # (rows, cols) once the verify lane opened our buffer
        self._slot = 0

    def draft(self, items: list[DraftItem]) -> list[DraftOutput]:
        if self.describe_pb().draft_model == "none":
            # `--draft none` proposes nothing (lanes/ngram.NoDraftLane): its answer is known without
            # a round trip, which a k = 0 split server would otherwise pay before every verify call.
            return [DraftOutput(i.request_id, [], None) for i in items]
        slot = 0
        if (
            self.handoff is not None
            and len(items) <= self.handoff[0]
            and max(i.k for i in items) <= self.handoff[1]
            and all(i.sampling.greedy for i in items)
        ):
            self._slot = slot = 3 - self._slot if self._slot else 1  # alternate 1, 2, 1, ...
        return self._work(
            items,
            lambda mirror, items: cc.encode_draft(mirror, items, slot),
            lambda items, reply: cc.decode_draft(items, reply, slot),
            lambda tp: lc.draft_outputs_from_pb(self.rpc("Draft", lc.draft_batch_to_pb(items), traceparent=tp)),
        )


class GrpcVerifyLane(_GrpcLane):
    lane = "verify"
    stub_class = lanes_pb2_grpc.VerifyLaneStub

    _method = lanes_pb2.LANE_METHOD_VERIFY

    def verify(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        return self.verify_start(items).result()

    @property
    def feeds_tokens(self) -> bool:
        """Takes `verify_start(items, feed=...)`: the lane keeps a plain step's chosen tokens on its
        device for the next call (call_pipeline.py), which is sent before this one's reply."""
        return self._use_channel and self.describe_pb().feeds_tokens

    @property
    def feeds_host_tokens(self) -> bool:
        """A feed may end with HostTokens (pending tokens the router has: a remote prefill's first ones)."""
        return self.feeds_tokens

    def verify_start(self, items: list[VerifyItem], feed: TokenFeed | None = None, fit=None) -> StartedCall:
        """`feed`: the items' pending tokens are rows of the previous call's `next_tokens` (a
        ChannelTokens), read on the lane's device; the call goes out with that one still in flight."""
        if fit is not None:
            raise ValueError("a remote verify lane fits no verdicts (fits_verdict is False)")

        def encode(probs, top_k):  # only when mixing an in-process draft lane with a remote verify
            from verifypd.lanes.rpc.kv_transport import encode_probs

            return encode_probs(probs, top_k)

        def encode_call(mirror, items) -> lanes_pb2.PackedBatch:
            batch = cc.encode_verify(mirror, items, encode)
            if feed is not None:
                client, last = self.last_sent or (None, 0)
                try:
                    batch.feed_call, batch.feed_rows_u32, pending = feed_fields(feed, client, last, len(items))
                    if pending is not None:  # host tokens (HostTokens) go as pending tokens
                        batch.pending_u32 = cc.u32(pending)
                except ValueError as exc:  # a reconnect since: the lane that held the tokens is gone
                    raise LaneError(f"{self.lane} lane at {self.addr}: {exc}") from None
            return batch

        started = self._start(
            items,
            encode_call,
            cc.decode_verify,
            lambda tp: lc.verify_outputs_from_pb(
                self.rpc("Verify", lc.verify_batch_to_pb(items, encode), traceparent=tp)
            ),
            ahead=feed is not None,
        )
        # A plain step leaves its chosen tokens on the lane's device (LocalVerifyLane: k = 0, plain items)
        if isinstance(started, StartedLaneCall) and all(not i.draft_tokens and plain_item(i) for i in items):
            started.next_tokens = ChannelTokens(started.client, started.call_id, len(items))
        return started
