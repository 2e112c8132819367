"""W3C trace context on our wires, and the OTLP tracer every verifypd process makes the same way.

Every process that writes spans (gateway, engine core, each lane) calls `make_tracing(service)`
(or `make_tracer`, its SDK tracer alone) when the environment names an endpoint
(OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; the lanes inherit the core's
environment), else gets None, and then no tracing code runs at all. Its spans are exported over
OTLP/gRPC by a child process (net/span_ship.py says why), never by a thread of its own. Sampling
follows OTEL_TRACES_SAMPLER (default: parent-based, always on; `serve --trace-sample-ratio`
sets parent-based trace-id ratio).

A span's context crosses a process boundary as its `traceparent` string
(`00-<trace id>-<span id>-<flags>`): HTTP header or gRPC metadata `traceparent` (public API and
unary lane RPCs), the `tp` field of the core channel's `add` message, `LaneCall.traceparent` on
the lane call channel.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from verifypd.net.span_ship import ShippingSpanProcessor, SpanRecords

TRACEPARENT = "traceparent"  # the header / metadata key
_PROPAGATOR = TraceContextTextMapPropagator()
log = logging.getLogger("verifypd.tracing")


def exporting() -> bool:
    """The environment asks for spans over OTLP."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


@dataclass
class Tracing:
    """A process's tracing: the SDK `tracer` (spans made with the OTel API) and the `records` both it
    and hot paths that write plain records (core/tracing.py) ship to the exporter process."""

    tracer: Tracer
    records: SpanRecords

    def close(self) -> None:
        self.records.close()


def make_tracing(service_name: str) -> Tracing | None:
    """Tracing exported over OTLP/gRPC when the environment names an endpoint, else None.
    OTEL_SERVICE_NAME overrides `service_name`.

    An endpoint named with no importable OTLP exporter (a broken or partial install) turns tracing
    off with one warning: serving must not depend on its telemetry."""
    if not exporting():
        return None
    from opentelemetry.sdk.trace import TracerProvider

    try:  # the exporter process imports it; fail here, once, instead of there
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: F401
    except ImportError as exc:
        log.warning(
            "tracing off in %s: an OTLP endpoint is set but the OTLP exporter can't be imported (%s)",
            service_name,
            exc,
        )
        return None
    records = SpanRecords.start(os.environ.get("OTEL_SERVICE_NAME", service_name))
    provider = TracerProvider()  # its sampler from OTEL_TRACES_SAMPLER; the exporter process adds the resource
    provider.add_span_processor(ShippingSpanProcessor(records))
    return Tracing(provider.get_tracer("verifypd"), records)


def sample_ratio_env(ratio: float) -> dict[str, str]:
    """The environment that makes every process's tracer keep `ratio` of new traces and follow a
    parent's decision (the SDK reads it: parent-based, trace-id ratio)."""
    return {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": repr(float(ratio))}


def make_tracer(service_name: str) -> Tracer | None:
    """`make_tracing`'s SDK tracer (the gateway's and the lanes' spans)."""
    tracing = make_tracing(service_name)
    return tracing.tracer if tracing is not None else None


def traceparent_of(span) -> str | None:
    """The W3C traceparent of a sampled span (what one process hands the next), else None."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT)


def context_of(carrier) -> Context | None:
    """The remote parent a carrier names: a traceparent string, a header mapping or gRPC
    metadata ((key, value) pairs); None when it names none (absent or malformed)."""
    if isinstance(carrier, str):
        pairs = [(TRACEPARENT, carrier)]
    elif hasattr(carrier, "items"):
        pairs = list(carrier.items())
    else:
        pairs = list(carrier or ())
    ctx = _PROPAGATOR.extract({k.lower(): v for k, v in pairs if isinstance(v, str)})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def traceparent_in(carrier) -> str | None:
    """The traceparent of HTTP headers (a case-insensitive mapping) or gRPC metadata ((key, value)
    pairs), without building a Context (the gateway reads one per request)."""
    if not carrier:
        return None
    if hasattr(carrier, "get"):
        return carrier.get(TRACEPARENT)
    for key, value in carrier:
        if key.lower() == TRACEPARENT and isinstance(value, str):
            return value
    return None


# W3C trace context level 1, as the OTel propagator reads it (leading / trailing blanks allowed; a
# version other than 00 may carry more fields).
_TRACEPARENT_RE = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$")


def parse_traceparent(text: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent string, or None when malformed: the
    propagator's rules, without building a Context (the core reads one per request)."""
    if not isinstance(text, str) or len(text) > 512:
        return None
    match = _TRACEPARENT_RE.search(text)
    if match is None:
        return None
    version, trace_hex, span_hex, flags, more = match.groups()
    if version == "ff" or (version == "00" and more):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, bool(int(flags, 16) & 1)
