"""OpenTelemetry metrics of the router/gateway, names from verifypd.domain.metric_names.

Exported over OTLP/gRPC only when OTEL_EXPORTER_OTLP_ENDPOINT is set (otherwise instruments are
the API's no-ops). The resource comes from the environment (OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES: the operator sets the config name/namespace/pod there). Tests pass
their own metric reader.

Implements the router's EngineObserver; all hooks run on the core loop's thread, observable gauges are
read by the exporter thread from plain attributes set in `on_step`.
"""

from __future__ import annotations

import os
from collections import deque

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from verifypd.core.serving_metrics import ServingMetrics
from verifypd.core.tracing import RequestTracing
from verifypd.domain import metric_names as mn
from verifypd.router.router import EngineObserver
from verifypd.router.sequence import SeqStatus

_DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    30.0,
    60.0,
)


def make_meter_provider(service_name: str, readers: list | None = None):
    """An SDK MeterProvider when exporting (env) or when readers are given; else None (no-op)."""
    readers = list(readers or [])
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        interval_ms = float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "10000"))
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=interval_ms))
    if not readers:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    resource = resource.merge(OTELResourceDetector().detect())
    views = [
        View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(_DURATION_BUCKETS))
        for name in (mn.TIME_TO_FIRST_TOKEN, mn.TIME_PER_OUTPUT_TOKEN, mn.REQUEST_DURATION, mn.LANE_STEP_DURATION)
    ]
    return MeterProvider(metric_readers=readers, resource=resource, views=views)


class Telemetry(EngineObserver):
    def __init__(
        self,
        service_name: str = "verifypd-gateway",
        readers: list | None = None,
        acceptance_window: int = 256,
        serving: ServingMetrics | None = None,
    ):
        """`serving`: the vLLM-named Prometheus series (core/serving_metrics.py), fed by the same hooks."""
        self.serving = serving
        self.tracing: RequestTracing | None = None  # core/tracing.py, when OTLP traces are on
        self.provider = make_meter_provider(service_name, readers)
        meter = (self.provider or metrics.NoOpMeterProvider()).get_meter("verifypd")
        self.ttft = meter.create_histogram(mn.TIME_TO_FIRST_TOKEN, unit="s", description="Time to first token")
        self.tpot = meter.create_histogram(
            mn.TIME_PER_OUTPUT_TOKEN, unit="s", description="Time per output token after the first"
        )
        self.duration = meter.create_histogram(mn.REQUEST_DURATION, unit="s", description="Request duration")
        self.tokens = meter.create_histogram(mn.TOKEN_USAGE, unit="{token}", description="Tokens per request")
        self.lane_step = meter.create_histogram(mn.LANE_STEP_DURATION, unit="s", description="Lane call duration")
        self.draft_tokens = meter.create_counter(mn.DRAFT_TOKENS, unit="{token}", description="Draft tokens proposed")
        self.accepted_tokens = meter.create_counter(
            mn.ACCEPTED_TOKENS, unit="{token}", description="Draft tokens accepted"
        )
        self.applied_k = meter.create_histogram(
            mn.APPLIED_K, unit="{token}", description="k used in a verify step (one per step and distinct k)"
        )
        self.chained_steps = meter.create_counter(
            mn.CHAINED_STEPS,
            unit="{step}",
            description="Verify steps launched before the previous step's results were on the host",
        )
        self._chained_seen = (0, 0)  # router.overlap's (steps, admitting) already counted
        self.lookup_proposals = meter.create_counter(
            mn.LOOKUP_PROPOSALS,
            unit="{step}",
            description="Requests' steps drafted by prompt lookup instead of the head (--draft eagle+ngram:)",
        )
        self.drafts_after_verify = meter.create_counter(
            mn.DRAFTS_AFTER_VERIFY,
            unit="{request}",
            description="Requests' drafts launched right after their verify call, fitted to its verdict on the device",
        )
        self.steps_ahead = meter.create_counter(
            mn.STEPS_AHEAD,
            unit="{step}",
            description="Speculative steps launched before the previous step's tokens were streamed",
        )
        self.verify_fitted = meter.create_counter(
            mn.VERIFY_FITTED,
            unit="{step}",
            description=(
                "Speculative steps whose verify call was launched before the verdict before it, fitted on the device"
            ),
        )
        self._seen: dict[str, int] = {}  # the engine's own counts already added, by counter name
        meter.create_observable_gauge(
            mn.LANE_QUEUE_DEPTH,
            [self._observe_queues],
            unit="{request}",
            description="Requests waiting for or running in each lane",
        )
        meter.create_observable_gauge(
            mn.KV_BLOCKS_IN_USE, [self._observe_blocks], unit="{block}", description="KV blocks allocated per pool"
        )
        meter.create_observable_gauge(
            mn.ACCEPTANCE_RATE,
            [self._observe_acceptance],
            unit="1",
            description="Accepted / drafted over the last verify items",
        )
        self._window: deque[tuple[int, int]] = deque(maxlen=acceptance_window)
        self._queues = {lane: 0 for lane in mn.LANES}
        self._blocks = {"target": 0, "draft": 0}
        self._step_ks: set[int] = set()  # this step's verify items, until on_step flushes them
        self._step_drafted = self._step_accepted = 0

    # -- EngineObserver (engine thread) ----------------------------------------------------
    def on_lane_step(self, lane: str, seconds: float, batch: int) -> None:
        self.lane_step.record(seconds, {mn.ATTR_LANE: lane})
        if self.tracing is not None:
            self.tracing.on_lane_step(lane, seconds, batch)

    def on_verify(self, k: int, accepted: int) -> None:
        # Called per verify item (request) on the engine thread: an SDK instrument call costs
        # ~3-5 us, so at batch 128 three of them per item were ~1.5 ms of every step's host time.
        # Tallied here and handed to the instruments once per step (`_flush_verify`).
        self._step_ks.add(k)
        if self.serving is not None:
            self.serving.on_verify(k, accepted)
        if k:
            self._step_drafted += k
            self._step_accepted += accepted
            self._window.append((k, accepted))

    def _flush_verify(self) -> None:
        """Once per step: the step's draft / accepted sums (counters exact, one step late at most)
        and one applied_k observation per distinct k the step used."""
        for k in self._step_ks:
            self.applied_k.record(k)
        self._step_ks.clear()
        if self._step_drafted:
            self.draft_tokens.add(self._step_drafted)
            self.accepted_tokens.add(self._step_accepted)
            self._step_drafted = self._step_accepted = 0

    def on_request_finished(self, seq) -> None:
        if self.serving is not None:
            self.serving.on_request_finished(seq)
        if self.tracing is not None:
            self.tracing.on_request_finished(seq)
        stats = seq.stats
        self.tokens.record(stats.prompt_tokens, {mn.ATTR_TOKEN_TYPE: "input"})
        self.tokens.record(stats.completion_tokens, {mn.ATTR_TOKEN_TYPE: "output"})
        if stats.ttft is not None:
            self.ttft.record(stats.ttft)
        times = stats.token_times
        if len(times) > 1:
            self.tpot.record((times[-1] - times[0]) / (len(times) - 1))
        if times:
            self.duration.record(times[-1] - stats.arrival_time)

    def _add_delta(self, counter, name: str, total: int) -> None:
        """Adds what an engine counter grew by since the last step (a new router counts from 0)."""
        seen = self._seen.get(name, 0)
        seen = seen if seen <= total else 0
        if total > seen:
            counter.add(total - seen)
        self._seen[name] = total

    def on_step(self, router) -> None:
        if self.serving is not None:
            self.serving.on_step(router)
        if self.tracing is not None:
            self.tracing.on_step(router)
        self._flush_verify()
        overlap = getattr(router, "overlap", None)
        if overlap is not None:  # counted when launched; the engine's own counters, as deltas
            steps, admitting = overlap.steps, overlap.admitting
            seen_steps, seen_admitting = self._chained_seen if self._chained_seen[0] <= steps else (0, 0)
            if steps > seen_steps:
                with_prefill = admitting - seen_admitting
                if with_prefill:
                    self.chained_steps.add(with_prefill, {mn.ATTR_STEP_PREFILL: "true"})
                if steps - seen_steps - with_prefill:
                    self.chained_steps.add(steps - seen_steps - with_prefill, {mn.ATTR_STEP_PREFILL: "false"})
                self._chained_seen = (steps, admitting)
        lookup = getattr(router, "lookup", None)
        if lookup is not None:  # the engine's own counts, as deltas
            self._add_delta(self.lookup_proposals, mn.LOOKUP_PROPOSALS, lookup.proposed)
        after, ahead = getattr(router, "draft_after", None), getattr(router, "ahead", None)
        if after is not None:
            self._add_delta(self.drafts_after_verify, mn.DRAFTS_AFTER_VERIFY, after.requests)
        if ahead is not None:
            self._add_delta(self.steps_ahead, mn.STEPS_AHEAD, ahead.steps)
            self._add_delta(self.verify_fitted, mn.VERIFY_FITTED, ahead.fitted)
        running = router.scheduler.running
        decoding = sum(1 for s in running if s.status is SeqStatus.DECODING)
        self._queues = {
            "prefill": router.scheduler.num_waiting + len(running) - decoding,
            "draft": decoding,
            "verify": decoding,
        }
        self._blocks = {"target": router.target_blocks.num_used}
        if router.draft_blocks is not None:  # None: pool-less draft lane (prompt lookup)
            self._blocks["draft"] = router.draft_blocks.num_used

    def on_idle(self, router) -> None:  # after an abort, while idle, after a lane recovery
        self.on_step(router)
        if self.serving is not None:  # not throttled: the state just changed
            self.serving.scan(router)

    # -- observable gauges (exporter thread) -----------------------------------------------
    def _observe_queues(self, options: CallbackOptions):
        return [Observation(v, {mn.ATTR_LANE: lane}) for lane, v in self._queues.items()]

    def _observe_blocks(self, options: CallbackOptions):
        return [Observation(v, {mn.ATTR_POOL: pool}) for pool, v in self._blocks.items()]

    def _observe_acceptance(self, options: CallbackOptions):
        window = list(self._window)
        drafted = sum(k for k, _ in window)
        return [Observation(sum(a for _, a in window) / drafted)] if drafted else []

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()


def prometheus_reader():
    """(reader for Telemetry(readers=...), the registry /metrics renders)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=True)
    return PrometheusMetricReader(registry=registry), registry
