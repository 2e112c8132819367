"""The exporter process of one serving process's spans (`python -m verifypd.net.span_export SERVICE`):
reads the records net/span_ship.py frames on stdin, rebuilds them as SDK spans and exports them
with the SDK's BatchSpanProcessor and OTLP/gRPC exporter, configured by the environment it
inherited. Exits, after exporting what it holds, when stdin ends (its parent closed it or died).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from verifypd.net.span_ship import FRAME

SAMPLED = TraceFlags(TraceFlags.SAMPLED)
SCOPE = InstrumentationScope("verifypd")


def span_of(record: list, resource: Resource) -> ReadableSpan:
    name, trace_id, span_id, parent_id, kind, start, end, attrs, code, text, events = record
    parent = SpanContext(trace_id, parent_id, is_remote=False, trace_flags=SAMPLED) if parent_id else None
    return ReadableSpan(
        name=name,
        context=SpanContext(trace_id, span_id, is_remote=False, trace_flags=SAMPLED),
        parent=parent,
        resource=resource,
        attributes=attrs,
        events=tuple(Event(n, attributes=a, timestamp=t) for n, t, a in events),
        kind=SpanKind(kind),
        status=Status(StatusCode(code), text or None),
        start_time=start,
        end_time=end,
        instrumentation_scope=SCOPE,
    )


def read_frames(stream):
    """The JSON frames of `stream` until it ends (a torn last frame is dropped)."""
    while True:
        head = stream.read(FRAME.size)
        if len(head) < FRAME.size:
            return
        (size,) = FRAME.unpack(head)
        data = stream.read(size)
        if len(data) < size:
            return
        yield json.loads(data)


def main(argv: list[str]) -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    # Its life is its stdin's: a terminal's Ctrl-C (sent to the whole process group) must not end
    # it before its parent has shipped the last spans.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Below serving in the CPU scheduler: where cores are few (a CPU limit), export waits, not steps.
    os.nice(10)

    service = os.environ.get("OTEL_SERVICE_NAME", argv[0] if argv else "verifypd")
    resource = Resource.create({"service.name": service}).merge(OTELResourceDetector().detect())
    processor = BatchSpanProcessor(OTLPSpanExporter())
    try:
        for batch in read_frames(sys.stdin.buffer):
            for record in batch:
                processor.on_end(span_of(record, resource))
    finally:
        processor.shutdown()  # exports what is queued


if __name__ == "__main__":
    main(sys.argv[1:])
