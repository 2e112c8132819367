"""The gateway's request spans as records (core/tracing.py GatewaySpans): the SDK sampler still
decides (a root by its ratio, a child as its parent says), the record continues the caller's trace,
and the engine core is handed a traceparent naming the gateway's span."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from verifypd.core.tracing import GatewaySpans
from verifypd.net.trace_context import Tracing, parse_traceparent

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


class Records:
    def __init__(self):
        self.written: list[tuple] = []

    def write(self, record: tuple) -> None:
        self.written.append(record)


def spans(ratio: float) -> tuple[GatewaySpans, Records]:
    records = Records()
    tracer = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio))).get_tracer("t")
    return GatewaySpans(Tracing(tracer, records)), records  # type: ignore[arg-type]


def test_a_sampled_parent_is_continued_and_the_core_gets_this_span():
    gw, records = spans(0.0)  # roots never sampled: the parent's flag decides
    grpc_metadata = (("user-agent", "x"), ("traceparent", f"00-{TRACE}-{PARENT}-01"))
    span = gw.start(grpc_metadata, "grpc", "r1", 5)
    assert span is not None
    assert parse_traceparent(span.traceparent) == (int(TRACE, 16), span.span_id, True)
    span.first_token_ns = span.start_ns + 10
    gw.end(span, "length", {"completion_tokens": 3, "accepted_tokens": 1})
    ((name, trace_id, span_id, parent, kind, start, end, attrs, status, _, events),) = records.written
    assert (name, trace_id, span_id, parent) == ("verifypd.generate", int(TRACE, 16), span.span_id, int(PARENT, 16))
    assert kind == SpanKind.SERVER.value and start <= end and status == StatusCode.UNSET.value
    assert attrs["gen_ai.usage.output_tokens"] == 3 and attrs["gen_ai.response.finish_reasons"] == ["length"]
    assert attrs["verifypd.api"] == "grpc" and attrs["gen_ai.usage.input_tokens"] == 5
    assert events == (("first_token", span.start_ns + 10, {}),)


def test_an_unsampled_parent_or_root_makes_no_span():
    gw, records = spans(0.0)
    assert gw.start({"traceparent": f"00-{TRACE}-{PARENT}-00"}, "http", "r", 1) is None
    assert gw.start({}, "http", "r", 1) is None and gw.start(None, "http", "r", 1) is None
    assert records.written == []


def test_roots_follow_the_ratio_and_errors_are_marked():
    gw, records = spans(1.0)
    span = gw.start({"traceparent": "garbage"}, "http", "r", 1)  # malformed: a trace of its own
    assert span is not None and span.parent_id == 0 and span.trace_id != int(TRACE, 16)
    gw.end(span, "error", None)
    (record,) = records.written
    assert record[3] == 0 and record[8] == StatusCode.ERROR.value and record[10] == ()  # a root; no first token
