"""`verifypd_request_errors_total{api, code, reason}`: requests the gateway refused or ended with an
error, counted where the error is sent (gRPC status name / HTTP status and the OpenAI error code),
on the gateway's event loop. /metrics renders it after the core's series (gateway/http_api.py)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from verifypd.domain import metric_names as mn


class RequestErrors:
    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def add(self, api: str, code: str, reason: str) -> None:
        """`api`: grpc | http; `code`: the gRPC status name or HTTP status; `reason`: a short word."""
        key = (api, code, reason)
        self.counts[key] = self.counts.get(key, 0) + 1

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            mn.REQUEST_ERRORS, "Requests refused or ended with an error, by API, code and reason",
            labels=["api", "code", "reason"],
        )  # fmt: skip
        for key, n in list(self.counts.items()):
            family.add_metric(list(key), n)
        yield family
