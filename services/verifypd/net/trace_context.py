"""W3C trace context on our wires, and the OTLP tracer every verifypd process makes the same way.

Every process that writes spans (gateway, engine core, each lane) calls `make_tracer(service)`:
a tracer exporting over OTLP/gRPC (batched, in a thread of the SDK) when the environment names
an endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; the lanes inherit
the core's environment), else None, and then no tracing code runs at all. Sampling follows
OTEL_TRACES_SAMPLER (default: parent-based, always on).

A span's context crosses a process boundary as its `traceparent` string
(`00-<trace id>-<span id>-<flags>`): HTTP header or gRPC metadata `traceparent` (public API and
unary lane RPCs), the `tp` field of the core channel's `add` message, `LaneCall.traceparent` on
the lane call channel.
"""

from __future__ import annotations

import logging
import os

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"  # the header / metadata key
_PROPAGATOR = TraceContextTextMapPropagator()
log = logging.getLogger("verifypd.tracing")


def exporting() -> bool:
    """The environment asks for spans over OTLP."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def make_tracer(service_name: str, exporter=None) -> Tracer | None:
    """A tracer exporting over OTLP/gRPC when the environment names an endpoint, or to `exporter`
    (tests); None when tracing is off. OTEL_SERVICE_NAME overrides `service_name`.

    An endpoint named with no importable OTLP exporter (a broken or partial install) turns tracing
    off with one warning: serving must not depend on its telemetry."""
    if exporter is None and not exporting():
        return None
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            log.warning(
                "tracing off in %s: an OTLP endpoint is set but the OTLP exporter can't be imported (%s)",
                service_name,
                exc,
            )
            return None
        exporter = OTLPSpanExporter()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource.merge(OTELResourceDetector().detect()))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider.get_tracer("verifypd")


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
