"""OpenTelemetry traces of requests: the gateway's span per request (receive to the last byte
streamed) and, in the engine core, the request's queue, prefill and decode spans and the lane
calls of its steps; one trace per request, continued from the caller's W3C `traceparent` (an
HTTP header, or gRPC metadata of the same name). Exported over OTLP/gRPC when
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; off otherwise, and
then nothing here runs at all. Sampling follows OTEL_TRACES_SAMPLER (default: parent-based,
always on).

Cost on the engine thread: a request's core spans are written once, when it finishes, with the
start and end times the router already keeps (RequestStats); no span per token or per step per
request. Lane calls are one span per call per step, parented to the oldest traced request of the
step's batch (attribute `verifypd.batch.size` says how many it served). Lane processes export no
spans of their own: the core times every lane call, RPC included (as for metrics).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from verifypd.domain.requests import FinishReason

_PROPAGATOR = TraceContextTextMapPropagator()
_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "abort",
}  # vLLM's finished_reason values


def exporting() -> bool:
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def make_tracer(service_name: str, exporter=None) -> Tracer | None:
    """A tracer exporting over OTLP/gRPC (batched, in a thread of the SDK) when the environment
    names an endpoint, or to `exporter` (tests); None when tracing is off."""
    if exporter is None and not exporting():
        return None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource.merge(OTELResourceDetector().detect()))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer("verifypd")


def traceparent_of(span) -> str | None:
    """The W3C traceparent of a sampled span (what the gateway hands the core), else None."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get("traceparent")


def start_gateway_span(tracer: Tracer, carrier, api: str, request_id: str, prompt_tokens: int):
    """The gateway's span of one request, a child of the caller's traceparent when it sent one."""
    pairs = carrier.items() if isinstance(carrier, Mapping) else carrier  # gRPC metadata: (key, value) pairs
    parent = _PROPAGATOR.extract({k.lower(): v for k, v in pairs if isinstance(v, str)})
    return tracer.start_span(
        "verifypd.generate",
        context=parent,
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
    """The core's side: `begin` (channel reader thread) remembers a request's parent context;
    the router's observer hooks (core loop thread, through `Telemetry`) write its spans."""

    def __init__(self, tracer: Tracer, clock=time.monotonic):
        self.tracer, self.clock = tracer, clock
        self._parents: dict[str, Context] = {}  # request id -> the gateway span's context
        self._lane_calls: list[tuple[str, float, float, int]] = []  # this step's (lane, start, end, batch)

    def begin(self, request_id: str, traceparent: str) -> None:
        ctx = _PROPAGATOR.extract({"traceparent": traceparent})
        if trace.get_current_span(ctx).get_span_context().is_valid:
            self._parents[request_id] = ctx

    def forget(self, request_id: str) -> None:
        """A refused request: no spans."""
        self._parents.pop(request_id, None)

    def on_lane_step(self, lane: str, seconds: float, batch: int) -> None:
        if self._parents:
            now = self.clock()
            self._lane_calls.append((lane, now - seconds, now, batch))

    def on_step(self, router) -> None:
        if not self._lane_calls:
            return
        calls, self._lane_calls = self._lane_calls, []
        parents = self._parents
        anchor = next((parents[s.request_id] for s in router.scheduler.running if s.request_id in parents), None)
        if anchor is None:
            return
        mono, wall = self.clock(), time.time_ns()
        for lane, start, end, batch in calls:
            span = self.tracer.start_span(
                f"verifypd.lane.{lane}",
                context=anchor,
                kind=SpanKind.CLIENT,
                start_time=_ns(start, mono, wall),
                attributes={"verifypd.lane": lane, "verifypd.batch.size": batch},
            )
            span.end(end_time=_ns(end, mono, wall))

    def on_request_finished(self, seq) -> None:
        parent = self._parents.pop(seq.request_id, None)
        if parent is None:
            return
        s, now = seq.stats, self.clock()
        mono, wall = now, time.time_ns()
        times = s.token_times
        end = times[-1] if times and seq.finish_reason is not FinishReason.CANCELLED else now
        root = self.tracer.start_span(
            "verifypd.core.request",
            context=parent,
            start_time=_ns(s.arrival_time, mono, wall),
            attributes={
                "gen_ai.usage.input_tokens": s.prompt_tokens,
                "gen_ai.usage.output_tokens": s.completion_tokens,
                "gen_ai.response.finish_reasons": [_REASONS.get(seq.finish_reason, "abort")],
                "verifypd.preemptions": s.preemptions,
            },
        )
        ctx = trace.set_span_in_context(root)

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
