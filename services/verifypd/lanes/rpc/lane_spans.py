"""Spans of lane calls across processes (split topology): one per call, whatever its batch.

    LaneCallSpans    the router's side (lane clients): a CLIENT span `verifypd.lane.<lane>` from
                     the call's send to its reply, below the core span of the oldest traced
                     request in the batch (`parent_of`, the engine core's); its traceparent goes
                     with the call (LaneCall.traceparent, or gRPC metadata `traceparent`)
    LaneServerSpans  the lane's side: a SERVER span of the same name below it, from the decoded
                     call to the reply built, in the lane's own service (`verifypd-lane-<role>`)

Both carry the same attributes, computed from the call's items (`call_attributes`): the batch
size, the tokens the call works on and, for draft and verify, the largest k. Nothing per token;
nothing at all when the call's batch holds no traced request (no parent, no span, no traceparent)
or when tracing is off (no tracer: these objects are never made).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer

from verifypd.net.trace_context import context_of, make_tracer, traceparent_of

ATTR_LANE = "verifypd.lane"
ATTR_BATCH = "verifypd.batch.size"
ATTR_TOKENS = "verifypd.lane.tokens"  # prefill: chunk tokens; draft: tokens asked for (sum of k); verify: positions
ATTR_K_MAX = "verifypd.lane.k_max"


def lane_attributes(lane: str, batch: int) -> dict:
    """What every lane span says: its lane and how many requests the call served."""
    return {ATTR_LANE: lane, ATTR_BATCH: batch}


def call_attributes(lane: str, items: Sequence) -> dict:
    """`lane_attributes` plus the call's tokens and largest k, from its items (PrefillItem,
    DraftItem or VerifyItem: verify positions are the drafts plus the pending token)."""
    attrs = lane_attributes(lane, len(items))
    if lane == "prefill":
        attrs[ATTR_TOKENS] = sum(len(i.token_ids) for i in items)
        return attrs
    ks = [i.k for i in items] if lane == "draft" else [len(i.draft_tokens) for i in items]
    attrs[ATTR_TOKENS] = sum(ks) + (len(items) if lane == "verify" else 0)
    attrs[ATTR_K_MAX] = max(ks, default=0)
    return attrs


class LaneCallSpans:
    """Shared by the three lane clients of one router (they run on its thread)."""

    def __init__(self, tracer: Tracer, parent_of: Callable[[Iterable[str]], Context | None]):
        self.tracer, self.parent_of = tracer, parent_of

    def start(self, lane: str, items: Sequence) -> tuple[Span, str] | None:
        """(the call's span, its traceparent to send), or None when no request of `items` is traced."""
        parent = self.parent_of(i.request_id for i in items)
        if parent is None:
            return None
        span = self.tracer.start_span(
            f"verifypd.lane.{lane}", context=parent, kind=SpanKind.CLIENT, attributes=call_attributes(lane, items)
        )
        traceparent = traceparent_of(span)
        if traceparent is None:  # not sampled
            return None
        return span, traceparent


def end_call_span(span: Span | None, error: str | None = None) -> None:
    """Ends a call's span, if it has one; `error`: what failed (the span's status says ERROR)."""
    if span is None:
        return
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()


class LaneServerSpans:
    """The lane process's tracer; `start` is called for calls that carry a traceparent only."""

    def __init__(self, role: str, tracer: Tracer):
        self.role, self.tracer = role, tracer

    @classmethod
    def from_env(cls, role: str) -> LaneServerSpans | None:
        """None unless the environment names an OTLP endpoint (the core's, inherited)."""
        tracer = make_tracer(f"verifypd-lane-{role}")
        return cls(role, tracer) if tracer is not None else None

    def start(self, carrier, items: Sequence) -> Span | None:
        """The SERVER span of one call below the caller's span (`carrier`: the traceparent string
        or the RPC's metadata); None when the caller sent no valid context."""
        parent = context_of(carrier)
        if parent is None:
            return None
        return self.tracer.start_span(
            f"verifypd.lane.{self.role}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=call_attributes(self.role, items),
        )
