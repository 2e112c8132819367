"""OpenTelemetry traces of requests: the gateway's span per request (receive to the last byte
streamed) and, in the engine core, the request's span with its queue, prefill and decode spans
and the lane calls of its steps; one trace per request, continued from the caller's W3C
`traceparent` (net/trace_context.py: the wires, the tracer every process makes alike).

Cost on the engine thread: a request's core span is started when the core receives it (channel
reader thread); its queue / prefill / decode spans are written once, when it finishes, with the
start and end times the router already keeps (RequestStats); no span per token or per step per
request. Lane calls are one span per call (one per step and lane, whatever the batch), below the
core span of the oldest traced request of the call's batch (`verifypd.batch.size` says how many
it served):
  * in-process lanes (colocated): written after the step from the router's lane timings;
  * lane clients (split, `trace_lane_calls`): a CLIENT span around each call, its traceparent
    sent with the call, and the lane process writes its SERVER span below it (lanes/rpc/lane_spans.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer

from verifypd.domain.requests import FinishReason
from verifypd.lanes.rpc.lane_spans import LaneCallSpans, lane_attributes
from verifypd.net.trace_context import context_of

_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}  # vLLM's finished_reason values


def start_gateway_span(tracer: Tracer, carrier, api: str, request_id: str, prompt_tokens: int):
    """The gateway's span of one request, a child of the caller's traceparent when it sent one
    (`carrier`: HTTP headers, or gRPC metadata as (key, value) pairs)."""
    return tracer.start_span(
        "verifypd.generate",
        context=context_of(carrier) or Context(),  # none: a trace of its own
        kind=SpanKind.SERVER,
        attributes={
            "verifypd.api": api,
            "verifypd.request_id": request_id,
            "gen_ai.operation.name": "text_completion",
            "gen_ai.usage.input_tokens": prompt_tokens,
        },
    )


def end_gateway_span(span, outcome: str, usage: dict[str, int] | None) -> None:
    """`outcome`: the finish reason (stop, length), abort (cancel, deadline, disconnect) or error."""
    span.set_attribute("gen_ai.response.finish_reasons", [outcome])
    if usage is not None:
        span.set_attribute("gen_ai.usage.output_tokens", usage.get("completion_tokens", 0))
        span.set_attribute("verifypd.accepted_tokens", usage.get("accepted_tokens", 0))
    if outcome == "error":
        span.set_status(trace.Status(trace.StatusCode.ERROR))
    span.end()


def _ns(t: float, mono_now: float, wall_now_ns: int) -> int:
    """A router-clock (monotonic) time as OTel's epoch nanoseconds."""
    return wall_now_ns - int((mono_now - t) * 1e9)


class RequestTracing:
    """The core's side: `begin` (channel reader thread) starts a request's core span below the
    gateway's; the router's observer hooks (core loop thread, through `Telemetry`) and the lane
    clients (same thread) write the spans below it."""

    def __init__(self, tracer: Tracer, clock=time.monotonic):
        self.tracer, self.clock = tracer, clock
        # request id -> (its verifypd.core.request span, a context holding it); dict operations
        # only across the two threads (atomic under the GIL).
        self._requests: dict[str, tuple[trace.Span, Context]] = {}
        self._lane_calls: list[tuple[str, float, float, int]] = []  # this step's (lane, start, end, batch)
        self.spans_from_steps = True  # False once the lane clients write the lane spans (trace_lane_calls)

    def begin(self, request_id: str, traceparent: str) -> None:
        parent = context_of(traceparent)
        if parent is None:
            return
        span = self.tracer.start_span("verifypd.core.request", context=parent)
        if span.get_span_context().trace_flags.sampled:
            self._requests[request_id] = (span, trace.set_span_in_context(span))

    def forget(self, request_id: str) -> None:
        """A refused request: its core span is dropped unended (never exported)."""
        self._requests.pop(request_id, None)

    def parent_of(self, request_ids: Iterable[str]) -> Context | None:
        """The core span context of the first traced request among `request_ids`, or None."""
        requests = self._requests
        if not requests:
            return None
        for rid in request_ids:
            held = requests.get(rid)
            if held is not None:
                return held[1]
        return None

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
        anchor = self.parent_of(s.request_id for s in router.scheduler.running)
        if anchor is None:
            return
        mono, wall = self.clock(), time.time_ns()
        for lane, start, end, batch in calls:
            span = self.tracer.start_span(
                f"verifypd.lane.{lane}",
                context=anchor,
                kind=SpanKind.CLIENT,
                start_time=_ns(start, mono, wall),
                attributes=lane_attributes(lane, batch),
            )
            span.end(end_time=_ns(end, mono, wall))

    def on_request_finished(self, seq) -> None:
        held = self._requests.pop(seq.request_id, None)
        if held is None:
            return
        root, ctx = held
        s, now = seq.stats, self.clock()
        mono, wall = now, time.time_ns()
        times = s.token_times
        end = times[-1] if times and seq.finish_reason is not FinishReason.CANCELLED else now
        root.set_attributes(
            {
                "gen_ai.usage.input_tokens": s.prompt_tokens,
                "gen_ai.usage.output_tokens": s.completion_tokens,
                "gen_ai.response.finish_reasons": [_REASONS.get(seq.finish_reason, "abort")],
                "verifypd.preemptions": s.preemptions,
            }
        )

        def child(name: str, start: float, stop: float, **attributes) -> None:
            span = self.tracer.start_span(name, context=ctx, start_time=_ns(start, mono, wall), attributes=attributes)
            span.end(end_time=_ns(stop, mono, wall))

        scheduled = s.scheduled_time
        child("verifypd.queue", s.arrival_time, scheduled if scheduled is not None else end)
        if scheduled is not None and times:
            child("verifypd.prefill", scheduled, times[0], **{"verifypd.prompt_tokens": s.prompt_tokens})
            child(
                "verifypd.decode",
                times[0],
                times[-1],
                **{
                    "verifypd.output_tokens": s.completion_tokens,
                    "verifypd.verify_steps": s.verify_steps,
                    "verifypd.draft_tokens": s.draft_tokens,
                    "verifypd.accepted_tokens": s.accepted_tokens,
                },
            )
        root.end(end_time=_ns(end, mono, wall))
