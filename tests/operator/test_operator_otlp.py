"""OTLP receiver: real OpenTelemetry SDK exporters push into it over gRPC; percentiles match."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource

from verifypd.domain import metric_names as mn
from verifypd_operator.otlp_receiver import Hist, MetricsStore, percentile, serve

BOUNDS = [i * 0.005 for i in range(1, 200)]  # 5 ms buckets up to ~1 s


@pytest.fixture
def receiver():
    store = MetricsStore()
    server, port = serve(store, "127.0.0.1:0")
    yield store, port
    server.stop(None)


def provider(port, config, pod, namespace="default"):
    exporter = OTLPMetricExporter(endpoint=f"127.0.0.1:{port}", insecure=True)
    reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
    res = Resource.create({mn.RES_CONFIG_NAME: config, mn.RES_CONFIG_NAMESPACE: namespace, mn.RES_POD_NAME: pod})
    views = [
        View(instrument_name=n, aggregation=ExplicitBucketHistogramAggregation(BOUNDS))
        for n in (mn.TIME_TO_FIRST_TOKEN, mn.TIME_PER_OUTPUT_TOKEN)
    ]
    return MeterProvider(metric_readers=[reader], resource=res, views=views)


def test_percentile_interpolates_within_bucket():
    h = Hist((1.0, 2.0, 4.0), (0, 10, 10, 0))
    assert percentile(h, 0.5) == pytest.approx(2.0)
    assert percentile(h, 0.75) == pytest.approx(3.0)  # halfway through (2, 4]
    assert percentile(h, 0.25) == pytest.approx(1.5)
    assert percentile(Hist((1.0,), (0, 4), max=3.0), 0.5) == pytest.approx(2.0)  # overflow to max
    assert percentile(Hist((1.0,), (0, 0)), 0.5) is None


def test_sdk_export_p95_matches_data(receiver):
    store, port = receiver
    store.register("default", "demo")
    rng = random.Random(1)
    ttft = {
        "demo-colocated-a": [rng.lognormvariate(-2.0, 0.5) for _ in range(700)],
        "demo-colocated-b": [rng.lognormvariate(-1.6, 0.4) for _ in range(500)],
    }
    itl = [rng.uniform(0.01, 0.08) for _ in range(2000)]
    for i, (pod, values) in enumerate(ttft.items()):
        mp = provider(port, "demo", pod)
        meter = mp.get_meter("verifypd")
        h = meter.create_histogram(mn.TIME_TO_FIRST_TOKEN, unit="s")
        for v in values:
            h.record(v)
        if i == 0:
            itl_h = meter.create_histogram(mn.TIME_PER_OUTPUT_TOKEN, unit="s")
            for v in itl:
                itl_h.record(v)
            q = meter.create_gauge(mn.LANE_QUEUE_DEPTH)
            q.set(7, {mn.ATTR_LANE: "verify"})
            q.set(2, {mn.ATTR_LANE: "draft"})
            meter.create_counter(mn.DRAFT_TOKENS).add(400)
            meter.create_counter(mn.ACCEPTED_TOKENS).add(100)
        assert mp.force_flush(10_000)
        mp.shutdown()

    obs = store.observe("default", "demo", time.time() + 1, 60)
    all_ttft = ttft["demo-colocated-a"] + ttft["demo-colocated-b"]
    assert obs.samples == len(all_ttft)  # min(TTFT count, ITL count)
    assert obs.ttft_p95_s == pytest.approx(np.percentile(all_ttft, 95), abs=0.005)  # within a bucket
    assert obs.itl_p95_s == pytest.approx(np.percentile(itl, 95), abs=0.005)
    assert obs.queue_depth == {"verify": 7.0, "draft": 2.0}
    assert obs.acceptance_rate == pytest.approx(0.25)


def test_unmanaged_resources_are_rejected(receiver):
    store, port = receiver
    store.register("default", "demo")
    for config, pod in (("other", "other-x"), ("demo", "intruder-pod")):
        mp = provider(port, config, pod)
        mp.get_meter("m").create_histogram(mn.TIME_TO_FIRST_TOKEN).record(5.0)
        assert mp.force_flush(10_000)
        mp.shutdown()
    assert store.histogram("default", "demo", mn.TIME_TO_FIRST_TOKEN, time.time() + 1, 60) is None
    store.unregister("default", "demo")
    resp = store.ingest(_request("demo", "demo-p", [(1.0, 0.5, [1, 0])]))
    assert resp == (0, 1)


def _request(config, pod, points, temporality=metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE):
    """points: [(t_seconds, start_seconds, bucket_counts)] with bounds (0.1,)."""

    def kv(k, v):
        return common_pb2.KeyValue(key=k, value=common_pb2.AnyValue(string_value=v))

    dps = [
        metrics_pb2.HistogramDataPoint(
            time_unix_nano=int(t * 1e9),
            start_time_unix_nano=int(s * 1e9),
            explicit_bounds=[0.1],
            bucket_counts=c,
            count=sum(c),
        )
        for t, s, c in points
    ]
    m = metrics_pb2.Metric(
        name=mn.TIME_TO_FIRST_TOKEN,
        histogram=metrics_pb2.Histogram(data_points=dps, aggregation_temporality=temporality),
    )
    rm = metrics_pb2.ResourceMetrics(
        resource={
            "attributes": [
                kv(mn.RES_CONFIG_NAME, config),
                kv(mn.RES_CONFIG_NAMESPACE, "default"),
                kv(mn.RES_POD_NAME, pod),
            ]
        },
        scope_metrics=[metrics_pb2.ScopeMetrics(metrics=[m])],
    )
    return metrics_service_pb2.ExportMetricsServiceRequest(resource_metrics=[rm])


def test_cumulative_window_subtracts_baseline_and_handles_reset():
    store = MetricsStore()
    store.register("default", "demo")
    # Cumulative since t=0: 100 fast requests by t=50, then 10 slow ones by t=150.
    store.ingest(_request("demo", "demo-p", [(50, 0, [100, 0]), (150, 0, [100, 10])]))
    h = store.histogram("default", "demo", mn.TIME_TO_FIRST_TOKEN, now=160, window_s=60)
    assert h.counts == (0, 10)  # only what happened in (100, 160]
    h = store.histogram("default", "demo", mn.TIME_TO_FIRST_TOKEN, now=160, window_s=200)
    assert h.counts == (100, 10)
    # Process restart (new start time): counts restart from zero, no negative deltas.
    store.ingest(_request("demo", "demo-p", [(170, 165, [3, 0])]))
    h = store.histogram("default", "demo", mn.TIME_TO_FIRST_TOKEN, now=175, window_s=60)
    assert h.counts == (3, 0)


def test_observe_reports_the_age_of_the_newest_point_and_idle():
    store = MetricsStore()
    store.register("default", "demo")
    assert store.observe("default", "demo", now=100, window_s=60).age_s is None  # nothing ever arrived
    store.ingest(_request("demo", "demo-p", [(50, 0, [100, 0]), (90, 0, [100, 0])]))
    seen = store.observe("default", "demo", now=100, window_s=60)
    assert seen.age_s == 10 and seen.samples == 0  # exports keep coming, no new requests
    assert store.observe("default", "demo", now=95, window_s=60).age_s == 5  # points after `now` do not count


def test_delta_points_in_window_are_summed():
    store = MetricsStore()
    store.register("default", "demo")
    delta = metrics_pb2.AGGREGATION_TEMPORALITY_DELTA
    store.ingest(_request("demo", "demo-p", [(10, 0, [5, 0]), (20, 10, [1, 2]), (30, 20, [0, 4])], delta))
    h = store.histogram("default", "demo", mn.TIME_TO_FIRST_TOKEN, now=30, window_s=15)
    assert h.counts == (1, 6)
