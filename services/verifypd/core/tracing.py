"""OpenTelemetry traces of requests: the gateway's span per request (receive to the last byte
streamed) and, in the engine core, the request's span with its queue, prefill and decode spans
and the lane calls of its steps; one trace per request, continued from the caller's W3C
`traceparent` (net/trace_context.py: the wires, the tracer every process makes alike).

Cost on the engine thread: a request's core span is opened when the core receives it (channel
reader thread: its ids and start time); it and its queue / prefill / decode spans are written
once, when it finishes, as plain records (net/span_ship.py) with the start and end times the
router already keeps (RequestStats); no span per token or per step per request. Lane calls are
one span per call (one per step and lane, whatever the batch), below the core span of the oldest
traced request of the call's batch (`verifypd.batch.size` says how many it served):
  * in-process lanes (colocated): written after the step from the router's lane timings;
  * lane clients (split, `trace_lane_calls`): a CLIENT span around each call, its traceparent
    sent with the call, and the lane process writes its SERVER span below it (lanes/rpc/lane_spans.py).

Cost on the gateway's event loop: the request's span is a GatewaySpan (ids, start, attributes)
written as one record when the request ends; the SDK only decides the sampling.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from verifypd.domain.requests import FinishReason
from verifypd.lanes.rpc.lane_spans import LaneCallSpans, lane_attributes
from verifypd.net.span_ship import new_id, new_trace_id
from verifypd.net.trace_context import Tracing, make_tracing, parse_traceparent, traceparent_in

_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}  # vLLM's finished_reason values


class GatewaySpan:
    """The gateway's span of one request while it runs ("verifypd.generate", SERVER), written as one
    record when it ends (`GatewaySpans.end`)."""

    __slots__ = ("trace_id", "span_id", "parent_id", "start_ns", "attributes", "first_token_ns")

    def __init__(self, trace_id: int, parent_id: int, attributes: dict):
        self.trace_id, self.parent_id, self.attributes = trace_id, parent_id, attributes
        self.span_id = new_id()
        self.start_ns = time.time_ns()
        self.first_token_ns: int | None = None  # its "first_token" event

    @property
    def traceparent(self) -> str:
        """What the engine core's spans of this request hang below (always sampled: an unsampled
        request has no GatewaySpan)."""
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-01"


class GatewaySpans:
    """The gateway's request spans as plain records (net/span_ship.py), as the core writes its own:
    an SDK span with its event cost ~0.1 ms of the gateway's event loop per request, and at c = 64 on
    an H200 the traced gateway's loop took 11 % more samples than the untraced one's (py-spy), enough
    to spread new requests' arrivals at the core over more (eager) prefill forwards. The sampling
    decision is still the SDK's (OTEL_TRACES_SAMPLER, default parent-based always-on), from the
    tracer `tracing` was made with."""

    def __init__(self, tracing: Tracing):
        self.records = tracing.records
        self.sampler = tracing.tracer.sampler  # type: ignore[attr-defined]  # the SDK Tracer's

    def start(self, carrier, api: str, request_id: str, prompt_tokens: int) -> GatewaySpan | None:
        """A request's span, a child of the caller's traceparent when it sent one (`carrier`: HTTP
        headers, or gRPC metadata as (key, value) pairs); None when the sampler drops it."""
        parent = parse_traceparent(traceparent_in(carrier) or "")
        if parent is None:
            trace_id, parent_id, context = new_trace_id(), 0, None
        else:
            trace_id, parent_id = parent[0], parent[1]
            remote = SpanContext(trace_id, parent_id, is_remote=True, trace_flags=TraceFlags(int(parent[2])))
            context = trace.set_span_in_context(NonRecordingSpan(remote))
        decision = self.sampler.should_sample(context, trace_id, "verifypd.generate", SpanKind.SERVER).decision
        if not decision.is_sampled():
            return None
        attributes = {
            "verifypd.api": api,
            "verifypd.request_id": request_id,
            "gen_ai.operation.name": "text_completion",
            "gen_ai.usage.input_tokens": prompt_tokens,
        }
        return GatewaySpan(trace_id, parent_id, attributes)

    def end(self, span: GatewaySpan, outcome: str, usage: dict[str, int] | None) -> None:
        """`outcome`: the finish reason (stop, length), abort (cancel, deadline, disconnect) or error."""
        attributes = span.attributes
        attributes["gen_ai.response.finish_reasons"] = [outcome]
        if usage is not None:
            attributes["gen_ai.usage.output_tokens"] = usage.get("completion_tokens", 0)
            attributes["verifypd.accepted_tokens"] = usage.get("accepted_tokens", 0)
        events: tuple = (("first_token", span.first_token_ns, {}),) if span.first_token_ns is not None else ()
        status = _ERROR if outcome == "error" else 0
        self.records.write(
            (
                "verifypd.generate", span.trace_id, span.span_id, span.parent_id, _SERVER,
                span.start_ns, time.time_ns(), attributes, status, "", events,
            )
        )  # fmt: skip


def gateway_spans(service_name: str) -> GatewaySpans | None:
    """The gateway's spans when the environment names an OTLP endpoint (net/trace_context.py), else None."""
    tracing = make_tracing(service_name)
    return GatewaySpans(tracing) if tracing is not None else None


def _ns(t: float, mono_now: float, wall_now_ns: int) -> int:
    """A router-clock (monotonic) time as OTel's epoch nanoseconds."""
    return wall_now_ns - int((mono_now - t) * 1e9)


_INTERNAL, _CLIENT, _SERVER = SpanKind.INTERNAL.value, SpanKind.CLIENT.value, SpanKind.SERVER.value
_ERROR = trace.StatusCode.ERROR.value
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


class _Traced:
    """A traced request's core span while it runs: its ids, start and (made when a lane client asks)
    its OTel context."""

    __slots__ = ("trace_id", "span_id", "parent_id", "start_ns", "context")

    def __init__(self, trace_id: int, parent_id: int, start_ns: int):
        self.trace_id, self.parent_id, self.start_ns = trace_id, parent_id, start_ns
        self.span_id = new_id()
        self.context: Context | None = None


class RequestTracing:
    """The core's side: `begin` (channel reader thread) opens a request's core span below the
    gateway's; the router's observer hooks (core loop thread, through `Telemetry`) and the lane
    clients (same thread) write the spans below it. The core's own spans are plain records
    (`tracing.records`, net/span_ship.py: ~1 us each on the loop thread, where an SDK span costs
    ~40 us); the lane clients' spans (split) are SDK spans of `tracing.tracer`."""

    def __init__(self, tracing: Tracing, clock=time.monotonic):
        self.tracer, self.records, self.clock = tracing.tracer, tracing.records, clock
        # request id -> its open core span; dict operations only across the two threads (atomic
        # under the GIL).
        self._requests: dict[str, _Traced] = {}
        self._lane_calls: list[tuple[str, float, float, int]] = []  # this step's (lane, start, end, batch)
        self.spans_from_steps = True  # False once the lane clients write the lane spans (trace_lane_calls)

    def begin(self, request_id: str, traceparent: str) -> None:
        parent = parse_traceparent(traceparent)
        if parent is None or not parent[2]:  # malformed, or the gateway's span is not sampled
            return
        self._requests[request_id] = _Traced(parent[0], parent[1], time.time_ns())

    def forget(self, request_id: str) -> None:
        """A refused request: its core span is dropped (never exported)."""
        self._requests.pop(request_id, None)

    def _first(self, request_ids: Iterable[str]) -> _Traced | None:
        requests = self._requests
        if not requests:
            return None
        for rid in request_ids:
            held = requests.get(rid)
            if held is not None:
                return held
        return None

    def parent_of(self, request_ids: Iterable[str]) -> Context | None:
        """The core span context of the first traced request among `request_ids`, or None."""
        held = self._first(request_ids)
        if held is None:
            return None
        if held.context is None:
            span = NonRecordingSpan(SpanContext(held.trace_id, held.span_id, is_remote=False, trace_flags=_SAMPLED))
            held.context = trace.set_span_in_context(span)
        return held.context

    def trace_lane_calls(self, lanes) -> None:
        """Lane clients (split) write a span around each call and send its context along."""
        spans = LaneCallSpans(self.tracer, self.parent_of)
        for lane in lanes:
            lane.spans = spans
        self.spans_from_steps = False

    # -- in-process lanes: spans from the router's timings ------------------------------------
    def on_lane_step(self, lane: str, seconds: float, batch: int) -> None:
        if self.spans_from_steps and self._requests:
            now = self.clock()
            self._lane_calls.append((lane, now - seconds, now, batch))

    def on_step(self, router) -> None:
        if not self._lane_calls:
            return
        calls, self._lane_calls = self._lane_calls, []
        anchor = self._first(s.request_id for s in router.scheduler.running)
        if anchor is None:
            return
        mono, wall = self.clock(), time.time_ns()
        write, trace_id, parent = self.records.write, anchor.trace_id, anchor.span_id
        for lane, start, end, batch in calls:
            write(
                (
                    f"verifypd.lane.{lane}", trace_id, new_id(), parent, _CLIENT,
                    _ns(start, mono, wall), _ns(end, mono, wall), lane_attributes(lane, batch), 0, "", (),
                )
            )  # fmt: skip

    def on_request_finished(self, seq) -> None:
        held = self._requests.pop(seq.request_id, None)
        if held is None:
            return
        s, now = seq.stats, self.clock()
        mono, wall = now, time.time_ns()
        times = s.token_times
        end = times[-1] if times and seq.finish_reason is not FinishReason.CANCELLED else now
        end_ns = _ns(end, mono, wall)
        write, trace_id, core = self.records.write, held.trace_id, held.span_id

        def child(name: str, start: float, stop: float, attributes: dict) -> None:
            begin_ns, end_ns = _ns(start, mono, wall), _ns(stop, mono, wall)
            write((name, trace_id, new_id(), core, _INTERNAL, begin_ns, end_ns, attributes, 0, "", ()))

        scheduled = s.scheduled_time
        child("verifypd.queue", s.arrival_time, scheduled if scheduled is not None else end, {})
        if scheduled is not None and times:
            child("verifypd.prefill", scheduled, times[0], {"verifypd.prompt_tokens": s.prompt_tokens})
            decode = {
                "verifypd.output_tokens": s.completion_tokens,
                "verifypd.verify_steps": s.verify_steps,
                "verifypd.draft_tokens": s.draft_tokens,
                "verifypd.accepted_tokens": s.accepted_tokens,
            }
            child("verifypd.decode", times[0], times[-1], decode)
        attributes = {
            "gen_ai.usage.input_tokens": s.prompt_tokens,
            "gen_ai.usage.output_tokens": s.completion_tokens,
            "gen_ai.response.finish_reasons": [_REASONS.get(seq.finish_reason, "abort")],
            "verifypd.preemptions": s.preemptions,
        }
        write(
            (
                "verifypd.core.request", trace_id, core, held.parent_id, _INTERNAL,
                held.start_ns, max(end_ns, held.start_ns), attributes, 0, "", (),
            )
        )  # fmt: skip
