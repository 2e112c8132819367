"""OTLP metrics receiver: the standard `MetricsService/Export`, windowed per config and lane.

Services export to it directly (`OTEL_EXPORTER_OTLP_ENDPOINT`) or through a collector. Only data
whose resource names a config registered here (`verifypd.config.name` + `k8s.namespace.name`)
and a pod of that config (`k8s.pod.name` starting with `<name>-`) is kept; the rest is counted
as rejected in the response's partial success.

Histograms: explicit-bucket, cumulative (the SDK's default) or delta. The window's histogram of a
cumulative series is its latest point minus its last point at or before the window start (a
reset, i.e. a new start time, restarts from zero); delta points inside the window are summed.
Series are merged bucket-wise across pods; percentiles interpolate linearly within a bucket.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.metrics.v1 import metrics_pb2

from verifypd.domain import metric_names as mn

from .decision import Observed

log = logging.getLogger(__name__)
CUMULATIVE = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE


@dataclasses.dataclass(frozen=True)
class Hist:
    """One explicit-bucket histogram observation (already windowed, or a raw OTLP point)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    max: float | None = None

    @property
    def count(self) -> int:
        return sum(self.counts)


def percentile(h: Hist, q: float) -> float | None:
    """q in [0, 1]; linear interpolation inside the bucket holding rank q*count.

    Bucket i spans (bounds[i-1], bounds[i]]; the first starts at 0 (durations are non-negative),
    the overflow bucket ends at the observed max when known, else it collapses onto the last bound.
    """
    total = h.count
    if total == 0:
        return None
    rank = q * total
    cum = 0
    for i, c in enumerate(h.counts):
        if c and cum + c >= rank:
            lo = h.bounds[i - 1] if i > 0 else 0.0
            if i < len(h.bounds):
                hi = h.bounds[i]
            else:
                hi = max(h.max, lo) if h.max is not None else lo
            return lo + (hi - lo) * max(0.0, rank - cum) / c
        cum += c
    return h.bounds[-1] if h.bounds else None


@dataclasses.dataclass(frozen=True)
class _Point:
    t: float  # seconds
    start: float
    cumulative: bool
    value: float = 0.0
    hist: Hist | None = None


def _attrs(kvs: Iterable) -> dict[str, str]:
    out = {}
    for kv in kvs:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = str(getattr(v, kind)) if kind else ""
    return out


class MetricsStore:
    """Windows of the metrics of managed configs. Thread-safe (gRPC workers write, timers read)."""

    WANTED = {
        mn.TIME_TO_FIRST_TOKEN,
        mn.TIME_PER_OUTPUT_TOKEN,
        mn.LANE_QUEUE_DEPTH,
        mn.DRAFT_TOKENS,
        mn.ACCEPTED_TOKENS,
        mn.ACCEPTANCE_RATE,
    }

    def __init__(self, retention_s: float = 900.0):
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._managed: set[tuple[str, str]] = set()
        # (namespace, config) -> (metric, pod, attrs) -> points in arrival order
        self._series: dict[tuple[str, str], dict[tuple, collections.deque[_Point]]] = {}

    def register(self, namespace: str, name: str) -> None:
        with self._lock:
            self._managed.add((namespace, name))

    def unregister(self, namespace: str, name: str) -> None:
        with self._lock:
            self._managed.discard((namespace, name))
            self._series.pop((namespace, name), None)

    def ingest(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> tuple[int, int]:
        """Returns (accepted, rejected) data point counts."""
        accepted = rejected = 0
        with self._lock:
            for rm in request.resource_metrics:
                res = _attrs(rm.resource.attributes)
                key = (res.get(mn.RES_CONFIG_NAMESPACE, ""), res.get(mn.RES_CONFIG_NAME, ""))
                pod = res.get(mn.RES_POD_NAME, "")
                ok = key in self._managed and pod.startswith(f"{key[1]}-")
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        points = list(self._points(m))
                        if not ok:
                            rejected += len(points)
                            continue
                        if m.name not in self.WANTED:
                            continue
                        series = self._series.setdefault(key, {})
                        for attrs, p in points:
                            dq = series.setdefault((m.name, pod, attrs), collections.deque())
                            dq.append(p)
                            while dq and dq[0].t < p.t - self.retention_s:
                                dq.popleft()
                            accepted += 1
        return accepted, rejected

    @staticmethod
    def _points(m: metrics_pb2.Metric):
        kind = m.WhichOneof("data")
        if kind == "histogram":
            cum = m.histogram.aggregation_temporality == CUMULATIVE
            for dp in m.histogram.data_points:
                h = Hist(tuple(dp.explicit_bounds), tuple(dp.bucket_counts), dp.max if dp.HasField("max") else None)
                yield (
                    tuple(sorted(_attrs(dp.attributes).items())),
                    _Point(dp.time_unix_nano / 1e9, dp.start_time_unix_nano / 1e9, cum, hist=h),
                )
        elif kind in ("gauge", "sum"):
            cum = kind == "gauge" or m.sum.aggregation_temporality == CUMULATIVE
            for dp in getattr(m, kind).data_points:
                v = dp.as_double if dp.WhichOneof("value") == "as_double" else float(dp.as_int)
                yield (
                    tuple(sorted(_attrs(dp.attributes).items())),
                    _Point(dp.time_unix_nano / 1e9, dp.start_time_unix_nano / 1e9, cum, value=v),
                )
        elif kind:
            log.debug("ignoring %s metric %s", kind, m.name)

    # ---- windowed reads ------------------------------------------------------------------

    def _select(self, key, metric: str, attr: tuple[str, str] | None = None):
        for (name, pod, attrs), dq in self._series.get(key, {}).items():
            if name == metric and (attr is None or attr in attrs):
                yield pod, list(dq)

    @staticmethod
    def _window_delta(points: Sequence[_Point], now: float, window_s: float):
        """(latest, baseline) for cumulative series, or the in-window points for delta ones."""
        start = now - window_s
        inside = [p for p in points if start < p.t <= now]
        if not inside:
            return None, None, []
        latest = inside[-1]
        if not latest.cumulative:
            return None, None, inside
        before = [p for p in points if p.t <= start and p.start == latest.start]
        if latest.start >= start:
            base = None  # the series began inside the window: everything counts
        elif before:
            base = before[-1]
        else:
            # Counting from an unknown earlier time would overcount; use what was seen inside.
            same = [p for p in inside if p.start == latest.start]
            base = same[0] if len(same) > 1 else None
            if base is None and len(same) == 1:
                return None, None, []
        return latest, base, []

    def histogram(self, namespace: str, name: str, metric: str, now: float, window_s: float) -> Hist | None:
        merged: dict[tuple[float, ...], list[int]] = {}
        maxes: dict[tuple[float, ...], float] = {}
        with self._lock:
            for _, points in self._select((namespace, name), metric):
                latest, base, deltas = self._window_delta(points, now, window_s)
                parts: list[tuple[Hist, int]] = [(p.hist, 1) for p in deltas]
                if latest is not None:
                    parts.append((latest.hist, 1))
                    if base is not None and base.hist.bounds == latest.hist.bounds:
                        parts.append((base.hist, -1))
                for h, sign in parts:
                    acc = merged.setdefault(h.bounds, [0] * len(h.counts))
                    if len(acc) != len(h.counts):
                        continue
                    for i, c in enumerate(h.counts):
                        acc[i] += sign * c
                    if sign > 0 and h.max is not None:
                        maxes[h.bounds] = max(maxes.get(h.bounds, h.max), h.max)
        if not merged:
            return None
        # Services share one bucket layout; should they differ, the layout with most data wins.
        bounds, counts = max(merged.items(), key=lambda kv: sum(kv[1]))
        return Hist(bounds, tuple(max(0, c) for c in counts), maxes.get(bounds))

    def _counter(self, key, metric: str, now: float, window_s: float) -> float:
        total = 0.0
        for _, points in self._select(key, metric):
            latest, base, deltas = self._window_delta(points, now, window_s)
            total += sum(p.value for p in deltas)
            if latest is not None:
                total += latest.value - (base.value if base is not None else 0.0)
        return total

    def _gauge_latest(self, key, metric: str, now: float, window_s: float, attr=None) -> list[float]:
        out = []
        for _, points in self._select(key, metric, attr):
            inside = [p for p in points if now - window_s < p.t <= now]
            if inside:
                out.append(inside[-1].value)
        return out

    def observe(self, namespace: str, name: str, now: float, window_s: float) -> Observed:
        """The decision function's view of one config over (now - window_s, now]."""
        ttft = self.histogram(namespace, name, mn.TIME_TO_FIRST_TOKEN, now, window_s)
        itl = self.histogram(namespace, name, mn.TIME_PER_OUTPUT_TOKEN, now, window_s)
        key = (namespace, name)
        with self._lock:
            queues = {
                lane: sum(v)
                for lane in mn.LANES
                for v in [self._gauge_latest(key, mn.LANE_QUEUE_DEPTH, now, window_s, (mn.ATTR_LANE, lane))]
                if v
            }
            drafted = self._counter(key, mn.DRAFT_TOKENS, now, window_s)
            accepted = self._counter(key, mn.ACCEPTED_TOKENS, now, window_s)
            rates = self._gauge_latest(key, mn.ACCEPTANCE_RATE, now, window_s)
            # Exporter timestamps, like the windows: the newest point at or before `now`.
            newest = max((p.t for dq in self._series.get(key, {}).values() for p in dq if p.t <= now), default=None)
        acceptance = accepted / drafted if drafted > 0 else (sum(rates) / len(rates) if rates else None)
        return Observed(
            ttft_p95_s=percentile(ttft, 0.95) if ttft else None,
            itl_p95_s=percentile(itl, 0.95) if itl else None,
            samples=min(ttft.count if ttft else 0, itl.count if itl else 0),
            queue_depth=queues,
            acceptance_rate=acceptance,
            age_s=None if newest is None else now - newest,
        )


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, store: MetricsStore):
        self.store = store

    def Export(self, request, context):
        _, rejected = self.store.ingest(request)
        resp = metrics_service_pb2.ExportMetricsServiceResponse()
        if rejected:
            resp.partial_success.rejected_data_points = rejected
            resp.partial_success.error_message = "resource names no config managed by this operator"
        return resp


def serve(store: MetricsStore, address: str = "[::]:4317", max_workers: int = 4) -> tuple[grpc.Server, int]:
    """Start the receiver; returns (server, bound port). Port 0 picks a free one."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(MetricsReceiver(store), server)
    # Standard health service ("" = SERVING): the chart's gRPC readiness probe on this port.
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port(address)
    server.start()
    return server, port


__all__ = ["Hist", "MetricsReceiver", "MetricsStore", "percentile", "serve"]
