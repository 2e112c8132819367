"""The call channel's side of a lane server (LaneServicer mixes this in): one `LaneCall` in, one
`LaneReply` out, with the same checks, lock and lanes as the unary RPCs, plus the device-side
ordering the channel makes possible:
  * `wait_event`: the prefill lane's KV writes, waited on by the owners' streams;
  * `handoff_slot`: draft tokens through the draft lane's DraftHandoff buffer (draft_handoff.py):
    the draft lane replies with counts as soon as its work is enqueued, the verify lane reads the
    proposals on the device;
  * `traceparent`: with traces on (`spans`), the call's SERVER span below the router's (lane_spans.py);
  * `feed_call`: a verify call's pending tokens read on the device from the previous verify call
    (call_pipeline.py). Verify calls are launched here and their replies finished on the
    connection's reply thread (DeferredReply), so the next call is launched before this one's reply.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING

import grpc
import torch

from verifypd.lanes.device_values import DeviceDraftTokens
from verifypd.lanes.local_verify import LocalVerifyLane
from verifypd.lanes.rpc import call_decode as cd
from verifypd.lanes.rpc import kv_transport as kv
from verifypd.lanes.rpc import lane_validate as lv
from verifypd.lanes.rpc.call_channel import CallServer
from verifypd.lanes.rpc.call_codec import HandoffTokens, u32
from verifypd.lanes.rpc.call_pipeline import DeferredReply
from verifypd.lanes.rpc.lane_spans import LaneServerSpans, end_call_span
from verifypd.v1 import lanes_pb2

if TYPE_CHECKING:
    from verifypd.domain.lanes import (
        DraftItem,
        DraftOutput,
        PrefillItem,
        PrefillOutput,
        StartedCall,
        TokenFeed,
        VerifyItem,
        VerifyOutput,
    )
    from verifypd.lanes.rpc.draft_handoff import DraftHandoffBuffer, OpenedHandoff

log = logging.getLogger("verifypd.lane")
CALL_METHODS = {
    "prefill": lanes_pb2.LANE_METHOD_PREFILL,
    "draft": lanes_pb2.LANE_METHOD_DRAFT,
    "verify": lanes_pb2.LANE_METHOD_VERIFY,
}
MAX_PEER_EVENTS = 8


class CallChannelWork:
    """Mixed into LaneServicer (lane_server.py), which sets the attributes declared here and
    implements the lane's work (the methods below that raise NotImplementedError)."""

    role: str  # "prefill" | "draft" | "verify"
    lock: threading.Lock  # one per process: serializes work calls on the pools
    device: torch.device
    peer_events: dict[bytes, torch.cuda.Event]  # opened IPC events of the prefill lane's KV writes
    # Set by LaneServicer: handoff (draft lane on CUDA) / opened_handoff (verify lane, once opened).
    handoff: DraftHandoffBuffer | None = None
    opened_handoff: OpenedHandoff | None = None
    spans: LaneServerSpans | None = None  # set when the environment turns traces on (launch/cli.py)
    call_server: CallServer | None = None  # the CallServer, once build_lane_server started it
    verify_lane: LocalVerifyLane | None  # set by LaneServicer (the verify lane's only)

    @property
    def lane(self) -> object | None:
        """The lane the work calls run on; None: the prefill lane before ImportPools (or closed)."""
        raise NotImplementedError

    def limits(self) -> lv.LaneLimits:
        raise NotImplementedError

    def prefill_work(self, items: list[PrefillItem]) -> tuple[list[PrefillOutput], int]:
        raise NotImplementedError

    def draft_work(self, items: list[DraftItem]) -> list[DraftOutput]:
        raise NotImplementedError

    def verify_work(self, items: list[VerifyItem]) -> list[VerifyOutput]:
        raise NotImplementedError

    def verify_start(self, items: list[VerifyItem], feed: TokenFeed | None = None) -> StartedCall:
        """Launches a verify call on this lane's LocalVerifyLane (results by `.result()`)."""
        if self.verify_lane is None:
            raise RuntimeError(f"the {self.role} lane runs no verify calls")
        for item in items:  # DraftProbs bytes -> tensors on this lane's device
            if isinstance(item.draft_probs, lanes_pb2.DraftProbs):
                item.draft_probs = kv.decode_probs(item.draft_probs, self.device)
        return self.verify_lane.verify_start(items, feed=feed)

    @property
    def feeds_tokens(self) -> bool:
        """A verify lane whose call channel takes `feed_call` (LaneInfo.feeds_tokens)."""
        lane = self.lane if self.role == "verify" else None
        return bool(getattr(lane, "feeds_tokens", False)) and self.call_server is not None

    def on_device(self) -> contextlib.AbstractContextManager:
        """This lane's GPU as the calling thread's current device. gRPC and call-channel threads start
        on cuda:0, and Triton launches, CUDA graphs and current_stream() follow the thread's current
        device, not the tensors': a lane on cuda:1 (--lane-devices) runs its work inside this."""
        if self.device.type == "cuda" and self.device.index is not None:
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    def _handoff_dims(self) -> tuple[int, int] | None:
        if self.handoff is not None:
            return (self.handoff.tokens.shape[1], self.handoff.tokens.shape[2])
        if self.opened_handoff is not None:
            return (self.opened_handoff.rows, self.opened_handoff.cols)
        return None

    def handle_call(self, call: lanes_pb2.LaneCall, state: cd.ChannelState) -> lanes_pb2.LaneReply | DeferredReply:
        """One call on the call channel: the unary RPC's checks, lock and lane, compact messages."""
        try:
            if call.method != CALL_METHODS[self.role]:
                raise lv.LaneInvalid(
                    f"method: {call.method} is not served by the {self.role} lane (expects {CALL_METHODS[self.role]})"
                )
            if self.lane is None:
                raise lv.LaneInvalid(
                    "prefill lane has no pools yet: call ImportPools", grpc.StatusCode.FAILED_PRECONDITION
                )
            feed = None
            if self.role == "verify":  # checked before decode changes the connection's state
                feed = state.fed.feed(call.batch, len(call.batch.keys_u32) // 4)
            items = cd.decode(call.method, call.batch, state, self.limits(), self._handoff_dims())
            if call.batch.wait_event:
                self._wait_for_peer(call.batch.wait_event)
        except lv.LaneInvalid as exc:
            return lanes_pb2.LaneReply(status_code=exc.code.value[0], error=str(exc))
        span = self.spans.start(call.traceparent, items) if self.spans is not None and call.traceparent else None
        if self.role == "verify":
            return self._verify_call(call, items, feed, state, span)
        reply = self._call_work(call, items)
        if span is not None:  # host time of the call: on CUDA its kernels may still run after the reply
            end_call_span(span, reply.error if reply.status_code else None)
        if not reply.status_code:
            state.release(call.batch.released)
        return reply

    def _verify_call(
        self, call: lanes_pb2.LaneCall, items: list[VerifyItem], feed: TokenFeed | None, state: cd.ChannelState, span
    ) -> lanes_pb2.LaneReply | DeferredReply:
        """Launches a verify call and keeps the tokens it leaves on the device for the next call's
        feed; its reply is built by `finish` (on the reply thread: call_pipeline.ReplyWriter)."""
        try:
            with self.lock, self.on_device():
                if call.batch.handoff_slot:
                    self._read_handoff(items, call.batch.handoff_slot)
                started = self.verify_start(items, feed) if items else None
        except Exception as exc:
            state.fed.keep(0, None, 0)
            reply = self._internal(exc)
            if span is not None:
                end_call_span(span, reply.error)
            return reply
        state.fed.keep(call.call_id, getattr(started, "next_tokens", None), len(items))
        state.release(call.batch.released)

        def finish() -> lanes_pb2.LaneReply:
            try:
                reply = cd.verify_reply(started.result() if started is not None else [])
            except Exception as exc:
                reply = self._internal(exc)
            if span is not None:
                end_call_span(span, reply.error if reply.status_code else None)
            return reply

        # Reply now where nothing can be launched behind it: computed at launch (CPU), or a lane that
        # takes no feed (a tensor-parallel target), whose next call the router sends after this reply.
        if started is None or self.device.type != "cuda" or not self.feeds_tokens:
            return finish()
        return DeferredReply(finish)

    def _internal(self, exc: Exception) -> lanes_pb2.LaneReply:
        """A fault of this lane (input was validated): logged with its traceback, INTERNAL to the caller."""
        log.error("%s lane call failed", self.role, exc_info=exc)
        return lanes_pb2.LaneReply(
            status_code=grpc.StatusCode.INTERNAL.value[0],
            error=f"{self.role} lane: internal error: {type(exc).__name__}: {exc}",
        )

    def _call_work(self, call: lanes_pb2.LaneCall, items: list) -> lanes_pb2.LaneReply:
        try:
            with self.lock, self.on_device():
                if self.role == "prefill":
                    reply = cd.prefill_reply(*self.prefill_work(items))
                elif self.role == "draft":
                    reply = self._draft_call(items, call.batch.handoff_slot)
                else:
                    if call.batch.handoff_slot:
                        self._read_handoff(items, call.batch.handoff_slot)
                    reply = cd.verify_reply(self.verify_work(items))
        except Exception as exc:
            log.exception("%s lane call failed", self.role)
            return lanes_pb2.LaneReply(
                status_code=grpc.StatusCode.INTERNAL.value[0],
                error=f"{self.role} lane: internal error: {type(exc).__name__}: {exc}",
            )
        return reply

    def _draft_call(self, items: list[DraftItem], slot: int) -> lanes_pb2.LaneReply:
        outputs = self.draft_work(items)
        if not slot:
            return cd.draft_reply(outputs, kv.encode_probs, [i.sampling.top_k for i in items])
        # Proposals into the handoff slot, its event recorded: no host sync, counts only.
        if self.handoff is None:
            raise RuntimeError("batch.handoff_slot: this lane has no handoff buffer")
        drafts = outputs[0].draft_tokens if outputs else None
        if not isinstance(drafts, DeviceDraftTokens):
            raise RuntimeError("batch.handoff_slot: the draft lane returned no drafts on its device to hand off")
        self.handoff.write(slot, drafts.batch)
        return lanes_pb2.LaneReply(count_u32=u32(len(o.draft_tokens) for o in outputs))

    def _read_handoff(self, items: list[VerifyItem], slot: int) -> None:
        """Handed-off drafts become rows of one device DraftBatch (ordered after the draft lane's write)."""
        if self.opened_handoff is None:
            raise RuntimeError("batch.handoff_slot: this lane opened no draft handoff buffer")
        batch = self.opened_handoff.drafts(slot)
        for item in items:
            if isinstance(item.draft_tokens, HandoffTokens):
                item.draft_tokens = DeviceDraftTokens(batch, item.draft_tokens.row, item.draft_tokens.k)

    def _wait_for_peer(self, handle: bytes) -> None:
        """Orders this lane's next work after the prefill lane's KV writes (PackedBatch.wait_event)."""
        if self.device.type != "cuda":
            raise lv.LaneInvalid("batch.wait_event: this lane runs on the CPU; there is no CUDA event to wait on")
        event = self.peer_events.get(handle)
        if event is None:
            if len(handle) > lv.CUDA_HANDLE_BYTES or len(self.peer_events) >= MAX_PEER_EVENTS:
                raise lv.LaneInvalid(f"batch.wait_event: not a CUDA IPC event handle ({len(handle)} bytes)")
            try:
                event = torch.cuda.Event.from_ipc_handle(self.device, handle)
            except RuntimeError as exc:
                raise lv.LaneInvalid(f"batch.wait_event: cannot open: {exc}") from None
            self.peer_events[handle] = event
        torch.cuda.current_stream(self.device).wait_event(event)
